"""Builds a config (a ``JobConfig`` by default) from defaults, a TOML recipe and
``--section.key value`` overrides, prints ``--help`` and writes a config back as TOML.

Generic: it knows the shape of a config (sections of typed fields, ranges from ``bounded``),
not the project's rules; those that span keys are the config's ``validate`` method
(``JobConfig``'s are in ``config/validation.py``; ``recipes/config_checks.py`` adds the rules
that need the model's, the loss's or the task's facts). Fails closed: an unknown key, a value of the
wrong type or out of range is a ``ValueError`` naming the dotted key, never a silently ignored
setting.
"""

import ast
import dataclasses
import difflib
import functools
import inspect
import math
import operator
import os
import sys
import types
import typing
from typing import Any, Literal, Union

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from torchtitan_rl.config.job_config import JobConfig

_CONFIG_FILE_KEY = "job.config_file"
_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")
_BOUNDS = {
    "gt": (">", operator.gt),
    "ge": (">=", operator.ge),
    "lt": ("<", operator.lt),
    "le": ("<=", operator.le),
}


@dataclasses.dataclass(frozen=True)
class _Field:
    key: str  # "section.name"
    type: Any
    default: Any
    bounds: dict


class ConfigManager:
    """Parses command lines into ``config_cls``: a dataclass whose fields are section
    dataclasses whose fields are scalars, ``Literal``, ``Optional`` or ``list`` of scalars.
    A ``validate()`` method of ``config_cls``, if any, runs on every parsed config; its
    ``renamed_keys`` (old dotted key -> new one), if any, turn an old key into an error naming
    the new one."""

    def __init__(self, config_cls: type = JobConfig):
        self.config_cls = config_cls
        hints = typing.get_type_hints(config_cls)
        self.sections: dict[str, type] = {f.name: hints[f.name] for f in dataclasses.fields(config_cls)}
        self.fields: dict[str, _Field] = {}
        for section, section_cls in self.sections.items():
            hints = typing.get_type_hints(section_cls)
            for f in dataclasses.fields(section_cls):
                key = f"{section}.{f.name}"
                if not _supported(hints[f.name]):
                    raise TypeError(f"{key}: unsupported config type {hints[f.name]}")
                default = f.default_factory() if f.default is dataclasses.MISSING else f.default
                self.fields[key] = _Field(key, hints[f.name], default, dict(f.metadata))

    def parse_args(self, argv: list[str]):
        if "-h" in argv or "--help" in argv:
            print(self.format_help())
            raise SystemExit(0)
        overrides = self._parse_cli(argv)
        values = {}
        if overrides.get(_CONFIG_FILE_KEY):
            values.update(self._load_toml(overrides[_CONFIG_FILE_KEY]))
        for key, text in overrides.items():
            values[key] = _from_str(key, text, self.fields[key].type)
        by_section: dict[str, dict] = {}
        for key, value in values.items():
            section, _, name = key.partition(".")
            by_section.setdefault(section, {})[name] = value
        cfg = self.config_cls(**{s: self.sections[s](**kw) for s, kw in by_section.items()})
        self._check_bounds(cfg)
        if hasattr(cfg, "validate"):
            cfg.validate()
        return cfg

    def format_help(self) -> str:
        lines = [
            "usage: [--job.config_file PATH] [--section.key VALUE | --section.key=VALUE ...]",
            "",
            "Values come from the defaults, then the TOML file of --job.config_file, then the",
            "command line. Booleans take true/false/1/0/yes/no (a bare flag means true), lists",
            "take a,b,c or [a, b], Optional keys take none.",
        ]
        for section, section_cls in self.sections.items():
            lines += ["", f"[{section}] {inspect.cleandoc(section_cls.__doc__ or '')}".rstrip()]
            docs = _attribute_docs(section_cls)
            for f in self.fields.values():
                if not f.key.startswith(section + "."):
                    continue
                default = "none" if f.default is None else _toml_value(f.default)
                ranges = ", ".join(f"{_BOUNDS[op][0]} {v}" for op, v in f.bounds.items())
                ranges = f"  (must be {ranges})" if ranges else ""
                lines.append(f"  --{f.key}  {_type_name(f.type)} = {default}{ranges}")
                doc = docs.get(f.key.partition(".")[2], "")
                lines += ["      " + line if line else "" for line in doc.splitlines()]
        return "\n".join(lines)

    def _lookup(self, key: str) -> _Field:
        if key in self.fields:
            return self.fields[key]
        renamed = getattr(self.config_cls, "renamed_keys", {})
        if key in renamed:
            raise ValueError(f"config key '{key}' is now '{renamed[key]}' (see --help for what it covers)")
        section, dot, _ = key.partition(".")
        if not dot:
            problem = f"config key '{key}' must be written as section.key"
        elif section not in self.sections:
            problem = f"unknown config section '{section}' in '{key}'"
        else:
            problem = f"unknown config key '{key}'"
        raise ValueError(problem + _did_you_mean(key, list(self.fields)))

    def _parse_cli(self, argv: list[str]) -> dict[str, str]:
        overrides = {}
        i = 0
        while i < len(argv):
            arg = argv[i]
            i += 1
            if not arg.startswith("--") or arg == "--":
                raise ValueError(f"unexpected argument {arg!r}: overrides look like --section.key value")
            key, eq, text = arg[2:].partition("=")
            field = self._lookup(key)
            if not eq:
                if i < len(argv) and not argv[i].startswith("--"):
                    text = argv[i]
                    i += 1
                elif _strip_optional(field.type) is bool:
                    text = "true"
                else:
                    raise ValueError(f"{key}: override {arg} is missing its value")
            overrides[key] = text
        return overrides

    def _load_toml(self, path: str) -> dict[str, Any]:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ValueError(f"{_CONFIG_FILE_KEY}: file not found: {path}") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{_CONFIG_FILE_KEY}: TOML syntax error in {path}: {e}") from None
        values = {}
        try:
            for section, table in data.items():
                if section not in self.sections:
                    candidates = list(self.sections) + list(self.fields)
                    raise ValueError(f"unknown config section '{section}'{_did_you_mean(section, candidates)}")
                if not isinstance(table, dict):
                    raise ValueError(f"{section}: expected a [{section}] table")
                for name, value in table.items():
                    field = self._lookup(f"{section}.{name}")
                    values[field.key] = _from_toml(field.key, value, field.type)
        except ValueError as e:
            raise ValueError(f"{e} (in {path})") from None
        return values

    def _check_bounds(self, cfg) -> None:
        for f in self.fields.values():
            section, _, name = f.key.partition(".")
            value = getattr(getattr(cfg, section), name)
            for op, limit in f.bounds.items():
                symbol, holds = _BOUNDS[op]
                if value is not None and not holds(value, limit):
                    raise ValueError(f"{f.key}: must be {symbol} {limit}, got {value!r}")


