"""Problems from local JSONL files: one ``{"prompt" | "messages", "answer"}`` object a line.

Prompts may carry images, as in SFT rows (``data.chat``): a system/user content may be a list
of ``{"type": "text", "text": ...}`` / ``{"type": "image", "image": path}`` parts, or the text
may hold ``<image>`` markers for the entries of a top-level ``"images"`` list of paths. Markers
become parts when the file is read, so a problem's messages hold images one way: parts whose
``image`` is a path, relative ones resolved against the file's directory. Whether the files
exist and decode is checked where the images are read, not here.

Rows are validated here rather than by ``datasets`` so every error names the file and line.
``num_eval`` rows are held out by a seeded random choice, and train rows that repeat a held-out
prompt are dropped, so no eval prompt is ever trained on.
"""

import json
import math
import random
from pathlib import Path
from typing import Any

from torchtitan_rl.data.chat import IMAGE_MARKER, image_of_part, prompt_messages_problem, resolve_image
from torchtitan_rl.rl.tasks.rewards import parse_number
from torchtitan_rl.rl.tasks.task import Problem

ROW_FORMATS = (
    "{'prompt': str, 'answer': str|int|float} or "
    "{'messages': [{'role': 'system'|'user', 'content': str or a list of {'type': 'text', 'text': str} / "
    "{'type': 'image', 'image': path} parts}, ...], 'answer': str|int|float}; either may add "
    "'images': [path, ...], the k-th '<image>' marker of its text standing for the k-th path"
)


def _jsonl_files(path: str) -> list[Path]:
    root = Path(path)
    if not root.exists():
        raise ValueError(f"rl.task_path: {path!r} does not exist")
    if root.is_file():
        if root.suffix != ".jsonl":
            raise ValueError(f"rl.task_path: {path!r} is not a .jsonl file")
        return [root]
    files = sorted(p for p in root.rglob("*.jsonl") if p.is_file())
    if not files:
        raise ValueError(f"rl.task_path: {path!r} is a directory with no .jsonl files")
    return files


def _answer_text(answer: Any, answer_match: str) -> str:
    # bool is an int subclass, but true/false is never a reference answer.
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(f"'answer' must be a string or a number, got {answer!r}")
    if isinstance(answer, float) and not math.isfinite(answer):
        raise ValueError(f"'answer' must be finite, got {answer!r}")
    text = str(answer)
    if not text.strip():
        raise ValueError("'answer' is empty")
    if answer_match == "numeric" and parse_number(text) is None:
        raise ValueError(f"'answer' {text!r} is not a decimal number, which answer_match='numeric' needs")
    return text


def _marker_parts(messages: list[dict], images: Any) -> list[dict]:
    """``messages`` with each ``<image>`` marker of their text replaced by a part holding the next image."""
    if not isinstance(images, list):
        raise ValueError(f"'images' must be a list of image paths (one per {IMAGE_MARKER!r} marker), got {images!r}")
    for k, image in enumerate(images):
        if not isinstance(image, str) or not image:
            raise ValueError(f"'images'[{k}] must be an image path, got {image!r}")
    if any(not isinstance(m["content"], str) for m in messages):
        raise ValueError("the row has both a top-level 'images' list and content parts; give images one way")
    num_markers = sum(m["content"].count(IMAGE_MARKER) for m in messages)
    if num_markers != len(images):
        raise ValueError(
            f"the row's text has {num_markers} {IMAGE_MARKER!r} markers but its 'images' list has {len(images)} "
            "images; each marker stands for the next image of the list"
        )
    remaining = iter(images)
    converted = []
    for message in messages:
        # Text without markers stays a string, as in a row without images.
        if IMAGE_MARKER not in message["content"]:
            converted.append(message)
            continue
        first, *rest = message["content"].split(IMAGE_MARKER)
        # Empty text between markers is no part: tokenizing the marker form skips it too.
        parts = [{"type": "text", "text": first}] if first else []
        for piece in rest:
            parts.append({"type": "image", "image": next(remaining)})
            parts += [{"type": "text", "text": piece}] if piece else []
        converted.append({**message, "content": parts})
    return converted


