import dataclasses
import math

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)

from torchtitan_rl.distributed.activation_checkpoint import (
    apply_activation_checkpointing,
)
from torchtitan_rl.distributed.compile import apply_compile
from torchtitan_rl.models.qwen3.args import Qwen3ModelArgs, qwen3_flavors
from torchtitan_rl.models.qwen3.model import (
    Qwen3Model,
    apply_rotary,
    param_seed,
    rotary_cos_sin,
)
from torchtitan_rl.models.qwen3.state_dict_adapter import from_hf, to_hf
from torchtitan_rl.models.registry import get_model_spec, spec_for_args

LENGTHS = [6, 1, 9, 4]


def small_args(tie_embeddings: bool, attn_backend: str = "sdpa_dense") -> Qwen3ModelArgs:
    return Qwen3ModelArgs(
        vocab_size=96,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        hidden_dim=80,
        norm_eps=1e-6,
        rope_theta=10_000.0,  # not the default, so a wrong theta would show
        tie_embeddings=tie_embeddings,
        max_seq_len=64,
        attn_backend=attn_backend,
    )


def hf_config(args: Qwen3ModelArgs) -> Qwen3Config:
    config = Qwen3Config(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.hidden_dim,
        rms_norm_eps=args.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        tie_word_embeddings=args.tie_embeddings,
        max_position_embeddings=args.max_seq_len,
        attention_dropout=0.0,
    )
    config._attn_implementation = "eager"  # the plain-math reference, independent of SDPA
    return config


def hf_and_ours(tie_embeddings: bool, attn_backend: str = "sdpa_dense"):
    args = small_args(tie_embeddings, attn_backend)
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(hf_config(args)).eval()
    # HF initializes norms to ones; randomize them so a misplaced norm weight would show.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    ours = Qwen3Model(args)
    ours.load_state_dict(from_hf(hf.state_dict(), args), strict=True)
    return hf, ours


def random_tokens(length: int, vocab_size: int, seed: int) -> torch.Tensor:
    return torch.randint(vocab_size, (length,), generator=torch.Generator().manual_seed(seed))


def pack(sequences):
    tokens = torch.cat(sequences)
    positions = torch.cat([torch.arange(len(s)) for s in sequences])
    seq_ids = torch.cat([torch.full((len(s),), i) for i, s in enumerate(sequences)])
    return tokens, positions, seq_ids


def our_logits(model: Qwen3Model, sequences) -> torch.Tensor:
    return model.output(model(*pack(sequences)))


def hf_logits(hf: Qwen3ForCausalLM, tokens: torch.Tensor) -> torch.Tensor:
    return hf(input_ids=tokens[None]).logits[0]


