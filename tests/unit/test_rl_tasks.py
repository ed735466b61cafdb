import functools
import json
import operator
import random
import re

import numpy as np
import pytest

from test_vision_loader import count_components, pixels_of, shape_colours
from torchtitan_rl.data import shapes as shapes_task
from torchtitan_rl.data.chat import tokenize_prompt, tokenize_prompt_row, tokenize_row, tokenize_row_with_images
from torchtitan_rl.data.questions import ENV_QUESTION_GENERATORS
from torchtitan_rl.data.tasks import BUILTIN_TASKS
from torchtitan_rl.data.tokenizer import ByteTokenizer
from torchtitan_rl.rl.tasks import GENERATED_TASKS, TASKS, Problem, RewardSpec, answered_rows, build_task

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
        build_task("dataset", path="unused.jsonl", num_train=0, num_eval=0, seed=0, **spec)


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


# ---------------------------------------------------------------- the shapes task (prompts with images)

SHAPE_QUESTIONS = {q: k for k, q in shapes_task.QUESTIONS.items()}


def large_shape_of(mask: np.ndarray) -> str:
    """The kind of the one large shape of ``mask``, from the share of its bounding box it fills:
    1 (square), pi/4 (circle) or 1/2 (triangle)."""
    ys, xs = mask.nonzero()
    height, width = ys.max() - ys.min() + 1, xs.max() - xs.min() + 1
    assert height == width >= 0.7 * min(mask.shape), "a large shape fills a square box"
    fill = mask.sum() / (height * width)
    # Pixel-exact drawings of every size 8..192 fill 1, 0.75..0.82 and 0.50..0.57 of their box.
    for kind, low, high in (("square", 0.97, 1.0), ("circle", 0.7, 0.87), ("triangle", 0.45, 0.62)):
        if low <= fill <= high:
            return kind
    raise AssertionError(f"a fill of {fill:.3f} is no shape")


def check_shapes_problem(problem: Problem) -> str:
    """Recomputes the problem's answer from its image's pixels; returns the question kind."""
    (message,) = problem.messages
    image, question = message["content"]
    assert message["role"] == "user" and image["type"] == "image" and question["type"] == "text"
    kind = SHAPE_QUESTIONS[question["text"]]
    pixels = pixels_of(image["image"])
    mask = (pixels != shapes_task.BACKGROUND).any(-1)
    if kind == "count":
        assert problem.answer == str(count_components(mask))
    else:
        (colour,) = shape_colours(pixels)
        assert problem.answer == (colour if kind == "colour" else large_shape_of(mask))
    return kind


def test_shapes_pools_are_deterministic_disjoint_and_in_the_rl_mix():
    task = build_task("shapes", num_train=300, num_eval=60, seed=5)
    assert task == build_task("shapes", num_train=300, num_eval=60, seed=5)
    # Row i depends on (seed, split, i) alone: a smaller pool is a prefix of a larger one.
    assert task.train_problems[:50] == build_task("shapes", num_train=50, num_eval=0, seed=5).train_problems
    assert task.train_problems[0] != build_task("shapes", num_train=1, num_eval=0, seed=6).train_problems[0]
    assert [p.source for p in task.eval_problems[:2]] == ["shapes eval #0", "shapes eval #1"]
    train_keys, eval_keys = [p.prompt_key() for p in task.train_problems], [p.prompt_key() for p in task.eval_problems]
    assert (len(set(train_keys)), len(set(eval_keys))) == (300, 60) and not set(train_keys) & set(eval_keys)
    kinds = [check_shapes_problem(p) for p in task.train_problems + task.eval_problems]
    for kind, share in shapes_task.RL_QUESTION_MIX:
        assert abs(kinds.count(kind) / len(kinds) - share) < 0.07, (kind, kinds.count(kind))
    answers = {p.answer for p in task.train_problems}
    assert answers == {*shapes_task.COLOURS, *shapes_task.SHAPE_KINDS, "1", "2", "3"}


