"""A critic's values and clipped value loss are exact under every layout (critic_cases.py): on
one rank, dp 2, tp 2, cp 2, dp2 x tp2 and dp2 x cp2, with several micro-batches per rank and
multi-turn samples, every reduction mode gives one rank's values, ``critic/vf_loss``,
``critic/vf_clipfrac`` and gradients; one rank's equal every sample alone through the plain
model in float64 with the loss written out token by token and its weights from the global
counts by hand. The PPO targets computed from those values (GAE, advantages whitened over
the data-parallel ranks) equal one process's on the whole batch."""

import functools

import pytest
import torch

import critic_cases as cc
import layout_cases as lc
from test_layout_invariance import assert_rel_close
from torchtitan_rl.models.qwen3.args import as_critic
from torchtitan_rl.models.qwen3.model import Qwen3Model
from torchtitan_rl.rl.gae import set_critic_targets, target_metrics

RTOL = 1e-5
ONE_RANK = (1, 1, 1, 1)


def runs(layout_results) -> dict:
    return {
        layout: {mode: world[cc.case_key(layout, mode)] for mode in cc.MODES}
        for world in layout_results.values()
        for layout in cc.CRITIC_LAYOUTS
        if cc.case_key(layout, cc.MODES[0]) in world
    }


def merged(per_rank: list[dict]) -> dict:
    return {index: values for part in per_rank for index, values in part.items()}


def weights(mode: str, samples) -> list[torch.Tensor]:
    """Each sample's per-token weights of ``mode``, from the whole batch's counts."""
    masks = [s.loss_mask.double() for s in samples]
    num_tokens = sum(float(m.sum()) for m in masks)
    num_seqs = sum(1 for m in masks if m.sum() > 0)
    groups = {}
    for s, m in zip(samples, masks):
        groups[s.group_id] = groups.get(s.group_id, 0.0) + float(m.sum())
    if mode == "sum":
        return masks
    if mode == "token_mean":
        return [m / num_tokens for m in masks]
    if mode == "sequence_mean":
        return [m / (m.sum() * num_seqs) for m in masks]
    if mode == "seq_mean_token_sum_norm":
        return [m / (lc.HORIZON * num_seqs) for m in masks]
    assert mode == "prompt_mean"
    return [m / (groups[s.group_id] * len(groups)) for s, m in zip(samples, masks)]


@functools.cache
def reference(mode: str) -> tuple[float, float, dict, dict]:
    """(vf_loss, vf_clipfrac, gradients, values per sample) in float64, one sample at a time."""
    model = Qwen3Model(as_critic(lc.model_args()))
    model.init_weights(lc.SEED)
    model = model.double()
    samples = cc.global_samples()
    total, num_held, num_loss_tokens, values = 0.0, 0, 0, {}
    for index, (sample, w) in enumerate(zip(samples, weights(mode, samples))):
        n = len(sample)
        v = model.score(model(sample.input_ids, torch.arange(n), torch.zeros(n, dtype=torch.long)))[:, 0]
        values[index] = v.detach().float()
        for t in range(n):
            if not sample.loss_mask[t]:
                continue
            r, old, value = float(sample.returns[t]), float(sample.old_values[t]), float(v[t].detach())
            loss = 0.5 * (v[t] - r) ** 2
            if abs(value - old) > cc.CLIP:
                # Outside the range the clipped value is a constant, old ± clip: no gradient.
                held_loss = 0.5 * (old + (cc.CLIP if value > old else -cc.CLIP) - r) ** 2
                if held_loss > 0.5 * (value - r) ** 2:
                    loss = torch.tensor(held_loss, dtype=torch.float64)
                    num_held += 1
            total = total + cc.VALUE_COEF * w[t] * loss
            num_loss_tokens += 1
    total.backward()
    grads = {fqn: p.grad.float() for fqn, p in model.named_parameters()}
    return float(total.detach()), num_held / num_loss_tokens, grads, values


def test_every_layout_ran_with_several_micro_batches(layout_results):
    got = runs(layout_results)
    assert set(got) == set(cc.CRITIC_LAYOUTS)
    assert got[ONE_RANK]["sum"]["num_microbatches"] > 2


@pytest.mark.parametrize("mode", cc.MODES)
def test_one_rank_equals_the_float64_reference(layout_results, mode):
    loss, clipfrac, grads, values = reference(mode)
    got = runs(layout_results)[ONE_RANK][mode]
    assert got["metrics"]["critic/vf_loss"] == pytest.approx(loss, rel=1e-5)
    assert got["metrics"]["critic/vf_clipfrac"] == pytest.approx(clipfrac)
    assert 0 < clipfrac < 1  # both branches of the clip exercised
    got_values = merged(got["values"])
    assert set(got_values) == set(values)
    for index, want in values.items():
        torch.testing.assert_close(got_values[index], want, rtol=1e-5, atol=1e-6)
    assert set(got["grads"]) == set(grads)
    for fqn, grad in grads.items():
        assert_rel_close(got["grads"][fqn], grad, f"{mode} {fqn}", rtol=1e-4)


@pytest.mark.parametrize("mode", cc.MODES)
def test_every_layout_equals_one_rank(layout_results, mode):
    got = runs(layout_results)
    baseline = got[ONE_RANK][mode]
    assert max(float(g.abs().max()) for g in baseline["grads"].values()) > 0
    base_values = merged(baseline["values"])
    for layout, record in got.items():
        case = record[mode]
        for tag, value in baseline["metrics"].items():
            assert case["metrics"][tag] == pytest.approx(value, rel=RTOL, abs=1e-9), (layout, tag)
        values = merged(case["values"])
        assert set(values) == set(base_values), layout
        for index, want in base_values.items():
            torch.testing.assert_close(values[index], want, rtol=1e-5, atol=1e-6)
        for fqn, grad in baseline["grads"].items():
            assert_rel_close(case["grads"][fqn], grad, f"{layout} {mode} {fqn}", rtol=RTOL)


def test_critic_targets_whiten_over_the_global_batch_under_every_layout(layout_results):
    """Each layout's advantages, returns and old values equal one process's on the whole batch
    with one rank's values (whose GAE and whitening test_gae checks against brute force)."""
    one_rank_values = merged(runs(layout_results)[ONE_RANK]["sum"]["values"])
    samples = cc.global_samples()
    set_critic_targets(
        samples,
        [one_rank_values[i] for i in range(len(samples))],
        list(cc.EPISODE_REWARDS),
        cc.GAMMA,
        cc.LAM,
        None,
    )
    for world in layout_results.values():
        for layout in cc.CRITIC_LAYOUTS:
            if cc.case_key(layout, "targets") not in world:
                continue
            metrics = world[cc.case_key(layout, "target_metrics")]
            for tag, value in target_metrics(samples, None).items():
                assert metrics[tag] == pytest.approx(value, rel=1e-5, abs=1e-6), (layout, tag)
            got = merged(world[cc.case_key(layout, "targets")])
            assert set(got) == set(range(len(samples))), layout
            for index, sample in enumerate(samples):
                for name, value in zip(("advantages", "returns", "old_values"), got[index]):
                    torch.testing.assert_close(
                        value, getattr(sample, name), rtol=1e-5, atol=1e-5, msg=f"{layout} {name}"
                    )
    assert samples[0].advantages.abs().max() > 0.1  # not vacuous
