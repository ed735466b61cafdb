"""``scripts/loss_compare.py`` end to end, and through it the project's promise: for each
layout-invariant reduction mode the loss curve of dp=1, dp=2, and dp=2 with gradient
accumulation (several micro-batches per rank) agree within 1e-4 over 10 steps.

Each (mode, layout) trains once: the tool's run-both mode produces dp=1 (baseline) and
dp=2 + small budget (test) of a mode, a direct launch adds dp=2; the other pairs are
compared with the tool's folder mode. Every verdict of the tool is checked against the
numbers read back independently with ``read_scalars``. The tool must also fail: exit 1 on a
real difference (token_mean_legacy with a small budget, shuffled or shortened curves),
exit 2 on a missing or empty folder and on a training run that fails. Tensor parallel
(dp=2 x tp=2) and context parallel (dp=2 x cp=2) curves must equal dp=2.
"""

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from reference import launch_env
from torchtitan_rl.tensorboard_io import read_scalars

REPO = Path(__file__).resolve().parents[2]
TOOL = str(REPO / "scripts" / "loss_compare.py")
TRAIN = str(REPO / "train.py")
RECIPE = str(REPO / "train_configs" / "debug_model.toml")
STEPS = 10
RTOL = 1e-4
SEQ_LEN = 64
GLOBAL_BATCH = 8
BUDGET = 64  # tokens per micro-batch: ~150 tokens per rank on 2 ranks -> >= 3 micro-batches
LOSS, GRAD_NORM = "loss_metrics/global_avg_loss", "grad_norm"
MODES = ["token_mean", "sequence_mean", "seq_mean_token_sum_norm"]
COMMON = (
    f"--training.global_batch_size {GLOBAL_BATCH} --training.seq_len {SEQ_LEN} --training.max_tokens_per_microbatch 0"
)
GA = f"--training.max_tokens_per_microbatch {BUDGET}"