@pytest.mark.parametrize("tie_embeddings", [False, True])
def test_single_sequence_logits_match_hf(tie_embeddings):
    hf, ours = hf_and_ours(tie_embeddings)
    assert (ours.output.weight is ours.tok_embeddings.weight) == tie_embeddings
    tokens = random_tokens(11, ours.args.vocab_size, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(our_logits(ours, [tokens]), hf_logits(hf, tokens), rtol=1e-5, atol=1e-5)


def test_rotary_uses_each_tokens_own_position():
    """RoPE is relative inside attention, so check absolute positions against HF directly."""
    args = small_args(tie_embeddings=False)
    positions = torch.tensor([3, 0, 7, 63, 1])
    q = torch.randn(5, args.n_heads, args.head_dim, generator=torch.Generator().manual_seed(0))
    k = torch.randn(5, args.n_kv_heads, args.head_dim, generator=torch.Generator().manual_seed(1))
    cos, sin = rotary_cos_sin(positions, args.head_dim, args.rope_theta, q.dtype)

    hf_cos, hf_sin = Qwen3RotaryEmbedding(hf_config(args))(q, positions[None])
    # HF layout is [batch, heads, T, head_dim].
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    torch.testing.assert_close(apply_rotary(q, cos, sin), hf_q[0].transpose(0, 1))
    torch.testing.assert_close(apply_rotary(k, cos, sin), hf_k[0].transpose(0, 1))


@pytest.mark.parametrize("attn_backend", ["sdpa_dense", "sdpa_varlen", "sdpa_loop"])
def test_packed_forward_matches_each_sequence_alone_in_hf(attn_backend):
    hf, ours = hf_and_ours(tie_embeddings=False, attn_backend=attn_backend)
    sequences = [random_tokens(n, ours.args.vocab_size, seed=10 + i) for i, n in enumerate(LENGTHS)]
    with torch.no_grad():
        packed = our_logits(ours, sequences)
        expected = torch.cat([hf_logits(hf, s) for s in sequences])
    torch.testing.assert_close(packed, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tie_embeddings", [False, True])
def test_gradients_match_hf(tie_embeddings):
    hf, ours = hf_and_ours(tie_embeddings)
    vocab_size = ours.args.vocab_size
    sequences = [random_tokens(n, vocab_size, seed=20 + i) for i, n in enumerate(LENGTHS)]
    targets = [random_tokens(n, vocab_size, seed=30 + i) for i, n in enumerate(LENGTHS)]

    ours_loss = torch.nn.functional.cross_entropy(our_logits(ours, sequences), torch.cat(targets), reduction="sum")
    ours_loss.backward()
    hf_loss = sum(
        torch.nn.functional.cross_entropy(hf_logits(hf, s), t, reduction="sum") for s, t in zip(sequences, targets)
    )
    hf_loss.backward()

    torch.testing.assert_close(ours_loss, hf_loss, rtol=1e-5, atol=1e-5)
    our_grads = to_hf({name: p.grad for name, p in ours.named_parameters()})
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    assert our_grads.keys() == hf_grads.keys()
    for name, grad in hf_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_state_dict_round_trip_and_tied_checkpoint_without_lm_head():
    args = small_args(tie_embeddings=True)
    model = Qwen3Model(args)
    hf_state_dict = to_hf(model.state_dict())
    lm_head, embed = hf_state_dict["lm_head.weight"], hf_state_dict["model.embed_tokens.weight"]
    assert lm_head.data_ptr() == embed.data_ptr()
    del hf_state_dict["lm_head.weight"]  # as tied HF checkpoints ship
    restored = from_hf(hf_state_dict, args)
    assert restored.keys() == model.state_dict().keys()
    assert restored["output.weight"] is restored["tok_embeddings.weight"]

    untied = small_args(tie_embeddings=False)
    with pytest.raises(ValueError, match="lm_head"):
        from_hf(hf_state_dict, untied)
    with pytest.raises(ValueError, match="unexpected key"):
        from_hf({"model.layers.0.self_attn.q_proj.bias": torch.zeros(1)}, args)
    with pytest.raises(ValueError, match="n_layers"):
        from_hf({"model.layers.5.input_layernorm.weight": torch.zeros(1)}, args)


def expected_num_params(args: Qwen3ModelArgs) -> int:
    attention = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.n_kv_heads)
    feed_forward = 3 * args.dim * args.hidden_dim
    norms = 2 * args.dim + 2 * args.head_dim
    embeddings = args.vocab_size * args.dim * (1 if args.tie_embeddings else 2)
    return embeddings + args.n_layers * (attention + feed_forward + norms) + args.dim


# Qwen3 model cards: 0.6B, 8.2B, 14.8B, 32.8B parameters.
@pytest.mark.parametrize("flavor, published", [("0.6B", 0.6e9), ("8B", 8.2e9), ("14B", 14.8e9), ("32B", 32.8e9)])
def test_num_params_of_published_flavors(flavor, published):
    args = qwen3_flavors[flavor]
    with torch.device("meta"):
        ours = Qwen3Model(args)
        hf = Qwen3ForCausalLM(hf_config(args))
    num_params = ours.num_params()
    assert num_params == expected_num_params(args)
    assert num_params == sum(p.numel() for p in hf.parameters())
    assert abs(num_params - published) / published < 0.01


def test_flavors_and_registry():
    spec = get_model_spec("qwen3")
    assert (spec.model_cls, spec.flavors, spec.to_hf) == (Qwen3Model, qwen3_flavors, to_hf)
    assert spec_for_args(qwen3_flavors["8B"]) is spec and get_model_spec("vlm").takes_images
    with pytest.raises(ValueError, match="unknown model.name 'llama'; valid: qwen3, vlm"):
        get_model_spec("llama")
    assert {"debugmodel", "0.6B", "1.7B", "4B", "8B"} <= qwen3_flavors.keys()
    for name, tied in [("0.6B", True), ("1.7B", True), ("4B", True), ("8B", False)]:
        assert qwen3_flavors[name].tie_embeddings is tied
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        dataclasses.replace(qwen3_flavors["debugmodel"], n_kv_heads=3)
    with pytest.raises(ValueError, match="unknown attn_backend"):
        dataclasses.replace(qwen3_flavors["debugmodel"], attn_backend="flash")


def test_forward_rejects_mismatched_shapes():
    model = Qwen3Model(small_args(tie_embeddings=False))
    tokens, positions, seq_ids = pack([random_tokens(4, 96, seed=0)])
    with pytest.raises(ValueError, match="equal length"):
        model(tokens, positions[:-1], seq_ids)


def test_init_is_independent_of_iteration_order():
    args = small_args(tie_embeddings=False)
    forward = Qwen3Model(args)
    forward.init_weights(seed=7)

    backward = Qwen3Model(args)
    for fqn, param in reversed(list(backward.named_parameters())):
        backward.init_param_(fqn, param, torch.Generator().manual_seed(param_seed(7, fqn)))
    for (name, a), (_, b) in zip(forward.named_parameters(), backward.named_parameters()):
        assert torch.equal(a, b), name

    other_seed = Qwen3Model(args)
    other_seed.init_weights(seed=8)
    wq = forward.layers["0"].attention.wq.weight
    assert not torch.equal(other_seed.layers["0"].attention.wq.weight, wq)
    # Same shape, different name: different values.
    assert not torch.equal(forward.layers["1"].attention.wq.weight, wq)


def test_init_rules():
    args = small_args(tie_embeddings=False)
    model = Qwen3Model(args)
    model.init_weights(seed=0)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(param, torch.ones_like(param)), name
    # Large tensors, so the empirical std is within a few percent of the rule.
    big = Qwen3Model(dataclasses.replace(args, vocab_size=4096, hidden_dim=512))
    big.init_weights(seed=0)
    assert big.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.05)
    w2, w2_std = big.layers["0"].feed_forward.w2.weight, 0.02 / (2 * args.n_layers) ** 0.5
    assert w2.std().item() == pytest.approx(w2_std, rel=0.05)
    assert w2.abs().max() <= 3 * w2_std  # truncated at 3 std
    with pytest.raises(ValueError, match="no init rule"):
        model.init_param_("layers.0.attention.wq.bias", torch.empty(3), torch.Generator())


