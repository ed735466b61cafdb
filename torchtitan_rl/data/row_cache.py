"""One prepared copy of a dataset per node, which every rank of the node maps.

The first use of a set of source files writes a file into the cache directory, named after
the files' paths, sizes and modification times (so an edited file is prepared again). Only
local rank 0 (``LOCAL_RANK``) writes it; it writes to a temporary name and renames it, so a
file under the final name is always complete, and two writers racing (two jobs, or nodes
sharing the directory) each leave a complete, identical file. The other local ranks poll for
it rather than wait in a collective: the trainer reports data mistakes before any collective,
and a preparation may take longer than a collective's timeout. A data mistake found while
preparing is written beside the file, so the waiting ranks fail with the same message.
"""

import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)


def cache_name(kind: str, files: list[Path], version: int) -> str:
    """``kind-<hash>`` of the files' absolute paths (in order), sizes and modification times and ``version``."""
    identity = [kind, version]
    for file in files:
        stat = os.stat(file)
        identity.append([os.path.abspath(file), stat.st_size, stat.st_mtime_ns])
    return f"{kind}-{hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:32]}"


def _write_atomically(final: str, write: Callable[[str], None]) -> None:
    """``write(path)`` to a fresh temporary name beside ``final``, renamed to ``final`` when done."""
    # Unique per writer (not mkstemp: its file would be private to this user, not the umask's).
    temporary = f"{final}.{uuid.uuid4().hex}.tmp"
    try:
        write(temporary)
        os.replace(temporary, final)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def _write_text(text: str) -> Callable[[str], None]:
    return lambda path: Path(path).write_text(text, encoding="utf-8")


def is_local_preparer() -> bool:
    """Whether this process prepares the node's cache files: local rank 0, or a process on its own."""
    return int(os.environ.get("LOCAL_RANK", "0")) == 0


def prepare_once(cache_dir: str, name: str, write: Callable[[str], None], timeout_s: float) -> str:
    """The path of ``cache_dir/name``; if it does not exist yet, local rank 0 makes it with
    ``write(path)`` and the other local ranks wait up to ``timeout_s`` seconds for it.

    A ValueError of ``write`` (a data mistake) is raised on every local rank.
    """
    final = os.path.join(cache_dir, name)
    failed = final + ".error"
    if os.path.exists(final):
        logger.info("re-using the prepared dataset file %s", final)
        return final
    if is_local_preparer():
        os.makedirs(cache_dir, exist_ok=True)
        start = time.perf_counter()
        try:
            _write_atomically(final, write)
        except ValueError as err:
            # Same files, same mistake: the message stays valid for as long as the name does.
            _write_atomically(failed, _write_text(str(err)))
            raise
        if os.path.exists(failed):
            os.remove(failed)
        logger.info("prepared the dataset file %s in %.1f s", final, time.perf_counter() - start)
        return final
    deadline = time.monotonic() + timeout_s
    delay = 0.05
    while not os.path.exists(final):
        if os.path.exists(failed):
            raise ValueError(Path(failed).read_text(encoding="utf-8"))
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"waited {timeout_s:.0f} s for local rank 0 to prepare the dataset file {final}: see its log for "
                "an error, or raise training.dataset_cache_timeout_seconds if the preparation is just slow"
            )
        time.sleep(delay)
        delay = min(2 * delay, 1.0)
    logger.info("mapping the dataset file %s prepared by local rank 0", final)
    return final
