"""The pure helpers of ``scripts/benchmark_dp_balance.py``: the data it writes (checked with the
repository's tokenizer and chat template), the wide model's files, the CPU time read from
/proc (checked against ``os.times``), and the figures and paired ratios of its tables."""

import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

import pytest

from torchtitan_rl.data.chat import tokenize_row
from torchtitan_rl.data.tokenizer import ByteTokenizer, build_tokenizer
from torchtitan_rl.hf_checkpoint import read_hf_model_args

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))  # the script imports bench_common from its folder
import benchmark_dp_balance as bench  # noqa: E402


def test_uniform_rows_have_one_length_and_varied_ones_follow_the_clipped_lognormal():
    assert bench.document_lengths("uniform", 5) == [bench.UNIFORM_LEN] * 5
    lengths = bench.document_lengths("varied", 4000)
    assert lengths == bench.document_lengths("varied", 4000)  # seeded
    assert lengths != bench.document_lengths("varied", 4000, seed=1)
    assert min(lengths) >= bench.VARIED_MIN and max(lengths) == bench.SEQ_LEN
    assert statistics.median(lengths) == pytest.approx(bench.VARIED_MEDIAN, rel=0.06)
    # The heavy tail: P(X > SEQ_LEN) of a lognormal, every such draw clipped to SEQ_LEN.
    z = math.log(bench.SEQ_LEN / bench.VARIED_MEDIAN) / bench.VARIED_SIGMA
    tail = 0.5 * math.erfc(z / math.sqrt(2))
    assert lengths.count(bench.SEQ_LEN) / len(lengths) == pytest.approx(tail, abs=0.015)
    with pytest.raises(ValueError, match="unknown data kind"):
        bench.document_lengths("zipf", 3)


@pytest.mark.parametrize("length", [bench.VARIED_MIN, 33, 256, 777, bench.SEQ_LEN])
def test_a_chat_row_tokenizes_to_its_length_with_the_answer_trained(length):
    row = bench.chat_row(length, random.Random(length))
    tokens, mask = tokenize_row(row, ByteTokenizer())
    assert len(tokens) == length
    answer = row["messages"][1]["content"]
    assert sum(mask) == len(answer) + 1  # the answer and its <|im_end|>
    assert len(row["messages"][0]["content"]) >= 1


def test_a_chat_row_too_short_for_the_template_is_refused():
    with pytest.raises(ValueError, match="at least"):
        bench.chat_row(bench.USER_OVERHEAD + bench.ASSISTANT_OVERHEAD + 1, random.Random(0))


def test_write_rows_writes_one_row_per_length(tmp_path):
    lengths = [40, 300, 1024]
    bench.write_rows(str(tmp_path / "rows.jsonl"), lengths)
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [len(tokenize_row(row, ByteTokenizer())[0]) for row in rows] == lengths


def test_the_wide_model_files_give_its_architecture_and_the_byte_tokenizers_ids(tmp_path):
    bench.write_wide_assets(str(tmp_path))
    args = read_hf_model_args(str(tmp_path))
    for field, value in bench.WIDE.items():
        assert getattr(args, field) == value
    assert args.n_layers == 2

    hf, byte = build_tokenizer(str(tmp_path)), ByteTokenizer()
    # No special-token strings: tokenizers matches them inside text, the byte tokenizer does not
    # (the benchmark's rows are lowercase letters and spaces).
    text = "What is 3 + 4?\n Ünïcode ✓ and\ttabs <|im"
    assert hf.encode(text) == byte.encode(text)
    assert hf.decode(byte.encode(text)) == text
    assert (hf.eos_id, hf.im_start_id, hf.im_end_id) == (byte.eos_id, byte.im_start_id, byte.im_end_id)
    assert hf.vocab_size == 259  # 256 bytes and the three ChatML specials
    row = bench.chat_row(200, random.Random(0))
    assert tokenize_row(row, hf) == tokenize_row(row, byte)


def test_bytes_to_unicode_is_a_printable_bijection():
    table = bench.bytes_to_unicode()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert all(char.isprintable() and not char.isspace() for char in table.values())
    assert table[ord("a")] == "a" and table[ord(" ")] != " "


def test_parse_stat_reads_the_parent_and_the_cpu_ticks_after_an_awkward_name():
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime cutime cstime ...
    line = "4242 (py (x) ) y) S 17 1 1 0 -1 4194304 10 0 0 0 300 40 5 2 20 0 3 0 99 1000 50"
    assert bench.parse_stat(line) == (17, 300 + 40 + 5 + 2)


