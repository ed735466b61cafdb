"""The loss functions of ``Engine.forward_backward``, as per-token losses ℓ_t (docs/design.md,
'Loss weights' and 'Engine and recipes').

A loss function turns the per-token log-probs ``logp_θ`` of a micro-batch share (and their
entropies ``H``) into

    ℓ_t = ℓ^pg_t + kl_coef · KL_t − entropy_coef · H_t,

and the engine sums ``w_t · ℓ_t`` with the reduction weights of ``losses.reduction``
(``weighted_loss``). The policy term, the KL penalty and the entropy bonus all go through the
same ``w_t``: each is normalized exactly like the others, for any parallel layout (scaling
only the advantages would leave the KL and entropy terms normalized per micro-batch).

Policy terms, with ``A`` the advantage, ``r = exp(logp_θ − logp_old)`` and
``clip(r) = clamp(r, 1 − clip_low, 1 + clip_high)``:

| loss_fn               | ℓ^pg_t                                                         |
|-----------------------|----------------------------------------------------------------|
| `cross_entropy`       | −logp_θ                                                        |
| `importance_sampling` | −r·A                                                           |
| `ppo`                 | max(−r·A, −clip(r)·A); with `dual_clip_c` = c, at most −c·A where A < 0 |
| `cispo`               | −sg(clip(r))·A·logp_θ  (sg: no gradient through the weight)    |
| `gspo`                | max(−s·A, −clip(s)·A), s = sg(s_i)·exp(logp_θ − sg(logp_θ))   |

``logp_old`` is the sampler's log-prob (behaviour policy), or the proximal policy's (decoupled
PPO): with the recipe option ``proximal_logprobs`` recomputed before the update, with
``current_proximal`` the update's own, ``sg(logp_θ)``, exact when the update is the only
optimizer step on its rollouts (the proximal policy is then the policy being trained, and the
forward that would recompute it is the update's own). With ``rollout_weights`` every policy
term is multiplied by the token's rollout-correction weight (given with the samples;
``rl/rollout_correction.py``; no gradient through it, 0 masks the token); with
``rollout_correction`` (a ``RolloutCorrection``, under ``current_proximal``) the loss pass
computes those weights itself from ``sg(logp_θ) − logp_sampler``: per token inside each logits
chunk, per sequence from the engine's sequence pass, which completes the sums first.

GSPO's ratio belongs to a whole sequence: ``s_i = exp(mean of logp_θ − logp_old over the
sequence's loss tokens)`` (with ``ratio_mask``: over the tokens where the sample's
``ratio_mask`` is non-zero; 0 when there are none, so ``s_i = 1``), computed by the engine
before the loss over every token of the sequence, whichever CP rank or logits chunk holds it
(``Engine``'s sequence pass). Each token carries ``s_i`` in value and the gradient of its own
log-prob (straight-through), so with ``loss.reduction = "sequence_mean"`` the gradient is
GSPO's ``∇ s_i = s_i · mean_t ∇logp_θ``; the clip zeroes the gradient of a whole sequence.

KL estimators, with ``Δ = logp_θ − logp_ref``: ``k1`` = Δ, ``k2`` = Δ²/2, ``k3`` =
exp(−Δ) − 1 + Δ, ``low_var_kl`` = min(k3, 10) (the default: the clamped ``k3``).

Ratios are ``exp`` of the log-ratio clamped to ``±max_log_ratio`` (default ``MAX_LOG_RATIO``,
20). A caller that needs the unguarded formula (the Tinker service, ``service/tinker_losses.py``)
raises the bound to ``FLOAT32_MAX_LOG_RATIO``, where the clamp only binds on ratios that would
overflow float32 or lie below its normal range.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_rl.data.packing import MicroBatch
from torchtitan_rl.distributed.utils import all_reduce
from torchtitan_rl.losses.rollout_weights import MAX_LOG_RATIO, RolloutCorrection, weights_of
from torchtitan_rl.losses.router import RouterMetrics

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
LOW_VAR_KL_MAX = 10.0

# (name, reduction, per-token values): "mean" over loss tokens, or "min" / "max" over them.
Stat = tuple[str, str, torch.Tensor]
PolicyTerm = Callable[[torch.Tensor, MicroBatch, dict[str, Any]], tuple[torch.Tensor, list[Stat]]]


@dataclass(frozen=True)
class LossFnSpec:
    policy_term: PolicyTerm
    inputs: tuple[str, ...]  # the sample inputs it reads (data.sample.RL_TOKEN_INPUTS)
    options: dict[str, Any]  # its own loss_fn_config keys, with their defaults
    # It reads ``mb.seq_log_ratio``, each token's sequence-mean log-ratio, which the engine
    # computes from the current policy before the loss.
    sequence_log_ratio: bool = False


# Keys every loss function takes.
SHARED_OPTIONS = {"kl_coef": 0.0, "kl_estimator": "low_var_kl", "entropy_coef": 0.0}
# Keys an RL recipe sets from its own settings ([rl]), never read from [loss]: the ratio's
# denominator is the recomputed proximal policy or the current one (decoupled PPO), and the
# policy term carries each token's rollout-correction weight, given or computed in the pass.
RECIPE_OPTIONS = {
    "proximal_logprobs": False,
    "current_proximal": False,
    "rollout_weights": False,
    "rollout_correction": None,
}
_CLIP_OPTIONS = {"clip_low": 0.2, "clip_high": 0.2}
# GSPO's sequence ratios sit much closer to 1 than token ratios: its authors' clip range.
GSPO_CLIP_OPTIONS = {"clip_low": 3e-4, "clip_high": 4e-4}
# The largest float32 log-ratio whose exp is finite: log(float32 max) rounds up to a float32
# whose exp overflows, so one float32 below it.
FLOAT32_MAX_LOG_RATIO = float(
    torch.nextafter(torch.tensor(math.log(torch.finfo(torch.float32).max)), torch.tensor(0.0))
)
# Keys only a program sets (the Tinker service), never the [loss] section: each token's loss
# multiplied by the sample's ``loss_weights`` (any sign; through the reduction weight, so every
# term alike), GSPO's sequence mean taken over the sample's ``ratio_mask`` instead of its loss
# tokens, and the bound on the log-ratio before exp (see the module docstring).
PROGRAM_OPTIONS = {"loss_weights": False, "ratio_mask": False, "max_log_ratio": MAX_LOG_RATIO}


def old_logprobs(mb: MicroBatch, options: dict[str, Any], logprobs: torch.Tensor) -> torch.Tensor:
    """The ratio's denominator: the proximal policy's log-probs (recomputed, or the current
    ``logprobs`` without gradient), or the sampler's."""
    if options["current_proximal"]:
        return logprobs.detach()
    return mb.prox_logprobs if options["proximal_logprobs"] else mb.sampler_logprobs


