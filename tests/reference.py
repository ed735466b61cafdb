"""Independent references shared by the tests: the reduction modes as written in docs/design.md ('Loss weights'),
and a clean environment for launching training processes."""

import os


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


def launch_env() -> dict:
    """This process's environment for a child launch, with one thread per process and none
    of the torchrun variables of an enclosing job."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env
