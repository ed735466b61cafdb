"""JSON / JSONL rows that remember the file and line they came from, parsed only when read.

Not HF ``datasets``: Arrow needs one type per column, so it rejects a ``content`` that is a
string in one message and a list of parts in another, and it forgets which file a row came
from. Not Python dicts either: a multi-GB dataset would then be a copy per rank. Instead
``write_json_rows`` checks every row once and stores its raw JSON text with its file and
line in an Arrow IPC file; ``FileRows`` reads that file (memory-mapped when it is on disk,
``data.row_cache``) and parses a row when it is accessed. Keeping ``(file, line)`` lets
errors point at ``file:line`` and image paths resolve relative to the row's file.

``row_where`` and ``row_base_dir`` work on any row sequence (in-memory lists, built-in tasks,
``datasets.Dataset``), so the loader need not know where rows came from.
"""

import bisect
import json
import os
import re
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

# Part of the prepared file's cache key: bump it when the layout below or the checks change.
FORMAT_VERSION = 1
_SCHEMA = pa.schema([("json", pa.large_string()), ("file", pa.int32()), ("line", pa.int64())])
# Rows per record batch: bounds the preparing process's memory, whatever the dataset's size.
_BATCH_ROWS = 65536


class SourcedRows(Sequence):
    """Rows that know where each came from: errors name it, relative image paths resolve against it."""

    @abstractmethod
    def source_of(self, index: int) -> str:
        """Where row ``index`` is, for humans: ``file:line``, or ``file row k``."""

    @abstractmethod
    def base_dir(self, index: int) -> str | None:
        """The directory row ``index``'s relative image paths are relative to; None: the working directory."""


class FileRows(SourcedRows):
    """Rows of JSON/JSONL files (a table of ``write_json_rows``), indexable by position, parsed on access.

    ``files`` are the source files in the order ``write_json_rows`` was given them.
    """

    def __init__(self, table: pa.Table, files: list[str]) -> None:
        if not table.schema.equals(_SCHEMA):
            raise ValueError(f"not a table of prepared JSON rows: schema {table.schema}, expected {_SCHEMA}")
        self._json = table.column("json")
        self._file_index = table.column("file")
        self._lines = table.column("line")
        self._files = files

    def __len__(self) -> int:
        return len(self._json)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return json.loads(self._json[index].as_py())

    def origin(self, index: int) -> tuple[str, int]:
        """``(file, 1-based line)`` of row ``index``."""
        return self._files[self._file_index[index].as_py()], self._lines[index].as_py()

    def source_of(self, index: int) -> str:
        file, line = self.origin(index)
        return f"{file}:{line}"

    def base_dir(self, index: int) -> str:
        return os.path.dirname(os.path.abspath(self._files[self._file_index[index].as_py()]))


class RowSelection(SourcedRows):
    """The rows ``indices`` of ``rows`` (e.g. a held-out split), each still named by where it came from."""

    def __init__(self, rows: Sequence, indices: Sequence[int]) -> None:
        self._rows, self._indices = rows, list(indices)

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self._rows[self._indices[index]]

    def source_of(self, index: int) -> str:
        original = self._indices[index]
        return (
            self._rows.source_of(original) if isinstance(self._rows, SourcedRows) else f"row {original} of the dataset"
        )

    def base_dir(self, index: int) -> str | None:
        return row_base_dir(self._rows, self._indices[index])


def row_where(rows: Sequence, index: int) -> str:
    """How errors name row ``index``: ``dataset row 17``, plus its file and line (or row) when known."""
    if isinstance(rows, SourcedRows):
        return f"dataset row {index} ({rows.source_of(index)})"
    return f"dataset row {index}"


def row_base_dir(rows: Sequence, index: int) -> str | None:
    """The directory relative image paths of row ``index`` resolve against; None: the working directory."""
    return rows.base_dir(index) if isinstance(rows, SourcedRows) else None


def _line_of(newlines: list[int], offset: int) -> int:
    """1-based line of character ``offset``, given the offsets of every newline."""
    return bisect.bisect_left(newlines, offset) + 1


def _malformed(file: Path, line: int, reason: str) -> ValueError:
    return ValueError(f"malformed JSON in {str(file)!r} at line {line}: {reason}")