def _did_you_mean(name: str, candidates: list[str]) -> str:
    # Leaf matches catch a key in the wrong section ("training.lr") or with none ("steps").
    # Within the same section only the leaf is compared: a shared "training." prefix would
    # otherwise make unrelated keys look alike.
    section, _, leaf = name.rpartition(".")
    by_leaf = {}
    for c in candidates:  # a leaf of several sections: the first, e.g. optimizer.lr before critic.lr
        by_leaf.setdefault(c.rpartition(".")[2], c)
    same_section = {c.rpartition(".")[2]: c for c in candidates if c.rpartition(".")[0] == section}
    close = (
        ([by_leaf[leaf]] if leaf in by_leaf else [])
        or [same_section[m] for m in difflib.get_close_matches(leaf, same_section, n=1)]
        or [by_leaf[m] for m in difflib.get_close_matches(leaf, by_leaf, n=1)]
    )
    return f"; did you mean '{close[0]}'?" if close else ""


def _strip_optional(tp):
    """``Optional[X]`` -> ``X``; anything else unchanged."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return inner
    return tp


def _supported(tp) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return len(args) == 2 and type(None) in args and _supported(_strip_optional(tp))
    if origin is Literal:
        return True
    if origin is list:
        return args[0] in (bool, int, float, str)
    return tp in (bool, int, float, str)


def _type_name(tp) -> str:
    if _strip_optional(tp) is not tp:
        return f"Optional[{_type_name(_strip_optional(tp))}]"
    if typing.get_origin(tp) is Literal:
        return " | ".join(_toml_value(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list[{typing.get_args(tp)[0].__name__}]"
    return tp.__name__


def _type_error(key: str, value, tp) -> ValueError:
    return ValueError(f"{key}: expected {_type_name(tp)}, got {value!r}")


def _check_literal(key: str, value, tp):
    allowed = typing.get_args(tp)
    # type() as well as ==: True == 1 must not pass for Literal[1].
    if not any(type(value) is type(a) and value == a for a in allowed):
        raise ValueError(f"{key}: {value!r} is not allowed; choose one of {', '.join(map(repr, allowed))}")
    return value


def _finite(key: str, value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{key}: expected a finite float, got {value!r}")
    return value


def _from_toml(key: str, value, tp):
    """Checks a TOML value against ``tp``. TOML has no null: omitting a key keeps its default."""
    tp = _strip_optional(tp)
    if typing.get_origin(tp) is Literal:
        return _check_literal(key, value, tp)
    if typing.get_origin(tp) is list:
        if not isinstance(value, list):
            raise _type_error(key, value, tp)
        return [_from_toml(key, v, typing.get_args(tp)[0]) for v in value]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    # bool is a subclass of int, so compare exact types: `true` is no int.
    if type(value) is not tp:
        raise _type_error(key, value, tp)
    return _finite(key, value) if tp is float else value


def _from_str(key: str, text: str, tp):
    """Parses a command-line string as ``tp``."""
    if _strip_optional(tp) is not tp:
        if text.strip().lower() == "none":
            return None
        tp = _strip_optional(tp)
    if typing.get_origin(tp) is Literal:
        matches = [a for a in typing.get_args(tp) if str(a) == text]
        return _check_literal(key, matches[0] if matches else text, tp)
    if typing.get_origin(tp) is list:
        return [_from_str(key, item, typing.get_args(tp)[0]) for item in _split_list(text)]
    if tp is bool:
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        raise ValueError(f"{key}: expected a boolean (true/false/1/0/yes/no), got {text!r}")
    if tp is str:
        return text
    try:
        value = tp(text)
    except ValueError:
        raise _type_error(key, text, tp) from None
    return _finite(key, value) if tp is float else value


def _split_list(text: str) -> list[str]:
    """``a,b,c`` or ``[1, 2]`` or ``["x", "y"]`` -> items as strings."""
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    items = [item.strip() for item in text.split(",")]
    if items[-1] == "":  # "" or "[]" or a TOML-style trailing comma
        items.pop()
    return [i[1:-1] if len(i) >= 2 and i[0] == i[-1] and i[0] in "\"'" else i for i in items]


@functools.cache
def _attribute_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal right after the field in ``cls``'s source."""
    tree = ast.parse(inspect.getsource(sys.modules[cls.__module__]))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            docs = {}
            for stmt, nxt in zip(node.body, node.body[1:]):
                if (
                    isinstance(stmt, ast.AnnAssign)
                    and isinstance(stmt.target, ast.Name)
                    and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)
                ):
                    docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
            return docs
    return {}


def config_to_dict(cfg) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def write_resolved_config(cfg, path: str) -> None:
    """Writes every value of ``cfg`` as TOML; ``--job.config_file path`` reloads it."""
    lines = ["# Fully resolved config of a run. None values are left out (they are defaults)."]
    for section, table in config_to_dict(cfg).items():
        lines += ["", f"[{section}]"]
        lines += [f"{name} = {_toml_value(v)}" for name, v in table.items() if v is not None]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + "".join(_toml_char(c) for c in value) + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def _toml_char(c: str) -> str:
    """One character of a TOML basic string: quote, backslash and controls are escaped."""
    if c in '"\\':
        return "\\" + c
    if c < " " or c == "\x7f":
        return f"\\u{ord(c):04x}"
    return c
