"""RL loss functions, KL estimators and the entropy bonus against brute-force formulas.

The reference is written token by token in plain Python floats: each loss's published
formula and its derivative by hand (which branch is active decides it), never the code
under test.
"""

import math
import random
import zlib

import pytest
import torch

from torchtitan_rl.config.job_config import JobConfig, Loss
from torchtitan_rl.data.packing import pack
from torchtitan_rl.data.sample import Sample
from torchtitan_rl.losses.loss_fns import (
    KL_ESTIMATORS,
    LOSS_FNS,
    MAX_LOG_RATIO,
    LossMetrics,
    loss_fn_from_config,
    per_token_loss,
    resolve_loss_fn,
    token_terms,
    weighted_loss,
)
from torchtitan_rl.losses.preference import PREFERENCE_LOSSES
from torchtitan_rl.losses.reduction import local_counts, token_weights
from torchtitan_rl.recipes.sft import sft_loss_fn


def brute_policy(name: str, x: float, q: float, a: float, options: dict) -> tuple[float, float]:
    """(ℓ^pg, dℓ^pg/dlogp_θ) of one token with log-prob x, sampler log-prob q, advantage a."""
    log_ratio = min(max(x - q, -MAX_LOG_RATIO), MAX_LOG_RATIO)
    inside = abs(x - q) < MAX_LOG_RATIO  # the clamp passes no gradient outside
    r = math.exp(log_ratio)
    dr = r if inside else 0.0
    if name == "cross_entropy":
        return -x, -1.0
    if name == "importance_sampling":
        return -r * a, -dr * a
    lo, hi = 1 - options["clip_low"], 1 + options["clip_high"]
    if name == "cispo":
        w = min(max(r, lo), hi)
        return -w * a * x, -w * a
    assert name == "ppo"
    # Written per sign of A: the pessimistic (larger) loss of clipped and unclipped ratio.
    if a >= 0:
        loss, grad = (-hi * a, 0.0) if r > hi else (-r * a, -dr * a)
    else:
        loss, grad = (-lo * a, 0.0) if r < lo else (-r * a, -dr * a)
        c = options["dual_clip_c"]
        if c is not None and loss > -c * a:
            loss, grad = -c * a, 0.0
    return loss, grad


def brute_kl(estimator: str, x: float, ref: float) -> tuple[float, float]:
    """(KL_t, dKL_t/dlogp_θ) with Δ = x - ref."""
    d = x - ref
    if estimator == "k1":
        return d, 1.0
    if estimator == "k2":
        return d * d / 2, d
    k3, dk3 = math.exp(-d) - 1 + d, 1 - math.exp(-d)
    if estimator == "low_var_kl" and k3 > 10:
        return 10.0, 0.0
    return k3, dk3


def make_mb(x, q, ref, adv, mask):
    sample = Sample(
        input_ids=torch.zeros(len(x), dtype=torch.long),
        labels=torch.zeros(len(x), dtype=torch.long),
        loss_mask=torch.tensor(mask),
        advantages=torch.tensor(adv),
        sampler_logprobs=torch.tensor(q),
        ref_logprobs=torch.tensor(ref),
        group_id=0,
    )
    return pack([sample], inputs=("advantages", "sampler_logprobs", "ref_logprobs"))


def random_tokens(seed: int, n: int = 40):
    rng = random.Random(seed)
    x = [rng.uniform(-5.0, -0.1) for _ in range(n)]
    # Ratios from e^-1.5 to e^1.5 cover both clip sides and the dual clip; zero advantages too.
    q = [xi - rng.uniform(-1.5, 1.5) for xi in x]
    ref = [xi - rng.uniform(-3.5, 3.0) for xi in x]  # Δ below -2.4 makes k3 > 10
    adv = [0.0 if i % 7 == 0 else rng.gauss(0.0, 1.0) for i in range(n)]
    entropy = [rng.uniform(0.0, 3.0) for _ in range(n)]
    # Values a float32 holds exactly: RL inputs are stored as float32.
    return [torch.tensor(v, dtype=torch.float32).tolist() for v in (x, q, ref, adv, entropy)]


