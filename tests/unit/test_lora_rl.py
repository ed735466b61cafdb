"""GRPO with LoRA, single process on CPU: the sampler's replica after adapter-only weight syncs,
its log-probs against the trainer's, the reference policy (the base, adapters off) and the
config rules around it.

References are independent of the code under test: merged weights written out as
``W + scale * B @ A``, a plain model built from the same seed as the adapted one's base, and
``Engine.forward`` of the adapted model itself.
"""

import pytest
import torch

from test_config import parse
from test_generator import ARGS, CPU, PROMPTS, generate
from torchtitan_rl.data.sample import Sample
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.engine import Engine, EngineOptions
from torchtitan_rl.models.lora import LoRASettings, adapters_disabled, is_adapter_key
from torchtitan_rl.recipes.base import build_model
from torchtitan_rl.recipes.grpo_data import check_lora_reference
from torchtitan_rl.recipes.reference import base_logprobs, check_adapters_add_nothing
from torchtitan_rl.rl.generator import TorchGenerator

LORA = LoRASettings(rank=4, alpha=8.0, target_modules=("wq", "wv", "wo", "w2"))


def lora_model(settings: LoRASettings = LORA, seed: int = 0, std: float = 0.3):
    """An adapted single-process model whose base and adapters are far from their init (B != 0)."""
    dims = ParallelDims(1, 1, 1, 1, world_size=1)
    dims.build_meshes("cpu")
    model = build_model(ARGS, parallel_dims=dims, device=CPU, seed=seed, param_dtype=torch.float32, lora=settings)
    perturb(model, lambda name, p: True, seed + 1, std)
    return model


