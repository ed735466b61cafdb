"""Which records to show and in which order: the ``--filter`` expressions and the ``--sort`` key.

A filter is either ``FIELD OP VALUE`` or text to search:

- ``FIELD`` is a record's field (``reward``, ``stop_reason``, ``staleness``, ``pass@k``), a field
  of a nested object with a dot (``reward_components.format``, ``greedy.correct``), or one of
  the fields every kind has: ``length`` (completion tokens; an evaluation's greedy completion),
  ``text`` (the prompt and completion text; an evaluation's prompt, answer and every completion)
  and, for evaluations, ``reward`` and ``correct`` (the greedy completion's).
- ``OP`` is ``=`` (or ``==``), ``!=``, ``<``, ``<=``, ``>``, ``>=`` (numbers), or ``~`` (a
  case-insensitive regular expression searched in the field's text).
- ``VALUE``: ``true``, ``false``, ``null``, a number, else text.

Anything else (no field name before an operator) is text searched, case-insensitively, in the
record's ``text``: ``--filter "3+4"`` keeps the records whose prompt or completion contains
``3+4``. Several filters must all hold. A record without the field a filter names never matches
it; a null value matches ``=null`` and ``!=`` anything else.
"""

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from torchtitan_rl.rollout_files import EVALS, ROLLOUTS

_MISSING = object()
_NUMBER_OPS = {"<": float.__lt__, "<=": float.__le__, ">": float.__gt__, ">=": float.__ge__}
_FIELD_FILTER = re.compile(r"\s*([A-Za-z_][\w@.]*)\s*(!=|>=|<=|==|=|>|<|~)(.*)", re.DOTALL)
_STARTS_WITH_OPERATOR = re.compile(r"\s*(!=|>=|<=|==|=|>|<|~)")


def _eval_texts(record: dict) -> list[str]:
    answers = [record.get("greedy") or {}, *(record.get("samples") or [])]
    return [record.get("prompt"), record.get("answer"), *(a.get("completion") for a in answers)]


# Fields computed from a record, per kind; they take precedence over the record's own keys.
VIRTUAL_FIELDS: dict[str, dict[str, Callable[[dict], object]]] = {
    ROLLOUTS: {
        "length": lambda r: r.get("num_completion_tokens"),
        "text": lambda r: [r.get("prompt"), r.get("completion")],
    },
    EVALS: {
        "length": lambda r: (r.get("greedy") or {}).get("num_completion_tokens"),
        "reward": lambda r: (r.get("greedy") or {}).get("reward"),
        "correct": lambda r: (r.get("greedy") or {}).get("correct"),
        "text": _eval_texts,
    },
}


def texts(record: dict, kind: str) -> list[str]:
    """The text of a record that a search looks in."""
    return [t for t in VIRTUAL_FIELDS[kind]["text"](record) if isinstance(t, str)]


def field_value(record: dict, kind: str, name: str) -> object:
    """The value of the field ``name`` (virtual, top-level or dotted) in ``record``, or
    ``_MISSING``."""
    virtual = VIRTUAL_FIELDS[kind].get(name)
    if virtual is not None:
        return virtual(record)
    value: object = record
    for key in name.split("."):
        if not isinstance(value, dict) or key not in value:
            return _MISSING
        value = value[key]
    return value


def field_names(records: list[dict], kind: str) -> set[str]:
    """The fields of ``records`` a filter or a sort can name: their keys, those of their nested
    objects (dotted), and the kind's virtual fields."""
    names = set(VIRTUAL_FIELDS[kind])
    for record in records:
        for key, value in record.items():
            names.add(key)
            if isinstance(value, dict):
                names.update(f"{key}.{inner}" for inner in value)
    return names


def _number(value: object) -> float | None:
    """``value`` as a float when it is a number (booleans count as 0 and 1), else None."""
    if isinstance(value, (bool, int, float)):
        return float(value)
    return None


def _parse_value(text: str) -> object:
    literals = {"true": True, "false": False, "null": None}
    if text.lower() in literals:
        return literals[text.lower()]
    try:
        return float(text)
    except ValueError:
        return text


