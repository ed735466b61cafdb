"""The promise: gradient, grad norm and logged loss do not depend on the parallel layout.

One torchrun launch per world size (2 and 4 gloo ranks) runs every layout, reduction mode
and micro-batch budget (see layout_worker.py); dp=1 runs in this process. Each result is
compared with a single-process, full-batch reference that runs every sequence alone
(no packing) and applies the reduction formulas of DESIGN §2 written out by hand.
"""

import functools
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import layout_cases as lc
import layout_worker
from torchtitan_rl.distributed.context_parallel import ZigzagLayout
from torchtitan_rl.losses.reduction import REDUCTION_MODES
from reference import launch_env, minibatch_loss
from torchtitan_rl.models.qwen3.model import Qwen3Model

HERE = os.path.dirname(os.path.abspath(__file__))
RTOL = 1e-5


def _launch_once(world_size: int, out_path: str) -> str | None:
    """Run the worker; None on success, else the failure's telling lines (full log beside OUT)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}",
           os.path.join(HERE, "layout_worker.py"), out_path]
    proc = subprocess.run(cmd, cwd=HERE, env=launch_env(), capture_output=True, text=True, timeout=600)
    if proc.returncode == 0:
        return None
    log = out_path + ".log"
    with open(log, "w") as f:
        f.write(proc.stdout + proc.stderr)
    # The first failing rank's own message is usually far above the tail.
    causes = [line for line in (proc.stdout + proc.stderr).splitlines()
              if any(word in line for word in ("Error", "terminate", "abort", "what()", "exitcode"))]
    return f"{world_size}-rank launch failed (full log: {log}):\n" + "\n".join(causes[:40])


def launch(world_size: int, out_path: str) -> dict:
    failure = _launch_once(world_size, out_path)
    if failure is not None:
        # A gloo rank on this 2-core machine has been seen to abort once in many launches
        # (SIGABRT, never reproduced since). A real bug fails twice; a rerun that passes is
        # still reported.
        warnings.warn(f"retrying after a failed launch: {failure}")
        failure = _launch_once(world_size, out_path)
        assert failure is None, failure
    return torch.load(out_path)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("layouts")
    by_world = {w: launch(w, str(out / f"world{w}.pt")) for w in (2, 4, 8)}
    by_world[1] = layout_worker.run_all_layouts(1)
    return by_world


# ---------------------------------------------------------------- the reference, by hand


def reference_model(tie: bool) -> Qwen3Model:
    model = Qwen3Model(lc.model_args(tie))
    model.init_weights(lc.SEED)
    return model


def per_sequence_losses(model: Qwen3Model, variant: str):
    """(token losses, mask) of each sequence, each run through the model on its own."""
    out = []
    for s in lc.global_batch(variant):
        n = len(s)
        hidden = model(s.input_ids, torch.arange(n), torch.zeros(n, dtype=torch.long))
        out.append((F.cross_entropy(model.output(hidden), s.labels, reduction="none"), s.loss_mask.float()))
    return out


def greedy_plan(lengths: list[int], budget: int) -> list[list[int]]:
    if budget == 0:
        return [list(range(len(lengths)))]
    groups, used = [[]], 0
    for i, n in enumerate(lengths):
        if groups[-1] and used + n > budget:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return groups


def reduced_loss(seqs, mode: str, budget: int, dp: int) -> torch.Tensor:
    n = [m.sum() for _, m in seqs]
    sums = [(l * m).sum() for l, m in seqs]
    if mode != "token_mean_legacy":
        return minibatch_loss(sums, n, mode, lc.HORIZON)
    per_rank = lc.GLOBAL_BATCH_SIZE // dp
    means = []
    for r in range(dp):
        idx = list(range(r * per_rank, (r + 1) * per_rank))
        for group in greedy_plan([len(seqs[i][0]) for i in idx], budget):
            k = sum(n[idx[j]] for j in group)
            if k > 0:
                means.append(sum(sums[idx[j]] for j in group) / k)
    return sum(means) / len(means)


def reference(mode: str, budget: int, variants: tuple, dp: int, tie: bool = False):
    """(loss, grads, max loss, loss tokens) of the full batch; shared by every layout that asks."""
    if mode != "token_mean_legacy":  # the only mode whose reference depends on the split
        budget, dp = 0, 1
    return _reference(mode, budget, variants, dp, tie)


@functools.cache
def _reference(mode: str, budget: int, variants: tuple, dp: int, tie: bool):
    model = reference_model(tie)
    losses = []
    for variant in variants:
        seqs = per_sequence_losses(model, variant)
        losses.append(reduced_loss(seqs, mode, budget, dp))
    sum(losses).backward()
    grads = {fqn: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for fqn, p in model.named_parameters()}
    last = per_sequence_losses(model, variants[-1])
    max_loss = max([float((l * m).sum().detach() / m.sum()) for l, m in last if m.sum() > 0], default=0.0)
    loss_tokens = int(sum(m.sum() for _, m in last))
    return float(losses[-1].detach()), grads, max_loss, loss_tokens


# ---------------------------------------------------------------- comparisons


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = RTOL):
    err = (actual - expected).norm()
    scale = expected.norm()
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    assert err <= rtol * scale + 1e-9, f"{what}: relative error {float(err / scale.clamp(min=1e-30)):.3e}"


def grad_norm(grads: dict) -> float:
    return float(torch.stack([g.norm() for g in grads.values()]).norm())


def layout_keys(results, world):
    return sorted({k.split("/")[0] for k in results[world] if k.startswith("rep")})


def batch_degree(layout: str) -> int:
    """rep{R}_shard{S}_cp{C}_tp{T}[_tied] -> R * S, the number of ranks with different samples."""
    parts = layout.split("_")
    return int(parts[0][len("rep"):]) * int(parts[1][len("shard"):])


WORLDS = [1, 2, 4, 8]


@pytest.mark.parametrize("world", WORLDS)
def test_initial_weights_identical_for_every_layout(results, world):
    for layout in layout_keys(results, world):
        ref = reference_model(layout.endswith("_tied"))
        got = results[world][f"{layout}/init"]
        for fqn, p in ref.named_parameters():
            torch.testing.assert_close(got[fqn], p.detach(), rtol=0, atol=0, msg=f"{layout} {fqn}")


@pytest.mark.parametrize("world", WORLDS)
def test_gradients_and_logged_metrics_equal_full_batch_reference(results, world):
    checked = 0
    for key, entry in results[world].items():
        parts = key.split("/")
        if not key.startswith("rep") or parts[-1] in ("init", "step", "forward"):
            continue
        layout, mode, budget, variants = parts[0], parts[1], int(parts[2][len("budget"):]), tuple(parts[3].split("+"))
        dp = batch_degree(layout)
        loss, grads, max_loss, loss_tokens = reference(mode, budget, variants, dp, layout.endswith("_tied"))
        for fqn, g in grads.items():
            assert_rel_close(entry["grads"][fqn], g, f"{key} grad {fqn}")
        logged = entry["logged"]
        assert logged["loss_metrics/global_avg_loss"] == pytest.approx(loss, rel=RTOL, abs=1e-12), key
        assert logged["loss_metrics/global_max_loss"] == pytest.approx(max_loss, rel=RTOL, abs=1e-12), key
        assert logged["grad_norm"] == pytest.approx(grad_norm(grads), rel=RTOL, abs=1e-12), key
        assert logged["tokens/loss_tokens"] == loss_tokens, key
        # Padding (TP, CP) is never counted; throughput is per rank (the worker's window is
        # the loss-token count over one second).
        assert logged["tokens/total"] == sum(len(s) for s in lc.global_batch(variants[-1])), key
        assert logged["throughput(tps)"] == pytest.approx(loss_tokens / world, rel=1e-12), key
        checked += 1
    checked_modes = {(key.split("/")[0], key.split("/")[1]) for key in results[world] if key.startswith("rep")}
    for layout in layout_keys(results, world):
        if not layout.endswith("_tied"):
            assert {m for lay, m in checked_modes if lay == layout} >= set(REDUCTION_MODES), layout
    assert checked >= len(layout_worker.COMPOSITE_CASES) - 1


@pytest.mark.parametrize("world", WORLDS)
def test_forward_logprobs_equal_per_sequence_reference(results, world):
    """Engine.forward: every sample's log-probs, in order, whatever splits its tokens."""
    model = reference_model(False)
    for layout in layout_keys(results, world):
        if layout.endswith("_tied"):
            continue
        got = results[world][f"{layout}/forward"]
        expected = [-losses for losses, _ in per_sequence_losses(model, "uneven")][: len(got)]
        assert len(got) == lc.GLOBAL_BATCH_SIZE // batch_degree(layout), layout
        for g, e in zip(got, expected):
            assert_rel_close(g, e.detach(), f"{layout} forward")


