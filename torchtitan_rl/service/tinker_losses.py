"""Tinker's built-in losses on the engine: a forward / forward_backward request's datums, loss
name and ``loss_fn_config`` made into engine samples, an engine loss function and its options,
each field checked (a ``UserError`` naming it otherwise).

Tinker's semantics: position i of a datum's model input predicts ``target_tokens[i]`` (the
client shifted them: nothing is shifted here), ``logp_i = log_softmax(logits_i)[target_tokens[i]]``,
and the loss is the plain sum of a per-token term over every position of every datum, and over
every forward_backward until optim_step (the engine's gradients add up until then). With
``q`` the datum's ``logprobs`` (the sampler's), ``A`` its ``advantages`` and ``r = exp(logp − q)``:

| loss | loss_fn_inputs (each (N,)) | per-token term | loss_fn_config (default) |
|---|---|---|---|
| cross_entropy | target_tokens, weights | −logp · weights | — |
| importance_sampling | target_tokens, logprobs, advantages | −r · A | — |
| ppo | same | −min(r·A, clamp(r, lo, hi)·A) | clip_low_threshold lo (0.8), clip_high_threshold hi (1.2) |
| cispo | same | −sg(clamp(r, lo, hi)) · logp · A | same |
| dro | same | −(logp·A − β/2 · (logp − q)²) | beta β (0.05) |
| gspo | same + sequence_ratio_mask | −min(s·A, clamp(s, lo, hi)·A), s = exp(m + logp − sg(logp)) | as ppo |

GSPO's ``m`` is the mean of ``sg(logp) − q`` over the datum's positions where
``sequence_ratio_mask`` is non-zero; with none, ``m = 0`` (``s = 1`` in value: the datum trains
as PPO at ratio 1) instead of the mean of nothing. ``sg``: no gradient through it.

On the engine every position is a loss position and the engine's reduction is ``"sum"``, so
each token's weight is 1 (cross_entropy: its ``weights``, through the samples' ``loss_weights``)
and the engine's loss is the plain sum. ppo, cispo and gspo are the engine's with clip bounds
``1 − clip_low = lo`` and ``1 + clip_high = hi``; dro is the engine's cispo with both bounds at 1
(its weight is exactly 1: the term ``−A·logp``) plus the KL penalty ``beta · k2`` to ``q`` as
reference (``k2 = (logp − q)²/2``). The ratio's log is bounded only where float32 would overflow
(``FLOAT32_MAX_LOG_RATIO``), never at the engine's default of 20.
"""

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_rl.data.packing import pack
from torchtitan_rl.data.sample import MAX_LOGPROB, Sample
from torchtitan_rl.distributed.utils import all_reduce
from torchtitan_rl.losses.loss_fns import (
    FLOAT32_MAX_LOG_RATIO,
    ForwardBackwardMetrics,
    per_token_loss,
    resolve_loss_fn,
    token_terms,
)
from torchtitan_rl.losses.reduction import token_weights
from torchtitan_rl.service.operations import TinkerDatum, UserError

# The metrics a forward / forward_backward result carries ("name:reduction").
METRIC_NAMES = ("loss:sum",)

_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
_POLICY = ("target_tokens", "logprobs", "advantages")


@dataclass(frozen=True)
class TinkerLoss:
    inputs: tuple[str, ...]  # its loss_fn_inputs, all required
    config: dict[str, float]  # its loss_fn_config keys and their defaults
    engine_loss_fn: str  # the engine's loss function that computes it


TINKER_LOSSES = {
    "cross_entropy": TinkerLoss(("target_tokens", "weights"), {}, "cross_entropy"),
    "importance_sampling": TinkerLoss(_POLICY, {}, "importance_sampling"),
    "ppo": TinkerLoss(_POLICY, _CLIP, "ppo"),
    "cispo": TinkerLoss(_POLICY, _CLIP, "cispo"),
    "dro": TinkerLoss(_POLICY, {"beta": 0.05}, "cispo"),
    "gspo": TinkerLoss((*_POLICY, "sequence_ratio_mask"), _CLIP, "gspo"),
}