def test_param_seed_depends_on_seed_and_name():
    assert param_seed(3, "norm.weight") != param_seed(4, "norm.weight")
    assert param_seed(3, "norm.weight") != param_seed(3, "layers.0.attention_norm.weight")


def test_compile_and_activation_checkpointing_keep_parameter_names():
    """Init seeds come from parameter names (param_seed): wrapping the blocks must not rename them."""
    model = Qwen3Model(small_args(tie_embeddings=False))
    names = [name for name, _ in model.named_parameters()]
    apply_compile(model.blocks(), backend="eager")
    apply_activation_checkpointing(model.blocks(), "full")
    assert [name for name, _ in model.named_parameters()] == names


@pytest.mark.parametrize("tie_embeddings", [False, True])
def test_meta_build_to_empty_init_matches_eager(tie_embeddings):
    args = small_args(tie_embeddings)
    eager = Qwen3Model(args)
    eager.init_weights(seed=5)

    with torch.device("meta"):
        model = Qwen3Model(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=5)

    assert (model.output.weight is model.tok_embeddings.weight) == tie_embeddings
    shares_storage = model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    assert shares_storage == tie_embeddings
    for (name, a), (_, b) in zip(eager.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), name
    tokens, positions, seq_ids = pack([random_tokens(n, args.vocab_size, seed=n) for n in LENGTHS])
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, positions, seq_ids), eager(tokens, positions, seq_ids), rtol=0, atol=0)


def test_debugmodel_trains_on_cpu():
    """A few optimizer steps on one repeated packed batch must lower the loss."""
    args = qwen3_flavors["debugmodel"]
    model = Qwen3Model(args)
    model.init_weights(seed=0)
    sequences = [random_tokens(n, args.vocab_size, seed=40 + n) for n in (16, 9, 23)]
    tokens, positions, seq_ids = pack(sequences)
    targets = random_tokens(tokens.numel(), args.vocab_size, seed=99)  # memorize these
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        logits = model.output(model(tokens, positions, seq_ids))
        loss = torch.nn.functional.cross_entropy(logits, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(args.vocab_size), rel=0.05)  # near-uniform start
    assert losses[-1] < 0.7 * losses[0]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flex_model_matches_sdpa_dense_on_cuda():
    args = small_args(tie_embeddings=False, attn_backend="flex")
    flex_model = Qwen3Model(args).cuda()
    flex_model.init_weights(seed=0)
    dense_model = Qwen3Model(dataclasses.replace(args, attn_backend="sdpa_dense")).cuda()
    dense_model.load_state_dict(flex_model.state_dict())
    sequences = [random_tokens(n, args.vocab_size, seed=n) for n in [130, 1, 77]]
    batch = [t.cuda() for t in pack(sequences)]
    flex_hidden = flex_model(*batch)
    dense_hidden = dense_model(*batch)
    torch.testing.assert_close(flex_hidden, dense_hidden, rtol=2e-4, atol=2e-4)
    flex_hidden.square().sum().backward()
    dense_hidden.square().sum().backward()
    for (name, a), (_, b) in zip(flex_model.named_parameters(), dense_model.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-3, atol=1e-4, msg=name)
