"""Engine, chunked cross-entropy, clipping and the lr schedule, single process on CPU.

References are independent of the code under test: ``F.cross_entropy`` on full logits,
a per-sequence (unpacked) forward of the same model with the mode's loss written out, and
formulas for the clipping coefficient and the schedule.
"""

import dataclasses
import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from reference import minibatch_loss
from torchtitan_rl.data.balance import plan_microbatches
from torchtitan_rl.data.sample import Sample
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.engine import Engine, EngineOptions
from torchtitan_rl.losses.logprobs import token_logprobs, token_loss
from torchtitan_rl.losses.reduction import NUM_LOSS_TOKENS, NUM_SEQS_WITH_LOSS, NUM_TOKENS
from torchtitan_rl.models.qwen3.args import Qwen3ModelArgs
from torchtitan_rl.optim import build_lr_scheduler, build_optimizer, lr_factor
from torchtitan_rl.profiling import cpu_memory_timeline
from torchtitan_rl.recipes.base import build_model

CPU = torch.device("cpu")
HORIZON = 20
ARGS = Qwen3ModelArgs(
    vocab_size=64,
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    hidden_dim=48,
    rope_theta=10_000.0,
    max_seq_len=64,
    attn_backend="sdpa_dense",
)
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1


def make_engine(
    reduction="token_mean", max_tokens=0, chunk=5, max_norm=0.0, steps=10, warmup=0, seed=0, args=ARGS, balanced=False
):
    dims = ParallelDims(1, 1, 1, 1, world_size=1)
    dims.build_meshes("cpu")
    model = build_model(args, parallel_dims=dims, device=CPU, seed=seed, param_dtype=torch.float32)
    optimizer = build_optimizer(model, LR, BETAS[0], BETAS[1], EPS, WD)
    scheduler = build_lr_scheduler(optimizer, steps, warmup, "linear", 0.1)
    options = EngineOptions(
        reduction=reduction,
        horizon=HORIZON,
        max_tokens_per_microbatch=max_tokens,
        logits_chunk_size=chunk,
        max_norm=max_norm,
        balance_microbatches=balanced,
    )
    return Engine(model, optimizer=optimizer, lr_scheduler=scheduler, parallel_dims=dims, device=CPU, options=options)


def random_raw(seed: int, num: int = 6, max_len: int = 11):
    rng = random.Random(seed)
    raw = []
    for i in range(num):
        n = 2 if i == 2 else rng.randint(3, max_len)
        tokens = [rng.randrange(ARGS.vocab_size) for _ in range(n)]
        if i == 1:
            mask = [False] * n  # a sequence without loss tokens
        else:
            mask = [False] + [rng.random() < 0.7 for _ in range(n - 1)]
            mask[-1] = True
        raw.append((tokens, mask))
    return raw


def samples_of(raw):
    return [Sample.from_tokens(tokens, mask) for tokens, mask in raw]


def per_sequence_token_losses(model, raw):
    """Cross-entropy of every token, one unpacked sequence at a time, full logits."""
    out = []
    for tokens, _ in raw:
        ids = torch.tensor(tokens[:-1])
        n = ids.numel()
        hidden = model(ids, torch.arange(n), torch.zeros(n, dtype=torch.long))
        logits = model.output(hidden).float()
        out.append(F.cross_entropy(logits, torch.tensor(tokens[1:]), reduction="none"))
    return out


def reference_loss(model, raw, mode):
    losses = per_sequence_token_losses(model, raw)
    masks = [torch.tensor(mask[1:], dtype=torch.float32) for _, mask in raw]
    seq_sums = [(l * m).sum() for l, m in zip(losses, masks)]
    return minibatch_loss(seq_sums, [int(m.sum()) for m in masks], mode, HORIZON)


def reference_grads(model, raw, mode):
    params = list(model.parameters())
    loss = reference_loss(model, raw, mode)
    return loss.detach(), torch.autograd.grad(loss, params)