def test_shapes_problems_are_the_sft_rows_without_the_answer():
    rng = random.Random("shapes-rl/train/9/0")
    (problem,) = build_task("shapes", num_train=1, num_eval=0, seed=9).train_problems
    assert answered_rows([problem]) == [shapes_task.draw_rl_row(rng)]
    (user,) = problem.messages
    assert [sorted(part) for part in user["content"]] == [["image", "type"], ["text", "type"]]
    png = user["content"][0]["image"]
    assert png.startswith(b"\x89PNG") and len(png) < 4096


def test_shapes_warmup_rows_are_sft_vision_rows_with_the_rl_prompt_as_prefix():
    task = build_task("shapes", num_train=40, num_eval=10, seed=0)
    # What the GRPO warm-up does: other problems of the task, none of them a pool's prompt.
    extra = build_task("shapes", num_train=30, num_eval=0, seed=1).train_problems
    taken = {p.prompt_key() for p in (*task.train_problems, *task.eval_problems)}
    kept = [p for p in extra if p.prompt_key() not in taken]
    assert len(kept) == 30
    rows = answered_rows(kept)
    for row, problem in zip(rows, kept):
        tokenized = tokenize_row_with_images(row, TOKENIZER)
        prompt = tokenize_prompt_row(problem.messages, TOKENIZER)
        assert tokenized.tokens[: len(prompt.tokens)] == prompt.tokens and tokenized.target_mask.index(True) == len(
            prompt.tokens
        )
        assert [(i.source, i.position) for i in tokenized.images] == [(i.source, i.position) for i in prompt.images]
        assert [i.source for i in prompt.images] == [problem.messages[0]["content"][0]["image"]]
        trained = [t for t, m in zip(tokenized.tokens, tokenized.target_mask) if m]
        assert TOKENIZER.decode(trained) == problem.answer + "<|im_end|>"
    rows[0]["messages"][0]["content"][0]["image"] = b"edited"
    assert kept[0].messages[0]["content"][0]["image"] != b"edited"


def test_prompt_keys_of_image_parts():
    def problem(*parts):
        return Problem(({"role": "user", "content": list(parts)},), "a", "test")

    text = {"type": "text", "text": "Which?"}
    same = problem({"type": "image", "image": b"png 1"}, text)
    assert same.prompt_key() == problem({"type": "image", "image": b"png 1"}, dict(text)).prompt_key()
    assert same.prompt_key() != problem({"type": "image", "image": b"png 2"}, text).prompt_key()
    assert same.prompt_key() != problem(text, {"type": "image", "image": b"png 1"}).prompt_key()
    # The two spellings of a path part are one prompt.
    by_path = problem({"type": "image", "path": "/d/a.png"}, text).prompt_key()
    assert by_path == problem({"type": "image", "image": "/d/a.png"}, text).prompt_key()
    assert by_path != problem({"type": "image", "image": "/d/b.png"}, text).prompt_key()
    assert len({by_path, same.prompt_key(), same.prompt_key()}) == 2


# ---------------------------------------------------------------- dataset rows


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_dataset_rows_of_both_forms(tmp_path):
    system = {"role": "system", "content": "Be brief."}
    rows = [
        {"prompt": "2+2?", "answer": "4"},
        {"messages": [system, {"role": "user", "content": "half of 5?"}], "answer": 2.5},
        {"prompt": "7*6?", "answer": 42},
    ]
    file = write_lines(tmp_path / "data.jsonl", [json.dumps(rows[0]), "", json.dumps(rows[1]), json.dumps(rows[2])])
    task = build_task("dataset", path=str(file), num_train=0, num_eval=0, seed=0, answer_match="numeric")
    assert task.eval_problems == ()
    assert task.train_problems == (
        Problem(({"role": "user", "content": "2+2?"},), "4", f"{file}:1"),
        Problem((system, {"role": "user", "content": "half of 5?"}), "2.5", f"{file}:3"),
        Problem(({"role": "user", "content": "7*6?"},), "42", f"{file}:4"),
    )
    assert task.reward(task.train_problems[1], "2.50", stopped=True).correct


def numbered_rows(count: int, start: int = 0) -> list[str]:
    return [json.dumps({"prompt": f"question {i}", "answer": str(i)}) for i in range(start, start + count)]


