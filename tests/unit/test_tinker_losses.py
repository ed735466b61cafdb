"""Tinker's built-in losses on the engine (``service/tinker_losses.py``), single process on CPU.

The reference is the documented per-token formula written out in plain torch
(``reference.tinker_loss``): each datum run through a copy of the model alone, ``log_softmax``
of the full logits, the target's log-prob, the formula, a plain sum, ``.backward()``. The engine packs the datums into several micro-batches
and computes the loss in logit chunks under reduction "sum"; its summed loss, each datum's
log-probs and every parameter's gradient must agree within float rounding. Then each bad input
is refused with a ``UserError`` naming the field.
"""

import math

import pytest
import torch

from reference import tinker_loss, tinker_ratios
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.engine import Engine, EngineOptions
from torchtitan_rl.losses.loss_fns import resolve_loss_fn
from torchtitan_rl.models.qwen3.args import Qwen3ModelArgs
from torchtitan_rl.models.qwen3.model import Qwen3Model
from torchtitan_rl.recipes.base import build_model
from torchtitan_rl.service.operations import TinkerDatum, UserError
from torchtitan_rl.service.tinker_losses import (
    METRIC_NAMES,
    TINKER_LOSSES,
    forward_backward_metrics,
    forward_metrics,
    to_engine,
)

CPU = torch.device("cpu")
VOCAB, MAX_LEN, SEED = 64, 16, 3
ARGS = Qwen3ModelArgs(
    vocab_size=VOCAB,
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    hidden_dim=48,
    max_seq_len=64,
    attn_backend="sdpa_dense",
)
RTOL = 1e-5
# Each loss with non-default settings, chosen so that clips bind on both sides of the data below.
CONFIGS = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.15},
    "cispo": {"clip_low_threshold": 0.85, "clip_high_threshold": 1.1},
    "dro": {"beta": 0.7},
    # Sequence ratios are means of several tokens' log-ratios: much closer to 1.
    "gspo": {"clip_low_threshold": 0.935, "clip_high_threshold": 1.1},
}


def make_engine(max_tokens: int = MAX_LEN) -> Engine:
    dims = ParallelDims(1, 1, 1, 1, world_size=1)
    dims.build_meshes("cpu")
    model = build_model(ARGS, parallel_dims=dims, device=CPU, seed=SEED, param_dtype=torch.float32)
    options = EngineOptions(
        reduction="sum", horizon=MAX_LEN, max_tokens_per_microbatch=max_tokens, logits_chunk_size=5, max_norm=0.0
    )
    return Engine(model, optimizer=None, lr_scheduler=None, parallel_dims=dims, device=CPU, options=options)


def reference_copy(engine: Engine) -> Qwen3Model:
    model = Qwen3Model(ARGS)
    model.load_state_dict(engine.model.state_dict())
    return model


def target_logprobs(model: Qwen3Model, datum: TinkerDatum) -> torch.Tensor:
    n = len(datum.tokens)
    hidden = model(torch.tensor(datum.tokens), torch.arange(n), torch.zeros(n, dtype=torch.long))
    return model.output(hidden).log_softmax(-1).gather(1, datum.inputs["target_tokens"][:, None])[:, 0]


def make_datums(model: Qwen3Model, loss_fn: str, lengths, seed: int) -> list[TinkerDatum]:
    """Datums with every input of ``loss_fn``: sampler log-probs 0.25 (normal) from the model's,
    advantages of both signs, CE weights of both signs (and zeros), GSPO masks covering part of
    each datum with values other than 0 and 1."""
    gen = torch.Generator().manual_seed(seed)
    datums = []
    for n in lengths:
        tokens = torch.randint(0, VOCAB, (n,), generator=gen)
        targets = torch.randint(0, VOCAB, (n,), generator=gen)
        datum = TinkerDatum(tokens.tolist(), {"target_tokens": targets})
        if loss_fn == "cross_entropy":
            weights = torch.randn(n, generator=gen)
            datum.inputs["weights"] = torch.where(torch.rand(n, generator=gen) < 0.2, 0.0, weights)
        else:
            with torch.no_grad():
                logp = target_logprobs(model, datum)
            datum.inputs["logprobs"] = logp + 0.25 * torch.randn(n, generator=gen)
            datum.inputs["advantages"] = torch.randn(n, generator=gen)
        if loss_fn == "gspo":
            covered = torch.arange(n) >= n // 3  # a completion after a prompt
            datum.inputs["sequence_ratio_mask"] = torch.where(covered, torch.rand(n, generator=gen) + 0.5, 0.0)
        datums.append(datum)
    return datums