CONFIGS = [
    ("cross_entropy", {}),
    ("cross_entropy", {"kl_coef": 0.3, "kl_estimator": "k2", "entropy_coef": 0.01}),
    ("importance_sampling", {"kl_coef": 0.1, "kl_estimator": "k1", "entropy_coef": 0.02}),
    ("ppo", {"clip_low": 0.2, "clip_high": 0.28}),
    (
        "ppo",
        {
            "clip_low": 0.1,
            "clip_high": 0.3,
            "dual_clip_c": 2.0,
            "kl_coef": 0.2,
            "kl_estimator": "k3",
            "entropy_coef": -0.05,
        },
    ),
    ("cispo", {"clip_low": 0.5, "clip_high": 0.2, "kl_coef": 0.5, "kl_estimator": "low_var_kl", "entropy_coef": 0.1}),
]


@pytest.mark.parametrize("name, config", CONFIGS)
def test_per_token_loss_and_gradient_match_brute_force(name, config):
    loss = resolve_loss_fn(name, config)
    # crc32, not hash(): str hashes change per process unless PYTHONHASHSEED is set.
    x, q, ref, adv, entropy = random_tokens(zlib.crc32(name.encode()) % 100 + len(config))
    mb = make_mb(x, q, ref, adv, [True] * len(x))
    logprobs = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    ent = torch.tensor(entropy, dtype=torch.float64, requires_grad=True)
    mb = mb.map_tokens(lambda t: t.double() if t.is_floating_point() else t)
    values = per_token_loss(loss, token_terms(loss, logprobs, ent if loss.needs_entropy else None, mb))
    values.sum().backward()
    values = values.detach()
    o = loss.options
    for t in range(len(x)):
        pg, dpg = brute_policy(name, x[t], q[t], adv[t], o)
        kl, dkl = brute_kl(o["kl_estimator"], x[t], ref[t]) if o["kl_coef"] > 0 else (0.0, 0.0)
        expected = pg + o["kl_coef"] * kl - o["entropy_coef"] * entropy[t]
        assert float(values[t]) == pytest.approx(expected, rel=1e-9, abs=1e-12), t
        assert float(logprobs.grad[t]) == pytest.approx(dpg + o["kl_coef"] * dkl, rel=1e-9, abs=1e-12), t
        if o["entropy_coef"] != 0:
            assert float(ent.grad[t]) == -o["entropy_coef"]
    if o["entropy_coef"] == 0:
        assert ent.grad is None  # reported, not trained


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_each_kl_estimator(estimator):
    loss = resolve_loss_fn("cross_entropy", {"kl_coef": 1.0, "kl_estimator": estimator})
    x, q, ref, adv, _ = random_tokens(3)
    mb = make_mb(x, q, ref, adv, [True] * len(x))
    logprobs = torch.tensor(x, requires_grad=True)
    terms = token_terms(loss, logprobs, None, mb)
    terms.kl.sum().backward()
    for t in range(len(x)):
        kl, dkl = brute_kl(estimator, x[t], ref[t])
        assert float(terms.kl[t]) == pytest.approx(kl, rel=1e-5, abs=1e-6)
        assert float(logprobs.grad[t]) == pytest.approx(dkl, rel=1e-5, abs=1e-6)
    if estimator in ("k3", "low_var_kl"):
        assert (terms.kl >= 0).all()  # k3 is non-negative: e^y >= 1 + y
    if estimator == "low_var_kl":
        assert float(terms.kl.max()) == 10.0