@torch.no_grad()
def perturb(model, which, seed: int, std: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if which(name, param):
            param.add_(torch.randn(param.shape, generator=gen) * std)


def merged_reference(model, scale: float, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The plain model's weights: every adapted weight plus scale * B @ A, from the trained
    tensors as the replica receives them (in its dtype), the sum in float32."""
    params = {name: p.detach().to(dtype) for name, p in model.named_parameters()}
    merged = {name: p for name, p in params.items() if not is_adapter_key(name)}
    for name in params:
        if name.endswith(".lora_a.weight"):
            module = name.removesuffix(".lora_a.weight")
            a, b = params[name].float(), params[f"{module}.lora_b.weight"].float()
            merged[f"{module}.weight"] = (params[f"{module}.weight"].float() + (b @ a) * scale).to(dtype)
    return merged


def engine_for(model, temperature: float = 1.0) -> Engine:
    dims = ParallelDims(1, 1, 1, 1, world_size=1)
    dims.build_meshes("cpu")
    options = EngineOptions(
        reduction="token_mean",
        horizon=20,
        max_tokens_per_microbatch=40,
        logits_chunk_size=7,
        max_norm=0.0,
        temperature=temperature,
    )
    return Engine(model, optimizer=None, lr_scheduler=None, parallel_dims=dims, device=CPU, options=options)


def samples_of(rollouts) -> list[Sample]:
    return [
        Sample.from_tokens(
            r.prompt_tokens + r.completion_tokens, [False] * len(r.prompt_tokens) + [True] * len(r.completion_tokens)
        )
        for r in rollouts
    ]


# ---------------------------------------------------------------- weight syncs


@pytest.mark.parametrize(
    "settings, dtype",
    [
        (LORA, torch.float32),
        (
            LoRASettings(rank=4, alpha=8.0, target_modules=("wq", "wv", "wo", "w2"), train_embeddings=True),
            torch.float32,
        ),
        (LoRASettings(rank=2, alpha=4.0, base_dtype=torch.bfloat16), torch.bfloat16),
    ],
)
def test_adapter_only_syncs_leave_the_replica_of_the_merged_weights(settings, dtype):
    model = lora_model(settings)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert any(is_adapter_key(name) for name in trainable)
    assert ("tok_embeddings.weight" in trainable) == settings.train_embeddings
    gen = TorchGenerator(ARGS, CPU, dtype=dtype, lora=settings)
    itemsize = dtype.itemsize
    # The first sync: every parameter of the trained model (base and adapters).
    assert gen.update_weights(model, 0) == itemsize * sum(p.numel() for p in model.parameters())
    for version in (1, 2):
        perturb(model, lambda name, p: p.requires_grad, 10 + version, 0.2)  # an optimizer step
        num_bytes = gen.update_weights(model, version)
        assert num_bytes == itemsize * sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert num_bytes < itemsize * sum(p.numel() for p in gen.model.parameters())
        expected = merged_reference(model, settings.scale, dtype)
        replica = dict(gen.model.named_parameters())
        assert replica.keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(replica[name], value), (version, name)
        assert gen.version == version
    # Not vacuous: the adapters moved the adapted weights away from the base.
    assert not torch.equal(replica["layers.0.attention.wq.weight"], model.layers["0"].attention.wq.weight.to(dtype))


def test_a_sync_takes_exactly_the_tensors_it_announces():
    model = lora_model()
    gen = TorchGenerator(ARGS, CPU, lora=LORA)
    tensors = {name: p.detach() for name, p in model.named_parameters()}
    assert [name for name, _ in gen.next_sync()] == sorted(tensors)
    assert gen.load_weights(tensors, 0) == 4 * sum(t.numel() for t in tensors.values())
    assert [name for name, _ in gen.next_sync()] == sorted(n for n in tensors if is_adapter_key(n))
    with pytest.raises(ValueError, match="unexpected.*layers.0.attention.wq.weight"):
        gen.load_weights(tensors, 1)  # the base again, into a replica that keeps it
    with pytest.raises(ValueError, match="do not match.*LoRA settings: missing.*lora_a"):
        TorchGenerator(ARGS, CPU, lora=LORA).update_weights(
            build_model(ARGS, parallel_dims=single(), device=CPU, seed=0, param_dtype=torch.float32)
        )


def single() -> ParallelDims:
    dims = ParallelDims(1, 1, 1, 1, world_size=1)
    dims.build_meshes("cpu")
    return dims


@pytest.mark.parametrize("temperature", [0.7])
def test_sampler_logprobs_after_adapter_syncs_equal_engine_forward_of_the_adapted_model(temperature):
    model = lora_model()
    gen = TorchGenerator(ARGS, CPU, lora=LORA)
    gen.update_weights(model, 0)
    perturb(model, lambda name, p: p.requires_grad, 5, 0.2)
    gen.update_weights(model, 1)  # adapters only
    rollouts = generate(gen, num_samples=3, max_new_tokens=10, temperature=temperature)
    samples = samples_of(rollouts)
    for r, sample, logprobs in zip(rollouts, samples, engine_for(model, temperature).forward(samples).logprobs):
        completion = logprobs[sample.loss_mask]
        assert completion.numel() == len(r.completion_tokens)
        torch.testing.assert_close(torch.tensor(r.logprobs), completion, rtol=0, atol=1e-5)
        assert r.version == 1
    # The adapters matter: the base model gives other log-probs of the same tokens.
    with adapters_disabled(model):
        base = engine_for(model, temperature).forward(samples).logprobs
    assert (
        max(float((b - p).abs().max()) for b, p in zip(base, engine_for(model, temperature).forward(samples).logprobs))
        > 0.1
    )


# ---------------------------------------------------------------- the reference policy


def test_the_reference_is_exactly_the_base_model_and_the_adapters_come_back():
    model = lora_model()
    plain = build_model(ARGS, parallel_dims=single(), device=CPU, seed=0, param_dtype=torch.float32)
    with torch.no_grad():
        for name, param in plain.named_parameters():
            param.copy_(model.get_parameter(name))  # the adapted model's (perturbed) base
    gen = TorchGenerator(ARGS, CPU, lora=LORA)
    gen.update_weights(model, 0)
    samples = samples_of(generate(gen, num_samples=2, max_new_tokens=8))
    engine = engine_for(model)
    reference = base_logprobs(engine, samples)
    expected = engine_for(plain).forward(samples).logprobs
    assert len(reference) == len(expected) == len(PROMPTS) * 2
    for got, want in zip(reference, expected):
        assert torch.equal(got, want)
    policy = engine.forward(samples).logprobs  # adapters on again
    assert max(float((p - r).abs().max()) for p, r in zip(policy, reference)) > 0.1


def test_a_lora_reference_needs_the_base_to_be_the_policy_rl_starts_from():
    model = build_model(ARGS, parallel_dims=single(), device=CPU, seed=0, param_dtype=torch.float32, lora=LORA)
    check_adapters_add_nothing(model, "drop the reference")  # B = 0 as initialized: the base is the policy
    with torch.no_grad():
        model.layers["1"].feed_forward.w2.lora_b.weight[3, 1] = 1e-3
    match = "lora.enable with a reference policy.*layers.1.feed_forward.w2 and 0 more.*or drop the reference"
    with pytest.raises(ValueError, match=match):
        check_adapters_add_nothing(model, "drop the reference")


def test_a_warm_up_with_a_lora_reference_is_refused():
    grpo = ("--job.recipe", "grpo", "--loss.loss_fn", "ppo", "--rl.sft_warmup_steps", "5")
    kl = ("--loss.kl_coef", "0.05", "--rl.use_reference", "true")
    with pytest.raises(ValueError, match=r"rl.sft_warmup_steps=5 with lora.enable and rl.use_reference"):
        check_lora_reference(parse(*grpo, *kl, "--lora.enable", "true"))
    check_lora_reference(parse(*grpo, *kl))  # full fine-tuning: the reference copies the warmed policy
    check_lora_reference(parse(*grpo, "--lora.enable", "true"))  # no KL: nothing to refer to