def tool(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python scripts/loss_compare.py ARGS`` from the repository root, as a user runs it."""
    return subprocess.run(
        [sys.executable, TOOL, *args], cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=timeout
    )


def train(nproc: int, dump: Path, options: str) -> None:
    """The same launch the tool makes, for a run that is compared only in folder mode."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        TRAIN,
        "--job.config_file",
        RECIPE,
        *options.split(),
        "--training.steps",
        str(STEPS),
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "true",
        "--job.dump_folder",
        str(dump),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def _output(proc: subprocess.CompletedProcess) -> str:
    return f"--- exit {proc.returncode}\n--- stdout\n{proc.stdout[-5000:]}\n--- stderr\n{proc.stderr[-5000:]}"


def max_rel_diff(a: dict[int, float], b: dict[int, float]) -> float:
    assert sorted(a) == sorted(b)
    return max(abs(b[s] - a[s]) / abs(a[s]) for s in a)


@dataclasses.dataclass
class ModeRuns:
    folders: dict[str, Path]  # layout -> dump folder
    run_both: subprocess.CompletedProcess  # the tool's run-both mode: dp1 vs dp2_ga
    scalars: dict[str, dict]  # layout -> read_scalars of its tb folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, ModeRuns]:
    out = tmp_path_factory.mktemp("loss_compare")
    result = {}
    for mode in MODES:
        common = f"{COMMON} --loss.reduction {mode}"
        run_both = tool(
            "--config",
            RECIPE,
            "--steps",
            str(STEPS),
            "--rtol",
            str(RTOL),
            "--output-folder",
            str(out / mode),
            "--options",
            common,
            "--baseline-ngpu",
            "1",
            "--baseline-options",
            "--parallelism.data_parallel_shard_degree 1",
            "--test-ngpu",
            "2",
            "--test-options",
            GA,
        )
        folders = {"dp1": out / mode / "baseline", "dp2_ga": out / mode / "test", "dp2": out / f"{mode}_dp2"}
        # A failed run-both leaves no curves to compare; the tests below then fail on this output.
        if (folders["dp2_ga"] / "tb").is_dir():
            train(2, folders["dp2"], common)
        scalars = {}
        for layout, folder in folders.items():
            try:
                scalars[layout] = read_scalars(str(folder / "tb"))
            except ValueError:
                pass
        result[mode] = ModeRuns(folders, run_both, scalars)
    return result


@pytest.fixture(scope="module")
def legacy_run(tmp_path_factory) -> Path:
    """token_mean_legacy on one rank with the small budget: a layout-dependent loss."""
    dump = tmp_path_factory.mktemp("legacy") / "dp1_ga_legacy"
    train(1, dump, f"{COMMON} {GA} --loss.reduction token_mean_legacy")
    return dump


@pytest.fixture(scope="module")
def tensor_parallel_run(tmp_path_factory) -> Path:
    """token_mean on 4 ranks: dp=2 x tp=2 (sequence parallel, vocab-parallel loss)."""
    dump = tmp_path_factory.mktemp("tp") / "dp2_tp2"
    train(4, dump, f"{COMMON} --loss.reduction token_mean --parallelism.tensor_parallel_degree 2")
    return dump


# sequence_mean: the mode whose per-sequence normalizer a CP rank cannot know from its own chunks.
CP_MODES = ["sequence_mean"]


@pytest.fixture(scope="module")
def context_parallel_runs(tmp_path_factory) -> dict[str, Path]:
    """4 ranks, dp=2 x cp=2: every sequence split over two ranks (zigzag, CP-local loss)."""
    folders = {}
    for mode in CP_MODES:
        folders[mode] = tmp_path_factory.mktemp("cp") / f"dp2_cp2_{mode}"
        train(4, folders[mode], f"{COMMON} --loss.reduction {mode} --parallelism.context_parallel_degree 2")
    return folders


# ---------------------------------------------------------------- the promise holds


@pytest.mark.parametrize("mode", CP_MODES)
def test_context_parallel_curve_equals_data_parallel(runs, context_parallel_runs, mode):
    folder = context_parallel_runs[mode]
    base = runs[mode].folders["dp2"]
    proc = tool("--baseline-folder", str(base), "--test-folder", str(folder), "--rtol", str(RTOL))
    assert proc.returncode == 0, _output(proc)
    assert "context_parallel_degree = 2" in (folder / "config.toml").read_text()
    cp = read_scalars(str(folder / "tb"))
    dp = runs[mode].scalars["dp2"]
    for tag in (LOSS, GRAD_NORM, "loss_metrics/global_max_loss"):
        assert max_rel_diff(dp[tag], cp[tag]) <= RTOL, tag
    # Counts come from whole sequences: no CP factor, no CP padding.
    assert cp["tokens/loss_tokens"] == dp["tokens/loss_tokens"]
    assert cp["tokens/total"] == dp["tokens/total"]


def test_tensor_parallel_curve_equals_data_parallel(runs, tensor_parallel_run):
    base = runs["token_mean"].folders["dp2"]
    proc = tool("--baseline-folder", str(base), "--test-folder", str(tensor_parallel_run), "--rtol", str(RTOL))
    assert proc.returncode == 0, _output(proc)
    assert "tensor_parallel_degree = 2" in (tensor_parallel_run / "config.toml").read_text()
    tp = read_scalars(str(tensor_parallel_run / "tb"))
    dp = runs["token_mean"].scalars["dp2"]
    assert max_rel_diff(dp[LOSS], tp[LOSS]) <= RTOL
    assert max_rel_diff(dp[GRAD_NORM], tp[GRAD_NORM]) <= RTOL
    assert tp["tokens/loss_tokens"] == dp["tokens/loss_tokens"]
    assert tp["tokens/total"] == dp["tokens/total"]  # sequence-parallel padding is not counted


@pytest.mark.parametrize("mode", MODES)
def test_run_both_mode_passes(runs, mode):
    proc = runs[mode].run_both
    assert proc.returncode == 0, _output(proc)
    assert f"PASS: {STEPS} steps agree" in proc.stdout
    for name in ("baseline", "test"):
        folder = runs[mode].folders["dp1" if name == "baseline" else "dp2_ga"]
        assert (folder / "config.toml").is_file() and (folder / "train.log").is_file()
        assert f"step: {STEPS}" in (folder / "train.log").read_text()
    # The table lists every step with both values.
    table = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] == [str(STEPS)]]
    assert len(table) == 1 and len(table[0]) == 7, proc.stdout


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pair", [("dp1", "dp2"), ("dp2", "dp2_ga"), ("dp1", "dp2_ga")], ids="-vs-".join)
def test_folder_mode_passes_and_numbers_agree(runs, mode, pair):
    base, test = (runs[mode].folders[p] for p in pair)
    proc = tool("--baseline-folder", str(base), "--test-folder", str(test), "--rtol", str(RTOL))
    assert proc.returncode == 0, _output(proc)
    assert f"PASS: {STEPS} steps agree" in proc.stdout
    # Independently of the tool:
    a, b = (runs[mode].scalars[p] for p in pair)
    for tag in (LOSS, GRAD_NORM, "loss_metrics/global_max_loss"):
        assert sorted(a[tag]) == list(range(1, STEPS + 1))
        assert max_rel_diff(a[tag], b[tag]) <= RTOL, tag
    assert a["tokens/loss_tokens"] == b["tokens/loss_tokens"]
    assert a["tokens/total"] == b["tokens/total"]