@pytest.mark.parametrize("world", WORLDS)
def test_zero_loss_token_batch_gives_zero_gradient(results, world):
    for layout in layout_keys(results, world):
        entry = results[world][f"{layout}/token_mean/budget24/no_loss"] if not layout.endswith("_tied") else None
        if entry is None:
            continue
        assert all(torch.equal(g, torch.zeros_like(g)) for g in entry["grads"].values())
        assert entry["logged"]["loss_metrics/global_avg_loss"] == 0.0
        assert entry["logged"]["grad_norm"] == 0.0


@pytest.mark.parametrize("world", WORLDS)
def test_clipped_adamw_step_equals_reference(results, world):
    for layout in layout_keys(results, world):
        if layout.endswith("_tied"):
            continue
        _, grads, _, _ = reference("token_mean", 24, ("uneven",), batch_degree(layout))
        model = reference_model(False)
        norm = grad_norm(grads)
        assert norm > lc.MAX_NORM, "the case must exercise clipping"
        scale = lc.MAX_NORM / (norm + 1e-6)
        for fqn, p in model.named_parameters():
            p.grad = grads[fqn] * scale
        # Schedule of the worker: no warmup, so step 1 runs at the full lr.
        torch.optim.AdamW(model.parameters(), lr=lc.LR, betas=(0.9, 0.95), eps=lc.ADAM_EPS, weight_decay=0.1).step()
        got = results[world][f"{layout}/token_mean/budget24/uneven/step"]["params"]
        for fqn, p in model.named_parameters():
            torch.testing.assert_close(got[fqn], p.detach(), rtol=1e-5, atol=1e-6, msg=f"{layout} {fqn}")


