import functools
import json
import operator
import re

import pytest

from torchtitan_rl.data.chat import tokenize_prompt, tokenize_row
from torchtitan_rl.data.questions import ENV_QUESTION_GENERATORS
from torchtitan_rl.data.tasks import BUILTIN_TASKS, IMAGE_TASKS
from torchtitan_rl.data.tokenizer import ByteTokenizer
from torchtitan_rl.rl.tasks import TASKS, Problem, RewardSpec, answered_rows, build_task

TOKENIZER = ByteTokenizer()
PROBLEM = Problem(({"role": "user", "content": "q"},), "42", "test")

# ---------------------------------------------------------------- rewards


def reward_of(completion: str, answer: str = "42", stopped: bool = True, **spec):
    return RewardSpec(**spec).score(completion, answer, stopped)


@pytest.mark.parametrize(
    "completion, answer, stopped, correct, partial",
    [
        ("42", "42", True, True, 1.0),
        ("  42\n", "42", True, True, 1.0),  # whitespace around either side is ignored
        ("42", " 42 ", False, True, 1.0),  # cut at max length: still correct, only format is lost
        ("41", "42", True, False, 1 / 2),  # '4' matches, '1' does not
        ("4", "42", True, False, 1 / 2),  # 1 match over the longer length 2
        ("cbaxy", "cba", True, False, 3 / 5),
        ("abc", "cba", True, False, 1 / 3),  # only the middle 'b' lines up
        ("", "42", False, False, 0.0),
        ("3.0", "3", True, False, 1 / 3),  # exact match compares text, not values
    ],
)
def test_exact_reward_components(completion, answer, stopped, correct, partial):
    reward = reward_of(completion, answer, stopped)
    assert reward.correct is correct
    assert reward.components == pytest.approx({"correct": float(correct), "partial": partial, "format": float(stopped)})


@pytest.mark.parametrize(
    "completion, answer, correct",
    [
        ("3.0", "3", True),
        (" 1e3 ", "1000", True),
        ("-0", "0", True),
        ("3.000001", "3", True),  # relative error 3.3e-7 <= 1e-6
        ("3.00001", "3", False),  # relative error 3.3e-6 > 1e-6
        ("-2.5", "2.5", False),
        ("three", "3", False),  # not a number: wrong, never an error
        ("3 apples", "3", False),
        ("nan", "nan", False),  # not a decimal number, even when the texts agree
        ("", "3", False),
    ],
)
def test_numeric_answer_match(completion, answer, correct):
    assert reward_of(completion, answer, answer_match="numeric").correct is correct


def test_total_weights_hand_computed():
    spec = {"partial_credit": 0.5, "format_reward": 0.1}
    assert reward_of("42", **spec).total == pytest.approx(1.0 + 0.1)
    assert reward_of("42", stopped=False, **spec).total == pytest.approx(1.0)
    assert reward_of("41", **spec).total == pytest.approx(0.5 * 0.5 + 0.1)
    assert reward_of("41", stopped=False, **spec).total == pytest.approx(0.5 * 0.5)
    # The defaults: 1 for a correct answer, 0 for anything else.
    assert [reward_of(c).total for c in ("42", "41", "")] == [1.0, 0.0, 0.0]


def test_task_reward_scores_against_the_problem_answer():
    task = build_task("arithmetic", num_train=4, num_eval=0, seed=0, format_reward=0.25)
    problem = task.train_problems[0]
    assert task.reward(problem, problem.answer, stopped=True).total == 1.25
    assert task.reward(problem, problem.answer + "0", stopped=False).total == 0.0


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"partial_credit": 1.5}, "partial_credit"),
        ({"partial_credit": -0.1}, "partial_credit"),
        ({"format_reward": -1.0}, "format_reward"),
        ({"format_reward": float("nan")}, "format_reward"),
        ({"answer_match": "fuzzy"}, r"answer_match='fuzzy'.*'exact', 'numeric'"),
    ],
)
def test_invalid_reward_options(spec, match):
    with pytest.raises(ValueError, match=match):
        build_task("jsonl", path="unused.jsonl", num_train=0, num_eval=0, seed=0, **spec)


# ---------------------------------------------------------------- built-in tasks


def prompt_of(problem: Problem) -> str:
    (message,) = problem.messages
    assert message["role"] == "user"
    return message["content"]


