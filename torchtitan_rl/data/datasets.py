"""Load the raw rows of a training set: local files, a built-in task, or a hub dataset already cached.

JSON / JSONL files are read by ``data.rows`` (rows keep their file and line; relative image
paths resolve against the row's file); parquet files and hub datasets go through ``datasets``.
Nothing is ever downloaded: offline mode is forced before ``datasets`` is imported, so a name
that is not in the local HF cache is an error rather than a silent network access.
"""

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import datasets  # noqa: E402  (must see the offline switches above at import time)
import pyarrow.parquet as pq  # noqa: E402

from torchtitan_rl.data.rows import read_json_files  # noqa: E402
from torchtitan_rl.data.tasks import BUILTIN_TASKS  # noqa: E402

# Extension → format family; the files of one dataset must share it.
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


def _load_parquet(files: list[Path]) -> datasets.Dataset:
    empty = [str(f) for f in files if pq.ParquetFile(f).metadata.num_rows == 0]
    if empty:
        raise ValueError(f"dataset file {empty[0]!r} is empty (no rows); remove it or fill it")
    # A private cache dir per call: concurrent ranks loading the same files never share (or race on)
    # datasets' on-disk arrow cache, and keep_in_memory means nothing is read from it afterwards.
    with tempfile.TemporaryDirectory(prefix="torchtitan_rl_data_") as cache_dir:
        try:
            return datasets.load_dataset(
                "parquet", data_files=[str(f) for f in files], split="train", keep_in_memory=True, cache_dir=cache_dir
            )
        except Exception as err:  # noqa: BLE001  (re-raised with the files, as datasets' errors do not name them)
            cause = f"{err}: {err.__cause__}" if err.__cause__ is not None else str(err)
            raise ValueError(f"could not load dataset files {[str(f) for f in files]}: {cause}") from err


def _load_files(dataset_path: str) -> Sequence[dict[str, Any]]:
    files = _data_files(dataset_path)
    if files[0].suffix == ".parquet":
        return _load_parquet(files)
    # JSON goes through our reader: it keeps each row's file and line (errors, image paths) and
    # accepts columns whose type varies between rows, which Arrow cannot.
    return read_json_files(files)


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
    """The rows of the training set, indexable by position (``data.rows.FileRows`` for JSON files).

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