def test_dataset_holdout_is_seeded_disjoint_and_in_file_order(tmp_path):
    # A directory: files in sorted order, subdirectories included.
    write_lines(tmp_path / "b.jsonl", numbered_rows(10, start=10))
    (tmp_path / "sub").mkdir()
    write_lines(tmp_path / "sub" / "c.jsonl", numbered_rows(5, start=20))
    write_lines(tmp_path / "a.jsonl", numbered_rows(10))
    (tmp_path / "notes.txt").write_text("not data")

    def pools(seed, num_train=0):
        task = build_task("dataset", path=str(tmp_path), num_train=num_train, num_eval=6, seed=seed)
        return [int(p.answer) for p in task.train_problems], [int(p.answer) for p in task.eval_problems]

    train, held_out = pools(seed=0)
    assert len(held_out) == 6 and held_out == sorted(held_out)
    assert sorted(train + held_out) == list(range(25)) and train == sorted(train)
    assert pools(seed=0) == (train, held_out) and pools(seed=1)[1] != held_out
    subset, same_held_out = pools(seed=0, num_train=5)
    assert same_held_out == held_out and len(subset) == 5 and set(subset) < set(train) and subset == sorted(subset)
    # The rows left out of the RL pool are the warm-up's; none without a subset.
    task = build_task("dataset", path=str(tmp_path), num_train=5, num_eval=6, seed=0)
    spare = [int(p.answer) for p in task.spare_problems]
    assert sorted(spare + subset) == train and spare == sorted(spare)
    assert build_task("dataset", path=str(tmp_path), num_train=0, num_eval=6, seed=0).spare_problems == ()


def test_dataset_spare_rows_never_repeat_a_train_prompt(tmp_path):
    rows = [json.dumps({"prompt": f"q{i % 4}", "answer": str(i)}) for i in range(12)]
    file = write_lines(tmp_path / "r.jsonl", rows)
    for seed in range(5):
        task = build_task("dataset", path=str(file), num_train=3, num_eval=0, seed=seed)
        train_prompts = {p.prompt_key() for p in task.train_problems}
        assert not train_prompts & {p.prompt_key() for p in task.spare_problems}
        trained = {p.answer for p in task.train_problems}
        questions = {p.messages[0]["content"] for p in task.train_problems}
        expected = [str(i) for i in range(12) if str(i) not in trained and f"q{i % 4}" not in questions]
        assert [p.answer for p in task.spare_problems] == expected and len(expected) > 0


def test_dataset_train_rows_repeating_a_held_out_prompt_are_dropped(tmp_path):
    same = json.dumps({"prompt": "same", "answer": "x"})
    file = write_lines(tmp_path / "d.jsonl", [same, same, same, json.dumps({"prompt": "other", "answer": "y"})])
    for seed in range(10):
        task = build_task("dataset", path=str(file), num_train=0, num_eval=1, seed=seed)
        assert not {p.prompt_key() for p in task.train_problems} & {p.prompt_key() for p in task.eval_problems}
        assert len(task.train_problems) == (1 if prompt_of(task.eval_problems[0]) == "same" else 3)


GOOD = json.dumps({"prompt": "q", "answer": "a"})