@pytest.mark.parametrize("name", ["arithmetic", "reverse"])
def test_builtin_pools_are_deterministic_sized_distinct_and_disjoint(name):
    task = build_task(name, num_train=200, num_eval=50, seed=3)
    assert task.name == name
    assert task == build_task(name, num_train=200, num_eval=50, seed=3)
    assert task.train_problems != build_task(name, num_train=200, num_eval=50, seed=4).train_problems
    train, held_out = [prompt_of(p) for p in task.train_problems], [prompt_of(p) for p in task.eval_problems]
    assert (len(set(train)), len(set(held_out))) == (200, 50)
    assert not set(train) & set(held_out)


@pytest.mark.parametrize("name", ["arithmetic", "reverse"])
def test_builtin_train_pool_is_the_sft_generator_without_repeats(name):
    # One generator feeds both recipes: the train pool is the SFT rows of the same seed, duplicates dropped.
    task = build_task(name, num_train=300, num_eval=0, seed=7)
    sft_pairs = [tuple(m["content"] for m in row["messages"]) for row in BUILTIN_TASKS[name](2000, 7)]
    first_distinct = list(dict.fromkeys(sft_pairs))[:300]
    assert [(prompt_of(p), p.answer) for p in task.train_problems] == first_distinct


def test_tiny_pools():
    task = build_task("arithmetic", num_train=8, num_eval=2, seed=0)
    assert (len(task.train_problems), len(task.eval_problems)) == (8, 2)
    assert [p.source for p in task.train_problems] == [f"arithmetic train #{i}" for i in range(8)]
    assert not {p.prompt_key() for p in task.train_problems} & {p.prompt_key() for p in task.eval_problems}


def test_builtin_answers_are_correct():
    ops = {"+": operator.add, "-": operator.sub, "*": operator.mul}
    task = build_task("arithmetic", num_train=300, num_eval=100, seed=1)
    for problem in task.train_problems + task.eval_problems:
        a, op, b = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", prompt_of(problem)).groups()
        assert problem.answer == str(ops[op](int(a), int(b)))
        assert task.reward(problem, problem.answer, stopped=True).correct
    task = build_task("reverse", num_train=100, num_eval=30, seed=1)
    for problem in task.train_problems + task.eval_problems:
        text = re.fullmatch(r"Reverse the string: ([a-z]{3,8})", prompt_of(problem)).group(1)
        assert problem.answer == "".join(reversed(text))


def test_too_few_distinct_questions_is_an_error(monkeypatch):
    import torchtitan_rl.rl.tasks as tasks
    from torchtitan_rl.rl.tasks.builtin import builtin_problem_pools

    # Three possible questions: all of them land in the train pool, none is left for eval.
    three = functools.partial(builtin_problem_pools, "arithmetic", lambda rng: (f"q{rng.randint(0, 2)}", "a"))
    monkeypatch.setitem(tasks.TASKS, "arithmetic", three)
    assert len(build_task("arithmetic", num_train=3, num_eval=0, seed=0).train_problems) == 3
    with pytest.raises(ValueError, match="only 0 distinct eval problems of the 1") as error:
        build_task("arithmetic", num_train=3, num_eval=1, seed=0)
    assert_names_config_keys(str(error.value))


def test_sft_rows_tokenize_with_the_rl_prompt_as_prefix():
    task = build_task("reverse", num_train=20, num_eval=5, seed=0)
    rows = answered_rows(task.train_problems)
    assert len(rows) == 20
    for row, problem in zip(rows, task.train_problems):
        tokens, mask = tokenize_row(row, TOKENIZER)
        prompt = tokenize_prompt(problem.messages, TOKENIZER)
        assert tokens[: len(prompt)] == prompt and mask.index(True) == len(prompt)
        trained = [t for t, m in zip(tokens, mask) if m]
        assert TOKENIZER.decode(trained) == problem.answer + "<|im_end|>"
    rows[0]["messages"][0]["content"] = "edited"
    assert prompt_of(task.train_problems[0]) != "edited"


# ---------------------------------------------------------------- jsonl


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_jsonl_rows_of_both_forms(tmp_path):
    system = {"role": "system", "content": "Be brief."}
    rows = [
        {"prompt": "2+2?", "answer": "4"},
        {"messages": [system, {"role": "user", "content": "half of 5?"}], "answer": 2.5},
        {"prompt": "7*6?", "answer": 42},
    ]
    file = write_lines(tmp_path / "data.jsonl", [json.dumps(rows[0]), "", json.dumps(rows[1]), json.dumps(rows[2])])
    task = build_task("jsonl", path=str(file), num_train=0, num_eval=0, seed=0, answer_match="numeric")
    assert task.eval_problems == ()
    assert task.train_problems == (
        Problem(({"role": "user", "content": "2+2?"},), "4", f"{file}:1"),
        Problem((system, {"role": "user", "content": "half of 5?"}), "2.5", f"{file}:3"),
        Problem(({"role": "user", "content": "7*6?"},), "42", f"{file}:4"),
    )
    assert task.reward(task.train_problems[1], "2.50", stopped=True).correct


