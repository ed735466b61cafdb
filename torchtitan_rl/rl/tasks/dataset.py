"""Problems from a user's rows: local ``.jsonl`` / ``.json`` / ``.parquet`` files (one file or a
directory of one format, e.g. written by ``datasets.Dataset.to_parquet``), read by the SFT
loader's ``load_rows``. A row is ``{"prompt" | "messages", "answer", ...}``; every other column
reaches a reward function as ``Problem.extra``.

Prompts may carry images, as in SFT rows (``data.chat``): a system/user content may be a list
of ``{"type": "text", "text": ...}`` / ``{"type": "image", "image": ...}`` parts (a path, or
encoded bytes as ``datasets`` stores an ``Image`` column), or the text may hold ``<image>``
markers for the entries of an ``"images"`` list. Markers become parts when the file is read,
relative paths resolved against the JSON file's directory. Whether images exist and decode is
checked where they are read, not here.

Errors name the file and line (JSON) or row (parquet). ``num_eval`` rows are held out by a
seeded random choice, or the eval problems are the rows of a file of their own; train rows
that repeat a held-out prompt are left out (and counted in the log), so no eval prompt is ever
trained on.
"""

import logging
import math
import random
from typing import Any

from torchtitan_rl.data.chat import IMAGE_MARKER, image_of_part, prompt_messages_problem, resolve_image
from torchtitan_rl.data.datasets import load_rows
from torchtitan_rl.rl.tasks.rewards import parse_number
from torchtitan_rl.rl.tasks.task import Problem

logger = logging.getLogger(__name__)

PROMPT_COLUMNS = ("prompt", "messages", "images")
ROW_FORMATS = (
    "{'prompt': str, 'answer': str|int|float} or "
    "{'messages': [{'role': 'system'|'user', 'content': str or a list of {'type': 'text', 'text': str} / "
    "{'type': 'image', 'image': path or bytes} parts}, ...], 'answer': str|int|float}; either may add "
    "'images': [path, ...], the k-th '<image>' marker of its text standing for the k-th path, and "
    "columns of its own for a reward function"
)


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


def _image_source(source: Any) -> str | bytes:
    """A part's image as a path or encoded bytes (``datasets`` stores an ``Image`` as ``{"bytes", "path"}``)."""
    if isinstance(source, dict) and (source.get("bytes") is not None or source.get("path")):
        source = source["bytes"] if source.get("bytes") is not None else source["path"]
    if isinstance(source, (bytes, bytearray)) and source:
        return bytes(source)
    if isinstance(source, str) and source:
        return source
    raise ValueError(f"an image must be a path or encoded bytes, got {source!r}")


def _resolved_parts(messages: list[dict], base_dir: str | None) -> tuple[dict, ...]:
    """``messages`` with every image part as ``{"type": "image", "image": path or bytes}``,
    relative paths made relative to ``base_dir`` (the file's directory; None: the working directory)."""
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
            try:
                source = _image_source(image_of_part(part))
            except ValueError as err:
                raise ValueError(f"message {index} part {part_index}: {err}") from None
            parts.append({"type": "image", "image": resolve_image(source, base_dir)})
        resolved.append({**message, "content": parts})
    return tuple(resolved)