def test_this_process_cpu_time_from_proc_matches_os_times():
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:  # burn some CPU so the ticks are not all zero
        pass
    times = os.times()
    expected = times.user + times.system + times.children_user + times.children_system
    with open("/proc/self/stat") as f:
        parent, ticks = bench.parse_stat(f.read())
    assert parent == os.getppid()
    assert ticks / os.sysconf("SC_CLK_TCK") == pytest.approx(expected, abs=0.05)
    # The tree below this process holds at least this process.
    assert bench.tree_cpu_seconds(os.getpid()) >= ticks / os.sysconf("SC_CLK_TCK") - 0.05


def test_descendants_walks_the_whole_tree_and_nothing_else():
    parents = {1: 0, 10: 1, 11: 10, 12: 10, 13: 12, 20: 1, 21: 20}
    assert bench.descendants(parents, 10) == {10, 11, 12, 13}
    assert bench.descendants(parents, 13) == {13}
    assert bench.descendants(parents, 1) == set(parents)


def logged_scalars(tokens, seconds, imbalance, world=2):
    """What a run logs when its steps train ``tokens`` in ``seconds``."""
    steps = range(1, len(tokens) + 1)
    return {
        bench.TOKENS_TAG: dict(zip(steps, tokens)),
        bench.TPS_TAG: {s: n / t / world for s, n, t in zip(steps, tokens, seconds)},
        bench.IMBALANCE_TAG: dict(zip(steps, imbalance)),
        bench.LOSS_TAG: {s: 10.0 / s for s in steps},
    }


def test_run_figures_count_the_steps_after_the_warmup_only():
    scalars = logged_scalars([1000, 4000, 3000, 1000], [9.0, 2.0, 1.0, 1.0], [3.0, 1.2, 1.1, 1.0])
    run = bench.SampledRun(scalars, {1: (100.0, 50.0), 4: (104.0, 57.0)})
    figures = bench.run_figures(run, warmup=1, steps=4, world_size=2)
    assert figures["tps"] == pytest.approx((4000 + 3000 + 1000) / (2.0 + 1.0 + 1.0) / 2)
    assert figures["cpu_per_token"] == pytest.approx(7.0 / 8000)
    assert figures["busy_cores"] == pytest.approx(7.0 / 4.0)
    assert figures["imbalance"] == pytest.approx((1.2 + 1.1 + 1.0) / 3)
    assert figures["loss"] == pytest.approx(10.0 / 4)
    del scalars[bench.TPS_TAG][3]
    with pytest.raises(ValueError, match=r"steps \[3\] were not logged"):
        bench.run_figures(run, warmup=1, steps=4)


def test_ratios_are_medians_of_the_rounds_paired_ratios_not_ratios_of_medians():
    runs = {
        "base": [{"tps": 100.0}, {"tps": 200.0}, {"tps": 300.0}],
        "other": [{"tps": 150.0}, {"tps": 180.0}, {"tps": 330.0}],
    }
    stats = bench.medians_and_paired_ratios(runs, "base")
    assert stats["base"]["tps"] == (200.0, 1.0)
    # Round ratios 1.5, 0.9, 1.1: their median is 1.1; the ratio of the medians would be 0.9.
    assert stats["other"]["tps"] == (180.0, pytest.approx(1.1))
    with pytest.raises(ValueError, match="rounds"):
        bench.medians_and_paired_ratios({"base": runs["base"], "short": runs["other"][:2]}, "base")


def test_variant_overrides_set_both_keys():
    assert bench.variant_overrides("on-never") == [
        "--training.balance_dp_compute",
        "true",
        "--parallelism.fsdp_reshard_after_forward",
        "never",
    ]
    assert bench.variant_overrides(bench.BASELINE)[1::2] == ["false", "always"]
    assert len(bench.VARIANTS) == 6 and bench.VARIANTS[0] == bench.BASELINE
    with pytest.raises(ValueError, match="unknown variant"):
        bench.variant_overrides("on-sometimes")


def test_the_compute_timer_counts_nested_regions_once():
    now = [0.0]
    timer = bench.ComputeTimer(clock=lambda: now[0])

    def inner():
        now[0] += 2.0

    def outer():
        now[0] += 1.0
        timer.wrap(inner)()
        now[0] += 3.0

    timer.wrap(outer)()
    now[0] += 100.0  # outside any region
    timer.enter()
    now[0] += 0.5
    timer.exit()
    assert timer.seconds == 6.5

    def fails():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        timer.wrap(fails)()
    assert timer._depth == 0  # an exception leaves the region


def test_the_compute_timer_leaves_excluded_host_work_out():
    now = [0.0]
    timer = bench.ComputeTimer(clock=lambda: now[0])

    def plan():
        now[0] += 4.0

    def forward():
        now[0] += 1.0
        timer.exclude(plan)()
        now[0] += 2.0

    timer.wrap(forward)()
    assert timer.seconds == 3.0
    timer.exclude(plan)()  # outside any region: not compute either way
    assert timer.seconds == 3.0
