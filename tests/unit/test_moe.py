"""Qwen3-MoE layers against transformers' ``Qwen3MoeForCausalLM`` (built offline from tiny
configs): packed logits, the balance loss from our router statistics, every gradient; the two
expert kernels; router-statistics semantics; flavors, config.json and checkpoint key layout."""

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from torchtitan_rl.models.moe import GroupedExperts, MoE, RouterStats, grouped_mm_supported
from torchtitan_rl.models.qwen3.args import Qwen3ModelArgs, find_flavor, qwen3_flavors
from torchtitan_rl.models.qwen3.model import INIT_STD, Qwen3Model
from torchtitan_rl.models.qwen3.parallelize import TokenShard
from torchtitan_rl.models.qwen3.state_dict_adapter import (
    expert_hf_keys,
    from_hf,
    is_expert_key,
    parse_expert_hf_key,
    to_hf,
)

LENGTHS = [6, 1, 9, 4]
NUM_PAD = 3
COEF = 0.1  # balance-loss weight, large enough that its gradient shows
# Router weights drawn wide, so that the top-k choice has clear margins and float rounding
# between the two implementations never flips an expert (HF's init std of 0.02 leaves top-k near-ties that rounding can flip).
ROUTER_STD = 0.5


def tiny_args(**changes) -> Qwen3ModelArgs:
    # Layer 1 is dense (mlp_only_layers), so MoE layers are 0, 2, 3 and the layer axis of
    # RouterStats is not the layer index.
    args = Qwen3ModelArgs(
        vocab_size=96,
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        hidden_dim=80,
        rope_theta=10_000.0,
        max_seq_len=64,
        num_experts=8,
        num_experts_per_tok=2,
        moe_hidden_dim=32,
        norm_topk_prob=True,
        mlp_only_layers=(1,),
    )
    return dataclasses.replace(args, **changes)


def dense_tiny_args() -> Qwen3ModelArgs:
    return tiny_args(num_experts=0, num_experts_per_tok=0, moe_hidden_dim=0, mlp_only_layers=())


def hf_config(args: Qwen3ModelArgs) -> Qwen3MoeConfig:
    config = Qwen3MoeConfig.from_dict({**args.to_hf_config("float32"), "router_aux_loss_coef": COEF})
    # Plain-math references, independent of SDPA and of torch._grouped_mm (HF's CPU default).
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return config


def hf_and_ours(args: Qwen3ModelArgs | None = None):
    args = args or tiny_args()
    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(hf_config(args)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):  # HF's ones would hide a misplaced norm
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, ROUTER_STD)
    ours = Qwen3Model(args)
    ours.load_state_dict(from_hf(hf.state_dict(), args), strict=True)
    return hf, ours


def random_tokens(length: int, vocab_size: int, seed: int) -> torch.Tensor:
    return torch.randint(vocab_size, (length,), generator=torch.Generator().manual_seed(seed))


def sequences(vocab_size: int = 96, seed: int = 10) -> list[torch.Tensor]:
    return [random_tokens(n, vocab_size, seed + i) for i, n in enumerate(LENGTHS)]


def pack(seqs, num_pad: int = 0):
    """Packed micro-batch; ``num_pad`` padding tokens form one more pseudo-sequence, masked
    out of the router statistics (as ``data.packing`` lays padding out)."""
    lens = [len(s) for s in seqs] + ([num_pad] if num_pad else [])
    tokens = torch.cat([*seqs, torch.zeros(num_pad, dtype=torch.long)])
    positions = torch.cat([torch.arange(n) for n in lens])
    seq_ids = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    router_mask = torch.cat([torch.ones(sum(lens) - num_pad, dtype=torch.bool), torch.zeros(num_pad, dtype=torch.bool)])
    return tokens, positions, seq_ids, router_mask


