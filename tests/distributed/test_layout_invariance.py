"""The promise: gradient, grad norm and logged loss do not depend on the parallel layout.

One torchrun launch per world size (2, 4 and 8 gloo ranks) runs every layout, reduction mode
and micro-batch budget (see layout_worker.py); dp=1 runs in this process. Each result is
compared with a single-process, full-batch reference that runs every sequence alone
(no packing) and applies the reduction formulas of docs/design.md ('Loss weights') written out by hand; for the
RL losses (with KL and entropy on) also the loss formulas and every logged rl/* metric.
"""

import dataclasses
import functools
import re

import pytest
import torch
import torch.nn.functional as F

import layout_cases as lc
import layout_worker
import torchtitan_rl.engine as engine_module
from reference import minibatch_loss
from torchtitan_rl.distributed.context_parallel import ZigzagLayout
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.losses.reduction import REDUCTION_MODES
from torchtitan_rl.models.qwen3.model import Qwen3Model

RTOL = 1e-5


@pytest.fixture(scope="module")
def results(layout_results) -> dict[int, dict]:
    return layout_results


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
    """The mode's mini-batch loss of per-sequence (token losses, mask) pairs (prompt groups: lc.RL_GROUPS)."""
    n = [m.sum() for _, m in seqs]
    sums = [(l * m).sum() for l, m in seqs]
    if mode != "token_mean_legacy":
        return minibatch_loss(sums, n, mode, lc.HORIZON, list(lc.RL_GROUPS))
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
    return int(parts[0][len("rep") :]) * int(parts[1][len("shard") :])


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
        if not key.startswith("rep") or parts[-1] in ("init", "step", "forward") or parts[1] == "rl":
            continue
        layout, mode, budget, variants = parts[0], parts[1], int(parts[2][len("budget") :]), tuple(parts[3].split("+"))
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
            assert {m for lay, m in checked_modes if lay == layout} >= set(layout_worker.SFT_MODES), layout
    assert checked >= len(layout_worker.COMPOSITE_CASES) - 1


@pytest.mark.parametrize("world", WORLDS)
def test_forward_logprobs_and_entropies_equal_per_sequence_reference(results, world):
    """Engine.forward: every sample's log-probs and entropies, in order, whatever splits its tokens."""
    model = reference_model(False)
    for layout in layout_keys(results, world):
        if layout.endswith("_tied"):
            continue
        got = results[world][f"{layout}/forward"]
        expected = [per_sequence_values(model, s) for s in lc.global_batch("uneven")][: len(got["logprobs"])]
        assert len(got["logprobs"]) == len(got["entropies"]) == lc.GLOBAL_BATCH_SIZE // batch_degree(layout), layout
        for logprobs, entropies, e in zip(got["logprobs"], got["entropies"], expected):
            assert_rel_close(logprobs, e["logprobs"].detach(), f"{layout} forward log-probs")
            assert_rel_close(entropies, e["entropy"].detach(), f"{layout} forward entropies")


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
    legacy = results[2]["rep1_shard2_cp1_tp1/token_mean_legacy/budget24/uneven"]["logged"][
        "loss_metrics/global_avg_loss"
    ]
    exact = results[2]["rep1_shard2_cp1_tp1/token_mean/budget24/uneven"]["logged"]["loss_metrics/global_avg_loss"]
    legacy_one_mb = results[1]["rep1_shard1_cp1_tp1/token_mean_legacy/budget0/uneven"]["logged"][
        "loss_metrics/global_avg_loss"
    ]
    # Float rounding moves these by ~1e-7 relative; the layout dependence is far larger.
    assert abs(legacy - exact) > 1e-4 * abs(exact)
    assert abs(legacy - legacy_one_mb) > 1e-4 * abs(exact)
    assert legacy_one_mb == pytest.approx(exact, rel=RTOL)  # one micro-batch on one rank: same thing


# ---------------------------------------------------------------- RL losses, KL and entropy on