def grads_of(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def assert_grads_close(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- chunked cross-entropy


class LargestTensorMode(TorchDispatchMode):
    """Records the element count of the largest tensor any op produces, and the matrix products
    (the entropy's per-token dot products are batched products, not counted)."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.num_matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.num_matmuls += 1
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("chunk", [1, 4, 5, 12, 50])
def test_chunked_logprobs_and_entropy_match_full_logits(chunk):
    torch.manual_seed(0)
    num_tokens, dim, vocab = 12, 16, 40
    weight = torch.randn(vocab, dim, requires_grad=True)
    ref_weight = weight.detach().clone().requires_grad_()
    hidden = torch.randn(num_tokens, dim, requires_grad=True)
    ref_hidden = hidden.detach().clone().requires_grad_()
    labels = torch.randint(0, vocab, (num_tokens,))
    weights = torch.rand(num_tokens)

    def loss_of_chunk(start, end, logprobs, entropy):
        return -(logprobs * weights[start:end]).sum() + entropy.sum()

    with LargestTensorMode() as mode:
        loss, logprobs, entropy = token_loss(hidden, weight, labels, chunk, loss_of_chunk, with_entropy=True)
    # Logits exist only chunk by chunk; per chunk: logits, then the two gradient products.
    assert mode.largest <= max(min(chunk, num_tokens) * vocab, vocab * dim)
    assert mode.num_matmuls == 3 * -(-num_tokens // chunk)
    with LargestTensorMode() as mode:
        loss.backward()
    # Backward recomputes nothing: it only scales the gradients taken in forward.
    assert mode.num_matmuls == 0 and mode.largest == vocab * dim
    no_grad_logprobs, no_grad_entropy = token_logprobs(hidden, weight, labels, chunk, with_entropy=True)

    ref_log_softmax = (ref_hidden @ ref_weight.t()).log_softmax(-1)
    ref_logprobs = ref_log_softmax.gather(1, labels[:, None])[:, 0]
    ref_entropy = -(ref_log_softmax.exp() * ref_log_softmax).sum(-1)
    ref_loss = -(ref_logprobs * weights).sum() + ref_entropy.sum()
    ref_loss.backward()
    assert logprobs.shape == entropy.shape == (num_tokens,)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(no_grad_logprobs, ref_logprobs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(no_grad_entropy, ref_entropy, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.grad, ref_hidden.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, ref_weight.grad, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- forward


@pytest.mark.parametrize("max_tokens, balanced", [(0, False), (12, False), (12, True)])
def test_forward_logprobs_and_entropies_match_per_sequence_log_softmax(max_tokens, balanced):
    engine = make_engine(max_tokens=max_tokens, chunk=7, balanced=balanced)
    raw = random_raw(1)
    samples = samples_of(raw)
    if max_tokens:
        plan = plan_microbatches([len(s) for s in samples], max_tokens, balanced=balanced)
        assert len(plan) > 1
        # Balanced packing reorders the samples; the results must still come back in order.
        assert ([i for group in plan for i in group] != list(range(len(samples)))) == balanced
    got = engine.forward(samples, with_entropy=True)
    assert engine.forward(samples).entropies is None
    assert len(got.logprobs) == len(got.entropies) == len(raw)
    model = engine.model
    with torch.no_grad():
        for (tokens, _), lp, ent in zip(raw, got.logprobs, got.entropies):
            ids = torch.tensor(tokens[:-1])
            n = ids.numel()
            log_softmax = (
                model.output(model(ids, torch.arange(n), torch.zeros(n, dtype=torch.long))).float().log_softmax(-1)
            )
            expected = log_softmax.gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
            assert lp.shape == ent.shape == (n,)
            assert lp.device == ent.device == torch.device("cpu")
            torch.testing.assert_close(lp, expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ent, -(log_softmax.exp() * log_softmax).sum(-1), rtol=1e-5, atol=1e-5)
    assert all(p.grad is None for p in model.parameters())


# ---------------------------------------------------------------- forward_backward


@pytest.mark.parametrize("mode", ["token_mean", "sequence_mean", "seq_mean_token_sum_norm", "sum"])
def test_forward_backward_matches_reference_for_any_microbatching(mode):
    raw = random_raw(2)
    samples = samples_of(raw)
    results = []
    for max_tokens, balanced in ((0, False), (12, False), (10, False), (12, True), (10, True)):
        engine = make_engine(reduction=mode, max_tokens=max_tokens, balanced=balanced)
        if max_tokens:
            assert len(plan_microbatches([len(s) for s in samples], max_tokens, balanced=balanced)) > 1
        metrics = engine.forward_backward(samples, "cross_entropy")
        results.append((engine, metrics, grads_of(engine.model)))
    model = results[0][0].model
    ref_loss, ref_grads = reference_grads(model, raw, mode)
    one_mb_grads = results[0][2]
    for _, metrics, grads in results:
        assert_grads_close(grads, ref_grads)
        assert_grads_close(grads, one_mb_grads)
        torch.testing.assert_close(metrics.loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert int(metrics.counts[NUM_LOSS_TOKENS]) == sum(sum(m[1:]) for _, m in raw)
        assert int(metrics.counts[NUM_SEQS_WITH_LOSS]) == sum(1 for _, m in raw if any(m[1:]))
        assert int(metrics.counts[NUM_TOKENS]) == sum(len(t) - 1 for t, _ in raw)


def test_forward_backward_max_seq_loss():
    raw = random_raw(3)
    engine = make_engine(max_tokens=12)
    metrics = engine.forward_backward(samples_of(raw))
    with torch.no_grad():
        losses = per_sequence_token_losses(engine.model, raw)
    means = [
        float((l * torch.tensor(m[1:], dtype=torch.float32)).sum()) / sum(m[1:])
        for l, (_, m) in zip(losses, raw)
        if any(m[1:])
    ]
    assert math.isclose(float(metrics.max_seq_loss), max(means), rel_tol=1e-5)


def test_forward_backward_calls_accumulate():
    raw_a, raw_b = random_raw(4, num=4), random_raw(5, num=3)
    engine = make_engine(max_tokens=12)
    engine.forward_backward(samples_of(raw_a))
    engine.forward_backward(samples_of(raw_b))
    got = grads_of(engine.model)
    _, grads_a = reference_grads(engine.model, raw_a, "token_mean")
    _, grads_b = reference_grads(engine.model, raw_b, "token_mean")
    assert_grads_close(got, [a + b for a, b in zip(grads_a, grads_b)])
    # And not just one of them.
    assert any(not torch.allclose(g, a, rtol=1e-3, atol=1e-6) for g, a in zip(got, grads_a))


@pytest.mark.parametrize("backend", ["sdpa_varlen", "sdpa_loop", "sdpa_dense"])
def test_a_prepared_batch_trains_like_its_samples(backend):
    """``prepare`` (what the loader runs on its prefetch thread) packs, counts and plans the
    attention of every micro-batch ahead; the step is the reference's all the same."""
    args = dataclasses.replace(ARGS, attn_backend=backend)
    raw = random_raw(9)
    direct, ahead = make_engine(max_tokens=12, args=args), make_engine(max_tokens=12, args=args)
    batch = ahead.prepare(samples_of(raw), "cross_entropy")
    assert len(batch.shares) > 1 and [a.backend for a in batch.attention] == [backend] * len(batch.shares)
    got, expected = ahead.forward_backward(batch), direct.forward_backward(samples_of(raw))
    ref_loss, ref_grads = reference_grads(ahead.model, raw, "token_mean")
    assert_grads_close(grads_of(ahead.model), ref_grads)
    torch.testing.assert_close(got.loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.max_seq_loss, expected.max_seq_loss)
    assert got.counts.tolist() == expected.counts.tolist()


def test_a_batch_prepared_for_another_loss_or_with_a_bad_sample_is_refused():
    engine = make_engine()
    batch = engine.prepare(samples_of(random_raw(10)))
    with pytest.raises(ValueError, match="prepared for a loss reading no inputs.*advantages"):
        engine.forward_backward(batch, "ppo")
    # A bad sample is recorded by prepare (no collective there) and raised by the step.
    spoiled = engine.prepare(samples_of(random_raw(10)), "ppo")
    assert spoiled.problem is not None and "advantages" in spoiled.problem
    with pytest.raises(ValueError, match="advantages"):
        engine.forward_backward(spoiled, "ppo")
    assert all(p.grad is None for p in engine.model.parameters())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_cuda_step_never_waits_for_the_device():
    """The step's one blocking collective agrees on the plan over gloo on the host; the
    counts are reduced on the device and metrics stay there: forward_backward + optim_step
    of a dense model under flex attention make no device-to-host sync (after a first step
    that compiles flex for these shapes)."""
    cuda = torch.device("cuda")
    # flex_attention's kernels need heads of at least 16 dims.
    engine = make_engine(max_tokens=12, args=dataclasses.replace(ARGS, attn_backend="auto", head_dim=16))
    engine.model.to(cuda)
    engine.device = cuda
    engine.optimizer = build_optimizer(engine.model, LR, BETAS[0], BETAS[1], EPS, WD)
    engine.lr_scheduler = build_lr_scheduler(engine.optimizer, 10, 0, "linear", 0.1)
    samples = samples_of(random_raw(11))
    engine.forward_backward(engine.prepare(samples))
    engine.optim_step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        metrics = engine.forward_backward(engine.prepare(samples))
        engine.optim_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert metrics.loss.device.type == "cuda" and torch.isfinite(metrics.loss)


def test_unknown_loss_fn():
    engine = make_engine()
    with pytest.raises(ValueError, match="'nope'.*cross_entropy"):
        engine.forward_backward(samples_of(random_raw(6)), "nope")
    assert all(p.grad is None for p in engine.model.parameters())


def rl_samples(raw, seed: int = 0):
    """Samples of ``raw`` with every RL input, groups of two."""
    gen = torch.Generator().manual_seed(seed)
    samples = samples_of(raw)
    for i, s in enumerate(samples):
        n = len(s)
        s.advantages = torch.randn(n, generator=gen)
        s.sampler_logprobs = -4 - torch.rand(n, generator=gen)
        s.ref_logprobs = -4 - torch.rand(n, generator=gen)
        s.group_id = i // 2
    return samples


def test_gspo_gradient_is_the_sequence_ratio_gradient():
    """GSPO against its published objective in fp64, written with the true sequence function
    s_i = exp(mean_t(logp_t − logp_old,t)) (sequence advantages, as GRPO's): for every
    micro-batching and logits chunk, the engine's straight-through tokens give ∇ of
    (1/B) Σ_i −min(s_i A_i, clip(s_i) A_i)."""
    args = dataclasses.replace(ARGS, attn_backend="sdpa_varlen")
    raw = random_raw(12, num=8)
    samples = rl_samples(raw, seed=3)
    for i, s in enumerate(samples):
        s.advantages = torch.full((len(s),), [0.9, -1.2, 0.4, -0.3, 1.5, -0.8, 0.2, -1.0][i])
    config = {"clip_low": 0.2, "clip_high": 0.3, "proximal_logprobs": True}
    for s in samples:
        s.prox_logprobs = s.sampler_logprobs.flip(0)
    reference = make_engine(reduction="sequence_mean", args=args).model.double()
    clipped, objective = 0, []
    for sample in samples:
        m = sample.loss_mask.double()
        if not m.any():
            continue
        n = len(sample)
        logits = reference.output(reference(sample.input_ids, torch.arange(n), torch.zeros(n, dtype=torch.long)))
        logp = logits.log_softmax(-1).gather(1, sample.labels[:, None])[:, 0]
        s_i = torch.exp(((logp - sample.prox_logprobs.double()) * m).sum() / m.sum())
        a = float(sample.advantages[0])
        s_value = float(s_i.detach())
        clipped += (a > 0 and s_value > 1 + config["clip_high"]) or (a < 0 and s_value < 1 - config["clip_low"])
        objective.append(torch.minimum(s_i * a, s_i.clamp(1 - config["clip_low"], 1 + config["clip_high"]) * a))
    expected_loss = -torch.stack(objective).mean()
    expected = torch.autograd.grad(expected_loss, list(reference.parameters()))
    assert 0 < clipped < len(objective)  # sequences whose clip binds, and others
    for max_tokens, chunk in ((0, 5), (12, 3), (10, 64)):
        engine = make_engine(reduction="sequence_mean", max_tokens=max_tokens, chunk=chunk, args=args)
        metrics = engine.forward_backward(samples, "gspo", config)
        torch.testing.assert_close(metrics.loss.double(), expected_loss.detach(), rtol=1e-5, atol=1e-7)
        for got, want in zip(grads_of(engine.model), expected):
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)


def test_decoupled_ppo_with_proximal_equal_to_behaviour_is_todays_ppo_bit_for_bit():
    samples = rl_samples(random_raw(13))
    config = {"clip_low": 0.2, "clip_high": 0.28, "kl_coef": 0.1, "entropy_coef": 0.01}
    today = make_engine(max_tokens=12)
    today_metrics = today.forward_backward(samples, "ppo", config)
    for s in samples:
        s.prox_logprobs = s.sampler_logprobs.clone()
        s.rollout_weights = torch.ones(len(s))
    decoupled = make_engine(max_tokens=12)
    decoupled_metrics = decoupled.forward_backward(
        samples, "ppo", {**config, "proximal_logprobs": True, "rollout_weights": True}
    )
    assert torch.equal(decoupled_metrics.loss, today_metrics.loss)
    for a, b in zip(grads_of(decoupled.model), grads_of(today.model)):
        assert torch.equal(a, b)


def test_rollout_weights_scale_each_tokens_policy_term():
    """Weights w_t multiply ℓ^pg_t: the gradient of Σ_t (token weight)·w_t·ℓ^pg_t, by brute force."""
    raw = random_raw(14)
    samples = rl_samples(raw)
    gen = torch.Generator().manual_seed(5)
    for s in samples:
        s.rollout_weights = torch.where(
            torch.rand(len(s), generator=gen) < 0.3, 0.0, 2 * torch.rand(len(s), generator=gen)
        )
    engine = make_engine(max_tokens=12)
    engine.forward_backward(samples, "importance_sampling", {"rollout_weights": True})
    model = engine.model
    num_loss_tokens = sum(int(s.loss_mask.sum()) for s in samples)
    total = 0.0
    for s in samples:
        n = len(s)
        logp = model.output(model(s.input_ids, torch.arange(n), torch.zeros(n, dtype=torch.long))).log_softmax(-1)
        logp = logp.gather(1, s.labels[:, None])[:, 0]
        ratio = torch.exp(logp - s.sampler_logprobs)
        total = total + (-ratio * s.advantages * s.rollout_weights * s.loss_mask).sum() / num_loss_tokens
    assert_grads_close(grads_of(model), torch.autograd.grad(total, list(model.parameters())))


def test_rl_step_with_entropy_never_holds_all_logits():
    """ppo + KL + entropy bonus: logits (and their softmax) exist one token chunk at a time."""
    args = dataclasses.replace(ARGS, vocab_size=4096)
    engine = make_engine(chunk=5, args=args)
    samples = rl_samples(random_raw(8))
    num_tokens = sum(len(s) for s in samples)
    with LargestTensorMode() as mode:
        engine.forward_backward(samples, "ppo", {"kl_coef": 0.1, "entropy_coef": 0.1})
    assert all(p.grad is not None for p in engine.model.parameters())
    # The output weight [V, D] is the largest tensor; all logits would be T x V.
    assert mode.largest <= args.vocab_size * args.dim < num_tokens * args.vocab_size


def step_peak_bytes(engine, samples, loss_fn, config) -> int:
    """Peak bytes allocated during one forward_backward and still alive (profiler events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        engine.forward_backward(samples, loss_fn, config)
    engine.model.zero_grad(set_to_none=True)
    return cpu_memory_timeline(prof)["peak_allocated_bytes"]


def test_entropy_memory_is_bounded_by_the_chunk():
    """A reported entropy (RL loss, no bonus) costs no memory over cross-entropy; with a
    gradient it costs a few chunk-sized buffers, never one per chunk of the micro-batch."""
    args = dataclasses.replace(ARGS, vocab_size=8192)
    chunk = 16
    engine = make_engine(chunk=chunk, args=args)
    samples = rl_samples(random_raw(10, num=8, max_len=40))
    num_tokens = sum(len(s) for s in samples)
    buffer = chunk * args.vocab_size * 4  # one fp32 [chunk, V]
    assert num_tokens >= 8 * chunk
    step_peak_bytes(engine, samples, "cross_entropy", {})  # warm-up
    base = step_peak_bytes(engine, samples, "cross_entropy", {})
    reported = step_peak_bytes(engine, samples, "ppo", {})
    bonus = step_peak_bytes(engine, samples, "ppo", {"entropy_coef": 0.1})
    assert reported <= base + buffer // 4, (reported - base) / buffer
    assert bonus <= base + 3 * buffer, (bonus - base) / buffer


@pytest.mark.parametrize(
    "loss_fn, config, reduction, spoil, message",
    [
        (
            "ppo",
            {},
            "token_mean",
            lambda s: setattr(s[2], "advantages", None),
            r"sample 2 of this rank's 6 has no advantages",
        ),
        (
            "cispo",
            {"kl_coef": 0.1},
            "token_mean",
            lambda s: setattr(s[0], "ref_logprobs", None),
            r"sample 0 .* has no ref_logprobs",
        ),
        (
            "importance_sampling",
            {},
            "token_mean",
            lambda s: setattr(s[1], "sampler_logprobs", torch.zeros(2)),
            r"sample 1 .*: sampler_logprobs must be a tensor of shape \(\d+,\) \(one value per label\), got \(2,\)",
        ),
        (
            "ppo",
            {},
            "token_mean",
            lambda s: setattr(s[3], "sampler_logprobs", s[3].sampler_logprobs.exp()),
            r"sample 3 .*: sampler_logprobs\[\d+\] = .* is a log-probability above 0",
        ),
        (
            "ppo",
            {},
            "token_mean",
            lambda s: s[0].advantages.__setitem__(1, float("inf")),
            r"advantages\[1\] = inf is not finite",
        ),
        (
            "ppo",
            {},
            "token_mean",
            lambda s: setattr(s[0], "advantages", s[0].advantages.long()),
            r"advantages must be floating point",
        ),
        ("ppo", {}, "prompt_mean", lambda s: setattr(s[4], "group_id", None), r"sample 4 .* has no group_id"),
        ("cross_entropy", {}, "prompt_mean", lambda s: setattr(s[4], "group_id", -1), r"group_id must be an int >= 0"),
        ("ppo", {}, "prompt_mean", lambda s: setattr(s[5], "group_id", 6), r"group_id 6 is out of range"),
        # A device tensor among CPU ones would otherwise meet CPU padding inside packing.
        (
            "ppo",
            {"kl_coef": 0.1},
            "token_mean",
            lambda s: setattr(s[1], "ref_logprobs", s[1].ref_logprobs.to("meta")),
            r"sample 1 .*: ref_logprobs is on meta; a sample's tensors live on the CPU",
        ),
        (
            "cross_entropy",
            {},
            "token_mean",
            lambda s: setattr(s[2], "labels", s[2].labels.to("meta")),
            r"sample 2 .*: labels is on meta",
        ),
    ],
)
def test_bad_rl_inputs_are_named_before_any_gradient(loss_fn, config, reduction, spoil, message):
    engine = make_engine(reduction=reduction, max_tokens=12)
    samples = rl_samples(random_raw(9))
    spoil(samples)
    with pytest.raises(ValueError, match=message):
        engine.forward_backward(samples, loss_fn, config)
    assert all(p.grad is None for p in engine.model.parameters())


# ---------------------------------------------------------------- optim_step


def run_optim_step(max_norm):
    """forward_backward + optim_step; returns what the optimizer saw and the reference step."""
    engine = make_engine(reduction="sum", max_tokens=12, max_norm=max_norm, steps=10, warmup=2)
    engine.forward_backward(samples_of(random_raw(7)))
    params = list(engine.model.parameters())
    before = [p.detach().clone() for p in params]
    grads = grads_of(engine.model)
    seen = {}

    def record_grads(optimizer, args, kwargs):
        seen["grads"] = [p.grad.detach().clone() for p in params]

    handle = engine.optimizer.register_step_pre_hook(record_grads)
    out = engine.optim_step()
    handle.remove()
    return engine, out, before, grads, seen["grads"]


def brute_force_norm(grads):
    return math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))


def adamw_reference(before, clipped, lr):
    params = [nn.Parameter(p.clone()) for p in before]
    opt = torch.optim.AdamW(params, lr=lr, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    for p, g in zip(params, clipped):
        p.grad = g.clone()
    opt.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("relative_max_norm", [0.1, 0.5, 2.0, 0.0])
def test_optim_step_clips_steps_and_zeroes(relative_max_norm):
    # Probe the norm once to set max_norm relative to it (0.0 disables clipping).
    probe = make_engine(reduction="sum", max_tokens=12)
    probe.forward_backward(samples_of(random_raw(7)))
    norm = brute_force_norm(grads_of(probe.model))
    assert norm > 0
    max_norm = relative_max_norm * norm

    engine, out, before, grads, seen = run_optim_step(max_norm)
    assert math.isclose(float(out["grad_norm"]), brute_force_norm(grads), rel_tol=1e-5)
    assert math.isclose(float(out["grad_norm"]), norm, rel_tol=1e-5)

    coef = min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0
    for s, g in zip(seen, grads):
        torch.testing.assert_close(s, g * coef, rtol=1e-5, atol=1e-9)
    post = brute_force_norm(seen)
    if max_norm > 0 and max_norm < norm:
        assert math.isclose(post, max_norm, rel_tol=1e-4)
    else:
        assert math.isclose(post, norm, rel_tol=1e-5)

    # warmup 2 of 10 steps: the first optimizer step runs at 1/3 of the base lr.
    assert math.isclose(out["lr"], LR * 1 / 3, rel_tol=1e-9)
    expected = adamw_reference(before, seen, out["lr"])
    for p, e in zip(engine.model.parameters(), expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-5, atol=1e-7)
    assert all(p.grad is None for p in engine.model.parameters())
    # The scheduler advanced: the next step uses step 2's factor, 2/3.
    assert math.isclose(engine.lr_scheduler.get_last_lr()[0], LR * 2 / 3, rel_tol=1e-9)


# ---------------------------------------------------------------- learning-rate schedule


def expected_factor(step, total, warmup, decay, min_factor):
    """Linear warmup step/(warmup+1) for steps 1..warmup, then the full lr (factor 1) at the
    first step after warmup, decaying (linear or cosine) to min_factor at step ``total``."""
    if step <= warmup:
        return step / (warmup + 1)
    progress = min(1.0, (step - warmup - 1) / (total - warmup - 1))
    shape = 1.0 - progress if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_factor + (1.0 - min_factor) * shape


SCHEDULES = [(10, 0, 0.0), (10, 3, 0.1), (20, 5, 0.25), (7, 1, 0.0)]


@pytest.mark.parametrize("decay", ["linear", "cosine"])
@pytest.mark.parametrize("total, warmup, min_factor", SCHEDULES)
def test_lr_factor_warmup_and_last_step(decay, total, warmup, min_factor):
    for step in range(1, warmup + 1):
        assert math.isclose(lr_factor(step, total, warmup, decay, min_factor), step / (warmup + 1))
    assert math.isclose(lr_factor(total, total, warmup, decay, min_factor), min_factor, abs_tol=1e-12)
    # Past the end it stays at the floor.
    assert math.isclose(lr_factor(total + 3, total, warmup, decay, min_factor), min_factor, abs_tol=1e-12)
    # Decay is monotone non-increasing after warmup.
    values = [lr_factor(s, total, warmup, decay, min_factor) for s in range(warmup + 1, total + 1)]
    assert all(a >= b - 1e-12 for a, b in zip(values, values[1:]))


def test_lr_factor_formula():
    for total, warmup, min_factor in SCHEDULES:
        for decay in ("linear", "cosine"):
            # The configured lr itself is reached, right after warmup (config doc: "linear
            # warmup from 0 to optimizer.lr"; lr_factor docstring: "... to 1").
            peak = lr_factor(warmup + 1, total, warmup, decay, min_factor)
            assert math.isclose(peak, 1.0), (total, warmup, decay, peak)
            for step in range(1, total + 1):
                expected = expected_factor(step, total, warmup, decay, min_factor)
                got = lr_factor(step, total, warmup, decay, min_factor)
                assert math.isclose(got, expected, abs_tol=1e-12), (total, warmup, decay, step)


def test_build_lr_scheduler_follows_the_formula():
    total, warmup, min_factor, base = 12, 3, 0.1, 0.5
    for decay in ("linear", "cosine"):
        param = nn.Parameter(torch.zeros(2))
        optimizer = torch.optim.SGD([param], lr=base)
        scheduler = build_lr_scheduler(optimizer, total, warmup, decay, min_factor)
        for step in range(1, total + 1):
            # The lr the step-th optimizer step runs with.
            expected = base * expected_factor(step, total, warmup, decay, min_factor)
            assert math.isclose(optimizer.param_groups[0]["lr"], expected), (decay, step)
            optimizer.step()
            scheduler.step()


def test_lr_factor_unknown_decay():
    with pytest.raises(ValueError, match="lr_scheduler.decay_type"):
        lr_factor(5, 10, 2, "step", 0.0)