class EngineCall(NamedTuple):
    """What ``Engine.forward_backward(samples, loss_fn, loss_fn_config)`` takes."""

    samples: list[Sample]
    loss_fn: str
    loss_fn_config: dict[str, Any]


def to_engine(
    data: list[TinkerDatum], loss_fn: str, loss_fn_config: dict[str, float] | None, *, vocab_size: int, max_len: int
) -> EngineCall:
    """The engine's samples, loss function and options for Tinker's ``loss_fn`` on ``data``, for
    ``Engine.forward_backward(*call, with_logprobs=True)`` or ``Engine.forward(call.samples)``
    on an engine built with reduction ``"sum"`` and temperature 1 (log-probs of the plain
    softmax), whose micro-batch budget holds a datum of ``max_len`` tokens (the longest
    accepted, ``training.seq_len``). Raises ``UserError`` naming the first bad field."""
    spec = TINKER_LOSSES.get(loss_fn)
    if spec is None:
        raise UserError(f"loss_fn: {loss_fn!r} is not supported; supported losses: {', '.join(TINKER_LOSSES)}")
    config = _config(loss_fn, spec, loss_fn_config or {})
    if not data:
        raise UserError("data: no datums")
    samples = [_sample(f"data[{i}]", d, loss_fn, spec, vocab_size, max_len) for i, d in enumerate(data)]
    return EngineCall(samples, spec.engine_loss_fn, _engine_options(loss_fn, config))