@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "cispo"])
def test_zero_advantage_gives_zero_policy_loss_and_gradient(name):
    loss = resolve_loss_fn(name, {"dual_clip_c": 3.0} if name == "ppo" else {})
    x, q, ref, _, _ = random_tokens(4)
    mb = make_mb(x, q, ref, [0.0] * len(x), [True] * len(x))
    logprobs = torch.tensor(x, requires_grad=True)
    terms = token_terms(loss, logprobs, torch.ones(len(x)), mb)
    terms.policy.sum().backward()
    assert not terms.policy.any()
    assert torch.equal(logprobs.grad, torch.zeros(len(x)))


@pytest.mark.parametrize("name, config", CONFIGS)
def test_extreme_ratios_are_clamped_and_masked_tokens_never_leak(name, config):
    """Log-ratios of ±1000 (a stale or broken sampler): finite loss and gradient; masked-out
    tokens with such values contribute exactly zero, and a fully masked micro-batch gives a
    zero gradient, not NaN."""
    loss = resolve_loss_fn(name, config)
    x = [-1.0, -2.0, -0.5, -3.0]
    q = [-1001.0, 998.0, -1001.0, 997.0]
    ref = [-900.0, 900.0, -2.0, -1.0]
    adv = [1.0, -1.0, -2.0, 0.5]
    for mask in ([True, True, False, False], [False] * 4):
        mb = make_mb(x, q, ref, adv, mask)
        logprobs = torch.tensor(x, requires_grad=True)
        entropy = torch.rand(4, requires_grad=True)
        terms = token_terms(loss, logprobs, entropy if loss.needs_entropy else None, mb)
        values = per_token_loss(loss, terms)
        assert torch.isfinite(values).all()
        counts = local_counts([mb])
        weights = token_weights(mb, "token_mean", counts, 1)
        total = weighted_loss(loss, terms, weights)
        total.backward()
        assert torch.isfinite(total) and torch.isfinite(logprobs.grad).all()
        assert torch.equal(logprobs.grad[~mb.loss_mask], torch.zeros(int((~mb.loss_mask).sum())))
        if not any(mask):
            assert float(total) == 0.0 and torch.equal(logprobs.grad, torch.zeros(4))
    ratio = math.exp(MAX_LOG_RATIO)
    if name == "importance_sampling":
        assert float(terms.policy[0]) == pytest.approx(-ratio * adv[0], rel=1e-6)  # clamped at e^20
    if name == "ppo" and config.get("dual_clip_c"):
        # A < 0 with r = e^20: the dual clip bounds the loss at -c·A.
        assert float(terms.policy[2]) == pytest.approx(-config["dual_clip_c"] * adv[2])


