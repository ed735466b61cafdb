"""Datasets prepared once per node into memory-mapped Arrow files, and the prefetching loader.

References are independent of the code under test: plain ``json`` / ``pyarrow.parquet``
reads of the source files, and the loader without prefetching.
"""

import json
import logging
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from torchtitan_rl.data.datasets import load_rows
from torchtitan_rl.data.loader import SFTDataLoader, build_sft_dataloader
from torchtitan_rl.data.row_cache import prepare_once
from torchtitan_rl.data.rows import row_where
from torchtitan_rl.data.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()
REPO = Path(__file__).resolve().parents[2]

# Per-row varying types: 'content' is a string, then a list of parts; a number, a null, unicode.
CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
PARTS = {
    "messages": [{"role": "user", "content": [{"type": "text", "text": "hé"}]}, {"role": "assistant", "content": "ok"}]
}
ODD = {"text": "x", "score": 1.5, "meta": None, "tags": ["a", 2]}


def write_sources(folder: Path) -> None:
    (folder / "a.jsonl").write_text(
        "\n" + json.dumps(CHAT) + "\n\n" + json.dumps(ODD, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    (folder / "b.json").write_text(
        "[\n  " + json.dumps(PARTS, ensure_ascii=False) + ",\n  " + json.dumps(CHAT) + "\n]\n", encoding="utf-8"
    )


def reference_rows(folder: Path) -> list[tuple[dict, str, int]]:
    """Brute force: each non-blank line of a.jsonl, then each element of b.json with the line
    its text starts on (found by searching the file)."""
    rows = []
    for number, line in enumerate((folder / "a.jsonl").read_text(encoding="utf-8").split("\n"), start=1):
        if line.strip():
            rows.append((json.loads(line), str(folder / "a.jsonl"), number))
    text = (folder / "b.json").read_text(encoding="utf-8")
    lines = text.split("\n")
    for element in json.loads(text):
        number = next(i for i, line in enumerate(lines, start=1) if json.dumps(element, ensure_ascii=False) in line)
        rows.append((element, str(folder / "b.json"), number))
    return rows


def prepared_files(cache: Path, suffix: str) -> list[Path]:
    return sorted(cache.glob(f"*{suffix}"))


def test_prepared_json_rows_equal_the_plain_read(tmp_path):
    data, cache = tmp_path / "data", tmp_path / "cache"
    data.mkdir()
    write_sources(data)
    expected = reference_rows(data)
    for cache_dir in [str(cache), None]:  # mapped from the cache, and prepared in memory
        rows = load_rows("", str(data), "train", 0, 0, cache_dir=cache_dir)
        assert [rows[i] for i in range(len(rows))] == [row for row, _, _ in expected]
        assert [rows.origin(i) for i in range(len(rows))] == [(file, line) for _, file, line in expected]
        assert row_where(rows, 3) == f"dataset row 3 ({data / 'b.json'}:3)"
    (arrow,) = prepared_files(cache, ".arrow")
    assert not list(cache.glob("*.tmp")) and not list(cache.glob("*.error"))


def test_prepared_parquet_rows_equal_the_plain_read(tmp_path):
    data, cache = tmp_path / "data", tmp_path / "cache"
    data.mkdir()
    pq.write_table(pa.Table.from_pylist([{"text": "a", "n": 1}, {"text": None, "n": 2}]), data / "0.parquet")
    pq.write_table(pa.Table.from_pylist([{"text": "c", "n": 3}]), data / "1.parquet")
    expected = pq.read_table(data / "0.parquet").to_pylist() + pq.read_table(data / "1.parquet").to_pylist()
    rows = load_rows("", str(data), "train", 0, 0, cache_dir=str(cache))
    assert [rows[i] for i in range(len(rows))] == expected
    assert row_where(rows, 2) == f"dataset row 2 ({data / '1.parquet'} row 0)"
    (marker,) = prepared_files(cache, ".done")
    # datasets' memory-mapped Arrow files sit in the folder named like the marker.
    assert list(Path(str(marker)[: -len(".done")]).rglob("*.arrow"))
    with pytest.raises(
        ValueError, match=rf"dataset row 1 \({re.escape(str(data / '0.parquet'))} row 1\): .*no supported format"
    ):
        next(SFTDataLoader(rows, TOKENIZER, 16, 3, "drop", 0, 0, 1))


@pytest.mark.parametrize("damage", ["truncated", "garbled pages"])
def test_a_damaged_parquet_shard_is_named(tmp_path, damage):
    data = tmp_path / "data"
    data.mkdir()
    table = pa.Table.from_pylist([{"text": f"row {i} " * 20} for i in range(200)])
    for name in ("0.parquet", "1.parquet", "2.parquet"):
        pq.write_table(table, data / name, compression="NONE")
    shard = data / "1.parquet"
    raw = bytearray(shard.read_bytes())
    if damage == "truncated":
        raw = raw[: len(raw) // 2]  # no footer: fails when its row count is read
    else:
        # The footer stays valid, the data pages are not: fails only when datasets decodes them.
        raw[8 : len(raw) // 2] = b"\xff" * (len(raw) // 2 - 8)
    shard.write_bytes(bytes(raw))
    with pytest.raises((pa.ArrowException, OSError)):  # the premise: pyarrow itself rejects the shard
        pq.read_table(shard)
    for cache_dir in [str(tmp_path / "cache"), None]:
        with pytest.raises(
            ValueError, match=rf"dataset file '{re.escape(str(shard))}' is damaged or not a parquet file"
        ):
            load_rows("", str(data), "train", 0, 0, cache_dir=cache_dir)


def test_second_load_reuses_and_an_edited_file_invalidates(tmp_path, caplog):
    data, cache = tmp_path / "data", tmp_path / "cache"
    data.mkdir()
    write_sources(data)
    load_rows("", str(data), "train", 0, 0, cache_dir=str(cache))
    (first,) = prepared_files(cache, ".arrow")
    written = first.stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="torchtitan_rl.data.row_cache"):
        again = load_rows("", str(data), "train", 0, 0, cache_dir=str(cache))
    assert first.stat().st_mtime_ns == written and any(
        "re-using" in r.message and str(first) in r.message for r in caplog.records
    )
    assert len(again) == 4

    with open(data / "a.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"text": "new"}) + "\n")
    edited = load_rows("", str(data), "train", 0, 0, cache_dir=str(cache))
    assert len(prepared_files(cache, ".arrow")) == 2
    assert [edited[i] for i in range(len(edited))] == [row for row, _, _ in reference_rows(data)]
    (latest,) = set(prepared_files(cache, ".arrow")) - {first}
    latest.write_bytes(b"not arrow")  # e.g. a disk that lost the file's end
    with pytest.raises(ValueError, match=rf"prepared dataset file {re.escape(str(latest))} is damaged .* delete it"):
        load_rows("", str(data), "train", 0, 0, cache_dir=str(cache))


_LOAD_AND_PRINT = """
import json, sys
from torchtitan_rl.data.datasets import load_rows
rows = load_rows("", sys.argv[1], "train", 0, 0, cache_dir=sys.argv[2], cache_timeout_s=120)
print(json.dumps([rows[i] for i in range(len(rows))]))
"""


def test_concurrent_preparation_by_processes_gives_one_valid_file(tmp_path):
    # Two local rank 0 processes (say two jobs) race to prepare; a local rank 1 waits for them.
    data, cache = tmp_path / "data", tmp_path / "cache"
    data.mkdir()
    rows = [{"text": f"row {i}", "n": i} for i in range(20000)]
    (data / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _LOAD_AND_PRINT, str(data), str(cache)],
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(env, LOCAL_RANK=local_rank),
        )
        for local_rank in ("1", "0", "0")
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert json.loads(out) == rows
    assert len(prepared_files(cache, ".arrow")) == 1 and not list(cache.glob("*.tmp"))


def test_racing_writers_leave_one_complete_file(tmp_path):
    # Both writers are inside write() at the same time; the name only ever holds a finished file.
    both_writing = threading.Barrier(2)
    results = []

    def write(path):
        both_writing.wait(timeout=10)
        Path(path).write_text(f"complete {threading.get_ident()}")

    threads = [
        threading.Thread(target=lambda: results.append(prepare_once(str(tmp_path), "x.arrow", write, 10)))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [str(tmp_path / "x.arrow")] * 2
    assert (tmp_path / "x.arrow").read_text().startswith("complete ") and os.listdir(tmp_path) == ["x.arrow"]


def test_errors_name_file_and_line_on_every_local_rank(tmp_path, monkeypatch):
    data, cache = tmp_path / "data", tmp_path / "cache"
    data.mkdir()
    (data / "bad.jsonl").write_text('{"text": "a"}\n{"text": b}\n')
    message = rf"malformed JSON in '{re.escape(str(data / 'bad.jsonl'))}' at line 2: Expecting value"
    with pytest.raises(ValueError, match=message):
        load_rows("", str(data), "train", 0, 0, cache_dir=str(cache))
    monkeypatch.setenv("LOCAL_RANK", "1")  # a waiting rank reports local rank 0's finding
    with pytest.raises(ValueError, match=message):
        load_rows("", str(data), "train", 0, 0, cache_dir=str(cache), cache_timeout_s=5)
    (data / "bad.jsonl").write_text('{"text": "a"}\n\n{"question": "?"}\n')
    with pytest.raises(TimeoutError, match=r"waited 0 s for local rank 0 .*dataset_cache_timeout_seconds"):
        load_rows("", str(data), "train", 0, 0, cache_dir=str(cache), cache_timeout_s=0.1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    rows = load_rows("", str(data), "train", 0, 0, cache_dir=str(cache))
    with pytest.raises(
        ValueError, match=rf"dataset row 1 \({re.escape(str(data / 'bad.jsonl'))}:3\): .*no supported format"
    ):
        next(SFTDataLoader(rows, TOKENIZER, 16, 2, "drop", 0, 0, 1))


# ---------------------------------------------------------------- prefetching

# 4 + 3*(i % 5) text bytes + EOS: with seq_len 12 some rows are dropped, the last is too short.
STREAM_ROWS = [{"text": f"r{i:03d}" + "x" * (3 * (i % 5))} for i in range(13)] + [{"text": ""}]
KWARGS = dict(
    seq_len=12,
    global_batch_size=4,
    long_sample_policy="drop",
    seed=3,
    batch_rank=1,
    batch_degree=2,
    balance_dp_compute=True,
)


def as_lists(batch):
    return [(s.input_ids.tolist(), s.labels.tolist(), s.loss_mask.tolist()) for s in batch]


def test_prefetching_gives_the_same_batches_state_and_resume():
    plain = build_sft_dataloader(STREAM_ROWS, TOKENIZER, **KWARGS)
    ahead = build_sft_dataloader(STREAM_ROWS, TOKENIZER, **KWARGS, prefetch=True)
    plain_iter, ahead_iter = iter(plain), iter(ahead)
    states = []
    for _ in range(8):  # several epochs
        assert as_lists(next(ahead_iter)) == as_lists(next(plain_iter))
        # The state is that of the batches taken, although the next one is being prepared.
        assert ahead.state_dict() == plain.state_dict()
        assert ahead.dataset.stats() == plain.dataset.stats()
        assert ahead.dataset.balance_stats() == plain.dataset.balance_stats()
        states.append(ahead.state_dict())
    expected = [as_lists(next(plain_iter)) for _ in range(3)]
    resumed = build_sft_dataloader(STREAM_ROWS, TOKENIZER, **KWARGS, prefetch=True)
    resumed.load_state_dict(states[-1])
    resumed_iter = iter(resumed)
    assert [as_lists(next(resumed_iter)) for _ in range(3)] == expected
    # Loading a state while a batch is being prepared drops that batch.
    resumed.load_state_dict(states[2])
    rewound = iter(resumed)
    replay = build_sft_dataloader(STREAM_ROWS, TOKENIZER, **KWARGS)
    replay.load_state_dict(states[2])
    replay_iter = iter(replay)
    assert [as_lists(next(rewound)) for _ in range(2)] == [as_lists(next(replay_iter)) for _ in range(2)]
    for loader in (ahead, resumed):
        loader.dataset.close()
    assert not [t for t in threading.enumerate() if t.name == "sft-data-prefetch"]


def test_an_error_in_prefetch_surfaces_at_its_step(tmp_path):
    rows = [{"text": f"ok {i}"} for i in range(6)] + [{"question": "?"}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows = load_rows("", str(path), "train", 0, 0)
    plain = SFTDataLoader(rows, TOKENIZER, 32, 1, "drop", 0, 0, 1)
    failing_step = 0
    with pytest.raises(ValueError) as plain_error:
        while True:
            next(plain)
            failing_step += 1
    assert failing_step >= 1 and f"({path}:7)" in str(plain_error.value)
    ahead = SFTDataLoader(rows, TOKENIZER, 32, 1, "drop", 0, 0, 1, prefetch=True)
    for _ in range(failing_step):
        next(ahead)  # the failing batch is already being prepared: no error yet
    with pytest.raises(ValueError) as ahead_error:
        next(ahead)
    assert str(ahead_error.value) == str(plain_error.value)
    ahead.close()


def test_prepare_runs_on_the_prefetch_thread_and_its_results_are_yielded():
    threads = []

    def prepare(samples):
        threads.append(threading.current_thread().name)
        return ("prepared", as_lists(samples))

    plain = build_sft_dataloader(STREAM_ROWS, TOKENIZER, **KWARGS)
    ahead = build_sft_dataloader(STREAM_ROWS, TOKENIZER, **KWARGS, prefetch=True, prepare=prepare)
    plain_iter, ahead_iter = iter(plain), iter(ahead)
    for _ in range(4):
        assert next(ahead_iter) == ("prepared", as_lists(next(plain_iter)))
    ahead.dataset.close()
    # The first batch is made when asked for; every later one ahead, in the background.
    assert threads[0] == threading.current_thread().name
    assert threads[1:] and set(threads[1:]) == {"sft-data-prefetch"}