def _config(loss_fn: str, spec: TinkerLoss, given: dict[str, Any]) -> dict[str, float]:
    config = dict(spec.config)
    for key, value in given.items():
        where = f"loss_fn_config.{key}"
        if key not in spec.config:
            options = ", ".join(spec.config) or "none"
            raise UserError(f"{where}: not an option of loss_fn {loss_fn!r}; its options: {options}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UserError(f"{where}: expected a finite number, got {value!r}")
        config[key] = float(value)
    if "clip_low_threshold" in config:
        low, high = config["clip_low_threshold"], config["clip_high_threshold"]
        if not 0 < low <= 1:
            raise UserError(f"loss_fn_config.clip_low_threshold: must be in (0, 1], got {low}")
        if high < 1:
            raise UserError(f"loss_fn_config.clip_high_threshold: must be >= 1, got {high}")
    if config.get("beta", 0.0) < 0:
        raise UserError(f"loss_fn_config.beta: must be >= 0, got {config['beta']}")
    return config


def _engine_options(loss_fn: str, config: dict[str, float]) -> dict[str, Any]:
    if loss_fn == "cross_entropy":
        return {"loss_weights": True}
    options: dict[str, Any] = {"max_log_ratio": FLOAT32_MAX_LOG_RATIO}
    if loss_fn == "dro":
        # cispo's weight clamp(r, 1, 1) is exactly 1: its term is -A·logp.
        options.update(clip_low=0.0, clip_high=0.0, kl_coef=config["beta"], kl_estimator="k2")
    elif "clip_low_threshold" in config:
        options.update(clip_low=1.0 - config["clip_low_threshold"], clip_high=config["clip_high_threshold"] - 1.0)
    if loss_fn == "gspo":
        options["ratio_mask"] = True
    return options


def _sample(where: str, datum: TinkerDatum, loss_fn: str, spec: TinkerLoss, vocab_size: int, max_len: int) -> Sample:
    tokens = torch.as_tensor(datum.tokens)
    n = tokens.numel()
    if n == 0:
        raise UserError(f"{where}.model_input: no tokens")
    if n > max_len:
        raise UserError(
            f"{where}.model_input: {n} tokens, more than the longest accepted, {max_len} (training.seq_len)"
        )
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise UserError(f"{where}.model_input: tokens must be integers, got {tokens.dtype}")
    _check_token_ids(f"{where}.model_input", tokens.long(), vocab_size)
    inputs = datum.inputs
    for key in inputs:
        if key not in spec.inputs:
            raise UserError(
                f"{where}.loss_fn_inputs.{key}: not an input of loss_fn {loss_fn!r} (its inputs: {', '.join(spec.inputs)})"
            )
    values = {}
    for key in spec.inputs:
        field = f"{where}.loss_fn_inputs.{key}"
        if key not in inputs:
            raise UserError(f"{field}: missing (loss_fn {loss_fn!r} needs {', '.join(spec.inputs)})")
        values[key] = _input(field, key, inputs[key], n)
    _check_token_ids(f"{where}.loss_fn_inputs.target_tokens", values["target_tokens"], vocab_size)
    sample = Sample(input_ids=tokens.long(), labels=values["target_tokens"], loss_mask=torch.ones(n, dtype=torch.bool))
    if loss_fn == "cross_entropy":
        sample.loss_weights = values["weights"]
        return sample
    logprobs = values["logprobs"]
    if float(logprobs.max()) > MAX_LOGPROB:
        t = int(logprobs.argmax())
        raise UserError(
            f"{where}.loss_fn_inputs.logprobs[{t}] = {float(logprobs[t]):.4g} is above 0: not a log-probability"
        )
    sample.sampler_logprobs, sample.advantages = logprobs, values["advantages"]
    if loss_fn == "dro":
        sample.ref_logprobs = logprobs  # the quadratic penalty's reference: the engine's k2 KL
    if loss_fn == "gspo":
        sample.ratio_mask = (values["sequence_ratio_mask"] != 0).float()
    return sample


def _input(field: str, key: str, value, n: int) -> torch.Tensor:
    """One loss_fn_input as the engine takes it: int64 target ids, else float32."""
    if not isinstance(value, torch.Tensor):
        raise UserError(f"{field}: expected a tensor, got {type(value).__name__}")
    if value.dim() != 1:
        raise UserError(f"{field}: shape {tuple(value.shape)}, expected ({n},) (one value per token)")
    if value.numel() != n:
        raise UserError(f"{field}: {value.numel()} values for {n} tokens")
    if key == "target_tokens":
        if value.dtype.is_floating_point or value.dtype == torch.bool:
            raise UserError(f"{field}: dtype {value.dtype}, expected int64")
        return value.to(torch.long)
    if not value.dtype.is_floating_point:
        raise UserError(f"{field}: dtype {value.dtype}, expected float32")
    value = value.to(torch.float32)
    finite = torch.isfinite(value)
    if not bool(finite.all()):
        t = int((~finite).nonzero()[0])
        raise UserError(f"{field}[{t}] = {float(value[t])} is not finite")
    return value


def _check_token_ids(field: str, ids: torch.Tensor, vocab_size: int) -> None:
    bad = (ids < 0) | (ids >= vocab_size)
    if bool(bad.any()):
        t = int(bad.nonzero()[0])
        raise UserError(f"{field}[{t}] = {int(ids[t])} is not a token id (the vocabulary is [0, {vocab_size}))")


# ---------------------------------------------------------------- results


def forward_backward_metrics(fb: ForwardBackwardMetrics, loss_mesh: DeviceMesh | None) -> dict[str, float]:
    """The result's metrics of one ``Engine.forward_backward`` of an ``EngineCall`` (every
    rank's share summed over ``loss_mesh``, ``parallel_dims.mesh("loss")``: a collective)."""
    return {"loss:sum": float(all_reduce(fb.loss, "sum", loss_mesh))}


def forward_metrics(call: EngineCall, logprobs: list[torch.Tensor]) -> dict[str, float]:
    """The result's metrics of a forward-only request, from each datum's log-probs
    (``Engine.forward``): the same per-token terms as the engine's loss pass, without gradient."""
    loss = resolve_loss_fn(call.loss_fn, call.loss_fn_config)
    mb = pack(call.samples, inputs=loss.inputs)
    logprobs = torch.cat(logprobs).to(torch.float32)
    if loss.needs_sequence_log_ratio:
        mask = mb.ratio_mask != 0 if loss.options["ratio_mask"] else mb.loss_mask
        per_seq = torch.zeros(2, mb.num_seqs).index_add_(
            1, mb.seq_ids, torch.stack((torch.where(mask, logprobs - mb.sampler_logprobs, 0.0), mask.float()))
        )
        mb.seq_log_ratio = (per_seq[0] / per_seq[1].clamp(min=1))[mb.seq_ids]
    terms = token_terms(loss, logprobs, None, mb)
    return {"loss:sum": float((per_token_loss(loss, terms) * token_weights(mb, "sum", None, 0)).sum())}