def _ratio(logprobs: torch.Tensor, mb: MicroBatch, options: dict[str, Any]) -> torch.Tensor:
    bound = options["max_log_ratio"]
    return (logprobs - old_logprobs(mb, options, logprobs)).clamp(-bound, bound).exp()


def _sampler_stats(logprobs: torch.Tensor, ratio: torch.Tensor, mb: MicroBatch, options: dict[str, Any]) -> list[Stat]:
    """What every loss that reads the sampler's log-probs reports."""
    ratio = ratio.detach()
    mismatch = (logprobs.detach() - mb.sampler_logprobs).abs()
    return [
        ("ratio_mean", "mean", ratio),
        ("ratio_min", "min", ratio),
        ("ratio_max", "max", ratio),
        ("logprob_diff_mean", "mean", mismatch),
        ("logprob_diff_max", "max", mismatch),
        # k1 of the ratio's old policy from the current one: how far the update has moved.
        ("ppo_kl", "mean", old_logprobs(mb, options, logprobs) - logprobs.detach()),
        ("advantage_mean", "mean", mb.advantages),
    ]


def _clip_stats(low: torch.Tensor, high: torch.Tensor, *more: torch.Tensor) -> list[Stat]:
    """Fractions of loss tokens where a clip bound binds (decides the token's gradient)."""
    binds = low | high
    for extra in more:
        binds = binds | extra
    return [("clipfrac_low", "mean", low), ("clipfrac_high", "mean", high), ("clipfrac", "mean", binds)]


def _cross_entropy(logprobs, mb, options):
    return -logprobs, []


def _importance_sampling(logprobs, mb, options):
    ratio = _ratio(logprobs, mb, options)
    return -ratio * mb.advantages, _sampler_stats(logprobs, ratio, mb, options)


