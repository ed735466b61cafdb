"""The ``calculator`` environment: arithmetic too long to do in one token stream, with a tool.

The policy may answer a turn with ``<tool>EXPR</tool>`` (integers, ``+ - *`` and parentheses);
the environment replies with a ``tool`` message ``<result>VALUE</result>`` (or ``<error>``).
Any other turn is the final answer: reward 1 when it equals the problem's answer. A well-formed
tool call earns ``tool_reward`` (default 0), so a policy may be nudged to use the tool.
"""

import re

from torchtitan_rl.rl.envs.base import EnvStep
from torchtitan_rl.rl.tasks.task import Problem

TOOL_CALL = re.compile(r"<tool>(.*?)</tool>", re.DOTALL)
_TOKEN = re.compile(r"\s*(?:([0-9]+)|(.))", re.DOTALL)
_BINARY = {"+": (1, lambda a, b: a + b), "-": (1, lambda a, b: a - b), "*": (2, lambda a, b: a * b)}
_UNARY = {"-": "negate", "+": "identity"}  # bind tighter than any binary operator, as in Python
_MAX_DIGITS = 30  # numbers beyond this are an error, not a slow big-integer product
_MAX_QUOTED = 40  # characters of the expression an error quotes: the policy reads it


def evaluate(expression: str) -> int:
    """The value of an integer expression of ``+ - *``, unary ``-`` / ``+`` and parentheses, as
    Python computes it; ValueError otherwise. Parsed, never executed, with explicit stacks (no
    recursion), so a call of any length or nesting is a value or a ValueError."""
    values: list[int] = []
    operators: list[str] = []  # pending: "(", a unary operator's name or a binary operator

    def apply(operator: str) -> None:
        if operator in _UNARY.values():
            values.append(-values.pop() if operator == "negate" else values.pop())
            return
        right = values.pop()
        result = _BINARY[operator][1](values.pop(), right)
        if len(str(abs(result))) > _MAX_DIGITS:
            raise ValueError("result too large")
        values.append(result)

    def precedence(operator: str) -> int:
        return 3 if operator in _UNARY.values() else _BINARY[operator][0]

    expect_operand, num_open = True, 0
    for match in _TOKEN.finditer(expression.strip()):
        number, symbol = match.groups()
        if expect_operand and number is not None:
            if len(number.lstrip("0")) > _MAX_DIGITS:
                raise ValueError("number too large")
            values.append(int(number))
            expect_operand = False
        elif expect_operand and symbol in ("(", *_UNARY):
            operators.append(_UNARY.get(symbol, symbol))
            num_open += symbol == "("
        elif not expect_operand and symbol in _BINARY:
            while operators and operators[-1] != "(" and precedence(operators[-1]) >= precedence(symbol):
                apply(operators.pop())
            operators.append(symbol)
            expect_operand = True
        elif not expect_operand and symbol == ")" and num_open:
            while operators[-1] != "(":
                apply(operators.pop())
            operators.pop()
            num_open -= 1
        elif symbol is not None and symbol not in "+-*()":
            raise ValueError(f"only integers, + - * and parentheses: {_quoted(expression)}")
        else:
            raise ValueError(f"not an expression: {_quoted(expression)}")
    if expect_operand or num_open:
        raise ValueError(f"not an expression: {_quoted(expression)}")
    while operators:
        apply(operators.pop())
    return values[0]


def _quoted(expression: str) -> str:
    if len(expression) <= _MAX_QUOTED:
        return repr(expression)
    return repr(expression[:_MAX_QUOTED]) + f" (and {len(expression) - _MAX_QUOTED} more characters)"


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