def per_sequence_values(model: Qwen3Model, sample) -> dict:
    """Log-probs of the labels and entropies of one sequence, run alone with full logits."""
    n = len(sample)
    log_softmax = model.output(model(sample.input_ids, torch.arange(n), torch.zeros(n, dtype=torch.long))).log_softmax(
        -1
    )
    return {
        "logprobs": log_softmax.gather(1, sample.labels[:, None])[:, 0],
        "entropy": -(log_softmax.exp() * log_softmax).sum(-1),
    }


def rl_token_values(model: Qwen3Model, loss_fn: str) -> list[dict]:
    """Per sequence, the per-token loss, its terms and the statistics, from the published formulas of each loss."""
    cfg = lc.RL_LOSS_FNS[loss_fn]
    out = []
    for sample in lc.rl_batch():
        v = per_sequence_values(model, sample)
        logp, adv, mask = v["logprobs"], sample.advantages, sample.loss_mask.float()
        old = sample.prox_logprobs if cfg.get("proximal_logprobs") else sample.sampler_logprobs
        ratio = torch.exp(logp - old)
        low, high = 1 - cfg.get("clip_low", 0.0), 1 + cfg.get("clip_high", 0.0)
        stats = {}
        if loss_fn == "gspo":
            # The sequence's ratio exp(mean of log r over its loss tokens) in value, each token's
            # own log-prob in gradient; the clip and its fractions per sequence, per sign of A.
            seq_log_ratio = ((logp - old) * mask).sum() / mask.sum().clamp(min=1)
            ratio = torch.exp(seq_log_ratio.detach() + logp - logp.detach())
            pg = torch.where(adv >= 0, -ratio.clamp(max=high) * adv, -ratio.clamp(min=low) * adv)
            stats["gspo/clipfrac_low"] = (adv < 0) & (ratio < low)
            stats["gspo/clipfrac_high"] = (adv > 0) & (ratio > high)
            stats["gspo/clipfrac"] = stats["gspo/clipfrac_low"] | stats["gspo/clipfrac_high"]
        elif loss_fn == "importance_sampling":
            pg = -ratio * adv
        elif loss_fn == "ppo":
            # The pessimistic bound written per sign of A: min(r, 1+e) for A >= 0, max(r, 1-e) for A < 0.
            pg = torch.where(adv >= 0, -ratio.clamp(max=high) * adv, -ratio.clamp(min=low) * adv)
            c = cfg["dual_clip_c"]
            pg = torch.where(adv < 0, torch.minimum(pg, -c * adv), pg)
            stats["clipfrac_low"] = (adv < 0) & (ratio < low)
            stats["clipfrac_high"] = (adv > 0) & (ratio > high)
            stats["clipfrac_dual"] = (adv < 0) & (ratio > c)
            stats["clipfrac"] = stats["clipfrac_low"] | stats["clipfrac_high"] | stats["clipfrac_dual"]
        else:
            assert loss_fn == "cispo"
            pg = -ratio.detach().clamp(low, high) * adv * logp
            stats["clipfrac_low"], stats["clipfrac_high"] = ratio < low, ratio > high
            stats["clipfrac"] = stats["clipfrac_low"] | stats["clipfrac_high"]
        if cfg.get("rollout_weights"):
            pg = pg * sample.rollout_weights
        stats["ppo_kl"] = (old - logp).detach()
        delta = logp - sample.ref_logprobs
        k3 = torch.exp(-delta) - 1 + delta
        kl = {"k2": delta**2 / 2, "k3": k3, "low_var_kl": k3.clamp(max=10.0)}[cfg["kl_estimator"]]
        stats.update(ratio=ratio.detach(), logprob_diff=(logp - sample.sampler_logprobs).abs().detach(), advantage=adv)
        loss = pg + cfg["kl_coef"] * kl - cfg["entropy_coef"] * v["entropy"]
        out.append(
            {
                "loss": loss,
                "pg_loss": pg,
                "kl": kl,
                "entropy": v["entropy"],
                "mask": mask,
                "stats": stats,
            }
        )
    return out