def pooled_balance_loss(stats: RouterStats, num_experts: int, num_real_tokens: int) -> torch.Tensor:
    """HF's load_balancing_loss_func from our statistics: one Switch loss pooled over the L MoE
    layers and the N real tokens, E * sum_e (c_e / (L N)) * (q_e / (L N)), with c_e and q_e the
    counts and probability sums of expert e summed over layers and sequences."""
    scale = stats.counts.shape[0] * num_real_tokens
    tokens_per_expert = stats.counts.sum((0, 1)) / scale
    prob_per_expert = stats.prob_sums.sum((0, 1)) / scale
    return num_experts * (tokens_per_expert * prob_per_expert).sum()


# ------------------------------------------------------------------------------- HF parity


@pytest.mark.parametrize("experts_impl", ["grouped_mm", "loop"])
def test_packed_logits_match_hf_run_per_sequence(experts_impl):
    hf, ours = hf_and_ours(tiny_args(experts_impl=experts_impl))
    seqs = sequences()
    tokens, positions, seq_ids, _ = pack(seqs)
    with torch.no_grad():
        hidden, stats = ours(tokens, positions, seq_ids)
        expected = torch.cat([hf(input_ids=s[None]).logits[0] for s in seqs])
    torch.testing.assert_close(ours.output(hidden), expected, rtol=1e-5, atol=1e-5)
    assert stats.counts.shape == (3, len(seqs), 8)


def test_balance_loss_and_every_gradient_match_hf():
    hf, ours = hf_and_ours()
    args = ours.args
    seqs = sequences(seed=20)

    # HF: right-padded batch; its loss is the mean next-token CE + coef * aux over real tokens.
    width = max(LENGTHS)
    input_ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attention_mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, s in enumerate(seqs):
        input_ids[row, : len(s)], attention_mask[row, : len(s)] = s, 1
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    out = hf(input_ids=input_ids, attention_mask=attention_mask, labels=labels, output_router_logits=True)
    out.loss.backward()

    # Ours: packed, with padding tokens that must stay out of the statistics.
    tokens, positions, seq_ids, router_mask = pack(seqs, NUM_PAD)
    hidden, stats = ours(tokens, positions, seq_ids, router_mask, num_seqs=len(seqs) + 1)
    logits = ours.output(hidden)
    starts = torch.tensor([0, *LENGTHS]).cumsum(0)
    ce_sum = sum(
        torch.nn.functional.cross_entropy(logits[a : b - 1], tokens[a + 1 : b], reduction="sum")
        for a, b in zip(starts[:-1].tolist(), starts[1:].tolist())
    )
    ce_mean = ce_sum / (sum(LENGTHS) - len(LENGTHS))
    aux = pooled_balance_loss(stats, args.num_experts, sum(LENGTHS))
    (ce_mean + COEF * aux).backward()

    torch.testing.assert_close(aux, out.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ce_mean + COEF * aux, out.loss, rtol=1e-5, atol=1e-6)
    hf_grads = from_hf({name: p.grad for name, p in hf.named_parameters()}, args)
    our_grads = {name: p.grad for name, p in ours.named_parameters()}
    assert our_grads.keys() == hf_grads.keys()
    assert any("router" in name for name in our_grads)
    for name, grad in hf_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_balance_loss_gradient_reaches_every_router():
    """The aux term alone moves each router (HF's gradient, through the adapter)."""
    hf, ours = hf_and_ours()
    seqs = sequences(seed=40)
    tokens, positions, seq_ids, _ = pack(seqs)
    pooled_balance_loss(ours(tokens, positions, seq_ids)[1], 8, len(tokens)).backward()
    input_ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(s) for s in seqs], batch_first=True)
    hf(input_ids=input_ids, attention_mask=mask, output_router_logits=True).aux_loss.backward()
    for layer in ours.args.moe_layers:
        grad = ours.get_parameter(f"layers.{layer}.moe.router.weight").grad
        hf_grad = hf.get_parameter(f"model.layers.{layer}.mlp.gate.weight").grad
        assert grad.abs().max() > 0
        torch.testing.assert_close(grad, hf_grad, rtol=1e-4, atol=1e-7, msg=f"layer {layer}")


