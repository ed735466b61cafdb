"""Memory profiling (``[profiling]``): its config checks, the CPU timeline against known
allocations, one 2-rank ``train.py`` run that records two of its steps, and on CUDA the
allocator snapshots.
"""

import json
import logging
import pickle

import pytest
import torch

from test_train import OVERRIDES, RECIPE, _output, train
from torchtitan_rl.config import ConfigManager, write_resolved_config
from torchtitan_rl.config.job_config import Profiling
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.models.qwen3.args import qwen3_flavors
from torchtitan_rl.profiling import MemoryProfiler

STEPS = 4
SNAPSHOT_STEPS = [1, 3]
MiB = 1 << 20


def parse(*argv):
    return ConfigManager().parse_args(list(argv))


# ------------------------------------------------------------------------------- config


def test_defaults_are_off():
    p = parse().profiling
    assert p == Profiling()
    assert p.enable_memory_snapshot is False
    assert p.memory_snapshot_steps == [1]
    assert p.memory_snapshot_max_entries == 100000
    assert p.save_memory_snapshot_folder == "memory_snapshot"


@pytest.mark.parametrize("text", ["[1, 3]", "1,3", "[1,3,]"])
def test_steps_from_cli(text):
    cfg = parse(
        "--training.steps", "5", "--profiling.enable_memory_snapshot", "--profiling.memory_snapshot_steps", text
    )
    assert cfg.profiling.enable_memory_snapshot is True
    assert cfg.profiling.memory_snapshot_steps == [1, 3]


def test_steps_from_toml_and_resolved_config_round_trip(tmp_path):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(
        "[training]\nsteps = 9\n[profiling]\nenable_memory_snapshot = true\nmemory_snapshot_steps = [2, 9]\n"
    )
    cfg = parse("--job.config_file", str(recipe))
    assert cfg.profiling.memory_snapshot_steps == [2, 9]
    resolved = tmp_path / "config.toml"
    write_resolved_config(cfg, str(resolved))
    assert "memory_snapshot_steps = [2, 9]" in resolved.read_text()
    assert parse("--job.config_file", str(resolved)).profiling == cfg.profiling


def test_empty_list_is_fine_while_disabled():
    assert parse("--profiling.memory_snapshot_steps", "[]").profiling.memory_snapshot_steps == []


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--profiling.memory_snapshot_steps", "0"], ["profiling.memory_snapshot_steps", "step 0", "1..10"]),
        (["--profiling.memory_snapshot_steps", "[2, 11]"], ["profiling.memory_snapshot_steps", "step 11", "1..10"]),
        (["--profiling.memory_snapshot_steps", "-1"], ["profiling.memory_snapshot_steps", "step -1"]),
        (
            ["--profiling.memory_snapshot_steps", "[3, 2, 3]"],
            ["profiling.memory_snapshot_steps", "step 3", "more than once"],
        ),
        (
            ["--profiling.enable_memory_snapshot", "--profiling.memory_snapshot_steps", "[]"],
            ["profiling.memory_snapshot_steps", "empty", "profiling.enable_memory_snapshot"],
        ),
        (["--profiling.memory_snapshot_steps", "[1, x]"], ["profiling.memory_snapshot_steps", "expected int", "'x'"]),
        (["--profiling.memory_snapshot_max_entries", "0"], ["profiling.memory_snapshot_max_entries", ">= 1"]),
        (
            ["--profiling.memory_snapshot_step", "1"],
            ["profiling.memory_snapshot_step'", "'profiling.memory_snapshot_steps'"],
        ),
    ],
)
def test_bad_values_name_the_key(argv, fragments):
    with pytest.raises(ValueError) as info:
        parse("--training.steps", "10", *argv)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_toml_list_of_bools_is_rejected(tmp_path):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text("[profiling]\nmemory_snapshot_steps = [true]\n")
    with pytest.raises(ValueError, match=r"profiling\.memory_snapshot_steps: expected int, got True"):
        parse("--job.config_file", str(recipe))


def test_help_documents_the_section():
    text = ConfigManager().format_help()
    assert "[profiling] Memory profiling" in text
    assert "--profiling.memory_snapshot_steps  list[int] = [1]" in text
    assert "--profiling.memory_snapshot_max_entries  int = 100000  (must be >= 1)" in text
    assert "allocator snapshot" in text


# ------------------------------------------------------------------ CPU timeline, in process


def _single_rank_profiler(tmp_path, enable=True, **overrides) -> MemoryProfiler:
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, world_size=1)
    dims.build_meshes("cpu")  # every dim has size 1: no process group is needed
    config = Profiling(enable_memory_snapshot=enable, **overrides)
    return MemoryProfiler(config, str(tmp_path), dims, 0, torch.device("cpu"))


def test_cpu_timeline_of_known_allocations(tmp_path):
    profiler = _single_rank_profiler(tmp_path, memory_snapshot_steps=[2])
    before = torch.ones(MiB, dtype=torch.uint8)
    with profiler.step(1):
        torch.ones(8 * MiB, dtype=torch.uint8)
    with profiler.step(2):
        kept = torch.empty(MiB, dtype=torch.uint8)
        temporary = torch.empty(4 * MiB, dtype=torch.uint8)
        del temporary, before  # memory from before the step is freed, but is not counted
    assert kept.numel() == MiB
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert files == ["memory_snapshot/step_2/rank0_dp0_cp0_tp0_memory_timeline.json"]
    timeline = json.loads((tmp_path / files[0]).read_text())
    assert timeline["device"] == "cpu"
    assert timeline["allocated_bytes"] == [MiB, 5 * MiB, MiB]
    assert timeline["peak_allocated_bytes"] == 5 * MiB
    assert timeline["allocated_bytes_at_end"] == MiB
    times = timeline["time_ns"]
    assert 0 <= times[0] <= times[1] <= times[2]