@dataclasses.dataclass
class RLReference:
    grads: dict
    logged: dict  # every tag the run must log, rl/* included, and its value


def rl_reference(loss_fn: str, mode: str, budget: int, dp: int) -> RLReference:
    if mode != "token_mean_legacy":
        budget, dp = 0, 1
    return _rl_reference(loss_fn, mode, budget, dp)


@functools.cache
def _rl_reference(loss_fn: str, mode: str, budget: int, dp: int) -> RLReference:
    model = reference_model(False)
    seqs = rl_token_values(model, loss_fn)
    loss = reduced_loss([(s["loss"], s["mask"]) for s in seqs], mode, budget, dp)
    loss.backward()
    grads = {fqn: p.grad.clone() for fqn, p in model.named_parameters()}
    masks = torch.cat([s["mask"] for s in seqs]).bool()
    logged = {
        "loss_metrics/global_avg_loss": float(loss.detach()),
        "loss_metrics/global_max_loss": max(
            float((s["loss"] * s["mask"]).sum() / s["mask"].sum()) for s in seqs if s["mask"].sum() > 0
        ),
        "grad_norm": grad_norm(grads),
    }
    for term in ("pg_loss", "kl", "entropy"):
        logged[f"rl/{term}"] = float(reduced_loss([(s[term].detach(), s["mask"]) for s in seqs], mode, budget, dp))
    for name in seqs[0]["stats"]:
        values = torch.cat([s["stats"][name] for s in seqs]).double()[masks]
        if name.startswith(("clipfrac", "gspo/clipfrac")) or name == "ppo_kl":
            logged[f"rl/{name}"] = float(values.mean())
            continue
        logged[f"rl/{name}_mean"] = float(values.mean())
        if name != "advantage":
            logged[f"rl/{name}_max"] = float(values.max())
    logged["rl/ratio_min"] = float(torch.cat([s["stats"]["ratio"] for s in seqs])[masks].min())
    return RLReference(grads, logged)


def check_rl_entry(key: str, entry: dict) -> None:
    """One RL case of one layout against the reference: gradients and every logged number."""
    layout, _, loss_fn, mode, budget = key.split("/")[:5]
    ref = rl_reference(loss_fn, mode, int(budget[len("budget") :]), batch_degree(layout))
    for fqn, g in ref.grads.items():
        assert_rel_close(entry["grads"][fqn], g, f"{key} grad {fqn}")
    logged = entry["logged"]
    assert {t for t in logged if t.startswith("rl/")} == {t for t in ref.logged if t.startswith("rl/")}, key
    for tag, value in ref.logged.items():
        assert logged[tag] == pytest.approx(value, rel=RTOL, abs=1e-9), (key, tag)


def rl_layout_name(layout: tuple) -> str:
    return "rep{}_shard{}_cp{}_tp{}".format(*layout)


@pytest.mark.parametrize("world", WORLDS)
def test_rl_losses_with_kl_and_entropy_equal_full_batch_reference(results, world):
    checked = set()
    for key, entry in results[world].items():
        if key.split("/")[1:2] == ["rl"]:
            check_rl_entry(key, entry)
            layout, _, loss_fn, mode, budget = key.split("/")[:5]
            checked.add((layout, loss_fn, mode, int(budget[len("budget") :])))
    expected = {
        (rl_layout_name(layout), loss_fn, mode, budget)
        for layout in lc.RL_LAYOUTS
        if layout in lc.layouts(world)
        for loss_fn in lc.RL_LOSS_FNS
        for mode in REDUCTION_MODES
        # Layouts that combine parallel dims or span more than 2 ranks run the budget of several
        # micro-batches only; those of more than 2 ranks run the losses other than ppo in two modes.
        if world <= 2 or loss_fn == "ppo" or mode in ("token_mean", "sequence_mean")
        for budget in (lc.RL_BUDGETS if world <= 2 and sum(d > 1 for d in layout) <= 1 else (24,))
    }
    assert checked == expected