@dataclass(frozen=True)
class Filter:
    """One ``--filter`` expression, parsed (see the module's docstring)."""

    expression: str
    field: str  # "text" for a plain search
    op: str  # "=", "!=", "<", "<=", ">", ">=", "~" or "contains" (a plain search)
    value: object  # the parsed value; a compiled pattern for "~", the lower-cased text for "contains"

    def matches(self, record: dict, kind: str) -> bool:
        if self.op == "contains":
            return any(self.value in t.lower() for t in texts(record, kind))
        value = field_value(record, kind, self.field)
        if value is _MISSING:
            return False
        if self.op == "~":
            found = texts(record, kind) if self.field == "text" else [_display(value)]
            return any(self.value.search(t) for t in found)
        if self.op in ("=", "!="):
            return _equals(value, self.value) == (self.op == "=")
        number = _number(value)
        return number is not None and not math.isnan(number) and _NUMBER_OPS[self.op](number, self.value)


def _display(value: object) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _equals(value: object, wanted: object) -> bool:
    if wanted is None or isinstance(wanted, bool):
        return value is wanted
    if isinstance(wanted, float):
        number = _number(value)
        return number is not None and number == wanted
    return _display(value) == wanted


def parse_filter(expression: str) -> Filter:
    """A ``--filter`` expression parsed; a ValueError naming it when it cannot be."""
    if not expression.strip():
        raise ValueError(f"--filter {expression!r}: empty filter (FIELD OP VALUE, or text to search)")
    if (leading := _STARTS_WITH_OPERATOR.match(expression)) is not None:
        raise ValueError(f"--filter {expression!r}: no field before {leading.group(1)!r} (FIELD OP VALUE)")
    match = _FIELD_FILTER.fullmatch(expression)
    if match is None:
        return Filter(expression, "text", "contains", expression.lower())
    field, op, raw = match.group(1), match.group(2), match.group(3).strip()
    op = "=" if op == "==" else op
    if op == "~":
        try:
            return Filter(expression, field, op, re.compile(raw, re.IGNORECASE))
        except re.error as err:
            raise ValueError(f"--filter {expression!r}: bad regular expression {raw!r} ({err})") from None
    if field == "text":
        raise ValueError(f"--filter {expression!r}: text is searched with ~ (text~REGEX) or given alone")
    if not raw:
        raise ValueError(f"--filter {expression!r}: no value after {op!r}")
    value = _parse_value(raw)
    if op in _NUMBER_OPS and (not isinstance(value, float) or math.isnan(value)):
        raise ValueError(f"--filter {expression!r}: {op!r} compares numbers, {raw!r} is not one")
    return Filter(expression, field, op, value)


def check_fields(filters: list[Filter], records: list[dict], kind: str) -> None:
    """A ValueError naming a filter whose field none of ``records`` has (a typo would otherwise
    silently match nothing)."""
    names = field_names(records, kind)
    for f in filters:
        if f.op != "contains" and f.field not in names:
            raise ValueError(
                f"--filter {f.expression!r}: no field {f.field!r} in the {kind} (fields: {', '.join(sorted(names))})"
            )


def sort_records(records: list[dict], kind: str, key: str, ascending: bool = False) -> list[dict]:
    """``records`` by the numeric field ``key``, largest first unless ``ascending``; records
    without a value (null, missing) last; ties keep their order."""
    valued, unvalued = [], []
    for record in records:
        value = field_value(record, kind, key)
        if value is None or value is _MISSING:
            unvalued.append(record)
            continue
        number = _number(value)
        if number is None:
            raise ValueError(
                f"--sort {key}: not a number ({value!r} in the record of step {record.get('step')}); sort by a numeric field"
            )
        if math.isnan(number):
            unvalued.append(record)
        else:
            valued.append((number, record))
    valued.sort(key=lambda pair: pair[0] if ascending else -pair[0])
    return [record for _, record in valued] + unvalued


def select(records: list[dict], kind: str, filters: list[Filter], sort: str | None, ascending: bool) -> list[dict]:
    """The records every filter keeps, sorted by ``sort`` (file order when None)."""
    if sort is not None and sort not in field_names(records, kind):
        raise ValueError(
            f"--sort {sort}: no such field in the {kind} (fields: {', '.join(sorted(field_names(records, kind)))})"
        )
    check_fields(filters, records, kind)
    kept = [r for r in records if all(f.matches(r, kind) for f in filters)]
    return kept if sort is None else sort_records(kept, kind, sort, ascending)