def test_loss_metrics_are_sums_over_loss_tokens_only():
    loss = resolve_loss_fn("ppo", {"dual_clip_c": 2.0, "kl_coef": 0.1, "entropy_coef": 0.1})
    x, q, ref, adv, entropy = random_tokens(5, n=30)
    mask = [i % 3 != 0 for i in range(30)]
    q[0], q[3] = -1000.0, 1000.0  # extreme ratios on masked tokens: must not reach min / max
    metrics = LossMetrics()
    halves = (slice(0, 13), slice(13, 30))
    mbs = [make_mb(x[h], q[h], ref[h], adv[h], mask[h]) for h in halves]
    counts = local_counts(mbs)
    for h, mb in zip(halves, mbs):
        terms = token_terms(loss, torch.tensor(x[h]), torch.tensor(entropy[h]), mb)
        metrics.add(terms, token_weights(mb, "token_mean", counts, 1))
    got = {k: float(v) for k, v in metrics.reduce(None).items()}
    keep = [t for t in range(30) if mask[t]]
    ratio = [math.exp(x[t] - q[t]) for t in keep]

    def mean(values):
        return sum(values) / len(values)

    lo, hi = 0.8, 1.2
    expected = {
        "rl/pg_loss": mean([brute_policy("ppo", x[t], q[t], adv[t], loss.options)[0] for t in keep]),
        "rl/kl": mean([brute_kl("low_var_kl", x[t], ref[t])[0] for t in keep]),  # the default estimator
        "rl/entropy": mean([entropy[t] for t in keep]),
        "rl/ratio_mean": mean(ratio),
        "rl/ratio_min": min(ratio),
        "rl/ratio_max": max(ratio),
        "rl/logprob_diff_mean": mean([abs(x[t] - q[t]) for t in keep]),
        "rl/logprob_diff_max": max(abs(x[t] - q[t]) for t in keep),
        "rl/advantage_mean": mean([adv[t] for t in keep]),
        "rl/ppo_kl": mean([q[t] - x[t] for t in keep]),
        "rl/clipfrac_low": mean([float(adv[t] < 0 and r < lo) for t, r in zip(keep, ratio)]),
        "rl/clipfrac_high": mean([float(adv[t] > 0 and r > hi) for t, r in zip(keep, ratio)]),
        "rl/clipfrac_dual": mean([float(adv[t] < 0 and r > 2.0) for t, r in zip(keep, ratio)]),
    }
    expected["rl/clipfrac"] = expected["rl/clipfrac_low"] + expected["rl/clipfrac_high"] + expected["rl/clipfrac_dual"]
    assert got.keys() == expected.keys()
    for tag, value in expected.items():
        assert got[tag] == pytest.approx(value, rel=1e-5, abs=1e-7), tag
    assert 0 < expected["rl/clipfrac_dual"] and 0 < expected["rl/clipfrac_low"] and 0 < expected["rl/clipfrac_high"]


def test_loss_metrics_of_several_updates_pool_tokens_and_average_terms():
    """An RL step's metrics over its updates: ratios are Σ numerator / Σ denominator over all
    of them (not a mean of per-update ratios), extremes are over all, terms are averaged."""
    loss = resolve_loss_fn("ppo", {"dual_clip_c": 2.0})
    x, q, ref, adv, entropy = random_tokens(7, n=21)
    mask = [i % 4 != 0 for i in range(21)]
    parts, per_update = [], []
    for h in (slice(0, 5), slice(5, 21)):  # updates of very different sizes
        mb = make_mb(x[h], q[h], ref[h], adv[h], mask[h])
        metrics = LossMetrics()
        weights = token_weights(mb, "token_mean", local_counts([mb]), 1)
        metrics.add(token_terms(loss, torch.tensor(x[h]), torch.tensor(entropy[h]), mb), weights)
        parts.append(metrics)
        per_update.append({k: float(v) for k, v in metrics.reduce(None).items()})
    got = {k: float(v) for k, v in LossMetrics.combine(parts).reduce(None).items()}
    keep = [t for t in range(21) if mask[t]]
    ratio = [math.exp(x[t] - q[t]) for t in keep]
    assert got["rl/ratio_mean"] == pytest.approx(sum(ratio) / len(ratio), rel=1e-5)
    assert got["rl/ratio_max"] == pytest.approx(max(ratio), rel=1e-6)
    assert got["rl/ratio_min"] == pytest.approx(min(ratio), rel=1e-6)
    assert got["rl/advantage_mean"] == pytest.approx(sum(adv[t] for t in keep) / len(keep), rel=1e-5, abs=1e-7)
    for term in ("rl/pg_loss", "rl/entropy"):
        assert got[term] == pytest.approx((per_update[0][term] + per_update[1][term]) / 2, rel=1e-6)
    # The mean of the per-update ratios would be another number.
    assert abs(got["rl/ratio_mean"] - (per_update[0]["rl/ratio_mean"] + per_update[1]["rl/ratio_mean"]) / 2) > 1e-4


