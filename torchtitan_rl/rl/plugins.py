"""A user's Python object named in the config as ``package.module:name``: imported at start-up,
so a typo or a missing module stops the run before any rank builds anything, naming the key."""

import contextlib
import importlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any


class UserCodeError(RuntimeError):
    """A user's code (``rl.env``, ``rl.task``, ``rl.reward_fn``) raised while the run called it:
    the message names the key and what was called on what; the cause (chained) is the user's
    exception, whose traceback ``train.py`` prints. Not a config mistake: whatever the user's
    code raised, a ValueError included, keeps its traceback."""


@contextlib.contextmanager
def calling_user_code(what: str) -> Iterator[None]:
    """Run a call of a user's code: an exception it raises becomes a ``UserCodeError`` whose
    message is ``what`` (e.g. ``rl.env = 'my_env:Env' on data.jsonl:3: step()``) and the error."""
    try:
        yield
    except Exception as err:
        raise UserCodeError(f"{what} raised {type(err).__name__}: {err}") from err


def is_import_path(value: str) -> bool:
    """Whether ``value`` has the form of an import path (``package.module:name``) rather than a built-in name."""
    return ":" in value


def import_object(key: str, path: str, builtins: str = "") -> Any:
    """The object ``path`` names (``package.module:name``), imported now; ``key`` is the config
    key errors name, ``builtins`` describes the built-in values the key also accepts (e.g.
    ``"environment (calculator, guess_number)"``)."""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        alternative = f"not a built-in {builtins} nor" if builtins else "not"
        raise ValueError(f"{key} = {path!r}: {alternative} an import path 'package.module:name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{key} = {path!r}: cannot import {module_name!r}: {err}") from None
    if not hasattr(module, attribute):
        raise ValueError(f"{key} = {path!r}: module {module_name!r} has no {attribute!r}")
    return getattr(module, attribute)


def check_callable_with(key: str, path: str, fn: Any, call: str, *args: Any, **kwargs: Any) -> None:
    """A ValueError naming ``key`` unless ``fn`` can be called with ``args`` and ``kwargs``;
    ``call`` shows the expected call, e.g. ``fn(problem, completion, stopped)``."""
    if not callable(fn):
        raise ValueError(f"{key} = {path!r} is a {type(fn).__name__}, not a function: it must be callable as {call}")
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as err:
        raise ValueError(f"{key} = {path!r} cannot be called as {call}: {err}") from None
    except ValueError:  # some builtins have no signature: let the first call tell
        pass


def accepted_keywords(fn: Callable, offered: tuple[str, ...]) -> set[str] | None:
    """The names of ``offered`` that ``fn`` takes as keywords; None when it takes any (``**kwargs``)."""
    parameters = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters if p.name in offered and p.kind is not inspect.Parameter.POSITIONAL_ONLY}