def test_legacy_mode_depends_on_layout_while_token_mean_does_not(results):
    """token_mean_legacy must differ from token_mean when micro-batches hold unequal counts."""
    legacy = results[2]["rep1_shard2_cp1_tp1/token_mean_legacy/budget24/uneven"]["logged"]["loss_metrics/global_avg_loss"]
    exact = results[2]["rep1_shard2_cp1_tp1/token_mean/budget24/uneven"]["logged"]["loss_metrics/global_avg_loss"]
    legacy_one_mb = results[1]["rep1_shard1_cp1_tp1/token_mean_legacy/budget0/uneven"]["logged"]["loss_metrics/global_avg_loss"]
    # Float rounding moves these by ~1e-7 relative; the layout dependence is far larger.
    assert abs(legacy - exact) > 1e-4 * abs(exact)
    assert abs(legacy - legacy_one_mb) > 1e-4 * abs(exact)
    assert legacy_one_mb == pytest.approx(exact, rel=RTOL)  # one micro-batch on one rank: same thing


def test_every_layout_was_checked(results):
    expected = {f"rep{r}_shard{s}_cp{c}_tp{t}" for w in WORLDS for r, s, c, t in lc.layouts(w)}
    assert {layout for w in WORLDS for layout in layout_keys(results, w) if not layout.endswith("_tied")} == expected


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_logprobs_and_entropy_equal_dense(results, world):
    hidden, weight, labels = lc.logprob_inputs()
    hidden.requires_grad_()
    weight.requires_grad_()
    log_softmax = (hidden @ weight.t()).log_softmax(-1)
    logprobs = log_softmax.gather(1, labels[:, None])[:, 0]
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    (logprobs * torch.arange(1.0, lc.LOGPROB_TOKENS + 1)).sum().add(entropy.sum()).backward()
    expected = {"logprobs": logprobs, "entropy": entropy, "grad_hidden": hidden.grad, "grad_weight": weight.grad}
    for loss_parallel in (1, 0):
        for chunk in lc.LOGPROB_CHUNKS:
            got = results[world][f"tp{world}/logprobs/parallel{loss_parallel}/chunk{chunk}"]
            for name, value in expected.items():
                assert_rel_close(got[name], value.detach(), f"tp{world} {name} chunk {chunk}", rtol=1e-6)


