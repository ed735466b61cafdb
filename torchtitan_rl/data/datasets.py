"""Load the raw rows of a training set: local files, a built-in task, or a hub dataset already cached.

Nothing is ever downloaded: offline mode is forced before ``datasets`` is imported, so a name
that is not in the local HF cache is an error rather than a silent network access.
"""

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import datasets  # noqa: E402  (must see the offline switches above at import time)
import pyarrow.parquet as pq  # noqa: E402

from torchtitan_rl.data.tasks import BUILTIN_TASKS  # noqa: E402

# Extension → `datasets` builder that reads it.
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def _data_files(dataset_path: str) -> list[Path]:
    path = Path(dataset_path)
    if not path.exists():
        raise ValueError(f"training.dataset_path={dataset_path!r} does not exist")
    if path.is_file():
        if path.suffix not in _BUILDERS:
            raise ValueError(f"unsupported dataset file {dataset_path!r}: expected one of {sorted(_BUILDERS)}")
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _BUILDERS)
    if not files:
        raise ValueError(f"training.dataset_path={dataset_path!r} is a directory with no {sorted(_BUILDERS)} files")
    builders = {_BUILDERS[f.suffix] for f in files}
    if len(builders) > 1:
        raise ValueError(f"training.dataset_path={dataset_path!r} mixes JSON and parquet files; use one format")
    return files


def _has_no_rows(file: Path) -> bool:
    if file.suffix == ".parquet":
        return pq.ParquetFile(file).metadata.num_rows == 0
    return file.read_text(encoding="utf-8", errors="replace").strip() in ("", "[]")


def _first_malformed_line(file: Path) -> tuple[int, str] | None:
    """``(1-based line, reason)`` of the first line that is not a JSON object, or None."""
    text = file.read_text(encoding="utf-8", errors="replace")
    if text.lstrip().startswith("["):
        # One JSON array document: its parser knows the line of the syntax error.
        try:
            json.loads(text)
        except json.JSONDecodeError as err:
            return err.lineno, err.msg
        return None
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as err:
            return line_number, err.msg
        if not isinstance(value, dict):
            return line_number, f"expected a JSON object, got {type(value).__name__}"
    return None


def _explain_load_failure(files: list[Path], err: Exception) -> ValueError:
    """`datasets` errors name neither the file nor the line; find the culprit ourselves."""
    empty_files = [str(f) for f in files if _has_no_rows(f)]
    if empty_files:
        return ValueError(f"dataset file {empty_files[0]!r} is empty (no rows); remove it or fill it")
    for file in files:
        if file.suffix != ".parquet":
            malformed = _first_malformed_line(file)
            if malformed is not None:
                line_number, reason = malformed
                return ValueError(f"malformed JSON in {str(file)!r} at line {line_number}: {reason}")
    cause = f"{err}: {err.__cause__}" if err.__cause__ is not None else str(err)
    return ValueError(f"could not load dataset files {[str(f) for f in files]}: {cause}")


def _load_files(dataset_path: str) -> datasets.Dataset:
    files = _data_files(dataset_path)
    # A private cache dir per call: concurrent ranks loading the same files never share (or race on)
    # datasets' on-disk arrow cache, and keep_in_memory means nothing is read from it afterwards.
    with tempfile.TemporaryDirectory(prefix="torchtitan_rl_data_") as cache_dir:
        try:
            return datasets.load_dataset(
                _BUILDERS[files[0].suffix],
                data_files=[str(f) for f in files],
                split="train",
                keep_in_memory=True,
                cache_dir=cache_dir,
            )
        except Exception as err:  # noqa: BLE001  (re-raised below with the file and line that caused it)
            raise _explain_load_failure(files, err) from err


def _load_hub(name: str, split: str) -> datasets.Dataset:
    try:
        return datasets.load_dataset(name, split=split)
    except (ConnectionError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as err:
        raise ValueError(
            f"training.dataset={name!r} is neither a built-in task ({sorted(BUILTIN_TASKS)}) nor a dataset in the "
            "local HF cache; nothing is downloaded at run time, so pre-download it into the cache or point "
            "training.dataset_path at local .jsonl/.json/.parquet files"
        ) from err


def load_rows(
    dataset: str, dataset_path: str, split: str, num_synthetic_samples: int, seed: int
) -> Sequence[dict[str, Any]]:
    """The rows of the training set, indexable by position.

    ``dataset_path`` (a file or a directory of files, all one split) wins over ``dataset``,
    which names a built-in task (``num_synthetic_samples`` rows from ``seed``) or a cached
    hub dataset (its ``split``).
    """
    if dataset_path:
        rows = _load_files(dataset_path)
        source = f"training.dataset_path={dataset_path!r}"
    elif dataset in BUILTIN_TASKS:
        rows = BUILTIN_TASKS[dataset](num_synthetic_samples, seed)
        source = f"built-in task {dataset!r} with {num_synthetic_samples} synthetic samples"
    else:
        rows = _load_hub(dataset, split)
        source = f"training.dataset={dataset!r} split {split!r}"
    if len(rows) == 0:
        raise ValueError(f"the dataset is empty: {source} has no rows")
    return rows
