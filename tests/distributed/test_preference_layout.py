"""The preference losses are exact under every layout (preference_cases.py): on one rank, dp 2,
tp 2, cp 2, dp2 x tp2 and dp2 x cp2, with several micro-batches per rank and every pair's two
completions on different data-parallel ranks, DPO (label smoothing on), IPO and SimPO give the
one-process reference's loss, ``rewards/*`` / ``logps/*`` metrics and gradients: every sequence
alone through the plain model in float64 and the formulas written out per pair
(test_preference_loss.brute_force). DPO on a MoE model with its router losses and on a LoRA
model (reference: the base), and a reward model's Bradley–Terry loss with centering and some
pairs' margins, give one rank's numbers on every layout; the reward model's one-rank numbers
equal every pair's whole texts scored alone in float64 and the loss written out per pair.
"""

import functools

import pytest
import torch

import layout_cases as lc
import preference_cases as pc
from test_layout_invariance import assert_rel_close, reference_model
from torchtitan_rl.models.qwen3.args import as_reward_model
from torchtitan_rl.models.qwen3.model import Qwen3Model
from unit.test_preference_loss import brute_force

RTOL = 1e-5
ONE_RANK = (1, 1, 1, 1)
CASES = (*pc.LOSSES, "dpo_moe", "dpo_lora", "reward_model")


def runs(layout_results) -> dict:
    return {
        layout: {name: world[pc.case_key(layout, name)] for name in CASES}
        for world in layout_results.values()
        for layout in pc.PREFERENCE_LAYOUTS
        if pc.case_key(layout, CASES[0]) in world
    }


def completion_sum(model: Qwen3Model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    tokens = torch.tensor(prompt + completion)
    n = len(tokens)
    hidden = model(tokens, torch.arange(n), torch.zeros(n, dtype=torch.long))
    logprobs = model.output(hidden).log_softmax(-1)
    return logprobs[len(prompt) - 1 : -1].gather(1, tokens[len(prompt) :, None]).sum()


@functools.cache
def reference(name: str) -> tuple[float, dict, dict]:
    """(loss, metrics, gradients) of the dense case ``name`` in float64, one sequence at a time."""
    policy = reference_model(False).double()
    ref = Qwen3Model(lc.model_args())
    ref.init_weights(pc.REFERENCE_SEED)
    ref = ref.double()
    sums = []
    for prompt, chosen, rejected in pc.pair_tokens():
        with torch.no_grad():
            reference_sums = {"rc": completion_sum(ref, prompt, chosen), "rr": completion_sum(ref, prompt, rejected)}
        sums.append(
            {
                "c": completion_sum(policy, prompt, chosen),
                "r": completion_sum(policy, prompt, rejected),
                "nc": len(chosen),
                "nr": len(rejected),
            }
            | reference_sums
        )
    loss, metrics = brute_force(name, pc.LOSSES[name], sums)
    loss.backward()
    return float(loss.detach()), metrics, {fqn: p.grad.float() for fqn, p in policy.named_parameters()}


def test_every_layout_ran_with_pairs_split_over_ranks_and_micro_batches(layout_results):
    got = runs(layout_results)
    assert set(got) == set(pc.PREFERENCE_LAYOUTS)
    # One rank packs the 12 completions into several micro-batches; data parallel splits the
    # chosen completions from the rejected ones (global_samples' order).
    assert got[ONE_RANK]["dpo"]["num_microbatches"] > 2
    samples = pc.global_samples()
    first_half = {s.group_id for s in samples[: len(samples) // 2]}
    assert all(s.preferred for s in samples[: len(samples) // 2]) and len(first_half) == len(pc.PAIRS)


@pytest.mark.parametrize("name", list(pc.LOSSES))
def test_one_rank_equals_the_float64_reference(layout_results, name):
    loss, metrics, grads = reference(name)
    got = runs(layout_results)[ONE_RANK][name]
    assert got["values"]["loss_metrics/global_avg_loss"] == pytest.approx(loss, rel=1e-5)
    for tag, value in metrics.items():
        assert got["values"][tag] == pytest.approx(value, rel=1e-5, abs=1e-6), tag
    assert set(got["grads"]) == set(grads)
    for fqn, grad in grads.items():
        assert_rel_close(got["grads"][fqn], grad, f"{name} {fqn}", rtol=1e-4)


def test_one_rank_reward_model_equals_the_float64_reference_with_margins(layout_results):
    model = Qwen3Model(as_reward_model(lc.model_args()))
    model.init_weights(lc.SEED)
    model = model.double()

    def score(tokens: list[int]) -> torch.Tensor:
        n = len(tokens)
        return model.score(model(torch.tensor(tokens), torch.arange(n), torch.zeros(n, dtype=torch.long)))[-1, 0]

    pairs, chosen, rejected = [], [], []
    for (prompt, good, bad), margin in zip(pc.pair_tokens(), pc.MARGINS, strict=True):
        chosen.append(score(prompt + good))
        rejected.append(score(prompt + bad))
        gap = chosen[-1] - rejected[-1] - margin
        center = pc.REWARD_MODEL_LOSS.center_coef * (chosen[-1] + rejected[-1]) ** 2
        pairs.append(-torch.nn.functional.logsigmoid(gap) + center)
    loss = torch.stack(pairs).mean()
    loss.backward()
    chosen, rejected = torch.stack(chosen).detach(), torch.stack(rejected).detach()
    got = runs(layout_results)[ONE_RANK]["reward_model"]
    assert got["values"]["loss_metrics/global_avg_loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    assert got["values"]["rm/accuracy"] == float((chosen > rejected).double().mean())
    assert got["values"]["rm/margin"] == pytest.approx(float((chosen - rejected).mean()), rel=1e-5, abs=1e-6)
    assert set(got["grads"]) == {fqn for fqn, _ in model.named_parameters()}
    for fqn, param in model.named_parameters():
        assert_rel_close(got["grads"][fqn], param.grad.float(), f"reward_model {fqn}", rtol=1e-4)


@pytest.mark.parametrize("name", CASES)
def test_every_layout_equals_one_rank(layout_results, name):
    got = runs(layout_results)
    baseline = got[ONE_RANK][name]
    assert max(float(g.abs().max()) for g in baseline["grads"].values()) > 0
    for layout, record in got.items():
        case = record[name]
        for tag, value in baseline["values"].items():
            assert case["values"][tag] == pytest.approx(value, rel=RTOL, abs=1e-6), (layout, tag)
        assert set(case["grads"]) == set(baseline["grads"]), layout
        for fqn, grad in baseline["grads"].items():
            assert_rel_close(case["grads"][fqn], grad, f"{layout} {name} {fqn}", rtol=RTOL)


def test_the_lora_case_trains_the_adapters_against_the_base(layout_results):
    record = runs(layout_results)[ONE_RANK]["dpo_lora"]
    assert record["grads"] and all(".lora_" in fqn or "tok_embeddings" in fqn for fqn in record["grads"])
    # The reference is the base: the adapters make the policy differ from it.
    assert abs(record["values"]["rewards/margins"]) > 1e-3