@pytest.mark.parametrize("world", WORLDS)
def test_gspo_means_taken_per_cp_share_are_rejected(results, world):
    """The check above has teeth for sequence ratios: GSPO whose sequence means leave out the
    other CP shares' tokens differs from the reference on every CP layout it runs on."""
    mutants = {k[len("mutant/") :]: v for k, v in results[world].items() if k.startswith("mutant/")}
    expected = {rl_layout_name(layout) for layout in lc.RL_LAYOUTS if layout in lc.layouts(world) and layout[2] > 1}
    assert {key.split("/")[0] for key in mutants} == expected
    for key, entry in mutants.items():
        with pytest.raises(AssertionError):
            check_rl_entry(key, entry)


def test_rl_data_exercises_every_clip_and_term():
    """The premise of the RL cases: clips bind on both sides (and the dual clip), groups differ in size."""
    for loss_fn in lc.RL_LOSS_FNS:
        logged = rl_reference(loss_fn, "token_mean", 0, 1).logged
        for tag, value in logged.items():
            if tag.startswith(("rl/clipfrac", "rl/gspo/clipfrac")):
                assert 0.02 < value < 0.9, (loss_fn, tag, value)
        if loss_fn == "gspo":  # sequence ratios: means of many tokens' log-ratios
            assert logged["rl/ratio_min"] < 0.98 and logged["rl/ratio_max"] > 1.03, loss_fn
        else:
            assert logged["rl/ratio_min"] < 0.7 and logged["rl/ratio_max"] > 1.5, loss_fn
        assert logged["rl/kl"] > 0.01 and logged["rl/entropy"] > 1.0
    sizes = [lc.RL_GROUPS.count(g) for g in set(lc.RL_GROUPS)]
    assert len(set(sizes)) > 1
    # prompt_mean is a different mode on this data, not sequence_mean in disguise.
    a = rl_reference("ppo", "prompt_mean", 0, 1).logged["loss_metrics/global_avg_loss"]
    b = rl_reference("ppo", "sequence_mean", 0, 1).logged["loss_metrics/global_avg_loss"]
    assert abs(a - b) > 1e-3 * abs(b)


def test_kl_normalized_per_microbatch_fails_the_layout_check(monkeypatch):
    """Mutation: SkyRL's convention, KL as a token mean inside each micro-batch while the policy
    term keeps the mode's weights, must fail the RL check (here on one rank with several
    micro-batches, where the true weights differ from per-micro-batch ones)."""
    real = engine_module.weighted_loss

    def kl_per_microbatch(loss, terms, weights):
        mask = terms.mask.float()
        kl_mean = (terms.kl * mask).sum() / mask.sum().clamp(min=1)
        return real(loss, dataclasses.replace(terms, kl=None), weights) + loss.options["kl_coef"] * kl_mean

    dims = ParallelDims(1, 1, 1, 1, world_size=1)
    dims.build_meshes("cpu")
    case = ("ppo", "token_mean", 24, ("rl",), False)
    honest, mutated = {}, {}
    layout_worker.run_layout(dims, False, honest, [case])
    monkeypatch.setattr(engine_module, "weighted_loss", kl_per_microbatch)
    layout_worker.run_layout(dims, False, mutated, [case])
    key = layout_worker.case_key("rep1_shard1_cp1_tp1", *case)
    check_rl_entry(key, honest[key])
    with pytest.raises(AssertionError):
        check_rl_entry(key, mutated[key])


def test_a_bad_sample_on_one_rank_stops_every_rank_naming_the_cause(results):
    """dp = 2, rank 1 alone holds the bad sample: both ranks raise (none waits in a collective),
    rank 1 names the cause, and the next step runs normally."""
    causes = {
        "no_advantages": r"sample 0 of this rank's 4 has no advantages",
        "nan_sampler_logprobs": r"sample 1 of this rank's 4: sampler_logprobs\[2\] = nan is not finite",
        "group_id_out_of_range": r"group_id 1000000 is out of range: .* at most 8 samples",
        "too_long_for_budget": r"a sample of 30 tokens exceeds training.max_tokens_per_microbatch=24",
    }
    for case, cause in causes.items():
        rank0, rank1 = results[2][f"bad_input/{case}"]
        assert re.search(cause, rank1), (case, rank1)
        if case == "group_id_out_of_range":
            assert rank0 == rank1  # found after the ranks agreed on the largest group id
        else:
            assert "another data-parallel rank refused its samples" in rank0, (case, rank0)
    got = results[2]["bad_input/then_good_step_grad"]
    for fqn, g in rl_reference("ppo", "prompt_mean", 0, 1).grads.items():
        assert_rel_close(got[fqn], g, f"good step after bad inputs: {fqn}")


