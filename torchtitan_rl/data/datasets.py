"""Load the raw rows of a training set: local files, a built-in task, or a hub dataset already cached.

JSON / JSONL files are read by ``data.rows`` (rows keep their file and line; relative image
paths resolve against the row's file); parquet files and hub datasets go through ``datasets``.
Nothing is ever downloaded: offline mode is forced before ``datasets`` is imported, so a name
that is not in the local HF cache is an error rather than a silent network access. ``datasets``
is imported on first use only: a run on JSON files or a built-in task never needs its 0.6 s of
start-up.

With a cache directory, local files are prepared once per node into memory-mapped Arrow
files (``data.row_cache``), so the ranks of a node share one copy in the page cache instead
of holding one each; without one, each process prepares its own copy in memory.
"""

import bisect
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from torchtitan_rl.data.row_cache import cache_name, prepare_once
from torchtitan_rl.data.rows import FORMAT_VERSION, FileRows, SourcedRows, read_json_files, write_json_rows
from torchtitan_rl.data.tasks import BUILTIN_TASKS

if TYPE_CHECKING:
    import datasets

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def _hf_datasets():
    """The ``datasets`` package, imported on first use (after the offline switches above)."""
    import datasets

    return datasets


# Extension → format family; the files of one dataset must share it.
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def _data_files(dataset_path: str, key: str) -> list[Path]:
    path = Path(dataset_path)
    if not path.exists():
        raise ValueError(f"{key}={dataset_path!r} does not exist")
    if path.is_file():
        if path.suffix not in _BUILDERS:
            raise ValueError(f"unsupported dataset file {dataset_path!r}: expected one of {sorted(_BUILDERS)}")
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _BUILDERS)
    if not files:
        raise ValueError(f"{key}={dataset_path!r} is a directory with no {sorted(_BUILDERS)} files")
    builders = {_BUILDERS[f.suffix] for f in files}
    if len(builders) > 1:
        raise ValueError(f"{key}={dataset_path!r} mixes JSON and parquet files; use one format")
    return files