def test_disabled_profiler_writes_nothing(tmp_path):
    profiler = _single_rank_profiler(tmp_path, enable=False)
    with profiler.step(1):
        torch.ones(MiB)
    assert not any(tmp_path.iterdir())


def test_write_failure_is_a_warning_naming_the_path(tmp_path, caplog):
    (tmp_path / "memory_snapshot").write_text("a file where the folder should be")
    profiler = _single_rank_profiler(tmp_path)
    with caplog.at_level(logging.WARNING, logger="torchtitan_rl.profiling"):
        with profiler.step(1):
            torch.ones(MiB)
    path = profiler.path(1)
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    message = caplog.records[0].getMessage()
    assert f"could not write memory profile {path}" in message
    assert "Error" in message  # the exception type: the reason, not just the symptom


# --------------------------------------------------------------- train.py, 2 ranks (cp=2) on CPU


def _param_bytes_fp32(flavor: str) -> int:
    """Parameter bytes of the whole model, from its hyper-parameters (Qwen3 layout)."""
    a = qwen3_flavors[flavor]
    attention = a.dim * a.head_dim * (2 * a.n_heads + 2 * a.n_kv_heads) + 2 * a.head_dim
    layer = attention + 3 * a.dim * a.hidden_dim + 2 * a.dim
    embeddings = a.vocab_size * a.dim * (1 if a.tie_embeddings else 2)
    return 4 * (embeddings + a.n_layers * layer + a.dim)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    dump = tmp_path_factory.mktemp("memory_snapshot_run")
    # Later overrides win: the shared ones, with fewer steps.
    argv = [
        "--job.config_file",
        RECIPE,
        *OVERRIDES,
        "--training.steps",
        str(STEPS),
        "--job.dump_folder",
        str(dump),
        "--profiling.enable_memory_snapshot",
        "true",
        "--profiling.memory_snapshot_steps",
        str(SNAPSHOT_STEPS),
        # Context parallel over the 2 ranks: the file names must carry the CP coordinate.
        "--parallelism.context_parallel_degree",
        "2",
    ]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", "")  # the CPU path, also on a GPU machine
        proc = train(argv, nproc=2)
    assert proc.returncode == 0, _output(proc)
    return dump, proc


def test_exactly_one_timeline_per_listed_step_and_rank(cpu_run):
    dump, _ = cpu_run
    files = sorted(
        p.relative_to(dump / "memory_snapshot").as_posix() for p in (dump / "memory_snapshot").rglob("*") if p.is_file()
    )
    assert files == [
        f"step_{step}/rank{rank}_dp0_cp{rank}_tp0_memory_timeline.json" for step in SNAPSHOT_STEPS for rank in (0, 1)
    ]


def test_log_names_every_file_and_says_what_cpu_writes(cpu_run):
    dump, proc = cpu_run
    log = proc.stdout + proc.stderr
    assert log.count("memory snapshots need the CUDA caching allocator") == 1, _output(proc)
    assert "WARNING torchtitan_rl.profiling" not in log, _output(proc)
    for step in SNAPSHOT_STEPS:
        for rank in (0, 1):
            path = dump / "memory_snapshot" / f"step_{step}" / f"rank{rank}_dp0_cp{rank}_tp0_memory_timeline.json"
            assert f"rank {rank}: wrote memory profile {path}" in log, _output(proc)


@pytest.mark.parametrize("step", SNAPSHOT_STEPS)
@pytest.mark.parametrize("rank", [0, 1])
def test_timeline_holds_the_step_memory(cpu_run, step, rank):
    dump, _ = cpu_run
    path = dump / "memory_snapshot" / f"step_{step}" / f"rank{rank}_dp0_cp{rank}_tp0_memory_timeline.json"
    timeline = json.loads(path.read_text())
    times, sizes = timeline["time_ns"], timeline["allocated_bytes"]
    assert len(times) == len(sizes) > 100
    assert times[0] >= 0 and all(a <= b for a, b in zip(times, times[1:]))
    assert min(sizes) >= 0
    assert timeline["peak_allocated_bytes"] == max(sizes)
    assert timeline["allocated_bytes_at_end"] == sizes[-1]
    params = _param_bytes_fp32("debugmodel")
    # A step all-gathers every layer's parameters and builds gradients and activations: more
    # than the whole model's fp32 weights at its peak, though each rank holds half of them.
    assert timeline["peak_allocated_bytes"] > params
    if step == 1:
        # AdamW creates its two moments for this rank's half of the parameters in step 1, and
        # they outlive it.
        assert timeline["allocated_bytes_at_end"] >= 2 * (params // 2)


# -------------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_snapshots_are_loadable_pickles(tmp_path):
    argv = [
        "--job.config_file",
        RECIPE,
        *OVERRIDES,
        "--training.steps",
        "3",
        "--job.dump_folder",
        str(tmp_path),
        "--profiling.enable_memory_snapshot",
        "--profiling.memory_snapshot_steps",
        "[2, 3]",
    ]
    proc = train(argv)
    assert proc.returncode == 0, _output(proc)
    folder = tmp_path / "memory_snapshot"
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert files == [f"step_{step}/rank0_dp0_cp0_tp0_memory_snapshot.pickle" for step in (2, 3)]
    for name in files:
        with open(folder / name, "rb") as f:
            snapshot = pickle.load(f)
        assert snapshot["segments"], name  # the parameters live on the GPU
        actions = {event["action"] for trace in snapshot["device_traces"] for event in trace}
        assert {"alloc", "free_completed"} <= actions, (name, actions)
