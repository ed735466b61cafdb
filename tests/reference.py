"""Independent references shared by the tests: the reduction modes as written in docs/design.md ('Loss weights'),
Tinker's built-in losses as their documentation writes them, a clean environment for launching
training processes, and ``train.py`` run in this process."""

import contextlib
import importlib.util
import io
import logging
import os
import subprocess
from pathlib import Path

import pytest
import torch


def minibatch_loss(seq_sums: list, seq_loss_tokens: list, mode: str, horizon: int, groups: list | None = None):
    """A layout-invariant mode's mini-batch loss from per-sequence loss sums and loss-token
    counts (and, for prompt_mean, each sequence's prompt group)."""
    num_tokens = sum(seq_loss_tokens)
    num_seqs = sum(1 for n in seq_loss_tokens if n > 0)
    if mode == "sum":
        return sum(seq_sums)
    if mode == "token_mean":
        return sum(seq_sums) / num_tokens if num_tokens > 0 else sum(seq_sums) * 0
    if mode == "sequence_mean":
        return sum(s / n for s, n in zip(seq_sums, seq_loss_tokens) if n > 0) / num_seqs
    if mode == "seq_mean_token_sum_norm":
        return sum(seq_sums) / (horizon * num_seqs)
    if mode == "prompt_mean":
        group_sums, group_tokens = {}, {}
        for s, n, g in zip(seq_sums, seq_loss_tokens, groups):
            group_sums[g] = group_sums.get(g, 0) + s
            group_tokens[g] = group_tokens.get(g, 0) + n
        means = [group_sums[g] / group_tokens[g] for g in group_sums if group_tokens[g] > 0]
        return sum(means) / len(means) if means else sum(seq_sums) * 0
    raise AssertionError(f"no layout-invariant reference for {mode}")


def tinker_loss(loss_fn: str, logp: torch.Tensor, inputs: dict, config: dict) -> torch.Tensor:
    """A Tinker built-in loss of one datum as its documentation writes it: the per-token term
    of the target log-probs ``logp`` and the datum's ``loss_fn_inputs``, summed over positions
    (``config``: its ``loss_fn_config``, defaults 0.8 / 1.2 and beta 0.05)."""
    if loss_fn == "cross_entropy":
        return (-logp * inputs["weights"]).sum()
    q, advantages = inputs["logprobs"], inputs["advantages"]
    low = config.get("clip_low_threshold", 0.8)
    high = config.get("clip_high_threshold", 1.2)
    ratio = torch.exp(logp - q)
    if loss_fn == "importance_sampling":
        return -(ratio * advantages).sum()
    if loss_fn == "ppo":
        return -torch.min(ratio * advantages, torch.clamp(ratio, low, high) * advantages).sum()
    if loss_fn == "cispo":
        return -(torch.clamp(ratio, low, high).detach() * logp * advantages).sum()
    if loss_fn == "dro":
        beta = config.get("beta", 0.05)
        return -(logp * advantages - 0.5 * beta * (logp - q) ** 2).sum()
    assert loss_fn == "gspo", loss_fn
    in_ratio = inputs["sequence_ratio_mask"] != 0
    # A mask without any position: log-ratio 0 (the documented mean of nothing is NaN).
    log_ratio = (logp.detach() - q)[in_ratio].mean() if in_ratio.any() else torch.zeros(())
    ratio = torch.exp(log_ratio + logp - logp.detach())
    return -torch.min(ratio * advantages, torch.clamp(ratio, low, high) * advantages).sum()


def tinker_ratios(loss_fn: str, log_ratios: list[torch.Tensor], masks: list[torch.Tensor | None]) -> torch.Tensor:
    """The ratios a Tinker loss clips, from each datum's per-token ``log_ratios`` (logp - q): per
    token, or for gspo one per datum (the mean over its ``sequence_ratio_mask``, 0 with none)."""
    if loss_fn != "gspo":
        return torch.cat(log_ratios).exp()
    means = [lr[m != 0].mean() if (m != 0).any() else torch.zeros(()) for lr, m in zip(log_ratios, masks)]
    return torch.stack(means).exp()


_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launch_env() -> dict:
    """This process's environment for a child launch, with one thread per process and none
    of the torchrun variables of an enclosing job."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    for key in _TORCHRUN_VARIABLES:
        env.pop(key, None)
    return env


_TRAIN = Path(__file__).resolve().parents[1] / "train.py"


def train_in_process(argv: list[str]) -> subprocess.CompletedProcess:
    """``python train.py ARGV`` run as ``train.main(ARGV)`` in this process: its exit status and
    what it writes to stdout and stderr. For runs that stop before training: a launch costs a
    Python and torch start-up (seconds), this none.

    As in a child of ``launch_env``, no torchrun variable is set (one process, no process
    group); the CPU RNG state the run seeds and the root logger come back afterwards.
    """
    spec = importlib.util.spec_from_file_location("train_entry_point", _TRAIN)
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    stdout, stderr = io.StringIO(), io.StringIO()
    # main() configures logging with basicConfig, which does nothing once the root logger has
    # a handler: this one, formatted the same way, puts the run's log lines into its stderr.
    handler = logging.StreamHandler(stderr)
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level

    def restore_logging():
        root.handlers[:] = handlers
        root.setLevel(level)

    with contextlib.ExitStack() as stack:
        env = stack.enter_context(pytest.MonkeyPatch.context())
        for key in _TORCHRUN_VARIABLES:
            env.delenv(key, raising=False)
        stack.enter_context(torch.random.fork_rng(devices=[]))
        stack.enter_context(contextlib.redirect_stdout(stdout))
        stack.enter_context(contextlib.redirect_stderr(stderr))
        stack.callback(restore_logging)
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        status = entry.main(argv)
    return subprocess.CompletedProcess(["train.py", *argv], status, stdout.getvalue(), stderr.getvalue())