def _decode(file: Path, raw: bytes, first_line: int, at_start: bool) -> str:
    try:
        return raw.decode("utf-8-sig" if at_start else "utf-8")  # tolerate a byte-order mark, as json.load does not
    except UnicodeDecodeError as err:
        line = first_line + raw[: err.start].count(b"\n")
        raise ValueError(f"dataset file {str(file)!r} is not UTF-8 at line {line}: {err.reason}") from err


def _is_array(file: Path) -> bool:
    """Whether the file's first non-blank character is '[' (a JSON array, else one object per line)."""
    with open(file, "rb") as f:
        for index, raw in enumerate(f):
            text = _decode(file, raw, index + 1, at_start=index == 0).lstrip()
            if text:
                return text.startswith("[")
    return False


def _array_rows(file: Path) -> Iterator[tuple[str, int]]:
    """The raw text of each object of one JSON array document and the line it starts on."""
    text = _decode(file, file.read_bytes(), 1, at_start=True)
    newlines = [match.start() for match in re.finditer("\n", text)]
    decoder = json.JSONDecoder()
    num_rows = 0
    position = text.index("[") + 1
    expect_value = True  # after '[' or ',' a value is due (a ']' only right after '[')
    while True:
        while position < len(text) and text[position].isspace():
            position += 1
        if position == len(text):
            raise _malformed(file, _line_of(newlines, position), "the array is not closed with ']'")
        if text[position] == "]" and (not num_rows or not expect_value):
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
        yield text[position:end], _line_of(newlines, position)
        num_rows += 1
        position, expect_value = end, False
    rest = text[position:]
    if rest.strip():
        extra = position + len(rest) - len(rest.lstrip())
        raise _malformed(file, _line_of(newlines, extra), "Extra data after the array")


def _jsonl_rows(file: Path) -> Iterator[tuple[str, int]]:
    """One JSON object per non-blank line, read a line at a time (the file never is in memory whole)."""
    line_number = 0
    with open(file, "rb") as f:
        for index, raw in enumerate(f):
            # Lines are numbered as str.splitlines numbers them (it also splits at '\r' and the
            # like), the UTF-8 error position at '\n' only.
            for line in _decode(file, raw, index + 1, at_start=index == 0).splitlines():
                line_number += 1
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as err:
                    raise _malformed(file, line_number, err.msg) from err
                if not isinstance(value, dict):
                    raise _malformed(file, line_number, f"expected a JSON object, got {type(value).__name__}")
                yield line, line_number


def write_json_rows(files: list[Path], sink: str | pa.NativeFile) -> int:
    """Check the rows of ``.json``/``.jsonl`` files and write them, in order, to an Arrow IPC
    file at ``sink`` for ``FileRows``; returns the number of rows.

    A file is a JSON array of objects or one object per line. An empty file (no rows), a line
    that is not a JSON object, or bytes that are not UTF-8 is a ValueError naming the file
    (and line).
    """
    columns: tuple[list, list, list] = ([], [], [])
    total = 0
    with pa.ipc.new_file(sink, _SCHEMA) as writer:

        def flush() -> None:
            writer.write_batch(
                pa.record_batch([pa.array(c, t) for c, t in zip(columns, _SCHEMA.types)], schema=_SCHEMA)
            )
            for column in columns:
                column.clear()

        for file_index, file in enumerate(files):
            num_rows = 0
            for text, line in _array_rows(file) if _is_array(file) else _jsonl_rows(file):
                for column, value in zip(columns, (text, file_index, line)):
                    column.append(value)
                num_rows += 1
                if len(columns[0]) == _BATCH_ROWS:
                    flush()
            if num_rows == 0:
                raise ValueError(f"dataset file {str(file)!r} is empty (no rows); remove it or fill it")
            total += num_rows
        if columns[0]:
            flush()
    return total


def read_json_files(files: list[Path]) -> FileRows:
    """The rows of ``files`` (see ``write_json_rows``), prepared in this process's memory."""
    sink = pa.BufferOutputStream()
    write_json_rows(files, sink)
    return FileRows(pa.ipc.open_file(sink.getvalue()).read_all(), [str(f) for f in files])