# ------------------------------------------------------------------------------ kernels


def expert_inputs(tokens_per_expert, dim=16, hidden=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.tensor(tokens_per_expert)
    x = torch.randn(int(counts.sum()), dim, generator=gen, dtype=dtype)
    experts = GroupedExperts(len(tokens_per_expert), dim, hidden, impl="grouped_mm").to(dtype)
    return x, counts, experts


def run_experts(experts: GroupedExperts, impl: str, x: torch.Tensor, counts: torch.Tensor):
    experts.impl = impl
    experts.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    y = experts(x, counts)
    y.sum().backward()  # a zero-stride upstream gradient, which _grouped_mm alone rejects
    return y, x.grad, {n: p.grad.clone() for n, p in experts.named_parameters()}


@pytest.mark.parametrize("tokens_per_expert", [[3, 0, 5, 2, 0, 4], [0, 0, 9, 0, 0, 0], [0] * 6])
def test_grouped_mm_matches_loop_including_experts_without_tokens(tokens_per_expert):
    x, counts, experts = expert_inputs(tokens_per_expert)
    y_gmm, dx_gmm, grads_gmm = run_experts(experts, "grouped_mm", x, counts)
    y_loop, dx_loop, grads_loop = run_experts(experts, "loop", x, counts)
    torch.testing.assert_close(y_gmm, y_loop, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx_gmm, dx_loop, rtol=1e-6, atol=1e-6)
    for name in grads_loop:
        torch.testing.assert_close(grads_gmm[name], grads_loop[name], rtol=1e-6, atol=1e-6)
        empty = counts == 0
        assert grads_gmm[name][empty].eq(0).all() and grads_loop[name][empty].eq(0).all()


def moe_pair(impl_a: str, impl_b: str, dtype=torch.float32):
    torch.manual_seed(3)
    a = MoE(dim=16, hidden_dim=8, num_experts=6, top_k=2, norm_topk_prob=False, experts_impl=impl_a).to(dtype)
    with torch.no_grad():
        a.router.weight.normal_(0.0, 1.0)
    b = MoE(dim=16, hidden_dim=8, num_experts=6, top_k=2, norm_topk_prob=False, experts_impl=impl_b).to(dtype)
    b.load_state_dict(a.state_dict())
    return a, b


def run_moe(moe: MoE, x: torch.Tensor, seq_ids: torch.Tensor, mask: torch.Tensor):
    x = x.clone().requires_grad_()
    out, counts, prob_sums, z_sums, _, _ = moe(x, seq_ids, mask, int(seq_ids.max()) + 1)
    (out.square().sum() + prob_sums.square().sum() + z_sums.sum()).backward()
    return [out, counts, prob_sums, z_sums, x.grad] + [p.grad for p in moe.parameters()]


def test_moe_layer_grouped_mm_matches_loop():
    a, b = moe_pair("grouped_mm", "loop")
    x = torch.randn(13, 16, generator=torch.Generator().manual_seed(1))
    seq_ids = torch.tensor([0] * 5 + [1] * 6 + [2] * 2)
    mask = torch.ones(13, dtype=torch.bool)
    for got, expected in zip(run_moe(a, x, seq_ids, mask), run_moe(b, x, seq_ids, mask)):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_loop_runs_float64_and_grouped_mm_refuses_it():
    auto, _ = moe_pair("auto", "loop", torch.float64)
    assert auto.experts.resolve_impl(torch.float64) == "loop"
    x = torch.randn(7, 16, dtype=torch.float64)
    out, counts, prob_sums, z_sums, _, _ = auto(x, torch.zeros(7, dtype=torch.long), torch.ones(7, dtype=torch.bool), 1)
    assert out.dtype == torch.float64 and counts.dtype == prob_sums.dtype == z_sums.dtype == torch.float32
    # The loop's backward is checked against finite differences (fp64).
    experts = GroupedExperts(3, 4, 6, impl="loop").double()
    counts = torch.tensor([2, 0, 3])
    inputs = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    weights = [p.detach().clone().requires_grad_() for p in (experts.w1, experts.w2, experts.w3)]

    def call(x, w1, w2, w3):
        return torch.func.functional_call(experts, {"w1": w1, "w2": w2, "w3": w3}, (x, counts))

    assert torch.autograd.gradcheck(call, (inputs, *weights))
    fp64_grouped = GroupedExperts(3, 16, 8, impl="grouped_mm").double()
    with pytest.raises(ValueError, match="grouped_mm.*float64"):
        fp64_grouped(torch.zeros(0, 16, dtype=torch.float64), torch.zeros(3, dtype=torch.long))


def test_bfloat16_grouped_mm_keeps_bfloat16():
    a, reference = moe_pair("auto", "loop")
    a.to(torch.bfloat16)
    assert a.experts.resolve_impl(torch.bfloat16) == "grouped_mm"
    x = torch.randn(13, 16, generator=torch.Generator().manual_seed(2))
    seq_ids, mask = torch.zeros(13, dtype=torch.long), torch.ones(13, dtype=torch.bool)
    got = run_moe(a, x.bfloat16(), seq_ids, mask)
    expected = run_moe(reference, x, seq_ids, mask)
    assert got[0].dtype == got[4].dtype == torch.bfloat16
    assert all(p.grad.dtype == torch.bfloat16 for p in a.parameters())
    torch.testing.assert_close(got[0].float(), expected[0], rtol=5e-2, atol=5e-2)
    with pytest.raises(ValueError, match="expert input is torch.float32"):
        a.experts(x, torch.tensor([13, 0, 0, 0, 0, 0]))


def test_auto_falls_back_to_the_loop_where_grouped_mm_cannot_run():
    # _grouped_mm needs row strides of a multiple of 16 bytes, in forward and backward.
    assert grouped_mm_supported(torch.float32, 16, 8) and not grouped_mm_supported(torch.float32, 16, 6)
    assert grouped_mm_supported(torch.bfloat16, 16, 8) and not grouped_mm_supported(torch.bfloat16, 16, 4)
    assert not grouped_mm_supported(torch.float16, 16, 8)
    assert GroupedExperts(2, 16, 6, impl="auto").resolve_impl(torch.float32) == "loop"
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        GroupedExperts(2, 16, 6, impl="grouped_mm").resolve_impl(torch.float32)
    with pytest.raises(ValueError, match="unknown experts impl"):
        GroupedExperts(2, 16, 8, impl="triton")


# ------------------------------------------------------------------------ router stats


def captured_router_logits(model: Qwen3Model, *inputs, **kwargs):
    """(hidden, stats, router logits [L, T, E] of every MoE layer in order)."""
    logits = []
    hooks = [
        model.get_submodule(f"layers.{i}.moe.router").register_forward_hook(lambda m, a, out: logits.append(out))
        for i in model.args.moe_layers
    ]
    hidden, stats = model(*inputs, **kwargs)
    for hook in hooks:
        hook.remove()
    return hidden, stats, torch.stack(logits)


def test_router_stats_are_per_sequence_sums_over_real_tokens():
    _, ours = hf_and_ours()
    seqs = sequences(seed=50)
    tokens, positions, seq_ids, router_mask = pack(seqs, NUM_PAD)
    num_seqs = len(seqs) + 1
    hidden, stats, logits = captured_router_logits(ours, tokens, positions, seq_ids, router_mask, num_seqs=num_seqs)
    num_layers, num_experts = len(ours.args.moe_layers), ours.args.num_experts
    assert stats.counts.shape == stats.prob_sums.shape == (num_layers, num_seqs, num_experts)
    assert stats.z_sums.shape == (num_layers, num_seqs)
    assert not stats.counts.requires_grad and stats.prob_sums.requires_grad and stats.z_sums.requires_grad
    assert {stats.counts.dtype, stats.prob_sums.dtype, stats.z_sums.dtype} == {torch.float32}

    # Brute force from the router logits: one-hot top-k, softmax, logsumexp^2 per sequence.
    probs = logits.softmax(-1)
    chosen = torch.nn.functional.one_hot(probs.topk(2, dim=-1).indices, num_experts).sum(-2).float()
    z = logits.logsumexp(-1).square()
    for s in range(num_seqs):
        rows = (seq_ids == s) & router_mask
        torch.testing.assert_close(stats.counts[:, s], chosen[:, rows].sum(1))
        torch.testing.assert_close(stats.prob_sums[:, s], probs[:, rows].sum(1))
        torch.testing.assert_close(stats.z_sums[:, s], z[:, rows].sum(1))
    # Padding (the last pseudo-sequence) counts nowhere; each real token once per top-k slot.
    assert stats.counts[:, -1].eq(0).all() and stats.prob_sums[:, -1].eq(0).all() and stats.z_sums[:, -1].eq(0).all()
    torch.testing.assert_close(stats.counts.sum(-1)[:, :-1], 2.0 * torch.tensor(LENGTHS).float().expand(num_layers, -1))


def test_padding_tokens_never_enter_the_statistics():
    _, ours = hf_and_ours()
    seqs = sequences(seed=60)
    tokens, positions, seq_ids, router_mask = pack(seqs, NUM_PAD)
    _, with_padding = ours(tokens, positions, seq_ids, router_mask)
    _, without = ours(*pack(seqs)[:3], num_seqs=len(seqs) + 1)  # same real tokens, no padding
    other_padding = tokens.clone()
    other_padding[-NUM_PAD:] = torch.tensor([5, 17, 90])
    _, other = ours(other_padding, positions, seq_ids, router_mask)
    for field in ("counts", "prob_sums", "z_sums"):
        torch.testing.assert_close(getattr(with_padding, field), getattr(without, field), rtol=1e-6, atol=1e-6)
        # Other padding moves real tokens to other rows of the grouped matmuls: rounding only.
        torch.testing.assert_close(getattr(with_padding, field), getattr(other, field), rtol=1e-6, atol=1e-6)
    assert torch.equal(with_padding.counts, other.counts) and torch.equal(with_padding.counts, without.counts)


def test_masked_tokens_are_computed_but_their_sequence_id_is_irrelevant():
    moe, _ = moe_pair("auto", "loop")
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(4))
    mask = torch.tensor([True] * 6 + [False] * 3)
    seq_ids = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2, 2])
    out, *stats = moe(x, seq_ids, mask, 3)
    other_out, *other_stats = moe(x, torch.tensor([0, 0, 1, 1, 1, 2, 0, 1, 0]), mask, 3)
    for got, expected in zip(other_stats, stats):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(other_out, out, rtol=0, atol=0)
    assert out[6:].abs().sum() > 0  # padding still goes through its experts
    _, alone_counts, alone_probs, *_ = moe(x[:6], seq_ids[:6], mask[:6], 3)
    torch.testing.assert_close(alone_counts, stats[0], rtol=0, atol=0)
    torch.testing.assert_close(alone_probs, stats[1], rtol=1e-6, atol=1e-7)


