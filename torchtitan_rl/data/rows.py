"""JSON / JSONL rows that remember the file and line they came from.

A plain Python reader rather than HF ``datasets``: Arrow needs one schema per column, so it
rejects a ``content`` that is a string in one message and a list of parts in another, and it
forgets which file a row came from. Keeping ``(file, line)`` per row lets errors point at
``file:line`` and lets image paths resolve relative to the row's file.

``row_where`` and ``row_base_dir`` work on any row sequence (in-memory lists, built-in tasks,
``datasets.Dataset``), so the loader need not know where rows came from.
"""

import bisect
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class FileRows(Sequence):
    """Rows of JSON/JSONL files, indexable by position, with the file and line of each."""

    def __init__(self) -> None:
        self._rows: list[dict[str, Any]] = []
        self._files: list[str] = []
        self._file_index: list[int] = []  # per row, into _files
        self._lines: list[int] = []  # per row, 1-based line where the row starts

    def extend_from(self, file: Path, rows: list[dict[str, Any]], lines: list[int]) -> None:
        self._files.append(str(file))
        self._rows += rows
        self._file_index += [len(self._files) - 1] * len(rows)
        self._lines += lines

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._rows[i] for i in range(*index.indices(len(self)))]
        return self._rows[index]

    def origin(self, index: int) -> tuple[str, int]:
        """``(file, 1-based line)`` of row ``index``."""
        return self._files[self._file_index[index]], self._lines[index]

    def base_dir(self, index: int) -> str:
        """The directory of row ``index``'s file, which its relative image paths are relative to."""
        return os.path.dirname(os.path.abspath(self._files[self._file_index[index]]))


def row_where(rows: Sequence, index: int) -> str:
    """How errors name row ``index``: ``dataset row 17``, plus ``(file:line)`` when known."""
    if isinstance(rows, FileRows):
        file, line = rows.origin(index)
        return f"dataset row {index} ({file}:{line})"
    return f"dataset row {index}"


def row_base_dir(rows: Sequence, index: int) -> str | None:
    """The directory relative image paths of row ``index`` resolve against; None: the working directory."""
    return rows.base_dir(index) if isinstance(rows, FileRows) else None


def _line_of(newlines: list[int], offset: int) -> int:
    """1-based line of character ``offset``, given the offsets of every newline."""
    return bisect.bisect_left(newlines, offset) + 1


def _malformed(file: Path, line: int, reason: str) -> ValueError:
    return ValueError(f"malformed JSON in {str(file)!r} at line {line}: {reason}")


def _read_array(file: Path, text: str) -> tuple[list[dict[str, Any]], list[int]]:
    """The objects of one JSON array document and the line each starts on."""
    newlines = [match.start() for match in re.finditer("\n", text)]
    decoder = json.JSONDecoder()
    rows, lines = [], []
    position = text.index("[") + 1
    expect_value = True  # after '[' or ',' a value is due (a ']' only right after '[')
    while True:
        while position < len(text) and text[position].isspace():
            position += 1
        if position == len(text):
            raise _malformed(file, _line_of(newlines, position), "the array is not closed with ']'")
        if text[position] == "]" and (not rows or not expect_value):
            position += 1
            break
        if not expect_value:
            if text[position] != ",":
                raise _malformed(file, _line_of(newlines, position), "Expecting ',' delimiter")
            position += 1
            expect_value = True
            continue
        try:
            value, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError as err:
            raise _malformed(file, err.lineno, err.msg) from err
        if not isinstance(value, dict):
            raise _malformed(file, _line_of(newlines, position), f"expected a JSON object, got {type(value).__name__}")
        rows.append(value)
        lines.append(_line_of(newlines, position))
        position, expect_value = end, False
    rest = text[position:]
    if rest.strip():
        extra = position + len(rest) - len(rest.lstrip())
        raise _malformed(file, _line_of(newlines, extra), "Extra data after the array")
    return rows, lines


def _read_lines(file: Path, text: str) -> tuple[list[dict[str, Any]], list[int]]:
    """One JSON object per non-blank line."""
    rows, lines = [], []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as err:
            raise _malformed(file, line_number, err.msg) from err
        if not isinstance(value, dict):
            raise _malformed(file, line_number, f"expected a JSON object, got {type(value).__name__}")
        rows.append(value)
        lines.append(line_number)
    return rows, lines


def read_json_files(files: list[Path]) -> FileRows:
    """The rows of ``.json``/``.jsonl`` files in order: a JSON array of objects, or one object per line.

    An empty file (no rows), a line that is not a JSON object, or bytes that are not UTF-8 is
    a ValueError naming the file (and line).
    """
    rows = FileRows()
    for file in files:
        raw = file.read_bytes()
        try:
            text = raw.decode("utf-8-sig")  # tolerate a byte-order mark, as json.load does not
        except UnicodeDecodeError as err:
            line = raw[: err.start].count(b"\n") + 1
            raise ValueError(f"dataset file {str(file)!r} is not UTF-8 at line {line}: {err.reason}") from err
        if text.lstrip().startswith("["):
            file_rows, lines = _read_array(file, text)
        else:
            file_rows, lines = _read_lines(file, text)
        if not file_rows:
            raise ValueError(f"dataset file {str(file)!r} is empty (no rows); remove it or fill it")
        rows.extend_from(file, file_rows, lines)
    return rows