@pytest.mark.parametrize(
    "bad_line, reason",
    [
        ('{"prompt": "q"}', "missing 'answer'"),
        ('{"prompt": "q", "answer": null}', "missing 'answer'"),
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
def test_dataset_bad_row_names_file_and_line(tmp_path, bad_line, reason):
    file = write_lines(tmp_path / "bad.jsonl", [GOOD, "", bad_line, GOOD])
    with pytest.raises(ValueError) as excinfo:
        build_task("dataset", path=str(file), num_train=0, num_eval=0, seed=0)
    assert f"{file}:3" in str(excinfo.value) and reason in str(excinfo.value)


@pytest.mark.parametrize(
    "bad_line, reason",
    [('{"prompt": "q", "answer": ', "Expecting value"), ('["q", "a"]', "expected a JSON object, got list")],
)
def test_dataset_malformed_json_names_file_and_line(tmp_path, bad_line, reason):
    file = write_lines(tmp_path / "bad.jsonl", [GOOD, "", bad_line, GOOD])
    with pytest.raises(ValueError, match=re.escape(f"malformed JSON in {str(file)!r} at line 3: {reason}")):
        build_task("dataset", path=str(file), num_train=0, num_eval=0, seed=0)


def test_dataset_numeric_match_needs_numeric_answers(tmp_path):
    file = write_lines(tmp_path / "n.jsonl", [json.dumps({"prompt": "q", "answer": 7}), GOOD])
    assert len(build_task("dataset", path=str(file), num_train=0, num_eval=0, seed=0).train_problems) == 2
    with pytest.raises(ValueError, match=re.escape(f"{file}:2: 'answer' 'a' is not a decimal number")):
        build_task("dataset", path=str(file), num_train=0, num_eval=0, seed=0, answer_match="numeric")


# ---------------------------------------------------------------- dataset rows with images


def image_rows_file(tmp_path):
    """Rows asking the same question about the same images as content parts and as markers, and
    a prompt with a marker; in a subdirectory, so paths relative to the file are not relative to ``tmp_path``."""
    (tmp_path / "sub").mkdir()
    parts = [
        {"type": "text", "text": "Compare "},
        {"type": "image", "image": "img/a.png"},
        {"type": "text", "text": " with "},
        {"type": "image", "path": "/abs/b.png"},
    ]
    system = {"role": "system", "content": "Look."}
    rows = [
        {"messages": [system, {"role": "user", "content": parts}], "answer": "same"},
        {
            "messages": [system, {"role": "user", "content": "Compare <image> with <image>"}],
            "images": ["img/a.png", "/abs/b.png"],
            "answer": "same",
        },
        {"prompt": "<image>Which colour?", "images": ["c.png"], "answer": "red"},
    ]
    return write_lines(tmp_path / "sub" / "rows.jsonl", [json.dumps(row) for row in rows])


def test_dataset_image_rows_become_parts_with_paths_resolved_against_the_file(tmp_path):
    file = image_rows_file(tmp_path)
    task = build_task("dataset", path=str(file), num_train=0, num_eval=0, seed=0)
    folder = str(tmp_path / "sub")
    user = {
        "role": "user",
        "content": [
            {"type": "text", "text": "Compare "},
            {"type": "image", "image": f"{folder}/img/a.png"},
            {"type": "text", "text": " with "},
            {"type": "image", "image": "/abs/b.png"},
        ],
    }
    by_parts, by_markers, prompt = task.train_problems
    assert by_parts == Problem(({"role": "system", "content": "Look."}, user), "same", f"{file}:1")
    assert by_markers.messages == by_parts.messages and by_markers.prompt_key() == by_parts.prompt_key()
    assert prompt.messages == (
        {
            "role": "user",
            "content": [{"type": "image", "image": f"{folder}/c.png"}, {"type": "text", "text": "Which colour?"}],
        },
    )
    # The prompt an RL rollout starts from is the SFT tokenization of the row as written in the file.
    raw = json.loads(file.read_text().splitlines()[1])
    sft = tokenize_row_with_images(
        {**raw, "messages": raw["messages"] + [{"role": "assistant", "content": "x"}]}, TOKENIZER, base_dir=folder
    )
    rl = tokenize_prompt_row(by_markers.messages, TOKENIZER)
    assert sft.tokens[: len(rl.tokens)] == rl.tokens and sft.target_mask.index(True) == len(rl.tokens)
    assert [(i.source, i.position) for i in sft.images] == [(i.source, i.position) for i in rl.images]
    assert len(rl.images) == 2


def user_parts(*parts) -> str:
    return json.dumps({"messages": [{"role": "user", "content": list(parts)}], "answer": "a"})


@pytest.mark.parametrize(
    "bad_line, reason",
    [
        (
            user_parts({"type": "image", "image": 3}),
            "message 0 part 0: an image must be a path or encoded bytes, got 3",
        ),
        (user_parts({"type": "image", "image": ""}), "an image must be a path or encoded bytes"),
        (user_parts({"type": "image", "url": "x.png"}), "an image part needs an 'image'"),
        (user_parts({"type": "video", "video": "x.mp4"}), "message 0: every content part"),
        (user_parts({"type": "text", "text": None}), "a text part needs a string 'text'"),
        (
            '{"prompt": "<image> and <image>?", "images": ["a.png"], "answer": "a"}',
            "has 2 '<image>' markers but its 'images' list has 1",
        ),
        (
            '{"prompt": "no marker", "images": ["a.png"], "answer": "a"}',
            "has 0 '<image>' markers but its 'images' list has 1",
        ),
        ('{"prompt": "<image>", "images": "a.png", "answer": "a"}', "'images' must be a list"),
        ('{"prompt": "<image>", "images": [null], "answer": "a"}', "'images'[0] must be an image path"),
        (
            '{"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}]}], "images": ["b.png"], "answer": "a"}',
            "both a top-level 'images' list and content parts",
        ),
    ],
)
def test_dataset_bad_image_row_names_file_and_line(tmp_path, bad_line, reason):
    file = write_lines(tmp_path / "bad.jsonl", [GOOD, bad_line])
    with pytest.raises(ValueError) as excinfo:
        build_task("dataset", path=str(file), num_train=0, num_eval=0, seed=0)
    assert f"{file}:2" in str(excinfo.value) and reason in str(excinfo.value)


@pytest.mark.parametrize(
    "setup, options, match",
    [
        (lambda d: write_lines(d / "e.jsonl", ["", "  "]), {}, "is empty"),
        (lambda d: d / "missing.jsonl", {}, "rl.task_path='.*missing.jsonl' does not exist"),
        (lambda d: write_lines(d / "rows.txt", [GOOD]), {}, "unsupported dataset file"),
        (lambda d: d, {}, "rl.task_path='.*' is a directory with no \\['.json', '.jsonl', '.parquet'\\] files"),
        (
            lambda d: write_lines(d / "r.jsonl", [GOOD]),
            {"eval_path": "/missing/eval.jsonl", "num_eval": 1},
            "rl.eval_task_path='/missing/eval.jsonl' does not exist",
        ),
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
            "every row of .* repeats a held-out prompt",
        ),
    ],
)
def test_dataset_file_errors(tmp_path, setup, options, match):
    path = setup(tmp_path)
    with pytest.raises(ValueError, match=match) as error:
        build_task("dataset", path=str(path), **{"num_train": 0, "num_eval": 0, "seed": 0, **options})
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
            r"rl.task: unknown task 'sudoku'; valid tasks: \['arithmetic', 'calculator', 'dataset', 'guess_number', "
            r"'reverse', 'shapes'\], or a task factory 'package.module:name'",
        ),
        ("arithmetic", {"path": "data.jsonl"}, "rl.task_path='data.jsonl'"),
        ("reverse", {"answer_match": "numeric"}, "rl.answer_match: .* must be 'exact'"),
        ("arithmetic", {"num_train": 0}, "rl.num_train_prompts: task 'arithmetic' needs at least 1"),
        ("arithmetic", {"num_eval": -1}, "rl.num_eval_prompts=-1"),
        ("arithmetic", {"eval_path": "e.jsonl"}, "rl.eval_task_path='e.jsonl'"),
        ("dataset", {}, "rl.task_path: task 'dataset' needs a .jsonl, .json or .parquet file"),
    ],
)
def test_unused_or_invalid_options_are_rejected(name, options, match):
    with pytest.raises(ValueError, match=match) as error:
        build_task(name, **{"num_train": 4, "num_eval": 1, "seed": 0, **options})
    assert_names_config_keys(str(error.value))


def test_registry_names():
    assert sorted(TASKS) == ["arithmetic", "calculator", "dataset", "guess_number", "reverse", "shapes"]
    # Every SFT task is an RL task (the image ones with a question mix of their own); the
    # environments' problems are RL-only (their answers take several turns), the preference
    # pairs are the DPO recipe's only.
    assert (
        set(TASKS) - {"dataset", *ENV_QUESTION_GENERATORS}
        == set(BUILTIN_TASKS) - {"arithmetic_preferences"}
        == set(GENERATED_TASKS) - set(ENV_QUESTION_GENERATORS)
    )