def test_sequences_alone_give_the_rows_of_the_packed_statistics():
    _, ours = hf_and_ours()
    seqs = sequences(seed=70)
    _, packed = ours(*pack(seqs)[:3])
    for s, seq in enumerate(seqs):
        _, alone = ours(*pack([seq])[:3])
        torch.testing.assert_close(alone.counts[:, 0], packed.counts[:, s], rtol=0, atol=0)
        torch.testing.assert_close(alone.prob_sums[:, 0], packed.prob_sums[:, s], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(alone.z_sums[:, 0], packed.z_sums[:, s], rtol=1e-5, atol=1e-5)


def test_dense_model_returns_plain_hidden_and_inputs_are_checked():
    dense = Qwen3Model(dense_tiny_args())
    tokens, positions, seq_ids, router_mask = pack(sequences(), NUM_PAD)
    hidden = dense(tokens, positions, seq_ids, router_mask)
    assert isinstance(hidden, torch.Tensor) and hidden.shape == (len(tokens), 64)
    assert not any("moe" in name for name, _ in dense.named_parameters())

    moe = Qwen3Model(tiny_args())
    with pytest.raises(ValueError, match="router_mask must be bool"):
        moe(tokens, positions, seq_ids, router_mask.long())
    with pytest.raises(ValueError, match="num_seqs must be a positive int"):
        moe(tokens, positions, seq_ids, num_seqs=0)
    # shard_tokens maps the metadata to the residual stream's tokens; a mismatch is refused
    # (half of the tokens' metadata for a residual stream that holds all of them).
    moe.set_token_shard(TokenShard(rank=0, degree=2))
    with pytest.raises(ValueError, match="shard_tokens"):
        moe(tokens, positions, seq_ids)


def test_init_weights_of_moe_parameters():
    args = qwen3_flavors["debugmodel_moe"]
    model = Qwen3Model(args)
    model.init_weights(seed=0)
    again = Qwen3Model(args)
    again.init_weights(seed=0)
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p, q), name
    w1 = model.get_parameter("layers.1.moe.experts.w1")
    w2 = model.get_parameter("layers.1.moe.experts.w2")
    router = model.get_parameter("layers.1.moe.router.weight")
    assert abs(w1.std().item() - INIT_STD) < 0.1 * INIT_STD
    assert w2.std() < w1.std() / 2  # depth-scaled residual writer
    assert abs(router.std().item() - INIT_STD) < 0.15 * INIT_STD
    # Each expert gets its own values.
    assert not torch.equal(w1[0], w1[1])