def numbered_rows(count: int, start: int = 0) -> list[str]:
    return [json.dumps({"prompt": f"question {i}", "answer": str(i)}) for i in range(start, start + count)]


def test_jsonl_holdout_is_seeded_disjoint_and_in_file_order(tmp_path):
    # A directory: files in sorted order, subdirectories included.
    write_lines(tmp_path / "b.jsonl", numbered_rows(10, start=10))
    (tmp_path / "sub").mkdir()
    write_lines(tmp_path / "sub" / "c.jsonl", numbered_rows(5, start=20))
    write_lines(tmp_path / "a.jsonl", numbered_rows(10))
    (tmp_path / "notes.txt").write_text("not data")

    def pools(seed, num_train=0):
        task = build_task("jsonl", path=str(tmp_path), num_train=num_train, num_eval=6, seed=seed)
        return [int(p.answer) for p in task.train_problems], [int(p.answer) for p in task.eval_problems]

    train, held_out = pools(seed=0)
    assert len(held_out) == 6 and held_out == sorted(held_out)
    assert sorted(train + held_out) == list(range(25)) and train == sorted(train)
    assert pools(seed=0) == (train, held_out) and pools(seed=1)[1] != held_out
    subset, same_held_out = pools(seed=0, num_train=5)
    assert same_held_out == held_out and len(subset) == 5 and set(subset) < set(train) and subset == sorted(subset)
    # The rows left out of the RL pool are the warm-up's; none without a subset.
    task = build_task("jsonl", path=str(tmp_path), num_train=5, num_eval=6, seed=0)
    spare = [int(p.answer) for p in task.spare_problems]
    assert sorted(spare + subset) == train and spare == sorted(spare)
    assert build_task("jsonl", path=str(tmp_path), num_train=0, num_eval=6, seed=0).spare_problems == ()


def test_jsonl_spare_rows_never_repeat_a_train_prompt(tmp_path):
    rows = [json.dumps({"prompt": f"q{i % 4}", "answer": str(i)}) for i in range(12)]
    file = write_lines(tmp_path / "r.jsonl", rows)
    for seed in range(5):
        task = build_task("jsonl", path=str(file), num_train=3, num_eval=0, seed=seed)
        train_prompts = {p.prompt_key() for p in task.train_problems}
        assert not train_prompts & {p.prompt_key() for p in task.spare_problems}
        trained = {p.answer for p in task.train_problems}
        questions = {p.messages[0]["content"] for p in task.train_problems}
        expected = [str(i) for i in range(12) if str(i) not in trained and f"q{i % 4}" not in questions]
        assert [p.answer for p in task.spare_problems] == expected and len(expected) > 0


def test_jsonl_train_rows_repeating_a_held_out_prompt_are_dropped(tmp_path):
    same = json.dumps({"prompt": "same", "answer": "x"})
    file = write_lines(tmp_path / "d.jsonl", [same, same, same, json.dumps({"prompt": "other", "answer": "y"})])
    for seed in range(10):
        task = build_task("jsonl", path=str(file), num_train=0, num_eval=1, seed=seed)
        assert not {p.prompt_key() for p in task.train_problems} & {p.prompt_key() for p in task.eval_problems}
        assert len(task.train_problems) == (1 if prompt_of(task.eval_problems[0]) == "same" else 3)


GOOD = json.dumps({"prompt": "q", "answer": "a"})


@pytest.mark.parametrize(
    "bad_line, reason",
    [
        ('{"prompt": "q", "answer": ', "malformed JSON"),
        ('["q", "a"]', "expected a JSON object, got list"),
        ('{"prompt": "q"}', "missing 'answer'"),
        ('{"prompt": "q", "answer": "a", "id": 3}', "unexpected keys ['id']"),
        ('{"answer": "a"}', "exactly one of 'prompt' and 'messages'"),
        ('{"prompt": "q", "messages": [{"role": "user", "content": "q"}], "answer": "a"}', "exactly one of"),
        ('{"prompt": 3, "answer": "a"}', "'prompt' must be a non-empty string"),
        ('{"prompt": "q", "answer": true}', "'answer' must be a string or a number"),
        ('{"prompt": "q", "answer": ["a"]}', "'answer' must be a string or a number"),
        ('{"prompt": "q", "answer": NaN}', "'answer' must be finite"),
        ('{"prompt": "q", "answer": "  "}', "'answer' is empty"),
        (
            '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "answer": "a"}',
            "must not contain an 'assistant' turn",
        ),
        ('{"messages": [{"role": "function", "content": "q"}], "answer": "a"}', "unsupported chat role 'function'"),
        ('{"messages": [], "answer": "a"}', "non-empty list"),
    ],
)
def test_jsonl_bad_row_names_file_and_line(tmp_path, bad_line, reason):
    file = write_lines(tmp_path / "bad.jsonl", [GOOD, "", bad_line, GOOD])
    with pytest.raises(ValueError) as excinfo:
        build_task("jsonl", path=str(file), num_train=0, num_eval=0, seed=0)
    assert f"{file}:3" in str(excinfo.value) and reason in str(excinfo.value)


