"""Router losses as partial losses (losses/router.py) against brute-force formulas in fp64.

Router logits of every token and layer are a leaf tensor; tokens belong to sequences, and a
"layout" scatters them over pieces (ranks x micro-batches, a sequence possibly split like under
CP). Each piece computes its partial loss from the complete counts of its groups (summed over
the pieces, detached) and its own probability sums; the partials must add up to the loss of the
whole mini-batch, value and gradient.
"""

import random

import pytest
import torch

from torchtitan_rl.losses.router import RouterLossConfig, balance_loss, z_loss

E, K, L = 6, 2, 3
SEQ_LENS = (7, 1, 12, 5, 9)


def logits_leaf(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(L, sum(SEQ_LENS), E, generator=gen, dtype=torch.float64)).requires_grad_()


def seq_of_token() -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(SEQ_LENS)), torch.tensor(SEQ_LENS))


def token_stats(logits: torch.Tensor, tokens: torch.Tensor):
    """(counts [L, E] detached, prob_sums [L, E], z_sums [L]) of ``tokens`` (indices)."""
    sub = logits[:, tokens]
    probs = sub.softmax(-1)
    top = probs.topk(K, dim=-1).indices
    counts = torch.zeros(L, E, dtype=torch.float64).scatter_add_(
        1, top.reshape(L, -1), torch.ones(L, top[0].numel(), dtype=torch.float64)
    )
    return counts, probs.sum(1), (sub.logsumexp(-1) ** 2).sum(1)


# ---------------------------------------------------------------- brute force


def full_balance(logits, groups: list[torch.Tensor], weights: list[float], layers: str) -> torch.Tensor:
    total = 0
    for tokens, w in zip(groups, weights):
        probs = logits[:, tokens].softmax(-1)
        top = probs.topk(K, dim=-1).indices
        one_hot = torch.nn.functional.one_hot(top, E).sum(-2).double()  # [L, n, E]
        n = len(tokens)
        if layers == "pooled":
            f = one_hot.sum((0, 1)) / (L * n)
            p = probs.sum((0, 1)) / (L * n)
            total = total + w * E * (f * p).sum()
        else:
            total = total + w * sum(E * ((one_hot[l].sum(0) / n) * (probs[l].sum(0) / n)).sum() for l in range(L))
    return total


def groups_of(scope: str, layout):
    """(groups of token indices, weights) of the whole mini-batch for a scope."""
    seq = seq_of_token()
    if scope == "global":
        return [torch.arange(len(seq))], [1.0]
    if scope == "sequence":
        return [(seq == s).nonzero()[:, 0] for s in range(len(SEQ_LENS))], [1 / len(SEQ_LENS)] * len(SEQ_LENS)
    microbatches = whole_microbatches(layout)
    return microbatches, [1 / len(microbatches)] * len(microbatches)