# ------------------------------------------------------------------ flavors and config


# Qwen/Qwen3-30B-A3B config.json as published.
QWEN3_30B_A3B_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_published_config_is_the_flavor():
    args = Qwen3ModelArgs.from_hf_config(QWEN3_30B_A3B_CONFIG)
    assert args == qwen3_flavors["30B-A3B"] and find_flavor(args) == "30B-A3B"
    ours = args.to_hf_config("bfloat16")
    assert {k: v for k, v in ours.items() if k in QWEN3_30B_A3B_CONFIG} == {
        k: QWEN3_30B_A3B_CONFIG[k] for k in ours if k in QWEN3_30B_A3B_CONFIG
    }


@pytest.mark.parametrize("flavor", sorted(qwen3_flavors))
def test_flavor_config_and_json_round_trip(flavor):
    args = qwen3_flavors[flavor]
    assert Qwen3ModelArgs.from_hf_config(args.to_hf_config("bfloat16")) == args
    # Checkpoints store asdict as JSON, which turns the mlp_only_layers tuple into a list.
    assert Qwen3ModelArgs.from_dict(json.loads(json.dumps(dataclasses.asdict(args)))) == args
    assert args.to_hf_config("bfloat16")["model_type"] == ("qwen3_moe" if args.is_moe else "qwen3")


