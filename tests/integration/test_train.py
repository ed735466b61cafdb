"""End to end through ``train.py``: the debug recipe gives the same loss curve on 1 and 2
ranks (read back from TensorBoard), it learns, its resolved config reloads, and bad input
fails with exit status 2 and a message that names the cause.

Launches are shared through module-scoped fixtures (each costs seconds on CPU): one
single-process run, one 2-rank torchrun run, and the bad inputs that need several ranks,
launched two at a time; the single-process bad inputs run in this process (``train.main``).
"""

import concurrent.futures
import dataclasses
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from reference import launch_env, train_in_process
from torchtitan_rl.config import ConfigManager, config_to_dict
from torchtitan_rl.tensorboard_io import read_scalars

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "train.py")
RECIPE = str(REPO / "train_configs" / "debug_model.toml")
STEPS = 10
RTOL = 1e-4
# The debug recipe, shrunk to seconds: 8 sequences of <= 64 tokens per step (~300 tokens),
# packed into micro-batches of <= 128 tokens, so both layouts accumulate several micro-batches.
# A small entropy bonus runs the loss-term path and its rl/* tags end to end.
ENTROPY_COEF = 0.01
OVERRIDES = [
    "--training.steps",
    str(STEPS),
    "--training.global_batch_size",
    "8",
    "--training.seq_len",
    "64",
    "--training.max_tokens_per_microbatch",
    "128",
    "--metrics.log_freq",
    "1",
    "--loss.entropy_coef",
    str(ENTROPY_COEF),
]