@pytest.mark.parametrize("mode", MODES)
def test_layouts_are_really_different(runs, mode):
    """dp2_ga holds > BUDGET tokens per rank per step, so it accumulates micro-batches, and
    the 2-rank runs really ran on 2 ranks."""
    totals = runs[mode].scalars["dp2_ga"]["tokens/total"]
    assert min(totals.values()) / 2 > 2 * BUDGET, totals
    for layout, ranks in (("dp1", 1), ("dp2", 2), ("dp2_ga", 2)):
        log = (runs[mode].folders[layout] / "train.log").read_text() if layout != "dp2" else None
        if log is not None:
            assert f"training steps 1..{STEPS} on {ranks} rank(s)" in log
        config = (runs[mode].folders[layout] / "config.toml").read_text()
        assert f'reduction = "{mode}"' in config
        assert f"max_tokens_per_microbatch = {BUDGET if layout == 'dp2_ga' else 0}" in config


def test_modes_are_really_different(runs):
    """The reductions took effect: same data and weights at step 1, different normalization.

    Step 1 sums the same token losses S: token_mean logs S / N and seq_mean_token_sum_norm
    logs S / (L * B), with N the loss tokens, L = seq_len and B = 8 sequences.
    """
    first = {mode: runs[mode].scalars["dp1"] for mode in MODES}
    n = first["token_mean"]["tokens/loss_tokens"][1]
    assert first["token_mean"]["data/num_without_loss_tokens"][1] == 0  # so B = GLOBAL_BATCH
    s = first["token_mean"][LOSS][1] * n
    assert first["seq_mean_token_sum_norm"][LOSS][1] == pytest.approx(s / (SEQ_LEN * GLOBAL_BATCH), rel=1e-5)
    # sequence_mean weighs tokens by 1 / (n_i * B): close to token_mean here (similar n_i) but
    # clearly further apart than the 1e-4 the layouts are held to.
    assert max_rel_diff(first["token_mean"][LOSS], first["sequence_mean"][LOSS]) > 3 * RTOL
    assert first["sequence_mean"]["tokens/loss_tokens"] == first["token_mean"]["tokens/loss_tokens"]


# --------------------------------------------------------------- and the tool fails


def test_fails_on_token_mean_legacy_with_small_budget(runs, legacy_run):
    base = runs["token_mean"].folders["dp1"]
    proc = tool("--baseline-folder", str(base), "--test-folder", str(legacy_run))
    assert proc.returncode == 1, _output(proc)
    assert "FAIL" in proc.stdout and "PASS" not in proc.stdout
    # The difference is real, not the tool's:
    a, b = runs["token_mean"].scalars["dp1"], read_scalars(str(legacy_run / "tb"))
    assert max_rel_diff(a[LOSS], b[LOSS]) > 1e-3
    assert a["tokens/loss_tokens"] == b["tokens/loss_tokens"]  # same data, other normalization


def _write_curve(folder: Path, curve: dict[int, float]) -> Path:
    with SummaryWriter(str(folder / "tb")) as writer:
        for step, value in curve.items():
            writer.add_scalar(LOSS, value, step)
            writer.add_scalar(GRAD_NORM, 1.0 + value / 10, step)
    return folder


def test_fails_on_a_small_difference_and_passes_within_rtol(tmp_path):
    curve = {s: 5.0 - 0.3 * s for s in range(1, 6)}
    base = _write_curve(tmp_path / "base", curve)
    close = _write_curve(tmp_path / "close", {s: v * (1 + 3e-5) for s, v in curve.items()})
    off = _write_curve(tmp_path / "off", {s: v * (1 + 1e-3) if s == 4 else v for s, v in curve.items()})
    proc = tool("--baseline-folder", str(base), "--test-folder", str(close))
    assert proc.returncode == 0, _output(proc)
    proc = tool("--baseline-folder", str(base), "--test-folder", str(close), "--rtol", "1e-5")
    assert proc.returncode == 1, _output(proc)
    proc = tool("--baseline-folder", str(base), "--test-folder", str(off))
    assert proc.returncode == 1, _output(proc)
    assert "[4]" in proc.stdout  # names the failing step