def test_dense_config_is_unchanged_by_the_moe_fields():
    config = qwen3_flavors["8B"].to_hf_config("bfloat16")
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert not {"num_experts", "moe_intermediate_size", "mlp_only_layers"} & config.keys()


def active_params(args: Qwen3ModelArgs) -> tuple[int, int]:
    """(total, active per token) parameters from the args alone."""
    attention = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.n_kv_heads) + 2 * args.head_dim
    expert = 3 * args.dim * args.moe_hidden_dim
    moe = args.num_experts * expert + args.num_experts * args.dim
    moe_active = args.num_experts_per_tok * expert + args.num_experts * args.dim
    dense_ffn = 3 * args.dim * args.hidden_dim
    embeddings = args.vocab_size * args.dim * (1 if args.tie_embeddings else 2)
    total = active = embeddings + args.dim
    for layer in range(args.n_layers):
        total += attention + 2 * args.dim + (moe if args.is_moe_layer(layer) else dense_ffn)
        active += attention + 2 * args.dim + (moe_active if args.is_moe_layer(layer) else dense_ffn)
    return total, active


@pytest.mark.parametrize("flavor, total, active", [("30B-A3B", 30.5e9, 3.3e9), ("235B-A22B", 235e9, 22e9)])
def test_published_moe_flavors_have_the_published_sizes(flavor, total, active):
    args = qwen3_flavors[flavor]
    with torch.device("meta"):
        ours = Qwen3Model(args)
    our_total, our_active = active_params(args)
    assert ours.num_params() == our_total
    assert abs(our_total - total) / total < 0.02 and abs(our_active - active) / active < 0.05


