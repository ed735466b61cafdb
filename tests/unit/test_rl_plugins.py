"""A user's reward function (``rl.reward_fn``) and task factory (``rl.task``) by import path, and
dataset rows whose extra columns reach the reward: the rewards are recomputed by hand from the
rows, the errors name the function and the problem."""

import json
import math
import re
import traceback
from pathlib import Path

import pytest

from rl_plugins import sort_digits
from torchtitan_rl.rl.generator import Rollout
from torchtitan_rl.rl.plugins import UserCodeError
from torchtitan_rl.rl.rollouts import ScoredGroup, rollout_metrics, rollout_sums
from torchtitan_rl.rl.tasks import PluginTask, build_task

RL_DOCS = Path(__file__).resolve().parents[2] / "docs" / "rl.md"
ROWS = [
    {"prompt": "Name a primary colour.", "accepted": ["red", "blue", "yellow"], "level": 1},
    {"prompt": "Name a vowel.", "answer": "a", "accepted": ["a", "e", "i", "o", "u"], "level": 2},
    {"messages": [{"role": "user", "content": "Say yes."}], "accepted": ["yes"], "level": None},
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def dataset_task(path: Path, **options):
    return build_task("dataset", path=str(path), num_train=0, num_eval=0, seed=0, **options)


def test_extra_columns_reach_the_reward_function_and_rows_need_no_answer(tmp_path):
    task = dataset_task(write_jsonl(tmp_path / "rows.jsonl", ROWS), reward_fn="rl_plugins:accepted_answers")
    assert isinstance(task, PluginTask)
    assert [p.extra for p in task.train_problems] == [
        {k: v for k, v in r.items() if k in ("accepted", "level")} for r in ROWS
    ]
    assert [p.answer for p in task.train_problems] == ["", "a", ""]
    for problem, row in zip(task.train_problems, ROWS):
        for completion in ("red", " yes\n", "e", "purple"):
            reward = task.reward(problem, completion, True)
            expected = completion.strip() in row["accepted"]
            assert (reward.total, reward.correct, reward.components) == (float(expected), expected, {})
    # The built-in verifier needs the answers.
    with pytest.raises(ValueError, match=r"rows.jsonl:1: missing 'answer'"):
        dataset_task(tmp_path / "rows.jsonl")


def test_parquet_rows_written_by_datasets_are_the_jsonl_rows(tmp_path):
    datasets = pytest.importorskip("datasets")
    # A column holds one type: the messages of the third row become a prompt.
    rows = [{**r, "prompt": r.get("prompt", "Say yes."), "answer": r.get("answer", "-")} for r in ROWS]
    for row in rows:
        row.pop("messages", None)
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "rows.parquet"))
    from_parquet = dataset_task(tmp_path / "rows.parquet", reward_fn="rl_plugins:accepted_answers")
    from_jsonl = dataset_task(write_jsonl(tmp_path / "rows.jsonl", rows), reward_fn="rl_plugins:accepted_answers")
    assert [(p.messages, p.answer, p.extra) for p in from_parquet.train_problems] == [
        (p.messages, p.answer, p.extra) for p in from_jsonl.train_problems
    ]
    assert [p.source for p in from_parquet.train_problems] == [f"{tmp_path / 'rows.parquet'} row {i}" for i in range(3)]


def test_every_row_trains_without_evaluation_or_with_an_eval_file(tmp_path):
    rows = [{"prompt": f"{n} + 1?", "answer": str(n + 1)} for n in range(8)]
    train_file = write_jsonl(tmp_path / "train.jsonl", rows)
    assert [p.answer for p in dataset_task(train_file).train_problems] == [str(n + 1) for n in range(8)]
    # A separate eval file: every train row trains except the one repeating a held-out prompt.
    eval_file = write_jsonl(tmp_path / "eval.jsonl", [rows[3], {"prompt": "9 + 1?", "answer": "10"}])
    task = dataset_task(train_file, eval_path=str(eval_file))
    assert [p.answer for p in task.eval_problems] == ["4", "10"]
    assert [p.answer for p in task.train_problems] == [str(n + 1) for n in range(8) if n != 3]
    # At most rl.num_eval_prompts of the eval file's rows, by a seeded draw.
    one = build_task("dataset", path=str(train_file), eval_path=str(eval_file), num_train=0, num_eval=1, seed=0)
    assert len(one.eval_problems) == 1 and one.eval_problems[0].answer in ("4", "10")


