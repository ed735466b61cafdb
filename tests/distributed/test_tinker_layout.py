"""Tinker's built-in losses are exact under every layout (tinker_cases.py): on one rank, dp 2,
tp 2, cp 2 and dp2 x tp2, with several micro-batches per rank and two accumulating
forward_backward calls, each loss's ``loss:sum`` of every call, the per-datum log-probs and the
accumulated gradients equal a one-process reference that runs every datum alone through the
plain model and applies the documented per-token formula (``reference.tinker_loss``), and each
layout's equal one rank's.
"""

import functools

import pytest
import torch

import tinker_cases as tc
from reference import tinker_loss, tinker_ratios
from test_layout_invariance import assert_rel_close, reference_model

RTOL = 1e-5
ONE_RANK = (1, 1, 1, 1)


def runs(layout_results) -> dict:
    return {
        layout: world[tc.layout_key(*layout)]
        for world in layout_results.values()
        for layout in tc.TINKER_LAYOUTS
        if tc.layout_key(*layout) in world
    }


def target_logprobs(model, datum) -> torch.Tensor:
    n = len(datum.tokens)
    hidden = model(torch.tensor(datum.tokens), torch.arange(n), torch.zeros(n, dtype=torch.long))
    return model.output(hidden).log_softmax(-1).gather(1, datum.inputs["target_tokens"][:, None])[:, 0]


@functools.cache
def reference(loss_fn: str):
    """(loss of each call, per-datum log-probs of each call, gradients after both calls)."""
    model = reference_model(False)
    loss_sums, logprobs = [], []
    for call in range(len(tc.CALL_LENGTHS)):
        datums = tc.datums(loss_fn, call)
        per_datum = [target_logprobs(model, d) for d in datums]
        loss = sum(tinker_loss(loss_fn, lp, d.inputs, tc.CONFIGS[loss_fn]) for lp, d in zip(per_datum, datums))
        loss.backward()
        loss_sums.append(float(loss.detach()))
        logprobs.append([lp.detach() for lp in per_datum])
    return loss_sums, logprobs, {fqn: p.grad.clone() for fqn, p in model.named_parameters()}


def test_every_layout_ran(layout_results):
    got = runs(layout_results)
    assert set(got) == set(tc.TINKER_LAYOUTS)
    assert all(set(record) == set(tc.CONFIGS) for record in got.values())


@pytest.mark.parametrize("loss_fn", list(tc.CONFIGS))
def test_loss_logprobs_and_gradients_equal_the_documented_formula_on_every_layout(layout_results, loss_fn):
    loss_sums, logprobs, grads = reference(loss_fn)
    got = runs(layout_results)
    one_rank = got[ONE_RANK][loss_fn]
    for layout, record in got.items():
        entry = record[loss_fn]
        # Sums of advantage-signed terms can sit near 0: an absolute floor besides the relative tolerance.
        assert entry["loss_sums"] == pytest.approx(loss_sums, rel=RTOL, abs=1e-6), layout
        assert entry["loss_sums"] == pytest.approx(one_rank["loss_sums"], rel=RTOL, abs=1e-6), layout
        # Rank 0's share: the first datums of each call.
        for call_got, call_expected in zip(entry["logprobs"], logprobs, strict=True):
            assert 0 < len(call_got) <= len(call_expected)
            for a, b in zip(call_got, call_expected):
                torch.testing.assert_close(a, b, rtol=RTOL, atol=1e-6, msg=f"{layout} log-probs")
        for fqn, g in grads.items():
            assert_rel_close(entry["grads"][fqn], g, f"{layout} {loss_fn} grad {fqn}")
            assert_rel_close(entry["grads"][fqn], one_rank["grads"][fqn], f"{layout} vs one rank {fqn}")


def test_data_exercises_clips_signs_and_micro_batches():
    """Premise: ratios (GSPO's sequence ratios) fall below, inside and above the clip bounds,
    advantages and CE weights take both signs, and one rank's datums need several micro-batches."""
    model = reference_model(False)
    for loss_fn, config in tc.CONFIGS.items():
        datums = tc.datums(loss_fn, 0)
        if loss_fn == "cross_entropy":
            weights = torch.cat([d.inputs["weights"] for d in datums])
            assert (weights < 0).any() and (weights > 0).any()
            continue
        assert (torch.cat([d.inputs["advantages"] for d in datums]) < 0).any()
        if loss_fn in ("importance_sampling", "dro"):
            continue
        low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
        with torch.no_grad():
            log_ratios = [target_logprobs(model, d) - d.inputs["logprobs"] for d in datums]
        ratios = tinker_ratios(loss_fn, log_ratios, [d.inputs.get("sequence_ratio_mask") for d in datums])
        assert (ratios < low).any() and (ratios > high).any() and ((ratios > low) & (ratios < high)).any(), loss_fn
    assert sum(tc.CALL_LENGTHS[0]) > 2 * tc.BUDGET and max(tc.CALL_LENGTHS[0]) == tc.BUDGET