def test_every_layout_was_checked(results):
    """Every layout of every world size, and the sdpa_varlen runs of lc.VARLEN_LAYOUTS (the
    checks above treat a ``_varlen`` layout like any other: same reference, same tolerance)."""
    expected = {f"rep{r}_shard{s}_cp{c}_tp{t}" for w in WORLDS for r, s, c, t in lc.layouts(w)}
    expected |= {"rep{}_shard{}_cp{}_tp{}_varlen".format(*layout) for layout in lc.VARLEN_LAYOUTS}
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
            assert max(per_rank) == sample.num_loss_tokens > 0 and sum(per_rank) == sample.num_loss_tokens


def test_metrics_identical_for_cp1_and_cp2(results):
    """Same mini-batch, same mode: every logged number of cp=2 equals that of one rank."""
    for mode in layout_worker.SFT_MODES:
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
    for backend in lc.CP_ATTENTION_BACKENDS:
        got = results[world][f"cp{world}/attention/{backend}"]
        for name, value in expected.items():
            assert_rel_close(got[name], value, f"cp{world} {backend} {name}", rtol=1e-5)


@pytest.mark.parametrize("layout", layout_worker.AC_LAYOUTS)
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_recomputes_blocks_and_leaves_every_gradient_unchanged(results, layout, mode):
    """Full and every-second-block recomputation under FSDP (dp 2) and FSDP x TP (dp2 x tp2):
    each checkpointed block runs twice per micro-batch (once more in backward), the others
    once, and the gradients are those of the same step without checkpointing, within 1e-6."""
    name = "rep{}_shard{}_cp{}_tp{}".format(*layout)
    world = layout[0] * layout[1] * layout[2] * layout[3]
    plain = results[world][layout_worker.case_key(name, *layout_worker.AC_CASE)]["grads"]
    entry = results[world][f"ac/{name}/{mode}"]
    micro_batches = entry["micro_batches"]
    assert micro_batches > 1  # budget 24 splits rank 0's share
    recomputed = {"full": {0, 1}, "selective": {0}}[mode]  # two blocks; selective: every second
    assert lc.model_args().n_layers == 2
    assert entry["block_runs"] == [micro_batches * (2 if i in recomputed else 1) for i in range(2)]
    checkpointed = entry["grads"]
    assert checkpointed.keys() == plain.keys()  # parameter names unchanged
    for fqn, g in plain.items():
        assert_rel_close(checkpointed[fqn], g, f"{name} {mode} {fqn}", rtol=1e-6)


@pytest.mark.parametrize("layout", layout_worker.COMPILE_LAYOUTS)
def test_compiled_blocks_leave_every_gradient_unchanged(results, layout):
    """Compiled blocks (dynamo + AOT autograd) under FSDP (dp 2), TP (tp 2, where the first
    block's input is an asynchronous collective's result) and CP (cp 2): the
    gradients of the same step without compile, within 1e-5, over micro-batches of several
    lengths."""
    name = "rep{}_shard{}_cp{}_tp{}".format(*layout)
    world = layout[0] * layout[1] * layout[2] * layout[3]
    plain = results[world][layout_worker.case_key(name, *layout_worker.AC_CASE)]["grads"]
    compiled = results[world][f"compile/{name}"]
    assert compiled.keys() == plain.keys()  # parameter names unchanged
    for fqn, g in plain.items():
        assert_rel_close(compiled[fqn], g, f"{name} compile {fqn}", rtol=1e-5)