def test_a_dict_reward_is_the_sum_of_its_components():
    task = build_task("reverse", num_train=4, num_eval=0, seed=0, reward_fn="rl_plugins:length_and_stop")
    problem = task.train_problems[0]
    for completion, stopped in (("ab", True), ("abcd", True), ("ab", False), ("abcdef", False)):
        reward = task.reward(problem, completion, stopped)
        short = float(len(completion) <= 3)
        assert reward.components == {"short": short, "stopped": float(stopped)}
        assert reward.total == short + stopped and reward.correct == (short + stopped >= 1)


def test_reward_components_are_logged_as_their_means():
    task = build_task("reverse", num_train=4, num_eval=0, seed=0, reward_fn="rl_plugins:length_and_stop")
    completions = [("ab", "stop"), ("abcd", "stop"), ("a", "length"), ("abcdef", "length"), ("x", "stop")]
    rollouts = [
        Rollout(0, i, [1], list(text.encode()) + ([258] if reason == "stop" else []), [], reason)
        for i, (text, reason) in enumerate(completions)
    ]
    rewards = [task.reward(task.train_problems[0], text, reason == "stop") for text, reason in completions]
    metrics = rollout_metrics(*rollout_sums([ScoredGroup(0, rollouts, rewards, [0.0] * 5)], 0), None)
    assert metrics["rl/reward_short"] == pytest.approx(3 / 5) and metrics["rl/reward_stopped"] == pytest.approx(3 / 5)
    assert metrics["rl/reward_mean"] == pytest.approx(6 / 5)
    # Correct means a reward >= 1: all but "abcdef" (long and cut).
    assert metrics["rl/pass@1"] == pytest.approx(4 / 5)


@pytest.mark.parametrize(
    "name, error, message",
    [
        ("raises", UserCodeError, "raised ZeroDivisionError: division by zero on problem reverse train #0"),
        # The user's own ValueError is an error in their code, not a mistake of the config.
        ("raises_value_error", UserCodeError, "raised ValueError: no score for 'abc' on problem reverse train #0"),
        ("returns_nan", ValueError, "on problem reverse train #0: the reward is nan; it must be a finite number"),
        ("returns_text", ValueError, "the reward is '1.0'; it must be a finite number"),
        ("returns_empty", ValueError, "returned an empty dict"),
        ("returns_mean", ValueError, "component name 'mean' is taken by the tag rl/reward_mean"),
        ("returns_bad_name", ValueError, "component name 'exact match' must be letters, digits and '_'"),
        ("returns_half_correct", ValueError, "component 'correct' is 0.5; it says whether the completion is correct"),
    ],
)
def test_a_broken_reward_names_the_function_and_the_problem(name, error, message):
    task = build_task("reverse", num_train=2, num_eval=0, seed=0, reward_fn=f"rl_plugins:{name}")
    with pytest.raises(error, match=re.escape(f"rl.reward_fn = 'rl_plugins:{name}'")) as info:
        task.reward(task.train_problems[0], "abc", True)
    assert message in str(info.value)
    if error is UserCodeError:
        # The user's exception is chained with its traceback down to the user's own frame.
        frames = traceback.extract_tb(info.value.__cause__.__traceback__)
        assert (Path(frames[-1].filename).name, frames[-1].name) == ("__init__.py", name)


def test_components_must_keep_their_names():
    task = build_task("reverse", num_train=2, num_eval=0, seed=0, reward_fn="rl_plugins:names_depend_on_completion")
    assert task.reward(task.train_problems[0], "a", True).components == {"a": 1.0}
    with pytest.raises(ValueError, match=r"returned the components \['b'\], but earlier calls returned \['a'\]"):
        task.reward(task.train_problems[1], "b", True)