def reference_step(model: Qwen3Model, calls: list[list[TinkerDatum]], loss_fn: str, config: dict):
    """(loss of each call, log-probs of each call's datums, gradients after all calls)."""
    losses, logprobs = [], []
    for datums in calls:
        per_datum = [target_logprobs(model, d) for d in datums]
        loss = sum(tinker_loss(loss_fn, lp, d.inputs, config) for lp, d in zip(per_datum, datums))
        loss.backward()
        losses.append(float(loss.detach()))
        logprobs.append([lp.detach() for lp in per_datum])
    return losses, logprobs, {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, what: str):
    err, scale = (actual - expected).norm(), expected.norm()
    assert torch.isfinite(actual).all(), what
    assert err <= RTOL * scale + 1e-7, f"{what}: relative error {float(err / scale.clamp(min=1e-30)):.3e}"


CALL_LENGTHS = ((7, 3, 12, 1, 9, 16), (5, 11, 2))


@pytest.mark.parametrize("loss_fn", list(CONFIGS))
def test_engine_equals_documented_formula_over_two_accumulating_calls(loss_fn):
    engine = make_engine()
    model = reference_copy(engine)
    config = CONFIGS[loss_fn]
    calls = [make_datums(model, loss_fn, lengths, seed) for seed, lengths in enumerate(CALL_LENGTHS)]
    losses, logprobs, grads = reference_step(model, calls, loss_fn, config)
    for datums, loss, expected_logprobs in zip(calls, losses, logprobs):
        call = to_engine(datums, loss_fn, config, vocab_size=VOCAB, max_len=MAX_LEN)
        fb = engine.forward_backward(call.samples, call.loss_fn, call.loss_fn_config, with_logprobs=True)
        assert forward_backward_metrics(fb, None)["loss:sum"] == pytest.approx(loss, rel=RTOL, abs=1e-6), loss_fn
        assert len(fb.logprobs) == len(datums)
        for got, expected in zip(fb.logprobs, expected_logprobs, strict=True):
            torch.testing.assert_close(got, expected, rtol=RTOL, atol=1e-6)
    for name, param in engine.model.named_parameters():
        assert_rel_close(param.grad, grads[name], f"{loss_fn}: gradient of {name}")


@pytest.mark.parametrize("loss_fn", list(CONFIGS))
def test_forward_only_gives_logprobs_and_the_loss_without_touching_gradients(loss_fn):
    engine = make_engine()
    model = reference_copy(engine)
    datums = make_datums(model, loss_fn, CALL_LENGTHS[0], 0)
    losses, logprobs, _ = reference_step(model, [datums], loss_fn, CONFIGS[loss_fn])
    call = to_engine(datums, loss_fn, CONFIGS[loss_fn], vocab_size=VOCAB, max_len=MAX_LEN)
    out = engine.forward(call.samples)
    assert forward_metrics(call, out.logprobs)["loss:sum"] == pytest.approx(losses[0], rel=RTOL, abs=1e-6)
    for got, expected in zip(out.logprobs, logprobs[0], strict=True):
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=1e-6)
    assert all(p.grad is None for p in engine.model.parameters())


