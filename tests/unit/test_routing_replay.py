"""Routing replay in one process: a MoE model given recorded experts against transformers'
``Qwen3MoeForCausalLM`` whose routers are forced to the same experts (logits and every
gradient); replaying the model's own routing changes nothing; the router statistics and the
agreement counts against brute force; what the engine refuses; how packing carries the records."""

import pytest
import torch
import torch.nn.functional as F

from test_moe import hf_and_ours, pack, sequences, tiny_args
from torchtitan_rl.data.cp_split import shard_microbatch
from torchtitan_rl.data.packing import pack as pack_samples
from torchtitan_rl.data.sample import Sample, find_routing_problem
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.losses.router import RouterLossConfig, RouterMetrics
from torchtitan_rl.metrics import MetricsLogger
from torchtitan_rl.models.qwen3.state_dict_adapter import from_hf

NUM_LAYERS, TOP_K, NUM_EXPERTS = 3, 2, 8  # tiny_args: MoE layers 0, 2, 3


def forced_routing(num_tokens: int, seed: int, recorded_share: float = 0.7) -> torch.Tensor:
    """``[T, L, k]`` random distinct experts per (token, layer); about ``1 - recorded_share`` of
    the tokens unrecorded (-1)."""
    generator = torch.Generator().manual_seed(seed)
    experts = torch.rand(num_tokens, NUM_LAYERS, NUM_EXPERTS, generator=generator).argsort(-1)[..., :TOP_K]
    unrecorded = torch.rand(num_tokens, generator=generator) > recorded_share
    experts[unrecorded] = -1
    return experts.to(torch.int16)


def force_hf_routers(hf, routing_of_layer: dict[int, torch.Tensor]) -> None:
    """Make each HF MoE layer's router pick ``routing_of_layer[layer]`` ``[T, k]`` (-1 rows: its
    own top-k), weighting them by its softmax renormalized over them: the reference replay."""
    for index, layer in enumerate(hf.model.layers):
        if index not in routing_of_layer:
            continue
        gate, forced = layer.mlp.gate, routing_of_layer[index].long()

        def forward(hidden, gate=gate, forced=forced):
            hidden = hidden.reshape(-1, gate.hidden_dim)
            logits = F.linear(hidden, gate.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            own = probs.topk(gate.top_k, dim=-1).indices
            experts = torch.where(forced[:, :1] >= 0, forced, own)
            weights = probs.gather(-1, experts)
            weights = weights / weights.sum(-1, keepdim=True)
            return logits, weights.to(logits.dtype), experts

        gate.forward = forward


@pytest.mark.parametrize("experts_impl", ["grouped_mm", "loop"])
def test_replayed_forward_and_gradients_match_hf_with_forced_routers(experts_impl):
    hf, ours = hf_and_ours(tiny_args(experts_impl=experts_impl))
    seqs = sequences()
    tokens, positions, seq_ids, _ = pack(seqs)
    routing = forced_routing(tokens.numel(), seed=3)
    projection = torch.randn(96, generator=torch.Generator().manual_seed(5))
    hidden, _ = ours(tokens, positions, seq_ids, routed_experts=routing)
    logits = ours.output(hidden)
    (logits @ projection).sum().backward()

    # HF runs one sequence at a time, each with its own rows of the routing.
    starts = torch.tensor([0, *[len(s) for s in seqs]]).cumsum(0).tolist()
    expected = []
    for seq, start in zip(seqs, starts):
        rows = routing[start : start + len(seq)]
        force_hf_routers(hf, {layer: rows[:, slot] for slot, layer in enumerate(ours.args.moe_layers)})
        expected.append(hf(input_ids=seq[None]).logits[0])
    expected = torch.cat(expected)
    (expected @ projection).sum().backward()

    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    hf_grads = from_hf({name: p.grad for name, p in hf.named_parameters()}, ours.args)
    our_grads = {name: p.grad for name, p in ours.named_parameters()}
    assert our_grads.keys() == hf_grads.keys()
    # Every gradient, each router's included: replay keeps the router's gradient. Summed logits
    # give large gradients: the absolute tolerance scales with each one's size.
    for name, grad in hf_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-6 * grad.abs().max(), msg=name)
    assert all(our_grads[f"layers.{i}.moe.router.weight"].abs().sum() > 0 for i in ours.args.moe_layers)
    # Replay changed the computation: without it the logits differ.
    with torch.no_grad():
        unreplayed = ours.output(ours(tokens, positions, seq_ids)[0])
    assert (unreplayed - logits).abs().max() > 1e-2


def test_replaying_its_own_routing_changes_nothing():
    _, ours = hf_and_ours()
    tokens, positions, seq_ids, mask = pack(sequences(), num_pad=3)
    with torch.no_grad():
        hidden, stats = ours(tokens, positions, seq_ids, mask, record_routing=True)
        own = stats.experts.permute(1, 0, 2).to(torch.int16)  # [T, L, k]
        replayed, replayed_stats = ours(tokens, positions, seq_ids, mask, routed_experts=own)
    assert torch.equal(replayed, hidden)
    for field in ("counts", "prob_sums", "z_sums"):
        assert torch.equal(getattr(replayed_stats, field), getattr(stats, field))
    num_real = int(mask.sum())
    # Every real token's every choice agrees; padding is never compared.
    torch.testing.assert_close(replayed_stats.agreement, torch.tensor([[num_real * TOP_K] * 2] * NUM_LAYERS).float())