def test_cp_data_puts_all_loss_tokens_of_one_sequence_on_one_rank():
    """The premise of the CP layouts above: one sequence's loss sits on a single CP rank."""
    sample = lc.global_batch("uneven")[lc.MIDDLE_LOSS]
    for w in WORLDS:
        for _, _, cp, tp in lc.layouts(w):
            if cp == 1:
                continue
            layout = ZigzagLayout.build([len(sample)], cp, tp)
            per_rank = [int(layout.split(sample.loss_mask, r, pad_value=False).sum()) for r in range(cp)]
            assert sorted(per_rank)[-1] == sample.num_loss_tokens > 0 and sum(per_rank) == sample.num_loss_tokens


def test_metrics_identical_for_cp1_and_cp2(results):
    """Same mini-batch, same mode: every logged number of cp=2 equals that of one rank."""
    for mode in REDUCTION_MODES:
        for budget in lc.BUDGETS:
            case = f"{mode}/budget{budget}/uneven"
            one = results[1][f"rep1_shard1_cp1_tp1/{case}"]["logged"]
            two = results[2][f"rep1_shard1_cp2_tp1/{case}"]["logged"]
            for tag in ("loss_metrics/global_avg_loss", "loss_metrics/global_max_loss", "grad_norm"):
                assert two[tag] == pytest.approx(one[tag], rel=RTOL), (case, tag)
            for tag in ("tokens/loss_tokens", "tokens/total"):
                assert two[tag] == one[tag], (case, tag)


@pytest.mark.parametrize("world", [2, 4])
def test_cp_attention_equals_unsplit_attention(results, world):
    """Outputs and q/k/v gradients of attention under CP against the whole packed buffer."""
    q, k, v, out_weights = (t.clone() for t in lc.cp_attention_inputs())
    for t in (q, k, v):
        t.requires_grad_()
    lens = torch.tensor(lc.CP_ATTENTION_LENS)
    seq_ids = torch.repeat_interleave(torch.arange(len(lens)), lens)
    # Brute force: each document alone through causal SDPA (GQA by repeating K/V heads).
    repeat = lc.CP_ATTENTION_HEADS // lc.CP_ATTENTION_KV_HEADS
    outs = []
    for doc in range(len(lens)):
        rows = seq_ids == doc
        qd, kd, vd = (t[rows].transpose(0, 1) for t in (q, k, v))
        kd, vd = kd.repeat_interleave(repeat, 0), vd.repeat_interleave(repeat, 0)
        outs.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True).transpose(0, 1))
    out = torch.cat(outs)
    (out * out_weights).sum().backward()
    expected = {"out": out.detach(), "grad_q": q.grad, "grad_k": k.grad, "grad_v": v.grad}
    for backend in ("sdpa_dense", "sdpa_loop"):
        got = results[world][f"cp{world}/attention/{backend}"]
        for name, value in expected.items():
            assert_rel_close(got[name], value, f"cp{world} {backend} {name}", rtol=1e-5)