def _ppo(logprobs, mb, options):
    adv = mb.advantages
    ratio = _ratio(logprobs, mb, options)
    lower, upper = 1.0 - options["clip_low"], 1.0 + options["clip_high"]
    loss = torch.maximum(-ratio * adv, -ratio.clamp(lower, upper) * adv)
    # The clipped branch wins (and zeroes the gradient) only on the side the advantage points to.
    clipped_low = (adv < 0) & (ratio < lower)
    clipped_high = (adv > 0) & (ratio > upper)
    c = options["dual_clip_c"]
    if c is None:
        stats = _clip_stats(clipped_low, clipped_high)
    else:
        # Dual clip: a negative advantage cannot push the loss above c·|A| however large r is.
        dual = (adv < 0) & (ratio > c)
        loss = torch.where(adv < 0, torch.minimum(loss, -c * adv), loss)
        stats = _clip_stats(clipped_low, clipped_high, dual) + [("clipfrac_dual", "mean", dual)]
    return loss, stats + _sampler_stats(logprobs, ratio, mb, options)


def _cispo(logprobs, mb, options):
    ratio = _ratio(logprobs, mb, options)
    lower, upper = 1.0 - options["clip_low"], 1.0 + options["clip_high"]
    weight = ratio.clamp(lower, upper).detach()
    stats = _clip_stats(ratio < lower, ratio > upper)
    return -weight * mb.advantages * logprobs, stats + _sampler_stats(logprobs, ratio, mb, options)


def _gspo(logprobs, mb, options):
    adv = mb.advantages
    # Value: the sequence's log-ratio; gradient: the token's own log-prob (straight-through).
    log_ratio = mb.seq_log_ratio + (logprobs - logprobs.detach())
    ratio = log_ratio.clamp(-options["max_log_ratio"], options["max_log_ratio"]).exp()
    lower, upper = 1.0 - options["clip_low"], 1.0 + options["clip_high"]
    # Not sg(clip(s)): where the branches tie (s inside the bounds) maximum splits the gradient
    # between them, and clamp passes its half through only while s is inside.
    loss = torch.maximum(-ratio * adv, -ratio.clamp(lower, upper) * adv)
    clipped_low = (adv < 0) & (ratio.detach() < lower)
    clipped_high = (adv > 0) & (ratio.detach() > upper)
    # Token fractions: a token counts as clipped when its sequence is.
    stats = [(f"gspo/{name}", kind, values) for name, kind, values in _clip_stats(clipped_low, clipped_high)]
    return loss, stats + _sampler_stats(logprobs, ratio, mb, options)


_POLICY = ("advantages", "sampler_logprobs")
LOSS_FNS: dict[str, LossFnSpec] = {
    "cross_entropy": LossFnSpec(_cross_entropy, (), {}),
    "importance_sampling": LossFnSpec(_importance_sampling, _POLICY, {}),
    "ppo": LossFnSpec(_ppo, _POLICY, {**_CLIP_OPTIONS, "dual_clip_c": None}),
    "cispo": LossFnSpec(_cispo, _POLICY, dict(_CLIP_OPTIONS)),
    "gspo": LossFnSpec(_gspo, _POLICY, dict(GSPO_CLIP_OPTIONS), sequence_log_ratio=True),
}
# The policy-gradient losses: they weigh each token's advantage by its ratio r = p_theta / p_old.
ADVANTAGE_LOSS_FNS = tuple(name for name, spec in LOSS_FNS.items() if "advantages" in spec.inputs)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from the sampled tokens' log-probs."""
    delta = logprobs - ref_logprobs
    if estimator == "k1":
        return delta
    if estimator == "k2":
        return 0.5 * delta.square()
    delta = delta.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    k3 = torch.expm1(-delta) + delta
    return k3.clamp(max=LOW_VAR_KL_MAX) if estimator == "low_var_kl" else k3


# ---------------------------------------------------------------- configuration


@dataclass(frozen=True)
class LossFn:
    """A loss function with every option resolved (``resolve_loss_fn``)."""

    name: str
    options: dict[str, Any]

    @property
    def inputs(self) -> tuple[str, ...]:
        """The sample inputs the loss reads."""
        kl = ("ref_logprobs",) if self.options["kl_coef"] > 0 else ()
        proximal = ("prox_logprobs",) if self.options["proximal_logprobs"] else ()
        # With rollout_correction the pass computes the weights: they are no input.
        weights = ("rollout_weights",) if self.options["rollout_weights"] else ()
        program = tuple(name for name in ("loss_weights", "ratio_mask") if self.options[name])
        return LOSS_FNS[self.name].inputs + proximal + weights + kl + program

    @property
    def needs_sequence_log_ratio(self) -> bool:
        """Whether the engine must give each token its sequence's mean log-ratio first."""
        return LOSS_FNS[self.name].sequence_log_ratio

    @property
    def needs_entropy(self) -> bool:
        # RL losses report the entropy even without a bonus: its collapse is what one watches.
        return self.name != "cross_entropy" or self.options["entropy_coef"] != 0