class ParquetRows(SourcedRows):
    """The rows of parquet files (a ``datasets.Dataset``), naming each row's file and its row in it."""

    def __init__(self, dataset: "datasets.Dataset", files: list[str], file_row_counts: list[int]):
        assert len(dataset) == sum(file_row_counts)
        self._dataset = dataset
        self._files = files
        self._file_starts = [sum(file_row_counts[:i]) for i in range(len(files))]

    def __len__(self) -> int:
        return len(self._dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self._dataset[index]

    def source_of(self, index: int) -> str:
        file_index = bisect.bisect_right(self._file_starts, index) - 1
        return f"{self._files[file_index]} row {index - self._file_starts[file_index]}"

    def base_dir(self, index: int) -> None:
        return None  # as ``datasets`` rows always had: relative image paths are relative to the working directory


# What pyarrow raises for a file that is not (or no longer) valid parquet.
_PARQUET_ERRORS = (pa.ArrowException, OSError)


def _damaged_shard(file: Path, err: Exception) -> ValueError:
    return ValueError(
        f"dataset file {str(file)!r} is damaged or not a parquet file ({str(err).strip()}); replace or remove it"
    )


def _num_rows(file: Path) -> int:
    try:
        return pq.ParquetFile(file).metadata.num_rows
    except _PARQUET_ERRORS as err:  # a truncated file has no footer
        raise _damaged_shard(file, err) from err


def _first_unreadable(files: list[Path]) -> tuple[Path, Exception] | None:
    """The first file whose pages pyarrow cannot decode, with the error; None if all decode."""
    for file in files:
        try:
            for _ in pq.ParquetFile(file).iter_batches():
                pass
        except _PARQUET_ERRORS as err:
            return file, err
    return None


def _parquet_dataset(files: list[Path], cache_dir: str, keep_in_memory: bool) -> "datasets.Dataset":
    try:
        return _hf_datasets().load_dataset(
            "parquet",
            data_files=[str(f) for f in files],
            split="train",
            keep_in_memory=keep_in_memory,
            cache_dir=cache_dir,
        )
    except Exception as err:  # noqa: BLE001  (re-raised with the files, as datasets' errors do not name them)
        # datasets reads the shards as one stream: a damaged page in any of them fails the whole
        # load without its name, so find it by decoding each file (only once the load has failed).
        unreadable = _first_unreadable(files)
        if unreadable is not None:
            raise _damaged_shard(*unreadable) from err
        cause = f"{err}: {err.__cause__}" if err.__cause__ is not None else str(err)
        raise ValueError(f"could not load dataset files {[str(f) for f in files]}: {cause}") from err


def _load_parquet(files: list[Path], cache_dir: str | None, timeout_s: float) -> ParquetRows:
    counts = [_num_rows(f) for f in files]
    empty = [str(f) for f, count in zip(files, counts) if count == 0]
    if empty:
        raise ValueError(f"dataset file {empty[0]!r} is empty (no rows); remove it or fill it")
    if cache_dir is None:
        # A private cache dir per call: concurrent loads never share (or race on) datasets' on-disk
        # arrow cache, and keep_in_memory means nothing is read from it afterwards.
        with tempfile.TemporaryDirectory(prefix="torchtitan_rl_data_") as private_dir:
            dataset = _parquet_dataset(files, private_dir, keep_in_memory=True)
    else:
        # datasets converts the files into memory-mapped Arrow files in a folder of its own under
        # our name (so an edited file gets a fresh one); the marker file says the folder is complete.
        name = cache_name("parquet", files, FORMAT_VERSION)
        hf_cache = os.path.join(cache_dir, name)

        def prepare(marker: str) -> None:
            _parquet_dataset(files, hf_cache, keep_in_memory=False)
            Path(marker).touch()

        prepare_once(cache_dir, name + ".done", prepare, timeout_s)
        dataset = _parquet_dataset(files, hf_cache, keep_in_memory=False)
    return ParquetRows(dataset, [str(f) for f in files], counts)


def _load_json(files: list[Path], cache_dir: str | None, timeout_s: float) -> FileRows:
    if cache_dir is None:
        return read_json_files(files)
    path = prepare_once(
        cache_dir,
        cache_name("json", files, FORMAT_VERSION) + ".arrow",
        lambda sink: write_json_rows(files, sink),
        timeout_s,
    )
    try:
        # Zero-copy: the table's buffers are the mapped file's pages, shared by every process mapping it.
        table = pa.ipc.open_file(pa.memory_map(path)).read_all()
    except pa.ArrowInvalid as err:
        raise ValueError(f"the prepared dataset file {path} is damaged ({err}); delete it to prepare it again") from err
    return FileRows(table, [str(f) for f in files])


def _load_files(dataset_path: str, cache_dir: str | None, timeout_s: float, key: str) -> Sequence[dict[str, Any]]:
    files = _data_files(dataset_path, key)
    if files[0].suffix == ".parquet":
        return _load_parquet(files, cache_dir, timeout_s)
    # JSON goes through our reader: it keeps each row's file and line (errors, image paths) and
    # accepts columns whose type varies between rows, which Arrow columns cannot.
    return _load_json(files, cache_dir, timeout_s)


def _load_hub(name: str, split: str) -> "datasets.Dataset":
    datasets = _hf_datasets()
    try:
        return datasets.load_dataset(name, split=split)
    except (ConnectionError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as err:
        raise ValueError(
            f"training.dataset={name!r} is neither a built-in task ({sorted(BUILTIN_TASKS)}) nor a dataset in the "
            "local HF cache; nothing is downloaded at run time, so pre-download it into the cache or point "
            "training.dataset_path at local .jsonl/.json/.parquet files"
        ) from err


def load_rows(
    dataset: str,
    dataset_path: str,
    split: str,
    num_synthetic_samples: int,
    seed: int,
    cache_dir: str | None = None,
    cache_timeout_s: float = 3600,
    key: str = "training.dataset_path",
) -> Sequence[dict[str, Any]]:
    """The rows of the training set, indexable by position (``data.rows.FileRows`` for JSON
    files, ``ParquetRows`` for parquet files).

    ``dataset_path`` (a file or a directory of files, all one split) wins over ``dataset``,
    which names a built-in task (``num_synthetic_samples`` rows from ``seed``) or a cached
    hub dataset (its ``split``); ``key`` is the config key errors name ``dataset_path`` by. Files are prepared into ``cache_dir`` once per node
    (``data.row_cache``; other local ranks wait up to ``cache_timeout_s``), or into this
    process's memory when it is None.
    """
    if dataset_path:
        rows = _load_files(dataset_path, cache_dir, cache_timeout_s, key)
        source = f"{key}={dataset_path!r}"
    elif dataset in BUILTIN_TASKS:
        rows = BUILTIN_TASKS[dataset](num_synthetic_samples, seed)
        source = f"built-in task {dataset!r} with {num_synthetic_samples} synthetic samples"
    else:
        rows = _load_hub(dataset, split)
        source = f"training.dataset={dataset!r} split {split!r}"
    if len(rows) == 0:
        raise ValueError(f"the dataset is empty: {source} has no rows")
    return rows
