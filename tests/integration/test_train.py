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
import time
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


def train_ranks(
    args: list[str],
    world_size: int,
    timeout: float = 300,
    extra_env: dict | None = None,
    exit_times: list[float] | None = None,
) -> list[subprocess.CompletedProcess]:
    """Start ``world_size`` ``python train.py`` ranks with torchrun's environment protocol
    (and ``extra_env``); ``exit_times``, when given, receives the moment (``time.monotonic()``)
    each rank exited.

    Used for errors that need a real world size: unlike torchrun, which reports its own
    status 1 when a child fails, this shows the exit status of every rank.
    """
    port = _free_port()
    procs = []
    for rank in range(world_size):
        env = dict(
            launch_env(),
            **(extra_env or {}),
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

    def wait(proc: subprocess.Popen) -> tuple[subprocess.CompletedProcess, float]:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.monotonic()

    with concurrent.futures.ThreadPoolExecutor(max_workers=world_size) as pool:
        try:
            finished = list(pool.map(wait, procs))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
    if exit_times is not None:
        exit_times.extend(moment for _, moment in finished)
    return [result for result, _ in finished]


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


# ------------------------------------------------------------------ the user's code raises

PLUGINS = str(REPO / "tests" / "unit")  # rl_plugins, env_plugins
# The embedded GRPO recipe, two short steps from scratch.
USER_CODE_RUN = ["--job.config_file", str(REPO / "train_configs" / "debug_grpo.toml"), "--rl.sft_warmup_steps", "0"]
USER_CODE_RUN += ["--training.steps", "2", "--rl.group_size", "4", "--rl.prompts_per_step", "2"]
USER_CODE_RUN += ["--rl.eval_interval", "0", "--metrics.enable_tensorboard", "false"]
# Every rank exits within this of the first one (the collective timeout is 300 s): the other
# ranks stop at the failure, not in their next collective.
FAILURE_BOUND_S = 20
FAILING_REWARD = "rl_plugins:raises_on_one_rank"
# name -> (launched ranks, the rank whose reward raises, extra options)
ONE_RANK_FAILS = {
    "colocated": (2, 1, []),
    # One trainer and two rollout ranks: the one that fails is not the one that sends.
    "rollout_ranks": (3, 2, ["--parallelism.rollout_ranks", "2"]),
}


def test_the_users_own_error_shows_its_traceback(tmp_path, monkeypatch):
    """A ValueError of the user's environment is no config mistake: its traceback, down to the
    user's line, then the line naming the environment and the problem."""
    monkeypatch.syspath_prepend(PLUGINS)
    argv = [*USER_CODE_RUN, "--job.dump_folder", str(tmp_path), "--rl.env", "env_plugins:ResetRaises"]
    proc = train_in_process(argv)
    assert proc.returncode == 1, _output(proc)
    assert "Traceback (most recent call last)" in proc.stderr, _output(proc)
    user_frame = f'File "{Path(PLUGINS) / "env_plugins" / "__init__.py"}", line '
    assert user_frame in proc.stderr and ", in reset\n" in proc.stderr, _output(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: rl.env = 'env_plugins:ResetRaises' on arithmetic train #0: reset() raised ValueError: invalid "
        "literal for int() with base 10: 'arithmetic train #0'"
    ], _output(proc)


@pytest.fixture(scope="module")
def one_rank_fails(tmp_path_factory) -> dict[str, tuple[list[subprocess.CompletedProcess], float]]:
    """Every ONE_RANK_FAILS launch (both at once): each rank's result, and the seconds between
    the first and the last rank's exit."""
    folder = tmp_path_factory.mktemp("one_rank_fails")

    def launch(name: str):
        world_size, failing, options = ONE_RANK_FAILS[name]
        argv = [*USER_CODE_RUN, "--job.dump_folder", str(folder / name), "--rl.reward_fn", FAILING_REWARD, *options]
        extra_env = {"PYTHONPATH": PLUGINS, "FAILING_RANK": str(failing)}
        exit_times: list[float] = []
        procs = train_ranks(argv, world_size, timeout=300, extra_env=extra_env, exit_times=exit_times)
        return procs, max(exit_times) - min(exit_times)

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(launch, name) for name in ONE_RANK_FAILS}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("name", sorted(ONE_RANK_FAILS))
def test_a_rank_whose_reward_raises_ends_every_rank_with_its_cause(one_rank_fails, name):
    """The failing rank prints the user's traceback; every other rank stops at once (not in
    its next collective at the timeout) with one line naming that rank and its error."""
    procs, seconds = one_rank_fails[name]
    world_size, failing, _ = ONE_RANK_FAILS[name]
    assert len(procs) == world_size and seconds < FAILURE_BOUND_S, seconds
    cause = f"rl.reward_fn = '{FAILING_REWARD}' raised KeyError: 'rank {failing}' on problem arithmetic train #"
    for rank, proc in enumerate(procs):
        assert proc.returncode == 1, f"rank {rank}\n" + _output(proc)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, f"rank {rank}\n" + _output(proc)
        if rank == failing:
            assert errors[0].startswith(f"error: {cause}"), _output(proc)
            assert ", in raises_on_one_rank\n" in proc.stderr, _output(proc)  # the user's frame
        else:
            assert errors[0].startswith(f"error: rank {failing} failed: UserCodeError: {cause}"), _output(proc)
            assert "Traceback" not in proc.stderr, f"rank {rank}\n" + _output(proc)