def test_hf_model_from_our_config_has_our_parameter_shapes():
    args = tiny_args(n_layers=6, decoder_sparse_step=2, mlp_only_layers=(3,))
    assert args.moe_layers == [1, 5]
    with torch.device("meta"):
        hf = Qwen3MoeForCausalLM(hf_config(args))
        ours = Qwen3Model(args)
    assert [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in hf.model.layers] == [
        args.is_moe_layer(i) for i in range(6)
    ]
    hf_shapes = {k: v.shape for k, v in from_hf(hf.state_dict(), args).items()}
    assert hf_shapes == {k: v.shape for k, v in ours.state_dict().items()}


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"moe_hidden_dim": 0}, "moe_hidden_dim"),
        ({"mlp_only_layers": (4,)}, "mlp_only_layers"),
        ({"mlp_only_layers": (0, 1, 2, 3)}, "no layer is MoE"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ({"experts_impl": "triton"}, "experts_impl"),
        ({"num_experts": 0}, "dense model"),
        ({"mlp_only_layers": ["1"]}, "mlp_only_layers"),
        ({"norm_topk_prob": 1}, "norm_topk_prob"),
    ],
)
def test_invalid_moe_args(changes, message):
    with pytest.raises(ValueError, match=message):
        tiny_args(**changes)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"model_type": "qwen2_moe"}, "model_type"),
        ({"shared_expert_intermediate_size": 512}, "shared_expert_intermediate_size"),
        ({"num_local_experts": 4}, "num_local_experts"),  # disagrees with num_experts
        ({"num_experts": "8"}, "num_experts"),
        ({"mlp_only_layers": 1}, "mlp_only_layers"),
        ({"moe_intermediate_size": None}, "moe_intermediate_size"),
    ],
)
def test_unsupported_hf_moe_config(change, field):
    config = {**tiny_args().to_hf_config("float32"), **change}
    with pytest.raises(ValueError, match=rf"my/config\.json.*{field}"):
        Qwen3ModelArgs.from_hf_config(config, source="my/config.json")


def test_hf_config_spellings_and_defaults():
    args = tiny_args()
    config = args.to_hf_config("float32")
    # transformers 5 writes num_experts under its alias num_local_experts.
    config["num_local_experts"] = config.pop("num_experts")
    assert Qwen3ModelArgs.from_hf_config(config) == args
    # transformers' default norm_topk_prob is false (the published checkpoints say true).
    del config["norm_topk_prob"]
    assert Qwen3ModelArgs.from_hf_config(config).norm_topk_prob is False
    # An MoE config without experts is a dense model.
    dense = Qwen3ModelArgs.from_hf_config({**config, "num_local_experts": 0})
    assert not dense.is_moe and dense == dense_tiny_args()