def row_problem(row: Any, source: str, answer_match: str, base_dir: str | None, answer_required: bool) -> Problem:
    """The problem of one row; ``answer_required`` False (a reward function of the user's judges
    the completions) lets a row have no ``answer``. A ValueError says what is wrong."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    # A parquet file has every column in every row: a null is an absent value.
    present = {key for key, value in row.items() if value is not None}
    if "answer" not in present and answer_required:
        raise ValueError("missing 'answer'")
    if ("prompt" in present) == ("messages" in present):
        raise ValueError("needs exactly one of 'prompt' and 'messages'")
    if "prompt" in present:
        if not isinstance(row["prompt"], str) or not row["prompt"].strip():
            raise ValueError(f"'prompt' must be a non-empty string, got {row['prompt']!r}")
        messages = [{"role": "user", "content": row["prompt"]}]
    else:
        problem = prompt_messages_problem(row["messages"])
        if problem is not None:
            raise ValueError(problem)
        messages = [dict(m) for m in row["messages"]]
    if "images" in present:
        messages = _marker_parts(messages, row["images"])
    answer = _answer_text(row["answer"], answer_match) if "answer" in present else ""
    extra = {key: value for key, value in row.items() if key not in (*PROMPT_COLUMNS, "answer")}
    return Problem(_resolved_parts(messages, base_dir), answer, source, extra)


def read_problems(key: str, path: str, answer_match: str, answer_required: bool) -> list[Problem]:
    """Every row of the file (or directory of files) ``path`` that config ``key`` names, as a ``Problem``."""
    if not path:
        raise ValueError(f"{key}: task 'dataset' needs a .jsonl, .json or .parquet file or a directory of them")
    rows = load_rows("", path, "train", 0, 0, key=key)
    problems = []
    for index in range(len(rows)):
        source = rows.source_of(index)  # file:line, or file row k
        try:
            problems.append(row_problem(rows[index], source, answer_match, rows.base_dir(index), answer_required))
        except ValueError as err:
            raise ValueError(f"invalid row at {source}: {err}; expected {ROW_FORMATS}") from err
    return problems


def dataset_problem_pools(
    *,
    path: str,
    eval_path: str,
    num_train: int,
    num_eval: int,
    seed: int,
    answer_match: str,
    answer_required: bool,
) -> tuple[list[Problem], list[Problem], list[Problem]]:
    """``(train, eval, spare)`` problems of the rows of ``path``, each pool in file order.

    The eval problems are ``num_eval`` rows of ``path`` held out by a seeded draw; or, with
    ``eval_path``, the rows of that file (a seeded draw of ``num_eval`` of them when it has more;
    0: all). ``num_train=0`` trains on every other row; a positive ``num_train`` takes a seeded
    random subset of that many, and the rest whose prompts are not train prompts are spare.
    """
    problems = read_problems("rl.task_path", path, answer_match, answer_required)
    rng = random.Random(seed)
    if eval_path:
        eval_rows = read_problems("rl.eval_task_path", eval_path, answer_match, answer_required)
        chosen = set(rng.sample(range(len(eval_rows)), num_eval)) if 0 < num_eval < len(eval_rows) else None
        eval_problems = [p for i, p in enumerate(eval_rows) if chosen is None or i in chosen]
        candidates = problems
    else:
        if len(problems) < num_eval + 1:
            raise ValueError(
                f"task 'dataset': {path!r} has {len(problems)} rows, fewer than rl.num_eval_prompts + 1 = "
                f"{num_eval + 1} (the held-out rows plus at least one to train on); set rl.num_eval_prompts "
                "lower, or rl.eval_task_path"
            )
        held_out = set(rng.sample(range(len(problems)), num_eval))
        eval_problems = [problem for i, problem in enumerate(problems) if i in held_out]
        candidates = [problem for i, problem in enumerate(problems) if i not in held_out]
    eval_prompts = {problem.prompt_key() for problem in eval_problems}
    train = [p for p in candidates if p.prompt_key() not in eval_prompts]
    if not train:
        raise ValueError(f"task 'dataset': every row of {path!r} repeats a held-out prompt")
    if len(train) < len(candidates):
        logger.warning(
            "task 'dataset': %d row(s) of %s repeat a held-out prompt and are not trained on",
            len(candidates) - len(train),
            path,
        )
    if num_train > len(train):
        raise ValueError(
            f"task 'dataset': rl.num_train_prompts={num_train} but only {len(train)} rows of {path!r} are not held out"
        )
    if not num_train:
        return train, eval_problems, []
    chosen = set(rng.sample(range(len(train)), num_train))
    train, rest = [p for i, p in enumerate(train) if i in chosen], [p for i, p in enumerate(train) if i not in chosen]
    train_prompts = {problem.prompt_key() for problem in train}
    return train, eval_problems, [problem for problem in rest if problem.prompt_key() not in train_prompts]