def train(args: list[str], nproc: int | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python train.py ARGS`` (one process, no process group) or torchrun with ``nproc`` ranks."""
    launcher = (
        [sys.executable]
        if nproc is None
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    )
    return subprocess.run(
        [*launcher, TRAIN, *args], cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=timeout
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_ranks(args: list[str], world_size: int, timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """Start ``world_size`` ``python train.py`` ranks with torchrun's environment protocol.

    Used for errors that need a real world size: unlike torchrun, which reports its own
    status 1 when a child fails, this shows the exit status of every rank.
    """
    port = _free_port()
    procs = []
    for rank in range(world_size):
        env = dict(
            launch_env(),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, TRAIN, *args],
                cwd=REPO,
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def _output(proc: subprocess.CompletedProcess) -> str:
    return f"--- exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"


# ------------------------------------------------------------------ 1 rank vs 2 ranks


@dataclasses.dataclass
class Run:
    argv: list[str]
    dump: Path
    proc: subprocess.CompletedProcess
    scalars: dict


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, Run]:
    out = tmp_path_factory.mktemp("train")
    result = {}
    for world_size in (1, 2):
        dump = out / f"ranks{world_size}"
        argv = ["--job.config_file", RECIPE, *OVERRIDES, "--job.dump_folder", str(dump)]
        # The reference is a plain single process (no process group at all).
        proc = train(argv, nproc=None if world_size == 1 else world_size)
        assert proc.returncode == 0, _output(proc)
        result[world_size] = Run(argv, dump, proc, read_scalars(str(dump / "tb")))
    return result


def test_two_ranks_really_ran_data_parallel(runs):
    log = runs[2].proc.stdout + runs[2].proc.stderr
    assert f"training steps 1..{STEPS} on 2 rank(s)" in log, _output(runs[2].proc)
    log = runs[1].proc.stdout + runs[1].proc.stderr
    assert f"training steps 1..{STEPS} on 1 rank(s)" in log, _output(runs[1].proc)


@pytest.mark.parametrize(
    "tag", ["loss_metrics/global_avg_loss", "loss_metrics/global_max_loss", "grad_norm", "rl/pg_loss", "rl/entropy"]
)
def test_two_ranks_match_one_rank(runs, tag):
    one, two = runs[1].scalars[tag], runs[2].scalars[tag]
    assert sorted(one) == sorted(two) == list(range(1, STEPS + 1))
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=RTOL), (tag, step, one[step], two[step])


@pytest.mark.parametrize("tag", ["tokens/loss_tokens", "tokens/total", "lr", "data/num_samples"])
def test_counts_and_schedule_identical(runs, tag):
    one, two = runs[1].scalars[tag], runs[2].scalars[tag]
    assert sorted(one) == list(range(1, STEPS + 1))
    assert one == two


def test_dp_compute_balancing_is_on_and_logged_every_step(runs):
    """Balancing is the default: every logged step has its imbalance, no worse than the contiguous split's."""
    two, one = runs[2].scalars, runs[1].scalars
    assert sorted(two["data/dp_cost_imbalance"]) == list(range(1, STEPS + 1))
    for step, value in two["data/dp_cost_imbalance"].items():
        assert value == two["data/dp_cost_imbalance_balanced"][step] <= two["data/dp_cost_imbalance_contiguous"][step]
        assert one["data/dp_cost_imbalance"][step] == 1.0
    assert any(v < two["data/dp_cost_imbalance_contiguous"][s] for s, v in two["data/dp_cost_imbalance"].items())


def test_micro_batches_are_accumulated(runs):
    """The budget really splits each rank's share: > 128 tokens per rank on 2 ranks."""
    totals = runs[2].scalars["tokens/total"]
    assert min(totals.values()) / 2 > 128, totals
    assert all(v > 0 for v in runs[1].scalars["tokens/loss_tokens"].values())


def test_entropy_bonus_is_in_the_logged_loss(runs):
    """loss = cross-entropy - entropy_coef * entropy, both weighted like the loss; no other rl/* tag."""
    tb = runs[2].scalars
    assert {t for t in tb if t.startswith("rl/")} == {"rl/pg_loss", "rl/entropy"}
    for step, loss in tb["loss_metrics/global_avg_loss"].items():
        assert loss == pytest.approx(tb["rl/pg_loss"][step] - ENTROPY_COEF * tb["rl/entropy"][step], rel=1e-5)
        # A per-token mean entropy of a 512-token vocabulary: between 0 and log(512).
        assert 0 < tb["rl/entropy"][step] < 6.24


def test_model_learns(runs):
    loss = runs[1].scalars["loss_metrics/global_avg_loss"]
    assert all(0 < v < 20 for v in loss.values()), loss
    assert loss[STEPS] < 0.8 * loss[1], loss
    assert loss[STEPS] < min(loss[s] for s in (1, 2, 3)), loss


def test_stdout_line_matches_tensorboard(runs):
    """The logged line and TensorBoard show the same loss and grad norm."""
    log = runs[2].proc.stdout + runs[2].proc.stderr
    lines = re.findall(r"step: (\d+)\s+loss: ([\d.]+)\s+max_loss: [\d.]+\s+grad_norm: ([\d.]+)", log)
    assert [int(s) for s, _, _ in lines] == list(range(1, STEPS + 1)), log[-3000:]
    tb = runs[2].scalars
    for step, loss, grad_norm in lines:
        assert float(loss) == pytest.approx(tb["loss_metrics/global_avg_loss"][int(step)], abs=1e-5)
        assert float(grad_norm) == pytest.approx(tb["grad_norm"][int(step)], abs=1e-4)


@pytest.mark.parametrize("world_size", [1, 2])
def test_resolved_config_reloads(runs, world_size):
    run = runs[world_size]
    path = run.dump / "config.toml"
    assert path.is_file()
    reloaded = ConfigManager().parse_args(["--job.config_file", str(path)])
    original = ConfigManager().parse_args(run.argv)
    assert reloaded.job.config_file == str(path)
    assert original.job.config_file == RECIPE
    # Every value but the file it came from is the same as the run's.
    got, want = config_to_dict(reloaded), config_to_dict(original)
    got["job"].pop("config_file")
    want["job"].pop("config_file")
    assert got == want
    # ...and the overrides are in it, not the recipe's values.
    assert reloaded.training.steps == STEPS
    assert reloaded.training.global_batch_size == 8
    assert reloaded.training.seq_len == 64
    assert reloaded.training.max_tokens_per_microbatch == 128
    assert reloaded.metrics.log_freq == 1
    assert reloaded.loss.entropy_coef == ENTROPY_COEF
    assert reloaded.job.dump_folder == str(run.dump)
    # ...and the recipe's values where nothing overrode them.
    assert reloaded.optimizer.lr == 3e-3
    assert reloaded.lr_scheduler.decay_type == "cosine"
    assert reloaded.parallelism.data_parallel_shard_degree == -1


# ------------------------------------------------------------------------ bad input


def _malformed_jsonl(folder: Path) -> Path:
    path = folder / "broken.jsonl"
    good = '{"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]}'
    path.write_text(good + "\n" + '{"messages": [{"role": "user", "content": "2+2?"' + "\n" + good + "\n")
    return path


GRPO = ["--job.recipe", "grpo", "--loss.loss_fn", "ppo", "--rl.sft_warmup_steps", "0"]
# name -> (world size (None: plain single process), extra args, substrings of the message)
BAD_INPUT = {
    "replicate_not_dividing_world": (
        2,
        ["--parallelism.data_parallel_replicate_degree", "3"],
        ["world size 2", "not divisible", "replicate", "3"],
    ),
    "shard_not_matching_world": (
        None,
        ["--parallelism.data_parallel_shard_degree", "3"],
        ["parallelism.data_parallel_shard_degree (3)", "does not equal the world size 1"],
    ),
    "global_batch_not_divisible": (
        2,
        ["--training.global_batch_size", "3"],
        ["training.global_batch_size=3", "not divisible", "data-parallel degree 2"],
    ),
    "missing_dataset": (
        None,
        ["--training.dataset_path", "/nonexistent.jsonl"],
        ["training.dataset_path='/nonexistent.jsonl'", "does not exist"],
    ),
    # Two ranks: rank 1 waits for local rank 0 to prepare the file, and reports what it found.
    "malformed_jsonl": (2, ["--training.dataset_path", "{malformed}"], ["malformed JSON", "{malformed}", "line 2"]),
    # An OS error on a configured path (here a cache directory that is a file) names the key.
    "cache_dir_is_a_file": (
        None,
        ["--training.dataset_path", "{malformed}", "--training.dataset_cache_dir", "{malformed}"],
        ["training.dataset_cache_dir = '{malformed}'", "{malformed}"],
    ),
    "context_parallel_not_dividing_world": (
        2,
        ["--parallelism.context_parallel_degree", "3"],
        ["world size 2", "not divisible", "parallelism.context_parallel_degree (3)"],
    ),
    "unknown_key": (
        None,
        ["--training.lr", "0.1"],
        ["unknown config key 'training.lr'", "did you mean 'optimizer.lr'"],
    ),
    "misspelled_key": (None, ["--training.step", "5"], ["unknown config key 'training.step'", "'training.steps'"]),
    "rl_loss_in_sft": (2, ["--loss.loss_fn", "ppo"], ["loss.loss_fn: 'ppo' needs advantages and sampler log-probs"]),
    "clip_low_at_one": (None, ["--loss.loss_fn", "ppo", "--loss.clip_low", "1"], ["loss.clip_low: must be in [0, 1)"]),
    "clip_for_cross_entropy": (
        None,
        ["--loss.clip_high", "0.28"],
        ["loss.clip_high: not an option of loss_fn 'cross_entropy'"],
    ),
    # GRPO
    "grpo_prompts_not_divisible": (
        2,
        [*GRPO, "--rl.prompts_per_step", "3"],
        ["rl.prompts_per_step=3", "not divisible by the data-parallel degree 2"],
    ),
    "grpo_unknown_stop_token": (
        None,
        [*GRPO, "--generation.stop_tokens", "<|nope|>"],
        ["generation.stop_tokens: '<|nope|>' is not a special token"],
    ),
    "grpo_malformed_jsonl": (
        None,
        [*GRPO, "--rl.task", "dataset", "--rl.task_path", "{malformed}"],
        ["malformed JSON", "{malformed}", "at line 2"],
    ),
    "grpo_prompt_longer_than_seq_len": (
        None,
        [*GRPO, "--training.seq_len", "16"],
        ["arithmetic train #0", "does not fit training.seq_len=16"],
    ),
}
CONFIG_ERRORS = {"unknown_key", "misspelled_key", "clip_low_at_one", "clip_for_cross_entropy"}


@pytest.fixture(scope="module")
def bad_input_results(tmp_path_factory) -> dict[str, tuple[list[subprocess.CompletedProcess], str]]:
    """Every BAD_INPUT case: one process in this one (no process group, as ``python train.py``
    runs it), several ranks launched, two cases at a time."""
    folder = tmp_path_factory.mktemp("bad_input")
    malformed = str(_malformed_jsonl(folder))

    def argv(name):
        extra = [a.replace("{malformed}", malformed) for a in BAD_INPUT[name][1]]
        return ["--job.config_file", RECIPE, *OVERRIDES, "--job.dump_folder", str(folder / name), *extra]

    results = {name: [train_in_process(argv(name))] for name, case in BAD_INPUT.items() if case[0] is None}
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            name: pool.submit(train_ranks, argv(name), case[0], timeout=120)
            for name, case in BAD_INPUT.items()
            if case[0] is not None
        }
        results |= {name: future.result() for name, future in futures.items()}
    return {name: (procs, malformed) for name, procs in results.items()}


@pytest.mark.parametrize("name", sorted(BAD_INPUT))
def test_bad_input_exits_2_naming_the_cause(bad_input_results, name):
    procs, malformed = bad_input_results[name]
    world_size, _, expected = BAD_INPUT[name]
    assert len(procs) == (world_size or 1)
    prefix = "config error: " if name in CONFIG_ERRORS else "error: "
    for rank, proc in enumerate(procs):
        assert proc.returncode == 2, f"rank {rank}\n" + _output(proc)
        message = [line for line in proc.stderr.splitlines() if line.startswith(prefix)]
        assert len(message) == 1, f"rank {rank}: no single '{prefix}...' line\n" + _output(proc)
        for part in expected:
            assert part.replace("{malformed}", malformed) in message[0], (part, message[0])
        # A user error is one clear line, not a traceback.
        assert "Traceback" not in proc.stderr, _output(proc)
