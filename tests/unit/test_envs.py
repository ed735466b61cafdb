"""Multi-turn environments: the calculator's arithmetic against Python's on random expressions
(and what it refuses), both built-ins' answers turn by turn, loading a user's environment by
import path with named errors, and the observation tokens against the tokens of the whole
conversation as an SFT row."""

import math
import random
import warnings

import pytest

from torchtitan_rl.data.chat import tokenize_observation, tokenize_prompt, tokenize_row
from torchtitan_rl.data.tokenizer import build_tokenizer
from torchtitan_rl.rl.envs import ENVIRONMENTS, EnvStep, load_environment
from torchtitan_rl.rl.envs.calculator import CalculatorEnv, evaluate
from torchtitan_rl.rl.envs.guess_number import GuessNumberEnv
from torchtitan_rl.rl.tasks.task import Problem


def random_expression(rng: random.Random, depth: int = 3) -> str:
    if depth == 0 or rng.random() < 0.3:
        return str(rng.randint(0, 999))
    left, right = random_expression(rng, depth - 1), random_expression(rng, depth - 1)
    text = f"{left} {rng.choice('+-*')} {right}"
    return f"({text})" if rng.random() < 0.5 else text


def test_the_calculator_computes_what_python_does():
    rng = random.Random(0)
    for _ in range(300):
        expression = random_expression(rng)
        assert evaluate(expression) == eval(expression), expression  # noqa: S307  (the reference)
    assert evaluate(" -3 * (2 + 4) ") == -18


def random_tokens(rng: random.Random, num_tokens: int) -> str:
    """A sequence of integers (no leading zeros, which Python refuses), operators and
    parentheses, spaced so that no two tokens merge (``* *`` is not ``**``): mostly what
    may come next in an expression, sometimes any token."""
    tokens = []
    for _ in range(num_tokens):
        number = str(rng.randint(0, 999))
        if rng.random() < 0.15:
            choices = [number, "+", "-", "*", "(", ")"]
        elif tokens and (tokens[-1] == ")" or tokens[-1].isdigit()):
            choices = ["+", "-", "*", ")"] if tokens.count("(") > tokens.count(")") else ["+", "-", "*"]
        else:
            choices = [number, number, "(", "-", "+"]
        tokens.append(rng.choice(choices))
    return " ".join(tokens)


def test_the_calculator_accepts_exactly_what_python_computes_as_an_integer():
    """At most 10 three-digit numbers: no product reaches the 30-digit bound."""
    rng = random.Random(1)
    num_valid = 0
    for _ in range(3000):
        expression = random_tokens(rng, rng.randint(1, 19))
        try:
            with warnings.catch_warnings(action="ignore", category=SyntaxWarning):  # "2 (3)": a call
                expected = eval(expression)  # noqa: S307  (the reference)
        except Exception:  # noqa: BLE001  (a syntax error, or a call of an integer: "2 (3)")
            expected = None
        if type(expected) is int:
            num_valid += 1
            assert evaluate(expression) == expected, expression
        else:
            with pytest.raises(ValueError):
                evaluate(expression)
    assert min(num_valid, 3000 - num_valid) > 250  # both kinds are well represented


def test_the_calculator_takes_calls_of_any_length_and_nesting():
    """Thousands of terms or nested parentheses, beyond what Python's own parser takes."""
    rng = random.Random(2)
    for num_terms in (1000, 20_000):
        assert evaluate("+".join(["1"] * num_terms)) == num_terms
        terms = [[rng.randint(-9, 9) for _ in range(rng.randint(1, 3))] for _ in range(num_terms)]
        text = " + ".join(" * ".join(f"({f})" if f < 0 else str(f) for f in term) for term in terms)
        assert evaluate(text) == sum(math.prod(term) for term in terms)
    for depth in (1000, 20_000):
        assert evaluate("(" * depth + "7" + ")" * depth) == 7
        assert evaluate("(1 + " * depth + "1" + ")" * depth) == depth + 1
        assert evaluate("-(" * depth + "5" + ")" * depth) == (-1) ** depth * 5
        assert evaluate("- " * depth + "5") == (-1) ** depth * 5
        for unbalanced in ("(" * depth + "7" + ")" * (depth - 1), "(" * (depth - 1) + "7" + ")" * depth):
            with pytest.raises(ValueError, match="not an expression"):
                evaluate(unbalanced)