def test_fails_on_different_step_sets(tmp_path):
    curve = {s: 5.0 - 0.3 * s for s in range(1, 6)}
    base = _write_curve(tmp_path / "base", curve)
    short = _write_curve(tmp_path / "short", {s: v for s, v in curve.items() if s != 5})
    proc = tool("--baseline-folder", str(base), "--test-folder", str(short))
    assert proc.returncode == 1, _output(proc)
    assert "different steps" in proc.stdout and "only baseline [5]" in proc.stdout


def test_fails_on_nan(tmp_path):
    curve = {s: 5.0 - 0.3 * s for s in range(1, 4)}
    base = _write_curve(tmp_path / "base", curve)
    nan = _write_curve(tmp_path / "nan", {**curve, 2: math.nan})
    proc = tool("--baseline-folder", str(base), "--test-folder", str(nan))
    assert proc.returncode == 1, _output(proc)


def test_missing_folder_is_trouble(runs, tmp_path):
    missing = tmp_path / "does_not_exist"
    proc = tool("--baseline-folder", str(runs["token_mean"].folders["dp1"]), "--test-folder", str(missing))
    assert proc.returncode == 2, _output(proc)
    assert f"folder '{missing}' does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_empty_folder_is_trouble(runs, tmp_path):
    empty = tmp_path / "empty"
    (empty / "tb").mkdir(parents=True)
    proc = tool("--baseline-folder", str(empty), "--test-folder", str(runs["token_mean"].folders["dp1"]))
    assert proc.returncode == 2, _output(proc)
    assert "no TensorBoard event files" in proc.stderr and str(empty) in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_tag_is_trouble(tmp_path):
    base = _write_curve(tmp_path / "base", {1: 1.0})
    proc = tool("--baseline-folder", str(base), "--test-folder", str(base), "--tags", "no/such_tag")
    assert proc.returncode == 2, _output(proc)
    assert "no/such_tag" in proc.stderr


def test_failed_run_is_trouble_with_log_tail(tmp_path):
    # A stale run of an earlier comparison (it has the tool's train.log) is replaced, not mixed in.
    stale = _write_curve(tmp_path / "out" / "baseline", {s: 1.0 for s in range(1, 50)})
    (stale / "train.log").write_text("STALE LOG\n")
    proc = tool(
        "--config",
        RECIPE,
        "--steps",
        "2",
        "--output-folder",
        str(tmp_path / "out"),
        "--baseline-options",
        "--training.no_such_key 1",
    )
    assert proc.returncode == 2, _output(proc)
    assert "baseline run failed" in proc.stderr
    # The tail of the run's log shows the cause, and the log is kept in the dump folder.
    assert "unknown config key 'training.no_such_key'" in proc.stderr
    assert (tmp_path / "out" / "baseline" / "train.log").is_file()
    assert "STALE LOG" not in (tmp_path / "out" / "baseline" / "train.log").read_text()
    assert not (tmp_path / "out" / "baseline" / "tb").exists()
    assert not (tmp_path / "out" / "test").exists()  # the test run never started


def test_foreign_output_folder_is_never_deleted(tmp_path):
    """Only folders the tool wrote (see the test above) are replaced."""
    out = tmp_path / "out"
    stale = _write_curve(out / "baseline", {s: 1.0 for s in range(1, 50)})
    (stale / "notes.txt").write_text("mine")
    proc = tool("--config", RECIPE, "--steps", "2", "--output-folder", str(out))
    assert proc.returncode == 2, _output(proc)
    assert "did not write" in proc.stderr and (stale / "notes.txt").is_file()


# ------------------------------------------------------------- read_scalars itself


def test_read_scalars_newest_value_wins(tmp_path):
    tb = tmp_path / "tb"
    with SummaryWriter(str(tb), filename_suffix=".a") as w:
        for step in (1, 2, 3):
            w.add_scalar("x", float(step), step, walltime=1000.0 + step)
    with SummaryWriter(str(tb / "restart"), filename_suffix=".b") as w:  # a later run, in a sub-folder
        for step in (2, 3, 4):
            w.add_scalar("x", 10.0 * step, step, walltime=2000.0 + step)
    assert read_scalars(str(tb)) == {"x": {1: 1.0, 2: 20.0, 3: 30.0, 4: 40.0}}


def test_read_scalars_keeps_every_step_and_errors_clearly(tmp_path):
    tb = tmp_path / "tb"
    with SummaryWriter(str(tb)) as w:
        for step in range(1, 12001):  # more than EventAccumulator's default sample of 10000
            w.add_scalar("y", step / 3, step)
    y = read_scalars(str(tb))["y"]
    assert len(y) == 12000 and y[12000] == pytest.approx(4000.0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no TensorBoard event files"):
        read_scalars(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="does not exist"):
        read_scalars(str(tmp_path / "nope"))