def random_layout(seed: int) -> list[list[torch.Tensor]]:
    """Pieces [CP rank * 2 + DP rank][micro-batch] of token indices: 2 DP ranks hold whole
    sequences, split into 1 or 2 micro-batches; every micro-batch's tokens are dealt over 2
    "CP" ranks."""
    rng = random.Random(seed)
    seq = seq_of_token()
    order = list(range(len(SEQ_LENS)))
    rng.shuffle(order)
    dp = [order[: len(order) // 2], order[len(order) // 2 :]]
    plans = []
    for seqs in dp:
        split = rng.randint(1, len(seqs))
        plans.append([seqs[:split], seqs[split:]] if split < len(seqs) else [seqs])
    layout = []
    for cp_rank in range(2):
        for mbs in plans:
            tokens = [torch.cat([(seq == s).nonzero()[:, 0] for s in mb]) for mb in mbs]
            layout.append([t[cp_rank::2] for t in tokens])  # this CP rank's half of each micro-batch
    return layout


def whole_microbatches(layout) -> list[torch.Tensor]:
    return [torch.cat([layout[c * 2 + r][k] for c in range(2)]) for r in range(2) for k in range(len(layout[r]))]


def partial_sum(logits, layout, scope: str, layers: str) -> torch.Tensor:
    """Σ over pieces of the partial losses, each piece knowing only its own tokens' probabilities."""
    seq = seq_of_token()
    with torch.no_grad():
        global_counts = token_stats(logits, torch.arange(len(seq)))[0]
    microbatches = whole_microbatches(layout)
    total = 0
    for rank in layout:
        for tokens in rank:
            counts, prob_sums, _ = token_stats(logits, tokens)
            if scope == "global":
                total = total + balance_loss(
                    global_counts[None],
                    prob_sums[None],
                    torch.tensor([len(seq)]),
                    torch.ones(1, dtype=torch.float64),
                    layers,
                )
            elif scope == "sequence":
                for s in seq[tokens].unique().tolist():
                    mine = tokens[seq[tokens] == s]
                    whole = (seq == s).nonzero()[:, 0]
                    c = token_stats(logits, whole)[0]  # summed over the CP peers
                    p = token_stats(logits, mine)[1]
                    total = total + balance_loss(
                        c[None],
                        p[None],
                        torch.tensor([len(whole)]),
                        torch.tensor([1 / len(SEQ_LENS)], dtype=torch.float64),
                        layers,
                    )
            else:
                whole = next(mb for mb in microbatches if bool(torch.isin(tokens, mb).all()))
                c = token_stats(logits, whole)[0]
                total = total + balance_loss(
                    c[None],
                    prob_sums[None],
                    torch.tensor([len(whole)]),
                    torch.tensor([1 / len(microbatches)], dtype=torch.float64),
                    layers,
                )
    return total


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("layers", ["pooled", "sum"])
@pytest.mark.parametrize("scope", ["global", "sequence", "microbatch"])
@pytest.mark.parametrize("seed", range(3))
def test_partial_losses_add_up_to_the_scope_loss(scope, layers, seed):
    layout = random_layout(seed)
    logits = logits_leaf(seed)
    got = partial_sum(logits, layout, scope, layers)
    (grad_got,) = torch.autograd.grad(got, logits)
    groups, weights = groups_of(scope, layout)
    want = full_balance(logits, groups, weights, layers)
    (grad_want,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad_got, grad_want, rtol=1e-10, atol=1e-14)


def test_microbatch_scope_is_not_the_global_loss():
    logits = logits_leaf(1)
    layout = random_layout(1)
    local = partial_sum(logits, layout, "microbatch", "pooled")
    exact = partial_sum(logits, layout, "global", "pooled")
    assert abs(float((local - exact).detach())) > 1e-3 * float(exact.detach())


def test_global_pooled_equals_hf_load_balancing_loss():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    logits = logits_leaf(2)
    mine = partial_sum(logits, random_layout(2), "global", "pooled")
    hf = load_balancing_loss_func(tuple(logits[l].float() for l in range(L)), E, K)
    torch.testing.assert_close(mine.float(), hf, rtol=1e-6, atol=1e-7)


def test_perfect_balance_gives_top_k_and_sum_gives_top_k_per_layer():
    n = 30
    counts = torch.full((1, L, E), n * K / E, dtype=torch.float64)
    prob_sums = torch.full((1, L, E), n / E, dtype=torch.float64)
    one = torch.ones(1, dtype=torch.float64)
    assert float(balance_loss(counts, prob_sums, torch.tensor([n]), one, "pooled")) == pytest.approx(K)
    assert float(balance_loss(counts, prob_sums, torch.tensor([n]), one, "sum")) == pytest.approx(K * L)


def test_counts_must_not_carry_gradient_and_empty_groups_give_zero():
    counts = torch.ones(1, L, E, requires_grad=True)
    with pytest.raises(AssertionError, match="gradient"):
        balance_loss(counts, torch.ones(1, L, E), torch.tensor([3]), torch.ones(1), "pooled")
    zero = balance_loss(torch.zeros(2, L, E), torch.zeros(2, L, E), torch.zeros(2), torch.ones(2), "sum")
    assert float(zero) == 0.0 and torch.isfinite(zero)


def test_z_loss_partials_add_up_to_the_token_mean():
    logits = logits_leaf(3)
    seq = seq_of_token()
    want = (logits.logsumexp(-1) ** 2).sum(0).mean()
    got = sum(
        z_loss(token_stats(logits, tokens)[2][:, None], torch.tensor(len(seq)))
        for rank in random_layout(3)
        for tokens in rank
    )
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("aux_loss_scope", "batch", "moe.aux_loss_scope: 'batch' is not one of global, sequence, microbatch"),
        ("aux_loss_layers", "mean", "moe.aux_loss_layers: 'mean' is not one of pooled, sum"),
        ("aux_loss_coef", -1.0, "moe.aux_loss_coef: must be a finite number >= 0"),
        ("z_loss_coef", float("nan"), "moe.z_loss_coef: must be a finite number >= 0"),
    ],
)
def test_config_errors_name_the_key(field, value, match):
    with pytest.raises(ValueError, match=match):
        RouterLossConfig(**{field: value})
