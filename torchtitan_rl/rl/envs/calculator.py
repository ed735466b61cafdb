"""The ``calculator`` environment: arithmetic too long to do in one token stream, with a tool.

The policy may answer a turn with ``<tool>EXPR</tool>`` (integers, ``+ - *`` and parentheses);
the environment replies with a ``tool`` message ``<result>VALUE</result>`` (or ``<error>``).
Any other turn is the final answer: reward 1 when it equals the problem's answer. A well-formed
tool call earns ``tool_reward`` (default 0), so a policy may be nudged to use the tool.
"""

import ast
import re

from torchtitan_rl.rl.envs.base import EnvStep
from torchtitan_rl.rl.tasks.task import Problem

TOOL_CALL = re.compile(r"<tool>(.*?)</tool>", re.DOTALL)
_OPERATORS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}
_MAX_DIGITS = 30  # results beyond this are an error, not a slow big-integer product


def evaluate(expression: str) -> int:
    """The value of an integer expression of ``+ - *`` and parentheses; ValueError otherwise.
    Parsed, never executed."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an expression: {expression!r}") from None

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            result = _OPERATORS[type(node.op)](value(node.left), value(node.right))
            if len(str(abs(result))) > _MAX_DIGITS:
                raise ValueError("result too large")
            return result
        raise ValueError(f"only integers, + - * and parentheses: {expression!r}")

    return value(tree.body)


_QUESTION = re.compile(r"What is (.+)\? Use the calculator\.")


class CalculatorEnv:
    def __init__(self, problem: Problem, tool_reward: float = 0.0):
        self.problem, self.tool_reward = problem, tool_reward

    def reset(self) -> list[dict]:
        return [dict(m) for m in self.problem.messages]

    @staticmethod
    def demonstration(problem: Problem) -> list[dict]:
        """The turns that solve a ``calculator_question`` with the tool (for an SFT warm-up)."""
        match = _QUESTION.fullmatch(problem.messages[-1]["content"])
        if match is None:
            raise ValueError(f"{problem.source}: not a calculator question: {problem.messages[-1]['content']!r}")
        return [
            {"role": "assistant", "content": f"<tool>{match.group(1)}</tool>"},
            {"role": "tool", "content": f"<result>{evaluate(match.group(1))}</result>"},
            {"role": "assistant", "content": problem.answer},
        ]

    def step(self, completion: str) -> EnvStep:
        call = TOOL_CALL.search(completion)
        if call is None:
            correct = completion.strip() == self.problem.answer
            return EnvStep(None, float(correct), True, correct)
        try:
            output = f"<result>{evaluate(call.group(1))}</result>"
            reward = self.tool_reward
        except ValueError as err:
            output, reward = f"<error>{err}</error>", 0.0
        return EnvStep([{"role": "tool", "content": output}], reward, False)