def test_loss_metrics_without_loss_tokens_are_zero_and_plain_cross_entropy_logs_none():
    loss = resolve_loss_fn("cispo", {})
    x, q, ref, adv, entropy = random_tokens(6, n=5)
    mb = make_mb(x, q, ref, adv, [False] * 5)
    metrics = LossMetrics()
    metrics.add(token_terms(loss, torch.tensor(x), torch.tensor(entropy), mb), torch.zeros(5))
    got = metrics.reduce(None)
    assert got and all(float(v) == 0.0 for v in got.values())
    plain = LossMetrics()
    ce = resolve_loss_fn("cross_entropy")
    plain.add(token_terms(ce, torch.tensor(x), None, mb), torch.zeros(5))
    assert plain.reduce(None) == {}


# ---------------------------------------------------------------- options and config


def test_registry_matches_config_choices():
    import typing

    hints = typing.get_type_hints(Loss)
    # The per-token losses, then the preference losses (losses.preference, job.recipe = "dpo").
    assert typing.get_args(hints["loss_fn"]) == (*LOSS_FNS, *PREFERENCE_LOSSES)
    assert typing.get_args(hints["kl_estimator"]) == KL_ESTIMATORS
    assert Loss().kl_estimator == resolve_loss_fn("cross_entropy").options["kl_estimator"]
    # Unset (None) options take each loss function's default.
    for key in ("clip_low", "clip_high", "dual_clip_c"):
        assert getattr(Loss(), key) is None
    assert resolve_loss_fn("ppo", {"clip_low": None}).options["clip_low"] == 0.2


@pytest.mark.parametrize(
    "name, config, message",
    [
        (
            "nope",
            {},
            r"unknown loss_fn 'nope'; valid loss functions: cross_entropy, importance_sampling, ppo, cispo, gspo",
        ),
        (
            "cross_entropy",
            {"clip_low": 0.2},
            r"loss_fn_config.clip_low: not an option of loss_fn 'cross_entropy'; its options: kl_coef, kl_estimator, entropy_coef",
        ),
        (
            "ppo",
            {"clip_lo": 0.2},
            r"clip_lo: not an option of loss_fn 'ppo'; its options: clip_low, clip_high, dual_clip_c",
        ),
        ("ppo", {"clip_low": 1.0}, r"clip_low: must be in \[0, 1\)"),
        ("cispo", {"clip_low": -0.1}, r"clip_low: must be in \[0, 1\)"),
        ("ppo", {"clip_high": -0.1}, r"clip_high: must be >= 0"),
        ("ppo", {"dual_clip_c": 1.0}, r"dual_clip_c: must be > 1"),
        ("ppo", {"dual_clip_c": "3"}, r"dual_clip_c: expected a finite number"),
        ("ppo", {"kl_coef": -1}, r"kl_coef: must be >= 0"),
        ("ppo", {"kl_coef": float("nan")}, r"kl_coef: expected a finite number"),
        ("ppo", {"entropy_coef": True}, r"entropy_coef: expected a finite number"),
        ("ppo", {"kl_estimator": "k4"}, r"kl_estimator: 'k4' is not one of k1, k2, k3, low_var_kl"),
    ],
)
def test_bad_loss_fn_or_option_is_a_named_error(name, config, message):
    with pytest.raises(ValueError, match=message):
        resolve_loss_fn(name, config)


def test_inputs_follow_the_options():
    assert resolve_loss_fn("cross_entropy").inputs == ()
    assert not resolve_loss_fn("cross_entropy").needs_entropy
    assert resolve_loss_fn("cross_entropy", {"entropy_coef": 0.1}).needs_entropy
    assert resolve_loss_fn("ppo").inputs == ("advantages", "sampler_logprobs")
    assert resolve_loss_fn("ppo", {"kl_coef": 0.1}).inputs == ("advantages", "sampler_logprobs", "ref_logprobs")


