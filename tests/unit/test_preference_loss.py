"""The preference step against HF transformers: on one process, with the pairs' completions packed
into several micro-batches (a pair's two completions in different ones), DPO (with and without
label smoothing), IPO and SimPO give the loss, the ``rewards/*`` and ``logps/*`` metrics and the
gradient of a brute-force float64 computation: every sequence alone through ``Qwen3ForCausalLM``,
the published formulas written out per pair, autograd through HF's model. The coefficient form
(``sequence_coefficients``) is also checked against finite differences of the loss."""

import math

import pytest
import torch

from torchtitan_rl.data.sample import Sample
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.engine import Engine, EngineOptions
from torchtitan_rl.losses.preference import PairSums, PreferenceLoss, pair_losses, sequence_coefficients
from torchtitan_rl.models.qwen3.model import Qwen3Model
from torchtitan_rl.models.qwen3.state_dict_adapter import to_hf
from torchtitan_rl.recipes.dpo import preference_step
from unit.test_qwen3_model import hf_and_ours, random_tokens

# (prompt, chosen, rejected) lengths; pair 2's completions are long enough to land in other
# micro-batches than their partner under the 24-token budget.
PAIRS = ((5, 3, 6), (2, 7, 1), (6, 9, 8), (3, 2, 2))
LOSSES = {
    "dpo": PreferenceLoss("dpo", beta=0.7),
    "cdpo": PreferenceLoss("dpo", beta=0.7, label_smoothing=0.2),
    "ipo": PreferenceLoss("ipo", beta=0.4),
    "simpo": PreferenceLoss("simpo", beta=2.0, label_smoothing=0.1, simpo_gamma=0.8),
    "rpo": PreferenceLoss("dpo", beta=0.7, nll_coef=0.3),
}


def pairs(vocab_size: int) -> list[tuple[list[int], list[int], list[int]]]:
    out = []
    for i, lengths in enumerate(PAIRS):
        prompt, chosen, rejected = (
            random_tokens(n, vocab_size, seed=40 + 3 * i + k).tolist() for k, n in enumerate(lengths)
        )
        out.append((prompt, chosen, rejected))
    return out


def samples_of(pair_tokens) -> list[Sample]:
    """Each pair's chosen then rejected completion, loss on the completion's tokens."""
    samples = []
    for index, (prompt, chosen, rejected) in enumerate(pair_tokens):
        for preferred, completion in ((True, chosen), (False, rejected)):
            sample = Sample.from_tokens(prompt + completion, [False] * len(prompt) + [True] * len(completion))
            sample.group_id, sample.preferred = index, preferred
            samples.append(sample)
    return samples