def test_a_long_or_broken_tool_call_is_a_tool_error_the_policy_reads():
    env = CalculatorEnv(problem("What is 1 + 1?", "2"))
    assert env.step(f"<tool>{'+'.join(['1'] * 5000)}</tool>").observation[0]["content"] == "<result>5000</result>"
    rng = random.Random(3)
    calls = ["(" * 5000 + "1", "1" + ")" * 5000, "1 +" * 5000, "9" * 5000, "9" * 25 + " * 9" * 5000]
    calls += ["".join(rng.choice("0123456789+-*() x/.") for _ in range(rng.randint(0, 3000))) for _ in range(200)]
    for call in calls:
        result = env.step(f"<tool>{call}</tool>")
        assert not result.done and result.reward == 0.0 or result.observation[0]["content"].startswith("<result>")
        if result.observation[0]["content"].startswith("<error>"):
            # It quotes the start of a long call, not all of it: the policy has a length budget.
            assert len(result.observation[0]["content"]) < 200, result.observation


@pytest.mark.parametrize(
    "expression",
    ["__import__('os')", "2 ** 100", "7 / 2", "abs(-1)", "1.5 + 1", "x + 1", "", "9" * 20 + "*" + "9" * 20],
)
def test_the_calculator_refuses_anything_else(expression):
    with pytest.raises(ValueError):
        evaluate(expression)


def problem(question: str, answer: str) -> Problem:
    return Problem(({"role": "user", "content": question},), answer, "test #0")


def test_the_calculator_environment_answers_tool_calls_and_scores_the_answer():
    env = CalculatorEnv(problem("What is 123 * 45 + 6?", "5541"), tool_reward=0.1)
    assert env.reset() == [{"role": "user", "content": "What is 123 * 45 + 6?"}]
    assert env.step("<tool>123 * 45 + 6</tool>") == EnvStep(
        [{"role": "tool", "content": "<result>5541</result>"}], 0.1, False
    )
    broken = env.step("<tool>123 / 0</tool>")
    assert broken.observation[0]["content"].startswith("<error>") and broken.reward == 0 and not broken.done
    assert env.step(" 5541 ") == EnvStep(None, 1.0, True, True)
    assert env.step("5540") == EnvStep(None, 0.0, True, False)


def test_guess_number_leads_a_bisecting_policy_to_the_secret_with_a_reward_falling_by_turn():
    for secret in range(1, 17):
        env = GuessNumberEnv(problem("Guess my number between 1 and 16.", str(secret)))
        low, high, turns = 1, 16, 0
        while True:
            guess = (low + high) // 2
            turns += 1
            result = env.step(str(guess))
            if result.done:
                break
            hint = result.observation[0]["content"]
            low, high = (guess + 1, high) if hint == "higher" else (low, guess - 1)
        assert result.correct and result.reward == pytest.approx(max(0.0, 1 - 0.2 * (turns - 1)))
    assert GuessNumberEnv(problem("?", "3")).step("three") == EnvStep(None, 0.0, True, False)


def test_environments_load_by_name_or_import_path_and_broken_ones_are_named():
    assert load_environment("calculator") is ENVIRONMENTS["calculator"] is CalculatorEnv
    echo = load_environment("env_plugins:Echo")
    env = echo(problem("Say 7", "7"))
    assert env.step("6").observation == [{"role": "user", "content": "again"}] and env.step("7").correct
    cases = {
        "calculater": "not a built-in environment (calculator, guess_number) nor an import path",
        "no_such_module:Env": "cannot import 'no_such_module'",
        "env_plugins:Missing": "module 'env_plugins' has no 'Missing'",
        "env_plugins:NoStep": "NoStep has no step()",
        "env_plugins:NeedsTwoArguments": "NeedsTwoArguments(problem) cannot be called with a problem",
        "env_plugins:not_a_class": "is not a class but a function",
    }
    for name, message in cases.items():
        with pytest.raises(ValueError, match=f"rl.env = {name!r}") as info:
            load_environment(name)
        assert message in str(info.value), (name, str(info.value))