def test_config_section_fails_closed():
    with pytest.raises(ValueError, match=r"loss.clip_high: not an option of loss_fn 'cross_entropy'"):
        loss_fn_from_config(Loss(clip_high=0.28))
    with pytest.raises(ValueError, match=r"loss.dual_clip_c: not an option of loss_fn 'cispo'"):
        loss_fn_from_config(Loss(loss_fn="cispo", dual_clip_c=3.0))
    with pytest.raises(ValueError, match=r"loss.kl_estimator: only used with loss.kl_coef > 0"):
        loss_fn_from_config(Loss(kl_estimator="k2"))
    with pytest.raises(ValueError, match=r"loss.clip_low: must be in \[0, 1\)"):
        loss_fn_from_config(Loss(loss_fn="ppo", clip_low=1.5))
    loss = loss_fn_from_config(Loss(loss_fn="ppo", clip_high=0.28, dual_clip_c=3.0, kl_coef=0.1, kl_estimator="k2"))
    assert loss.options == {
        "clip_low": 0.2,
        "clip_high": 0.28,
        "dual_clip_c": 3.0,
        "kl_coef": 0.1,
        "kl_estimator": "k2",
        "entropy_coef": 0.0,
        "proximal_logprobs": False,
        "current_proximal": False,
        "rollout_weights": False,
        "rollout_correction": None,
        # Set only by a program (the Tinker service), never from the section.
        "loss_weights": False,
        "ratio_mask": False,
        "max_log_ratio": MAX_LOG_RATIO,
    }
    # Unset clip bounds are each loss function's own: GSPO's are the paper's.
    gspo = loss_fn_from_config(Loss(loss_fn="gspo"))
    assert (gspo.options["clip_low"], gspo.options["clip_high"]) == (3e-4, 4e-4)
    with pytest.raises(ValueError, match=r"loss_fn_config.rollout_weights: loss_fn 'cross_entropy' has no ratio"):
        resolve_loss_fn("cross_entropy", {"rollout_weights": True})
    tis = {"mode": "tis", "level": "token", "max_ratio": 2.0, "min_ratio": 0.5}
    for config, fragment in (
        ({"proximal_logprobs": True, "current_proximal": True}, "the proximal policy is one or the other"),
        ({"rollout_correction": tis}, "rollout_correction: computed in the loss pass only under current_proximal"),
        (
            {"current_proximal": True, "rollout_correction": tis, "rollout_weights": True},
            "the weights are computed or given, not both",
        ),
        ({"current_proximal": True, "rollout_correction": "tis"}, "expected a RolloutCorrection or its fields"),
        ({"current_proximal": True, "rollout_correction": {"mode": "tis", "cap": 2}}, "unknown field 'cap'"),
    ):
        with pytest.raises(ValueError, match=fragment):
            resolve_loss_fn("ppo", config)
    # The pass computes the weights and the proximal log-probs: neither is an input.
    fused = resolve_loss_fn("ppo", {"current_proximal": True, "rollout_correction": tis})
    assert fused.inputs == ("advantages", "sampler_logprobs")


@pytest.mark.parametrize(
    "loss, message",
    [
        (Loss(loss_fn="ppo"), r"loss.loss_fn: 'ppo' needs advantages and sampler log-probs"),
        (Loss(kl_coef=0.1), r"loss.kl_coef: the KL penalty needs reference log-probs"),
        (Loss(reduction="prompt_mean"), r"loss.reduction: 'prompt_mean' weighs prompt groups"),
    ],
)
def test_sft_refuses_what_sft_data_cannot_feed(loss, message):
    with pytest.raises(ValueError, match=message):
        sft_loss_fn(JobConfig(loss=loss))
    assert sft_loss_fn(JobConfig(loss=Loss(entropy_coef=0.01))).options["entropy_coef"] == 0.01


@pytest.mark.parametrize("name", list(LOSS_FNS))
def test_resolved_options_resolve_again_unchanged(name):
    """A recipe resolves [loss] once and hands the engine the resolved options (every key, the
    defaults included): they must pass the same checks again and give the same loss function."""
    resolved = resolve_loss_fn(name)
    assert resolve_loss_fn(name, resolved.options).options == resolved.options