@pytest.mark.parametrize(
    "path, message",
    [
        ("rl_plugins:takes_two", "cannot be called as fn(problem, completion, stopped)"),
        ("rl_plugins:not_callable", "is a int, not a function"),
        ("rl_plugins:missing", "module 'rl_plugins' has no 'missing'"),
        ("no_such_package:fn", "cannot import 'no_such_package'"),
        ("rl_plugins", "not an import path 'package.module:name'"),
    ],
)
def test_reward_functions_are_checked_at_start_up(path, message):
    with pytest.raises(ValueError, match=re.escape(f"rl.reward_fn = {path!r}")) as info:
        build_task("reverse", num_train=2, num_eval=0, seed=0, reward_fn=path)
    assert message in str(info.value)


def test_a_task_factory_makes_the_pools_and_its_reward_scores_by_hand():
    task = build_task("rl_plugins.sort_digits:make_task", num_train=0, num_eval=8, seed=3)
    reference = sort_digits.make_task(seed=3, num_eval_prompts=8)
    assert task.train_problems == tuple(reference.train_problems) and len(task.train_problems) == 64
    assert task.eval_problems == tuple(reference.eval_problems) and len(task.eval_problems) == 8
    assert task.spare_problems == tuple(reference.spare_problems) and len(task.spare_problems) == 528
    keys = [{p.prompt_key() for p in pool} for pool in (task.train_problems, task.eval_problems, task.spare_problems)]
    assert not (keys[0] & keys[1] or keys[0] & keys[2] or keys[1] & keys[2])
    problem = task.train_problems[0]
    digits = problem.extra["digits"]
    for completion in ("".join(sorted(digits)), digits[::-1], "123", "9"):
        reward = task.reward(problem, completion, True)
        correct = completion == "".join(sorted(digits))
        same = sorted(completion) == sorted(digits)
        assert reward.components == {"correct": float(correct), "same_digits": 0.2 * same}
        assert math.isclose(reward.total, correct + 0.2 * same) and reward.correct == correct
    # rl.reward_fn replaces the task's reward; rows from a factory keep their columns.
    rows = build_task(
        "rl_plugins:two_problems", num_train=0, num_eval=1, seed=5, reward_fn="rl_plugins:length_and_stop"
    )
    assert rows.train_problems[0].extra == {"level": 0} and rows.eval_problems[0].answer == "6"
    assert rows.reward(rows.train_problems[0], "ab", False).components == {"short": 1.0, "stopped": 0.0}


@pytest.mark.parametrize(
    "path, error, message",
    [
        ("rl_plugins:factory_with_unknown_argument", ValueError, "missing a required argument: 'flavour'"),
        ("rl_plugins:factory_raises", UserCodeError, "the task factory raised RuntimeError: no data today"),
        ("rl_plugins:factory_without_reward", ValueError, "rl.task = 'rl_plugins:factory_without_reward .reward'"),
        ("rl_plugins:factory_eval_repeats_train", ValueError, "eval problem mine has the prompt of train problem mine"),
        ("rl_plugins:factory_bad_row", ValueError, "train_problems[0]: needs exactly one of 'prompt' and 'messages'"),
        ("rl_plugins:factory_of_a_string", ValueError, "train_problems must be a sequence of problems, got str"),
        ("rl_plugins:not_callable", ValueError, "is a int, not a task factory"),
    ],
)
def test_a_broken_task_factory_is_named(path, error, message):
    with pytest.raises(error, match=re.escape(f"rl.task = '{path.split(' ')[0]}")) as info:
        build_task(path, num_train=0, num_eval=1, seed=0)
    assert message in str(info.value)


def test_the_documented_worked_example_is_the_tested_one():
    """docs/rl.md shows ``sort_digits.py`` as this test package has it."""
    source = Path(sort_digits.__file__).read_text()
    assert f"```python\n{source}```" in RL_DOCS.read_text()