# ------------------------------------------------------------------- checkpoint layout


def test_to_hf_writes_what_save_pretrained_writes_and_from_pretrained_loads_it(tmp_path):
    hf, ours = hf_and_ours()
    hf.save_pretrained(tmp_path / "hf")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        saved = {key: f.get_tensor(key) for key in f.keys()}
    exported = to_hf(ours.state_dict())
    assert exported.keys() == saved.keys()  # per-expert on disk, as the published checkpoints
    for key, tensor in saved.items():
        torch.testing.assert_close(exported[key], tensor, rtol=0, atol=0, msg=key)
    assert exported["model.layers.0.mlp.experts.3.up_proj.weight"].data_ptr() == (
        ours.get_parameter("layers.0.moe.experts.w3")[3].data_ptr()
    )  # views, no copies

    # Our export (config.json + per-expert tensors) loads into transformers, same logits.
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "config.json").write_text(json.dumps(ours.args.to_hf_config("float32")))
    save_file({k: v.contiguous() for k, v in exported.items()}, str(tmp_path / "ours" / "model.safetensors"))
    loaded = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    tokens = sequences()[0]
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=tokens[None]).logits, hf(input_ids=tokens[None]).logits)
    # And back: the per-expert on-disk dict loads into our model.
    again = Qwen3Model(ours.args)
    again.load_state_dict(from_hf(saved, ours.args), strict=True)
    for name, p in ours.state_dict().items():
        assert torch.equal(again.state_dict()[name], p), name


def test_expert_key_helpers():
    keys = expert_hf_keys("layers.2.moe.experts.w2", 3)
    assert keys == [f"model.layers.2.mlp.experts.{e}.down_proj.weight" for e in range(3)]
    assert expert_hf_keys("layers.0.moe.experts.w1", 1) == ["model.layers.0.mlp.experts.0.gate_proj.weight"]
    assert parse_expert_hf_key("model.layers.7.mlp.experts.11.up_proj.weight") == ("layers.7.moe.experts.w3", 11)
    assert parse_expert_hf_key("model.layers.7.mlp.gate.weight") is None
    assert is_expert_key("layers.3.moe.experts.w1") and not is_expert_key("layers.3.moe.router.weight")
    assert to_hf({"layers.3.moe.router.weight": torch.zeros(1)}).keys() == {"model.layers.3.mlp.gate.weight"}
    with pytest.raises(ValueError, match="not a stacked expert weight"):
        expert_hf_keys("layers.3.feed_forward.w1.weight", 8)


def test_from_hf_refuses_mismatched_layer_kinds_and_missing_experts():
    hf, ours = hf_and_ours()
    args = ours.args
    saved = to_hf(ours.state_dict())
    missing = {k: v for k, v in saved.items() if k != "model.layers.2.mlp.experts.5.gate_proj.weight"}
    with pytest.raises(ValueError, match=r"lacks experts \[5\] of 'layers.2.moe.experts.w1'"):
        from_hf(missing, args)
    with pytest.raises(ValueError, match="expert 8, but num_experts=8"):
        from_hf({**saved, "model.layers.2.mlp.experts.8.gate_proj.weight": torch.zeros(32, 64)}, args)
    with pytest.raises(ValueError, match="layer 1, which is a dense layer"):
        from_hf({**saved, "model.layers.1.mlp.gate.weight": torch.zeros(8, 64)}, args)
    with pytest.raises(ValueError, match="layer 0, which is an MoE layer"):
        from_hf({**saved, "model.layers.0.mlp.gate_proj.weight": torch.zeros(80, 64)}, args)
    both = {**saved, **{k: v for k, v in hf.state_dict().items() if "layers.2.mlp.experts.gate_up" in k}}
    with pytest.raises(ValueError, match="both per-expert and fused"):
        from_hf(both, args)