def test_data_exercises_every_clip_and_sign():
    """Premise of the comparisons: ratios fall outside every clip bound on both sides, and
    advantages and CE weights take both signs."""
    model = reference_copy(make_engine())
    for loss_fn, config in CONFIGS.items():
        datums = make_datums(model, loss_fn, CALL_LENGTHS[0], 0)
        if loss_fn == "cross_entropy":
            weights = torch.cat([d.inputs["weights"] for d in datums])
            assert (weights < 0).any() and (weights > 0).any() and (weights == 0).any()
            continue
        advantages = torch.cat([d.inputs["advantages"] for d in datums])
        assert (advantages < 0).any() and (advantages > 0).any()
        if "clip_low_threshold" not in config:
            continue
        with torch.no_grad():
            log_ratios = [target_logprobs(model, d) - d.inputs["logprobs"] for d in datums]
        ratios = tinker_ratios(loss_fn, log_ratios, [d.inputs.get("sequence_ratio_mask") for d in datums])
        assert (ratios < config["clip_low_threshold"]).any() and (ratios > config["clip_high_threshold"]).any()
        assert ((ratios > config["clip_low_threshold"]) & (ratios < config["clip_high_threshold"])).any()


def test_default_config_and_large_log_ratios_follow_the_formula():
    """Tinker's defaults (clip 0.8 / 1.2, beta 0.05), and log-ratios of 30 (ratio 1e13): the
    engine's usual clamp of the log-ratio at 20 must not bind on a finite documented value."""
    for loss_fn in ("importance_sampling", "ppo", "dro", "gspo"):
        engine = make_engine()
        model = reference_copy(engine)
        datums = make_datums(model, loss_fn, (6, 4), 7)
        datums[0].inputs["logprobs"][2] -= 30.0
        datums[1].inputs["logprobs"] -= 30.0  # GSPO: the whole sequence's ratio
        losses, _, grads = reference_step(model, [datums], loss_fn, {})
        call = to_engine(datums, loss_fn, None, vocab_size=VOCAB, max_len=MAX_LEN)
        fb = engine.forward_backward(call.samples, call.loss_fn, call.loss_fn_config)
        if loss_fn == "importance_sampling":
            assert abs(losses[0]) > 1e9  # the ratios of 1e13 are in the loss
        assert float(fb.loss) == pytest.approx(losses[0], rel=RTOL), loss_fn
        for name, param in engine.model.named_parameters():
            assert_rel_close(param.grad, grads[name], f"{loss_fn}: gradient of {name}")


def test_gspo_mask_without_any_position_is_a_log_ratio_of_zero():
    engine = make_engine()
    model = reference_copy(engine)
    datums = make_datums(model, "gspo", (6, 5), 2)
    datums[0].inputs["sequence_ratio_mask"] = torch.zeros(6)
    losses, _, grads = reference_step(model, [datums], "gspo", CONFIGS["gspo"])
    call = to_engine(datums, "gspo", CONFIGS["gspo"], vocab_size=VOCAB, max_len=MAX_LEN)
    fb = engine.forward_backward(call.samples, call.loss_fn, call.loss_fn_config)
    assert float(fb.loss) == pytest.approx(losses[0], rel=RTOL)
    for name, param in engine.model.named_parameters():
        assert_rel_close(param.grad, grads[name], f"gradient of {name}")