def hf_sum(hf, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Σ log p(completion token) of one sequence alone through the HF model."""
    tokens = torch.tensor(prompt + completion)
    logprobs = hf(input_ids=tokens[None]).logits[0].double().log_softmax(-1)
    targets = tokens[len(prompt) :]
    return logprobs[len(prompt) - 1 : -1].gather(1, targets[:, None]).sum()


def log_sigmoid(x: torch.Tensor) -> torch.Tensor:
    return -torch.log1p(torch.exp(-x))


def brute_force(name: str, loss: PreferenceLoss, sums: list[dict]) -> tuple[torch.Tensor, dict]:
    """The mean pair loss (plus the chosen tokens' NLL with ``nll_coef``) and TRL's metrics, each
    formula written out."""
    beta, eps = loss.beta, loss.label_smoothing
    losses, chosen_rewards, rejected_rewards = [], [], []
    for s in sums:
        if loss.name == "simpo":
            chosen, rejected = s["c"] / s["nc"], s["r"] / s["nr"]
            x = beta * (chosen - rejected) - loss.simpo_gamma
            losses.append(-(1 - eps) * log_sigmoid(x) - eps * log_sigmoid(-x))
            chosen_rewards.append(beta * chosen)
            rejected_rewards.append(beta * rejected)
            continue
        chosen_ratio, rejected_ratio = s["c"] - s["rc"], s["r"] - s["rr"]
        if loss.name == "dpo":
            x = beta * (chosen_ratio - rejected_ratio)
            losses.append(-(1 - eps) * log_sigmoid(x) - eps * log_sigmoid(-x))
        else:
            losses.append((chosen_ratio / s["nc"] - rejected_ratio / s["nr"] - 1 / (2 * beta)) ** 2)
        chosen_rewards.append(beta * chosen_ratio)
        rejected_rewards.append(beta * rejected_ratio)
    num_pairs = len(sums)
    mean_loss = sum(losses) / num_pairs
    if loss.nll_coef:
        mean_loss = mean_loss - loss.nll_coef * sum(s["c"] for s in sums) / sum(s["nc"] for s in sums)
    chosen_rewards, rejected_rewards = [r.detach() for r in chosen_rewards], [r.detach() for r in rejected_rewards]
    metrics = {
        "rewards/chosen": sum(float(r) for r in chosen_rewards) / num_pairs,
        "rewards/rejected": sum(float(r) for r in rejected_rewards) / num_pairs,
        "rewards/accuracies": sum(float(c) > float(r) for c, r in zip(chosen_rewards, rejected_rewards)) / num_pairs,
        "rewards/margins": sum(float(c - r) for c, r in zip(chosen_rewards, rejected_rewards)) / num_pairs,
        "logps/chosen": sum(float(s["c"].detach()) for s in sums) / num_pairs,
        "logps/rejected": sum(float(s["r"].detach()) for s in sums) / num_pairs,
        "loss_metrics/global_max_loss": max(float(v.detach()) for v in losses),
    }
    if loss.nll_coef:
        metrics["nll_loss"] = -sum(float(s["c"].detach()) for s in sums) / sum(s["nc"] for s in sums)
    return mean_loss, metrics


def one_rank_engine(model: Qwen3Model, budget: int) -> Engine:
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, world_size=1)
    dims.build_meshes("cpu")
    options = EngineOptions(
        reduction="sum", horizon=1, max_tokens_per_microbatch=budget, logits_chunk_size=8, max_norm=0.0
    )
    return Engine(
        model, optimizer=None, lr_scheduler=None, parallel_dims=dims, device=torch.device("cpu"), options=options
    )


@pytest.mark.parametrize("name", list(LOSSES))
def test_the_step_equals_hf_in_float64(name):
    loss = LOSSES[name]
    hf, ours = hf_and_ours(tie_embeddings=False)
    hf_ref, ours_ref = hf_and_ours(tie_embeddings=True)  # another model: the reference
    hf, hf_ref = hf.double(), hf_ref.double()
    pair_tokens = pairs(ours.args.vocab_size)
    sums = []
    for prompt, chosen, rejected in pair_tokens:
        with torch.no_grad():
            reference = {"rc": hf_sum(hf_ref, prompt, chosen), "rr": hf_sum(hf_ref, prompt, rejected)}
        sums.append(
            {"c": hf_sum(hf, prompt, chosen), "r": hf_sum(hf, prompt, rejected), "nc": len(chosen), "nr": len(rejected)}
            | reference
        )
    want_loss, want_metrics = brute_force(name, loss, sums)
    want_loss.backward()
    want_grads = {n: p.grad for n, p in hf.named_parameters()}

    engine, reference_engine = one_rank_engine(ours, budget=24), one_rank_engine(ours_ref, budget=24)
    samples = samples_of(pair_tokens)
    batch = engine.prepare(samples)
    assert len(batch.whole) > 1  # premise: several micro-batches
    _, values = preference_step(engine, samples, loss, len(pair_tokens), lambda s: reference_engine.forward(s).logprobs)
    assert values["loss_metrics/global_avg_loss"] == pytest.approx(float(want_loss), rel=1e-5, abs=1e-7)
    for tag, value in want_metrics.items():
        assert values[tag] == pytest.approx(value, rel=1e-5, abs=1e-6), tag
    got_grads = to_hf({n: p.grad for n, p in ours.named_parameters()})
    scale = max(float(g.abs().max()) for g in want_grads.values())
    assert scale > 0
    for n, grad in want_grads.items():
        torch.testing.assert_close(got_grads[n].double(), grad, rtol=1e-4, atol=1e-5 * scale, msg=n)


@pytest.mark.parametrize("name", list(LOSSES))
def test_coefficients_are_the_losss_derivatives(name):
    loss = LOSSES[name]
    generator = torch.Generator().manual_seed(7)
    table = torch.randn(6, 5, generator=generator, dtype=torch.float64) * 3
    table[4:] = torch.randint(1, 9, (2, 5), generator=generator).double()
    sums = PairSums.from_table(table)
    grad_chosen, grad_rejected, value = sequence_coefficients(loss, sums)

    def objective(t: torch.Tensor) -> float:
        nll = -float(t[0].sum() / t[4].sum())  # the chosen tokens' negative log-likelihood per token
        return float(pair_losses(loss, PairSums.from_table(t)).mean()) + loss.nll_coef * nll

    assert value == pytest.approx(objective(table))
    step = 1e-6
    for row, grad in ((0, grad_chosen), (1, grad_rejected)):
        for pair in range(5):
            plus, minus = table.clone(), table.clone()
            plus[row, pair] += step
            minus[row, pair] -= step
            numeric = (objective(plus) - objective(minus)) / (2 * step)
            assert float(grad[pair]) == pytest.approx(numeric, rel=1e-5, abs=1e-9), (row, pair)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="loss.beta must be > 0"):
        PreferenceLoss("dpo", beta=0.0)
    with pytest.raises(ValueError, match=r"loss.label_smoothing must be in \[0, 0.5\)"):
        PreferenceLoss("dpo", beta=0.1, label_smoothing=0.5)
    with pytest.raises(ValueError, match="not ipo"):
        PreferenceLoss("ipo", beta=0.1, label_smoothing=0.1)
    assert math.isfinite(float(pair_losses(LOSSES["dpo"], PairSums.from_table(torch.zeros(6, 1)))[0]))
