"""The terminal view (rich): a summary per step of the selected records, then one row per record
(step, group/sample, reward, advantage, length, the end of the prompt's question, the start of
the completion; for evaluations pass@1, pass@k and the greedy completion)."""

import math
import re
from collections.abc import Callable

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from torchtitan_rl.rollout_files import EVALS, ROLLOUTS

HEADERS = {
    ROLLOUTS: ["step", "group/sample", "reward", "advantage", "length", "stop"],
    EVALS: ["step", "prompt #", "pass@1", "pass@k", "correct", "length"],
}
TEXT_HEADER = {ROLLOUTS: "completion", EVALS: "greedy completion"}
MIN_TEXT_CHARS = 12
# Compact: no outer border, two spaces between columns (counted by records_table).
TABLE_STYLE = dict(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
# C0 controls -> their Unicode control pictures (U+2400..), DEL -> ␡, C1 controls -> ¿.
_CONTROL_PICTURES = (
    {code: 0x2400 + code for code in range(0x20)} | {0x7F: 0x2421} | dict.fromkeys(range(0x80, 0xA0), "¿")
)
# A ChatML message (the chat format of the built-in tokenizer and Qwen3): role, text.
_CHATML_MESSAGE = re.compile(r"<\|im_start\|>(\w+)\n(.*?)(?:<\|im_end\|>|$)", re.DOTALL)


def question(prompt: object) -> str:
    """The text of the last message of a ChatML prompt not from the assistant (the question,
    without the system text and the template's glue); any other prompt whole."""
    text = str(prompt or "")
    messages = [body.strip() for role, body in _CHATML_MESSAGE.findall(text) if role != "assistant" and body.strip()]
    return messages[-1] if messages else text


def printable(text: str) -> str:
    """``text`` with its control characters shown as symbols (␛ for ESC): a sampled completion
    may hold any byte, and an escape sequence printed raw would drive the terminal."""
    return text.translate(_CONTROL_PICTURES)


def one_line(text: object, max_chars: int, keep_end: bool = False) -> str:
    """``text`` on one line (line breaks shown as ⏎, control characters as symbols), cut to
    ``max_chars`` with an ellipsis: its start, or its end with ``keep_end`` (a prompt's question
    is at its end)."""
    flat = printable("⏎".join(str(text or "").splitlines()))
    if len(flat) <= max_chars:
        return flat
    return "…" + flat[len(flat) - max_chars + 1 :] if keep_end else flat[: max_chars - 1] + "…"


def number(value: object, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def mean(values: list) -> float | None:
    numbers = [float(v) for v in values if isinstance(v, (int, float)) and not math.isnan(float(v))]
    return sum(numbers) / len(numbers) if numbers else None


def by_step(records: list[dict]) -> dict[int, list[dict]]:
    steps: dict[int, list[dict]] = {}
    for record in records:
        steps.setdefault(record.get("step"), []).append(record)
    return dict(sorted(steps.items(), key=lambda item: (item[0] is None, item[0])))


def summary_table(kind: str, records: list[dict]) -> Table:
    """One row per step of ``records``: how many, and their means."""
    table = Table(title=f"{kind} per step", title_justify="left", **TABLE_STYLE)
    columns: list[tuple[str, Callable[[list[dict]], object]]]
    if kind == ROLLOUTS:
        columns = [
            ("rollouts", len),
            ("mean reward", lambda rs: mean([r.get("reward") for r in rs])),
            ("mean advantage", lambda rs: mean([r.get("advantage") for r in rs])),
            ("correct", lambda rs: mean([r.get("correct") for r in rs])),
            ("mean length", lambda rs: mean([r.get("num_completion_tokens") for r in rs])),
        ]
    else:
        columns = [
            ("prompts", len),
            ("pass@1", lambda rs: mean([r.get("pass@1") for r in rs])),
            ("pass@k", lambda rs: mean([r.get("pass@k") for r in rs])),
            ("k", lambda rs: ",".join(sorted({str(r.get("k")) for r in rs}))),
        ]
    table.add_column("step", justify="right")
    for name, _ in columns:
        table.add_column(name, justify="right")
    for step, rows in by_step(records).items():
        table.add_row(str(step), *(number(compute(rows)) for _, compute in columns))
    return table


def record_cells(kind: str, record: dict) -> tuple[list[str], str]:
    """The narrow cells of a record's row, and the text shown as its completion."""
    r = record
    if kind == ROLLOUTS:
        cells = [
            r.get("step"),
            f"{r.get('group')}/{r.get('sample')}",
            number(r.get("reward")),
            number(r.get("advantage")),
            r.get("num_completion_tokens"),
            r.get("end_reason") or r.get("stop_reason"),
        ]
        return [number(c) for c in cells], r.get("completion")
    greedy = r.get("greedy") or {}
    cells = [
        r.get("step"),
        r.get("prompt_index"),
        number(r.get("pass@1"), 0),
        number(r.get("pass@k"), 0),
        f"{r.get('num_correct')}/{r.get('k')}",
        greedy.get("num_completion_tokens"),
    ]
    return [number(c) for c in cells], greedy.get("completion")


def records_table(kind: str, records: list[dict], width: int) -> Table:
    """One row per record, fitting ``width`` console columns: the narrow columns as wide as
    their widest cell, the prompt (its end: the question) and the completion (its start) sharing
    the rest 2:3."""
    headers = HEADERS[kind]
    rows = [record_cells(kind, r) for r in records]
    widths = [max([len(h), *(len(cells[i]) for cells, _ in rows)]) for i, h in enumerate(headers)]
    # Two spaces between columns (a padding space and the separator), none at the edges.
    num_columns = len(headers) + 2
    text_width = max(2 * MIN_TEXT_CHARS, width - sum(widths) - 2 * (num_columns - 1))
    prompt_chars = text_width * 2 // 5
    completion_chars = text_width - prompt_chars
    table = Table(title=kind, title_justify="left", **TABLE_STYLE)
    for header, column_width in zip(headers, widths):
        table.add_column(header, justify="right", no_wrap=True, width=column_width)
    table.add_column("prompt", no_wrap=True, width=prompt_chars)
    table.add_column(TEXT_HEADER[kind], no_wrap=True, width=completion_chars)
    for record, (cells, completion) in zip(records, rows):
        texts = [
            one_line(question(record.get("prompt")), prompt_chars, keep_end=True),
            one_line(completion, completion_chars),
        ]
        # Text, not str: the records' text is never read as rich markup.
        table.add_row(*(Text(c) for c in cells), *(Text(t) for t in texts))
    return table


def show(console: Console, kind: str, records: list[dict], limit: int) -> None:
    """Print the per-step summary of ``records`` and the first ``limit`` of them (0: all)."""
    shown = records if limit == 0 else records[:limit]
    console.print(summary_table(kind, records))
    console.print(records_table(kind, shown, console.width))
    if len(shown) < len(records):
        console.print(f"{len(shown)} of {len(records)} {kind} shown (--limit 0 shows all)")
