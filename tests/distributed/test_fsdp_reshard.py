"""FSDP reshard-after-forward policies (``parallelism.fsdp_reshard_after_forward``) on dp 2.

Every policy trains like a one-process reference that runs every sequence alone: two clipped
AdamW steps over several micro-batches per rank, with an ``Engine.forward`` between the first
backward and its step (gradients, logged loss, max loss and grad norm, parameters after each
step, and the forward's log-probs). Between a forward and its backward exactly the policy's
groups hold gathered parameters ("default": the last block run, with its MoE experts;
"always": none; "never": all, a VLM's vision tower included), and after ``Engine.forward``
every group is sharded again. The other layout tests run the "default" policy.
"""

import functools

import pytest
import torch

import layout_cases as lc
import moe_cases
import reshard_cases as rc
import vlm_cases
from test_layout_invariance import (
    assert_rel_close,
    grad_norm,
    per_sequence_losses,
    per_sequence_values,
    reduced_loss,
    reference_model,
)
from torchtitan_rl.distributed.fsdp import RESHARD_POLICIES

RTOL = 1e-5
LAYOUT = rc.RESHARD_LAYOUTS[0]
WORLD = LAYOUT[0] * LAYOUT[1] * LAYOUT[2] * LAYOUT[3]


@pytest.fixture(scope="module")
def results(layout_results) -> dict:
    return layout_results[WORLD]


@functools.cache
def reference_steps() -> tuple[list[torch.Tensor], list[dict]]:
    """The log-probs of the "uneven" batch at the initial weights, and per optimizer step the
    loss, max per-sequence loss, gradients, their norm and the parameters after the step."""
    model = reference_model(False)
    logprobs = [per_sequence_values(model, s)["logprobs"].detach() for s in lc.global_batch("uneven")]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lc.LR, betas=(0.9, 0.95), eps=lc.ADAM_EPS, weight_decay=0.1)
    steps = []
    for i, variant in enumerate(rc.STEP_DATA):
        seqs = per_sequence_losses(model, variant)
        loss = reduced_loss(seqs, "token_mean", 0, 1)
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        grads = {fqn: p.grad.clone() for fqn, p in model.named_parameters()}
        norm = grad_norm(grads)
        for p in model.parameters():
            p.grad.mul_(min(1.0, lc.MAX_NORM / (norm + 1e-6)))
        # Linear decay to 0 at step TOTAL_STEPS, no warmup: step i + 1 runs at lr * (1 - i / (TOTAL_STEPS - 1)).
        for group in optimizer.param_groups:
            group["lr"] = lc.LR * (1 - i / (rc.TOTAL_STEPS - 1))
        optimizer.step()
        steps.append(
            {
                "loss": float(loss.detach()),
                "max_loss": max(float((l * m).sum().detach() / m.sum()) for l, m in seqs if m.sum() > 0),
                "grads": grads,
                "grad_norm": norm,
                "params": {fqn: p.detach().clone() for fqn, p in model.named_parameters()},
            }
        )
    return logprobs, steps


@pytest.mark.parametrize("policy", RESHARD_POLICIES)
def test_every_policy_trains_like_the_reference(results, policy):
    logprobs, ref_steps = reference_steps()
    assert ref_steps[0]["grad_norm"] > lc.MAX_NORM and ref_steps[1]["grad_norm"] > lc.MAX_NORM  # both steps clip
    got = results[rc.key(LAYOUT, "dense", policy)]
    assert len(got) == len(ref_steps)
    rank0_logprobs = got[0]["forward_logprobs"]
    assert len(rank0_logprobs) == lc.GLOBAL_BATCH_SIZE // (LAYOUT[0] * LAYOUT[1])
    for actual, expected in zip(rank0_logprobs, logprobs):
        assert_rel_close(actual, expected, f"{policy} forward log-probs")
    for step, (entry, ref) in enumerate(zip(got, ref_steps), start=1):
        what = f"{policy} step {step}"
        for fqn, g in ref["grads"].items():
            assert_rel_close(entry["grads"][fqn], g, f"{what} grad {fqn}")
        logged = entry["logged"]
        assert logged["loss_metrics/global_avg_loss"] == pytest.approx(ref["loss"], rel=RTOL), what
        assert logged["loss_metrics/global_max_loss"] == pytest.approx(ref["max_loss"], rel=RTOL), what
        assert logged["grad_norm"] == pytest.approx(ref["grad_norm"], rel=RTOL), what
        for fqn, p in ref["params"].items():
            torch.testing.assert_close(entry["params"][fqn], p, rtol=1e-5, atol=1e-6, msg=f"{what} {fqn}")


def expected_gathered(policy: str, blocks: list[str], last: list[str]) -> list[str]:
    """The groups gathered between forward and backward: ``blocks`` are every group but the
    root, ``last`` those of the last block run in forward."""
    return {"always": [], "never": blocks, "default": last}[policy]


def _units() -> dict[str, tuple[list[str], list[str]]]:
    """Per model of the records: (every FSDP group below the root, those of the last block)."""
    dense = [f"layers.{i}" for i in range(lc.model_args().n_layers)]
    moe_args = moe_cases.model_args()
    moe = [f"layers.{i}" for i in range(moe_args.n_layers)]
    moe += [f"layers.{i}.moe.experts" for i in range(moe_args.n_layers) if i not in moe_args.mlp_only_layers]
    last_moe = f"layers.{moe_args.n_layers - 1}"
    assert moe_args.n_layers - 1 not in moe_args.mlp_only_layers  # the last block has experts
    vision = vlm_cases.model_args().vision
    vlm = dense + [f"vision_tower.layers.{i}" for i in range(vision.n_layers)] + ["projector"]
    return {
        "dense": (dense, [dense[-1]]),
        "moe": (moe, [last_moe, f"{last_moe}.moe.experts"]),
        "vlm": (vlm, [dense[-1]]),
    }


@pytest.mark.parametrize("policy", RESHARD_POLICIES)
@pytest.mark.parametrize("model", ["dense", "moe", "vlm"])
def test_groups_gathered_between_forward_and_backward_follow_the_policy(results, policy, model):
    got = results[rc.key(LAYOUT, model, policy)]
    entries = got if model == "dense" else [got]  # the dense model records each of its steps
    records = [r for entry in entries for r in entry["gathered_before_backward"]]
    assert len(records) > 1, "several micro-batches per rank"
    blocks, last = _units()[model]
    for gathered in records:
        assert sorted(gathered) == sorted(expected_gathered(policy, blocks, last)), (model, policy)


@pytest.mark.parametrize("policy", RESHARD_POLICIES)
def test_forward_without_backward_reshards_every_group(results, policy):
    """After ``Engine.forward`` every parameter is sharded again, the root's included, though the
    policy left groups gathered during it (these would go stale at the next optimizer step)."""
    dense = results[rc.key(LAYOUT, "dense", policy)][0]
    blocks, last = _units()["dense"]
    assert dense["gathered_in_forward"] and all(
        sorted(g) == sorted(expected_gathered(policy, blocks, last)) for g in dense["gathered_in_forward"]
    )
    assert dense["sharded_after_forward"]
    for model in ("moe", "vlm"):
        assert results[rc.key(LAYOUT, model, policy)]["sharded_after_forward"], (model, policy)