def _resolved_parts(messages: list[dict], base_dir: str) -> tuple[dict, ...]:
    """``messages`` with every image part as ``{"type": "image", "image": path}``, relative paths
    made relative to ``base_dir`` (the file's directory)."""
    resolved = []
    for index, message in enumerate(messages):
        if isinstance(message["content"], str):
            resolved.append(message)
            continue
        parts = []
        for part_index, part in enumerate(message["content"]):
            if part["type"] == "text":
                parts.append({"type": "text", "text": part["text"]})
                continue
            source = image_of_part(part)
            if not isinstance(source, str) or not source:
                raise ValueError(f"message {index} part {part_index}: an image must be a path string, got {source!r}")
            parts.append({"type": "image", "image": resolve_image(source, base_dir)})
        resolved.append({**message, "content": parts})
    return tuple(resolved)


def _row_problem(row: Any, source: str, answer_match: str, base_dir: str) -> Problem:
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    unexpected = sorted(set(row) - {"prompt", "messages", "images", "answer"})
    if unexpected:
        raise ValueError(f"unexpected keys {unexpected}")
    if "answer" not in row:
        raise ValueError("missing 'answer'")
    if ("prompt" in row) == ("messages" in row):
        raise ValueError("needs exactly one of 'prompt' and 'messages'")
    if "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"].strip():
            raise ValueError(f"'prompt' must be a non-empty string, got {row['prompt']!r}")
        messages = [{"role": "user", "content": row["prompt"]}]
    else:
        problem = prompt_messages_problem(row["messages"])
        if problem is not None:
            raise ValueError(problem)
        messages = [dict(m) for m in row["messages"]]
    if "images" in row:
        messages = _marker_parts(messages, row["images"])
    return Problem(_resolved_parts(messages, base_dir), _answer_text(row["answer"], answer_match), source)


def read_problems(file: Path, answer_match: str) -> list[Problem]:
    """Every row of one JSONL file as a ``Problem``; blank lines are skipped."""
    problems = []
    # Split bytes, not text: str.splitlines would also split on U+2028 inside JSON strings.
    for line_number, line in enumerate(file.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        source = f"{file}:{line_number}"
        try:
            row = json.loads(line)
        except ValueError as err:  # JSONDecodeError and UnicodeDecodeError both are ValueErrors
            raise ValueError(f"malformed JSON at {source}: {err}") from err
        try:
            problems.append(_row_problem(row, source, answer_match, str(file.parent)))
        except ValueError as err:
            raise ValueError(f"invalid row at {source}: {err}; expected {ROW_FORMATS}") from err
    if not problems:
        raise ValueError(f"task 'jsonl': file {str(file)!r} is empty (no rows)")
    return problems


def jsonl_problem_pools(
    *, path: str, num_train: int, num_eval: int, seed: int, answer_match: str
) -> tuple[list[Problem], list[Problem], list[Problem]]:
    """``(train, eval, spare)`` problems of the rows under ``path``, each pool in file order.

    ``num_train=0`` trains on every row not held out; a positive ``num_train`` takes a seeded
    random subset of that many, and the rest whose prompts are not train prompts are spare.
    """
    if not path:
        raise ValueError("rl.task_path: task 'jsonl' needs a .jsonl file or a directory of them")
    problems = [problem for file in _jsonl_files(path) for problem in read_problems(file, answer_match)]
    if len(problems) < num_eval + 1:
        raise ValueError(
            f"task 'jsonl': {path!r} has {len(problems)} rows, fewer than rl.num_eval_prompts + 1 = {num_eval + 1} "
            "(the held-out rows plus at least one to train on)"
        )
    rng = random.Random(seed)
    held_out = set(rng.sample(range(len(problems)), num_eval))
    eval_problems = [problem for i, problem in enumerate(problems) if i in held_out]
    eval_prompts = {problem.prompt_key() for problem in eval_problems}
    train = [p for i, p in enumerate(problems) if i not in held_out and p.prompt_key() not in eval_prompts]
    if not train:
        raise ValueError(f"task 'jsonl': every row of {path!r} repeats a held-out prompt; lower rl.num_eval_prompts")
    if num_train > len(train):
        raise ValueError(
            f"task 'jsonl': rl.num_train_prompts={num_train} but only {len(train)} rows of {path!r} are not held out"
        )
    if not num_train:
        return train, eval_problems, []
    chosen = set(rng.sample(range(len(train)), num_train))
    train, rest = [p for i, p in enumerate(train) if i in chosen], [p for i, p in enumerate(train) if i not in chosen]
    train_prompts = {problem.prompt_key() for problem in train}
    return train, eval_problems, [problem for problem in rest if problem.prompt_key() not in train_prompts]