def test_converter_maps_every_loss_to_an_engine_loss_with_its_config():
    assert METRIC_NAMES == ("loss:sum",)
    assert set(TINKER_LOSSES) == {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"}
    datums = [TinkerDatum([1, 2], {"target_tokens": torch.tensor([2, 3]), "weights": torch.ones(2)})]
    call = to_engine(datums, "cross_entropy", {}, vocab_size=VOCAB, max_len=MAX_LEN)
    assert (call.loss_fn, call.loss_fn_config) == ("cross_entropy", {"loss_weights": True})
    sample = call.samples[0]
    assert sample.input_ids.tolist() == [1, 2] and sample.labels.tolist() == [2, 3]  # no shift
    assert sample.loss_mask.all()  # every position counts
    for loss_fn in TINKER_LOSSES:  # each resolves to a valid engine loss
        inputs = {"target_tokens": torch.tensor([2, 3]), "logprobs": -torch.ones(2), "advantages": torch.ones(2)}
        inputs |= {"weights": torch.ones(2)} if loss_fn == "cross_entropy" else {}
        inputs |= {"sequence_ratio_mask": torch.ones(2)} if loss_fn == "gspo" else {}
        inputs = {k: v for k, v in inputs.items() if k in TINKER_LOSSES[loss_fn].inputs}
        call = to_engine([TinkerDatum([1, 2], inputs)], loss_fn, None, vocab_size=VOCAB, max_len=MAX_LEN)
        resolve_loss_fn(call.loss_fn, call.loss_fn_config)


# ---------------------------------------------------------------- bad input


def good_ppo_datum(n: int = 4) -> TinkerDatum:
    return TinkerDatum(
        list(range(n)),
        {"target_tokens": torch.arange(1, n + 1), "logprobs": -torch.ones(n), "advantages": torch.ones(n)},
    )


def refused(data, loss_fn="ppo", config=None, max_len=MAX_LEN) -> str:
    with pytest.raises(UserError) as err:
        to_engine(data, loss_fn, config, vocab_size=VOCAB, max_len=max_len)
    return str(err.value)


def test_lengths_that_disagree_are_refused_naming_the_field():
    bad = good_ppo_datum(8)
    bad.inputs["advantages"] = torch.ones(7)
    assert refused([good_ppo_datum(), bad]) == "data[1].loss_fn_inputs.advantages: 7 values for 8 tokens"
    ce = TinkerDatum(list(range(8)), {"target_tokens": torch.arange(8), "weights": torch.ones(7)})
    assert refused([ce], "cross_entropy") == "data[0].loss_fn_inputs.weights: 7 values for 8 tokens"
    two_d = good_ppo_datum(4)
    two_d.inputs["logprobs"] = -torch.ones(2, 2)
    assert refused([two_d]).startswith("data[0].loss_fn_inputs.logprobs: shape (2, 2), expected (4,)")


def test_missing_extra_and_unknown_inputs_are_refused():
    missing = good_ppo_datum()
    del missing.inputs["advantages"]
    assert refused([missing]).startswith("data[0].loss_fn_inputs.advantages: missing (loss_fn 'ppo' needs")
    extra = good_ppo_datum()
    extra.inputs["weights"] = torch.ones(4)  # an input of another loss
    assert refused([good_ppo_datum(), extra]).startswith("data[1].loss_fn_inputs.weights: not an input of loss_fn")
    unknown = good_ppo_datum()
    unknown.inputs["mask"] = torch.ones(4)
    assert refused([unknown]).startswith("data[0].loss_fn_inputs.mask: not an input of loss_fn 'ppo'")
    assert refused([good_ppo_datum()], "gspo").startswith("data[0].loss_fn_inputs.sequence_ratio_mask: missing")


def test_wrong_dtypes_are_refused():
    floats = good_ppo_datum()
    floats.inputs["target_tokens"] = floats.inputs["target_tokens"].float()
    assert refused([floats]) == "data[0].loss_fn_inputs.target_tokens: dtype torch.float32, expected int64"
    ints = good_ppo_datum()
    ints.inputs["advantages"] = torch.ones(4, dtype=torch.long)
    assert refused([ints]) == "data[0].loss_fn_inputs.advantages: dtype torch.int64, expected float32"
    assert refused([TinkerDatum([0.5, 1.0], {})]).startswith("data[0].model_input: tokens must be integers")


def test_token_ids_outside_the_vocabulary_are_refused():
    past = good_ppo_datum()
    past.tokens[2] = VOCAB
    assert refused([good_ppo_datum(), past]) == (
        f"data[1].model_input[2] = {VOCAB} is not a token id (the vocabulary is [0, {VOCAB}))"
    )
    negative = good_ppo_datum()
    negative.inputs["target_tokens"][3] = -1
    assert refused([negative]).startswith("data[0].loss_fn_inputs.target_tokens[3] = -1 is not a token id")


def test_empty_and_too_long_datums_and_empty_data_are_refused():
    assert refused([good_ppo_datum(), TinkerDatum([], {})]) == "data[1].model_input: no tokens"
    assert refused([good_ppo_datum(17)]).startswith(
        "data[0].model_input: 17 tokens, more than the longest accepted, 16 (training.seq_len)"
    )
    assert refused([good_ppo_datum(MAX_LEN)], max_len=MAX_LEN - 1).startswith("data[0].model_input: 16 tokens")
    assert refused([]) == "data: no datums"


def test_non_finite_values_and_positive_log_probs_are_refused():
    nan = good_ppo_datum()
    nan.inputs["advantages"][1] = math.nan
    assert refused([nan]) == "data[0].loss_fn_inputs.advantages[1] = nan is not finite"
    inf = TinkerDatum([1, 2], {"target_tokens": torch.tensor([2, 3]), "weights": torch.tensor([1.0, math.inf])})
    assert refused([inf], "cross_entropy") == "data[0].loss_fn_inputs.weights[1] = inf is not finite"
    positive = good_ppo_datum()
    positive.inputs["logprobs"][0] = 0.5
    assert refused([positive]).startswith("data[0].loss_fn_inputs.logprobs[0] = 0.5 is above 0")


def test_unknown_loss_and_bad_config_are_refused_naming_the_key():
    assert refused([good_ppo_datum()], "stable_reinforce").startswith("loss_fn: 'stable_reinforce' is not supported")
    assert refused([good_ppo_datum()], "ppo", {"beta": 0.1}).startswith(
        "loss_fn_config.beta: not an option of loss_fn 'ppo'; its options: clip_low_threshold, clip_high_threshold"
    )
    assert refused([good_ppo_datum()], "ppo", {"clip_low_threshold": "0.9"}).startswith(
        "loss_fn_config.clip_low_threshold: expected a finite number"
    )
    assert refused([good_ppo_datum()], "cispo", {"clip_low_threshold": 0.0}).startswith(
        "loss_fn_config.clip_low_threshold: must be in (0, 1]"
    )
    assert refused([good_ppo_datum()], "gspo", {"clip_high_threshold": 0.9}).startswith(
        "loss_fn_config.clip_high_threshold: must be >= 1"
    )
    assert refused([good_ppo_datum()], "dro", {"beta": -1.0}) == "loss_fn_config.beta: must be >= 0, got -1.0"
    assert refused([good_ppo_datum()], "dro", {"beta": math.inf}).startswith("loss_fn_config.beta: expected a finite")
    assert isinstance(UserError("x"), ValueError)


def test_engine_options_set_only_by_programs_are_checked():
    with pytest.raises(ValueError, match=r"loss_fn_config.ratio_mask: loss_fn 'ppo' has no sequence ratio"):
        resolve_loss_fn("ppo", {"ratio_mask": True})
    with pytest.raises(ValueError, match=r"loss_fn_config.max_log_ratio: loss_fn 'cross_entropy' has no ratio"):
        resolve_loss_fn("cross_entropy", {"max_log_ratio": 30.0})
    with pytest.raises(ValueError, match=r"loss_fn_config.max_log_ratio: must be > 0"):
        resolve_loss_fn("ppo", {"max_log_ratio": 0.0})
    with pytest.raises(ValueError, match=r"loss_fn_config.loss_weights: expected true or false"):
        resolve_loss_fn("ppo", {"loss_weights": 1})
    assert resolve_loss_fn("cross_entropy", {"loss_weights": True}).inputs == ("loss_weights",)
    assert resolve_loss_fn("gspo", {"ratio_mask": True}).inputs == ("advantages", "sampler_logprobs", "ratio_mask")