def test_observation_tokens_complete_the_conversation_exactly_as_an_sft_row():
    tokenizer = build_tokenizer("")
    prompt = [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "What is 12 * 34?"}]
    turns = ["<tool>12 * 34</tool>", "408"]
    observation = [{"role": "tool", "content": "<result>408</result>"}]
    end = [tokenizer.im_end_id]
    episode = tokenize_prompt(prompt, tokenizer)
    sampled = [False] * len(episode)
    first = tokenizer.encode(turns[0]) + end
    episode += first
    sampled += [True] * len(first)
    appended = tokenize_observation(observation, tokenizer)
    episode += appended
    sampled += [False] * len(appended)
    second = tokenizer.encode(turns[1]) + end
    episode += second
    sampled += [True] * len(second)
    conversation = [*prompt, {"role": "assistant", "content": turns[0]}, *observation]
    conversation.append({"role": "assistant", "content": turns[1]})
    tokens, target_mask = tokenize_row({"messages": conversation}, tokenizer)
    # The row ends with the template's newline after the last <|im_end|>, never sampled.
    assert tokens[:-1] == episode and tokens[-1:] == tokenizer.encode("\n")
    assert target_mask[:-1] == sampled
    with pytest.raises(ValueError, match="invalid observation: an observation cannot contain an assistant turn"):
        tokenize_observation([{"role": "assistant", "content": "x"}], tokenizer)


def test_the_warm_up_mixes_environment_demonstrations_and_direct_answers():
    import dataclasses

    from torchtitan_rl.config import JobConfig
    from torchtitan_rl.recipes.grpo import GRPORecipe
    from torchtitan_rl.rl.tasks import build_task

    recipe = GRPORecipe.__new__(GRPORecipe)
    cfg = JobConfig()
    cfg.rl = dataclasses.replace(cfg.rl, task="calculator", env="calculator", sft_warmup_demonstrations=0.25)
    recipe.job_config, recipe.env_class = cfg, CalculatorEnv
    problems = build_task("calculator", num_train=8, num_eval=0, seed=0).train_problems
    rows = recipe._answered(problems)
    tokenizer = build_tokenizer("")
    demonstrations = [r for r in rows if any(m["role"] == "tool" for m in r["messages"])]
    assert len(rows) == 8 and len(demonstrations) == 2
    for row in demonstrations:
        call, result, answer = row["messages"][1:]
        assert evaluate(call["content"][len("<tool>") : -len("</tool>")]) == int(answer["content"])
        assert result["content"] == f"<result>{answer['content']}</result>"
    for row in rows:
        assert row["messages"][-1]["content"] in {p.answer for p in problems}
        tokenize_row(row, tokenizer)  # every row is a valid SFT row


def test_the_warm_up_trains_on_demonstrations_alone_for_its_first_steps(tmp_path, monkeypatch):
    """rl.sft_warmup_demonstration_steps: those first steps draw rows that all call the tool,
    the later ones the rl.sft_warmup_demonstrations mix; more of them than warm-up steps, or
    an environment without demonstrations, is a config error naming the key."""
    from pathlib import Path

    from torchtitan_rl.config import ConfigManager
    from torchtitan_rl.recipes import grpo

    drawn = []
    real_loader = grpo.build_sft_dataloader

    def recording_loader(rows, *args, **kwargs):
        demonstrations = sum(any(m["role"] == "tool" for m in row["messages"]) for row in rows) / len(rows)
        for batch in real_loader(rows, *args, **kwargs):
            drawn.append(round(demonstrations, 1))
            yield batch

    monkeypatch.setattr(grpo, "build_sft_dataloader", recording_loader)

    def config(*args: str, recipe: str = "debug_tool_grpo.toml"):
        recipe = Path(__file__).resolve().parents[2] / "train_configs" / recipe
        return ConfigManager().parse_args(
            ["--job.config_file", str(recipe), "--job.dump_folder", str(tmp_path), "--metrics.enable_tensorboard",
             "false", "--rl.eval_interval", "0", "--rl.sft_warmup_batch_size", "2", *args]
        )  # fmt: skip

    recipe = grpo.GRPORecipe(
        config("--rl.sft_warmup_steps", "5", "--rl.sft_warmup_demonstration_steps", "3",
               "--rl.sft_warmup_demonstrations", "0.5")
    )  # fmt: skip
    recipe.setup()
    recipe.close()
    assert drawn == [1.0, 1.0, 1.0, 0.5, 0.5]
    with pytest.raises(ValueError, match=r"rl.sft_warmup_demonstration_steps=6 exceeds rl.sft_warmup_steps=5"):
        grpo.GRPORecipe(config("--rl.sft_warmup_steps", "5", "--rl.sft_warmup_demonstration_steps", "6"))
    with pytest.raises(ValueError, match=r"rl.sft_warmup_demonstration_steps=1: no rl.env to demonstrate"):
        grpo.GRPORecipe(
            config("--rl.sft_warmup_steps", "2", "--rl.sft_warmup_demonstration_steps", "1", recipe="debug_grpo.toml")
        )