def test_statistics_count_the_replayed_experts_and_agreement_counts_own_choices():
    _, ours = hf_and_ours()
    tokens, positions, seq_ids, mask = pack(sequences(), num_pad=3)
    routing = forced_routing(tokens.numel(), seed=8)
    with torch.no_grad():
        _, own_stats = ours(tokens, positions, seq_ids, mask, record_routing=True)
        _, stats = ours(tokens, positions, seq_ids, mask, routed_experts=routing, record_routing=True)
        # Compare only: the model keeps its own routing and output.
        kept, compared = ours(tokens, positions, seq_ids, mask, routed_experts=routing, replay_routing=False)
    own = own_stats.experts  # [L, T, k]
    recorded = routing[:, :, 0] >= 0  # [T, L]
    num_seqs = int(seq_ids.max()) + 1
    for slot in range(NUM_LAYERS):
        used = torch.where(recorded[:, slot, None], routing[:, slot].long(), stats.experts[slot])
        assert torch.equal(stats.experts[slot], used)
        counts = torch.zeros(num_seqs, NUM_EXPERTS)
        for t in range(tokens.numel()):
            if mask[t]:
                for e in used[t].tolist():
                    counts[seq_ids[t], e] += 1
        assert torch.equal(stats.counts[slot], counts)
    # Agreement of the compare-only pass: its own routing is the unreplayed one (own_stats).
    matched = compared_choices = 0
    for t in range(tokens.numel()):
        for slot in range(NUM_LAYERS):
            if mask[t] and recorded[t, slot]:
                matched += len(set(routing[t, slot].tolist()) & set(own[slot, t].tolist()))
                compared_choices += TOP_K
    assert torch.equal(compared.agreement.sum(0), torch.tensor([float(matched), float(compared_choices)]))
    assert 0 < matched < compared_choices
    reference, _ = ours(tokens, positions, seq_ids, mask)
    assert torch.equal(kept, reference)


def test_bad_records_are_refused_naming_sample_and_row():
    def sample(experts):
        return Sample(torch.arange(4), torch.arange(4), torch.ones(4, dtype=torch.bool), routed_experts=experts)

    good = forced_routing(4, seed=1)
    assert find_routing_problem([sample(good), sample(None)], NUM_LAYERS, TOP_K, NUM_EXPERTS) is None
    duplicate, out_of_range, half = good.clone(), good.clone(), good.clone()
    duplicate[2, 1] = torch.tensor([5, 5])
    out_of_range[1, 0] = torch.tensor([0, NUM_EXPERTS])
    half[3, 2] = torch.tensor([-1, 4])
    for bad, where in ((duplicate, "[2, 1]"), (out_of_range, "[1, 0]"), (half, "[3, 2]")):
        problem = find_routing_problem([sample(good), sample(bad)], NUM_LAYERS, TOP_K, NUM_EXPERTS)
        assert "sample 1 of this rank's 2" in problem and f"routed_experts{where}" in problem, problem
    problem = find_routing_problem([sample(good[:, :2])], NUM_LAYERS, TOP_K, NUM_EXPERTS)
    assert "[tokens, MoE layers, top_k] = (4, 3, 2)" in problem
    assert "no MoE layers" in find_routing_problem([sample(good)], 0, 0, 0)
    problem = find_routing_problem([sample(good.float())], NUM_LAYERS, TOP_K, NUM_EXPERTS)
    assert "integer tensor" in problem


def test_packing_and_the_context_parallel_split_carry_the_records():
    lengths = (5, 7, 3)
    samples = [
        Sample(torch.arange(n), torch.arange(n), torch.ones(n, dtype=torch.bool), routed_experts=experts)
        for n, experts in zip(lengths, (forced_routing(5, 1), None, forced_routing(3, 2)))
    ]
    mb = pack_samples(samples, pad_multiple=4)
    expected = torch.cat(
        [samples[0].routed_experts, torch.full((7, NUM_LAYERS, TOP_K), -1, dtype=torch.int16)]
        + [samples[2].routed_experts, torch.full((1, NUM_LAYERS, TOP_K), -1, dtype=torch.int16)]
    )
    assert torch.equal(mb.routed_experts, expected)
    shares = [shard_microbatch(mb, 2, rank) for rank in range(2)]
    # The records follow their tokens: the same (input id, sequence) rows on the shares.
    for share in shares:
        real = share.real_token_mask()
        for token, seq, experts in zip(share.input_ids[real], share.seq_ids[real], share.routed_experts[real]):
            start = sum(lengths[: int(seq)])
            assert torch.equal(experts, expected[start + int(token)])
        assert bool((share.routed_experts[~real] == -1).all())
    assert pack_samples([samples[1]]).routed_experts is None


def test_agreement_is_logged_pooled_over_layers():
    dims = ParallelDims(1, 1, 1, 1, world_size=1)
    dims.build_meshes("cpu")
    logger = MetricsLogger(dims, torch.device("cpu"), 0, tb_folder=None, num_params=1, flops_per_token_context=1)
    metrics = RouterMetrics(
        torch.zeros(()),
        torch.zeros(()),
        torch.ones(2, 4),
        (1, 3),
        RouterLossConfig(),
        agreement=torch.tensor([[3.0, 4.0], [1.0, 4.0]]),
    )
    values, _ = logger.reduce_router(metrics)
    assert values["moe/routing_agreement"] == 0.5
    assert (values["moe/routing_agreement/layer_1"], values["moe/routing_agreement/layer_3"]) == (0.75, 0.25)
    metrics.agreement = torch.zeros(2, 2)  # nothing recorded: no value at all
    assert "moe/routing_agreement" not in logger.reduce_router(metrics)[0]