def test_jsonl_numeric_match_needs_numeric_answers(tmp_path):
    file = write_lines(tmp_path / "n.jsonl", [json.dumps({"prompt": "q", "answer": 7}), GOOD])
    assert len(build_task("jsonl", path=str(file), num_train=0, num_eval=0, seed=0).train_problems) == 2
    with pytest.raises(ValueError, match=re.escape(f"{file}:2: 'answer' 'a' is not a decimal number")):
        build_task("jsonl", path=str(file), num_train=0, num_eval=0, seed=0, answer_match="numeric")


@pytest.mark.parametrize(
    "setup, options, match",
    [
        (lambda d: write_lines(d / "e.jsonl", ["", "  "]), {}, "is empty"),
        (lambda d: d / "missing.jsonl", {}, "does not exist"),
        (lambda d: write_lines(d / "rows.json", [GOOD]), {}, "not a .jsonl file"),
        (lambda d: d, {}, "directory with no .jsonl files"),
        (
            lambda d: write_lines(d / "r.jsonl", [GOOD] * 3),
            {"num_eval": 3},
            "3 rows, fewer than rl.num_eval_prompts \\+ 1 = 4",
        ),
        (
            lambda d: write_lines(d / "r.jsonl", numbered_rows(4)),
            {"num_eval": 1, "num_train": 4},
            "rl.num_train_prompts=4 but only 3 rows",
        ),
        (
            lambda d: write_lines(d / "r.jsonl", [GOOD] * 3),
            {"num_eval": 1},
            "repeats a held-out prompt; lower rl.num_eval_prompts",
        ),
    ],
)
def test_jsonl_file_errors(tmp_path, setup, options, match):
    path = setup(tmp_path)
    with pytest.raises(ValueError, match=match) as error:
        build_task("jsonl", path=str(path), **{"num_train": 0, "num_eval": 0, "seed": 0, **options})
    assert_names_config_keys(str(error.value))


def assert_names_config_keys(message: str) -> None:
    """Errors a user fixes in the config name its keys, never build_task's argument names."""
    assert not re.search(r"(?<!rl\.)\b(num_train|num_eval|path|answer_match)\b", message), message


# ---------------------------------------------------------------- options fail closed


@pytest.mark.parametrize(
    "name, options, match",
    [
        (
            "sudoku",
            {},
            r"rl.task: unknown task 'sudoku'; valid tasks: \['arithmetic', 'calculator', 'guess_number', 'jsonl', "
            r"'reverse'\]",
        ),
        ("arithmetic", {"path": "data.jsonl"}, "rl.task_path='data.jsonl'"),
        ("reverse", {"answer_match": "numeric"}, "rl.answer_match: .* must be 'exact'"),
        ("arithmetic", {"num_train": 0}, "rl.num_train_prompts: task 'arithmetic' needs at least 1"),
        ("arithmetic", {"num_eval": -1}, "rl.num_eval_prompts=-1"),
        ("jsonl", {}, "rl.task_path: task 'jsonl' needs a .jsonl file"),
    ],
)
def test_unused_or_invalid_options_are_rejected(name, options, match):
    with pytest.raises(ValueError, match=match) as error:
        build_task(name, **{"num_train": 4, "num_eval": 1, "seed": 0, **options})
    assert_names_config_keys(str(error.value))


def test_registry_names():
    assert sorted(TASKS) == ["arithmetic", "calculator", "guess_number", "jsonl", "reverse"]
    # Every text SFT task is an RL task; image tasks are SFT-only (the generator has no vision input);
    # the environments' problems are RL-only (their answers take several turns).
    assert set(TASKS) - {"jsonl", *ENV_QUESTION_GENERATORS} == set(BUILTIN_TASKS) - set(IMAGE_TASKS)