def _number(key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
        raise ValueError(f"{key}: expected a finite number, got {value!r}")
    return float(value)


def resolve_loss_fn(name: str, config: dict[str, Any] | None = None, key_prefix: str = "loss_fn_config.") -> LossFn:
    """``name`` and its options, checked; defaults fill the keys ``config`` leaves out.

    ``key_prefix`` names the keys in error messages (``loss.`` for the TOML section).
    """
    if name not in LOSS_FNS:
        raise ValueError(f"unknown loss_fn {name!r}; valid loss functions: {', '.join(LOSS_FNS)}")
    valid = {**LOSS_FNS[name].options, **SHARED_OPTIONS}
    options = dict(valid)
    ratio_based = "sampler_logprobs" in LOSS_FNS[name].inputs
    options.update(RECIPE_OPTIONS)
    options.update(PROGRAM_OPTIONS)
    for key, value in (config or {}).items():
        if key in PROGRAM_OPTIONS:
            options[key] = _program_option(name, key_prefix + key, key, value, ratio_based)
            continue
        if key in RECIPE_OPTIONS:
            if value and not ratio_based:
                raise ValueError(f"{key_prefix}{key}: loss_fn {name!r} has no ratio to an old policy")
            if key == "rollout_correction":
                if isinstance(value, dict):
                    unknown = set(value) - set(RolloutCorrection.__dataclass_fields__)
                    if unknown:
                        raise ValueError(f"{key_prefix}{key}: unknown field {sorted(unknown)[0]!r}")
                    value = RolloutCorrection(**value)
                if value is not None and not isinstance(value, RolloutCorrection):
                    raise ValueError(f"{key_prefix}{key}: expected a RolloutCorrection or its fields, got {value!r}")
                options[key] = None if value is None or value.mode == "none" else value
            else:
                options[key] = bool(value)
            continue
        if key not in valid:
            raise ValueError(f"{key_prefix}{key}: not an option of loss_fn {name!r}; its options: {', '.join(valid)}")
        if value is not None or key == "dual_clip_c":
            options[key] = value  # None elsewhere: the loss function's own default
    for key in ("clip_low", "clip_high", "kl_coef", "entropy_coef"):
        if key in options:
            options[key] = _number(key_prefix + key, options[key])
    if "clip_low" in options and not 0 <= options["clip_low"] < 1:
        raise ValueError(
            f"{key_prefix}clip_low: must be in [0, 1) (the lower bound is 1 - clip_low > 0), got {options['clip_low']}"
        )
    if "clip_high" in options and options["clip_high"] < 0:
        raise ValueError(f"{key_prefix}clip_high: must be >= 0, got {options['clip_high']}")
    if options.get("dual_clip_c") is not None:
        options["dual_clip_c"] = _number(key_prefix + "dual_clip_c", options["dual_clip_c"])
        if options["dual_clip_c"] <= 1:
            raise ValueError(
                f"{key_prefix}dual_clip_c: must be > 1 (or unset to disable), got {options['dual_clip_c']}"
            )
    if options["kl_coef"] < 0:
        raise ValueError(f"{key_prefix}kl_coef: must be >= 0, got {options['kl_coef']}")
    if options["proximal_logprobs"] and options["current_proximal"]:
        raise ValueError(f"{key_prefix}proximal_logprobs and current_proximal: the proximal policy is one or the other")
    if options["rollout_correction"] is not None and not options["current_proximal"]:
        raise ValueError(
            f"{key_prefix}rollout_correction: computed in the loss pass only under current_proximal "
            "(otherwise give each token's weight with rollout_weights)"
        )
    if options["rollout_correction"] is not None and options["rollout_weights"]:
        raise ValueError(
            f"{key_prefix}rollout_correction and rollout_weights: the weights are computed or given, not both"
        )
    if options["kl_estimator"] not in KL_ESTIMATORS:
        raise ValueError(
            f"{key_prefix}kl_estimator: {options['kl_estimator']!r} is not one of {', '.join(KL_ESTIMATORS)}"
        )
    return LossFn(name, options)


def _program_option(name: str, where: str, key: str, value, ratio_based: bool):
    """A checked value of ``PROGRAM_OPTIONS[key]`` for loss function ``name``."""
    if key == "max_log_ratio":
        # The default passes: a resolved loss's options (every key) resolve again unchanged.
        if not ratio_based and value != PROGRAM_OPTIONS[key]:
            raise ValueError(f"{where}: loss_fn {name!r} has no ratio to an old policy")
        value = _number(where, value)
        if value <= 0:
            raise ValueError(f"{where}: must be > 0, got {value}")
        return value
    if not isinstance(value, bool):
        raise ValueError(f"{where}: expected true or false, got {value!r}")
    if key == "ratio_mask" and value and not LOSS_FNS[name].sequence_log_ratio:
        raise ValueError(f"{where}: loss_fn {name!r} has no sequence ratio")
    return value


def loss_fn_from_config(section) -> LossFn:
    """The loss of a ``[loss]`` config section (``config.job_config.Loss``), naming its keys in errors.

    Fails closed: an option the chosen loss function does not use, set to anything but its
    default, is an error (a forgotten ``loss.loss_fn``), as is a KL estimator without a KL.
    """
    defaults = type(section)()
    valid = {**LOSS_FNS[section.loss_fn].options, **SHARED_OPTIONS}
    all_keys = {key for spec in LOSS_FNS.values() for key in spec.options} | set(SHARED_OPTIONS)
    config = {
        key: getattr(section, key)
        for key in sorted(all_keys)
        if key in valid or getattr(section, key) != getattr(defaults, key)
    }
    if section.kl_estimator != defaults.kl_estimator and section.kl_coef == 0:
        raise ValueError("loss.kl_estimator: only used with loss.kl_coef > 0")
    return resolve_loss_fn(section.loss_fn, config, key_prefix="loss.")


# ---------------------------------------------------------------- per-token terms


@dataclass
class TokenTerms:
    """The per-token pieces of one micro-batch share's loss."""

    mask: torch.Tensor  # loss mask, bool
    policy: torch.Tensor  # ℓ^pg
    kl: torch.Tensor | None  # KL_t, when kl_coef > 0
    entropy: torch.Tensor | None  # H_t, when computed
    stats: list[Stat]


def token_terms(loss: LossFn, logprobs: torch.Tensor, entropy: torch.Tensor | None, mb: MicroBatch) -> TokenTerms:
    policy, stats = LOSS_FNS[loss.name].policy_term(logprobs, mb, loss.options)
    weights = mb.rollout_weights  # given, or set by the engine's sequence pass
    correction = loss.options["rollout_correction"]
    if weights is None and correction is not None:
        # Per token: from this chunk's own log-probs, the proximal (current) policy's.
        log_ratio = torch.where(mb.loss_mask, logprobs.detach() - mb.sampler_logprobs, 0.0)
        weights = weights_of(correction, log_ratio, mb.loss_mask)
    if weights is not None:
        policy = policy * weights
    kl = None
    if loss.options["kl_coef"] > 0:
        kl = kl_penalty(logprobs, mb.ref_logprobs, loss.options["kl_estimator"])
    return TokenTerms(mb.loss_mask, policy, kl, entropy, stats)


def per_token_loss(loss: LossFn, terms: TokenTerms) -> torch.Tensor:
    """ℓ_t = ℓ^pg_t + kl_coef · KL_t − entropy_coef · H_t."""
    total = terms.policy
    if terms.kl is not None:
        total = total + loss.options["kl_coef"] * terms.kl
    if loss.options["entropy_coef"] != 0:
        total = total - loss.options["entropy_coef"] * terms.entropy
    return total


def weighted_loss(loss: LossFn, terms: TokenTerms, weights: torch.Tensor) -> torch.Tensor:
    """``Σ_t w_t ℓ_t``: the one place where every term meets the reduction weights, the same for all."""
    return (per_token_loss(loss, terms) * weights).sum()


# ---------------------------------------------------------------- metrics


class LossMetrics:
    """Device-resident sums and extremes of one ``forward_backward``'s loss terms (docs/design.md, 'Metrics').

    Term values are ``Σ w_t x_t`` (so ``pg_loss + kl_coef·kl − entropy_coef·entropy`` is the
    logged loss); means are ``Σ m_t x_t / Σ m_t`` over loss tokens, carried as numerator and
    denominator; min / max run over loss tokens. Every piece comes from the tokens a rank
    holds, so all are reduced over the ``loss`` mesh (DP × CP, never TP replicas).
    """

    def __init__(self):
        self.weighted: dict[str, torch.Tensor] = {}
        self.masked: dict[str, torch.Tensor] = {}  # "mean" numerators, and the loss-token count
        self.maxima: dict[str, torch.Tensor] = {}
        self.negated: set[str] = set()  # "min" statistics, kept as the max of their negation

    def add(self, terms: TokenTerms, weights: torch.Tensor) -> None:
        if terms.kl is None and terms.entropy is None and not terms.stats:
            return  # plain cross-entropy: the logged loss says it all
        mask = terms.mask
        for name, values in (("pg_loss", terms.policy), ("kl", terms.kl), ("entropy", terms.entropy)):
            if values is not None:
                _accumulate(self.weighted, name, (weights * values.detach()).sum(), torch.add)
        _accumulate(self.masked, _NUM_LOSS_TOKENS, mask.sum(), torch.add)
        for name, kind, values in terms.stats:
            values = values.to(weights.dtype)
            if kind == "mean":
                _accumulate(self.masked, name, torch.where(mask, values, 0).sum(), torch.add)
                continue
            if kind == "min":
                self.negated.add(name)
                values = -values
            _accumulate(self.maxima, name, torch.where(mask, values, -torch.inf).max(), torch.maximum)

    @classmethod
    def combine(cls, parts: list["LossMetrics"]) -> "LossMetrics":
        """One RL step's metrics from its updates: token sums add up and extremes stay extremes
        (so ratios are still Σ numerator / Σ denominator over the step), while the term values,
        each already a mini-batch loss, are averaged over the updates."""
        combined = cls()
        for part in parts:
            for store, merged, combine in (
                (part.weighted, combined.weighted, torch.add),
                (part.masked, combined.masked, torch.add),
                (part.maxima, combined.maxima, torch.maximum),
            ):
                for name, value in store.items():
                    _accumulate(merged, name, value, combine)
            combined.negated |= part.negated
        combined.weighted = {name: value / len(parts) for name, value in combined.weighted.items()}
        return combined

    def reduce(self, loss_mesh: DeviceMesh | None) -> dict[str, torch.Tensor]:
        """``rl/*`` tag -> global value, on device; two all-reduces (none if nothing was recorded)."""
        if not self.masked:
            return {}
        names = [*self.weighted, *self.masked]
        sums = dict(
            zip(names, all_reduce(torch.stack([*self.weighted.values(), *self.masked.values()]), "sum", loss_mesh))
        )
        num_loss_tokens = sums.pop(_NUM_LOSS_TOKENS)
        out = {f"rl/{name}": value for name, value in sums.items()}
        for name in self.masked:
            if name != _NUM_LOSS_TOKENS:
                out[f"rl/{name}"] = sums[name] / num_loss_tokens.clamp(min=1)
        if self.maxima:
            maxima = all_reduce(torch.stack(list(self.maxima.values())), "max", loss_mesh)
            for name, value in zip(self.maxima, maxima):
                value = torch.where(num_loss_tokens > 0, value, 0)  # no loss token anywhere: 0, not inf
                out[f"rl/{name}"] = -value if name in self.negated else value
        return out


@dataclass
class ForwardBackwardMetrics:
    """Device-resident results of one ``forward_backward`` (the engine's); reduced only when logged."""

    loss: torch.Tensor  # this rank's Σ w·ℓ (sum over the `loss` mesh = mini-batch loss)
    max_seq_loss: torch.Tensor  # largest per-sequence mean loss among this rank's sequences (-inf: none)
    counts: torch.Tensor  # global counts, see losses.reduction
    terms: LossMetrics  # the loss's terms and statistics (rl/* tags)
    router: RouterMetrics | None = None  # MoE models only
    # Each sample's per-token log-probs before the update, in the samples' order (on request).
    logprobs: list[torch.Tensor] | None = None


_NUM_LOSS_TOKENS = "num_loss_tokens"


def _accumulate(store: dict[str, torch.Tensor], name: str, value: torch.Tensor, combine) -> None:
    value = value.double()
    store[name] = value if name not in store else combine(store[name], value)
