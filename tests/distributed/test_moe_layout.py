"""Router losses are exact for any layout: with the load-balancing loss (global and sequence
scopes, pooled and summed over layers; the micro-batch scope for a fixed micro-batch plan)
and the z-loss on, also with routing replay (recorded experts replayed; moe/routing_agreement
logged), gradients (router and experts; with LoRA on attention and the dense MLP,
the adapters'),
grad norm and the logged moe/aux_loss, moe/z_loss and moe/load_imbalance on dp 2, cp 2, tp 2, dp2 x cp2 and
cp2 x tp2, with several micro-batches per rank and a filler micro-batch, equal a one-process
reference that runs every sequence alone and writes the losses out by hand.
"""

import functools
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import layout_cases as lc
import lora_cases
import moe_cases as mc
from test_layout_invariance import assert_rel_close, grad_norm, greedy_plan
from torchtitan_rl.losses.router import RouterLossConfig
from torchtitan_rl.models.qwen3.model import Qwen3Model

RTOL = 1e-5


def reference_model(args=None) -> Qwen3Model:
    model = Qwen3Model(args or mc.model_args())
    model.init_weights(lc.SEED)
    mc.set_router_weights(model)
    return model


def balance(counts: torch.Tensor, prob_sums: torch.Tensor, num_tokens: int, layers: str) -> torch.Tensor:
    """E * sum_e f_e * P_e of one group from its [L, E] counts and probability sums."""
    num_layers, num_experts = counts.shape
    if layers == "pooled":
        return (
            num_experts
            * (counts.sum(0) / (num_layers * num_tokens) * prob_sums.sum(0) / (num_layers * num_tokens)).sum()
        )
    return num_experts * sum((counts[l] / num_tokens * prob_sums[l] / num_tokens).sum() for l in range(num_layers))


class Reference(NamedTuple):
    grads: dict[str, torch.Tensor]
    token_loss: float
    aux: float
    z: float
    config: RouterLossConfig
    imbalance: list[float]  # per MoE layer
    counts: torch.Tensor  # [L, E] float32 top-k counts of the whole batch (the experts used)
    agreement: torch.Tensor  # [L, 2]: zeros without replayed experts


@functools.cache
def reference(name: str, expert_parallel: bool = False) -> Reference:
    config = {mc.AUX_ONLY: mc.AUX_ONLY_CONFIG, mc.MICROBATCH: mc.MICROBATCH_CONFIG}.get(name) or mc.ROUTER_CONFIGS.get(
        name
    )
    if name == mc.LORA:
        config = mc.ROUTER_CONFIGS["global_pooled"]
    if name == mc.REPLAY:
        config = mc.REPLAY_CONFIG
    variant = "no_loss" if name == mc.AUX_ONLY else "uneven"
    args = mc.ep_model_args() if expert_parallel else mc.model_args()
    model = reference_model(args)
    forward, leaves = model, dict(model.named_parameters())
    if name == mc.LORA:
        forward, leaves = lora_forward(model)
    # Replay: each sequence alone routed to its own recorded rows (a sequence without a record
    # routes itself), so the worker's packing, CP / TP splits and EP dispatch are not involved.
    batch = mc.replay_batch(args) if name == mc.REPLAY else lc.global_batch(variant)
    ce, masks, stats = [], [], []
    for s in batch:
        n = len(s)
        hidden, router = forward(
            s.input_ids, torch.arange(n), torch.zeros(n, dtype=torch.long), routed_experts=s.routed_experts
        )
        ce.append(F.cross_entropy(model.output(hidden), s.labels, reduction="none"))
        masks.append(s.loss_mask.float())
        stats.append(router)
    num_loss = sum(m.sum() for m in masks)
    token_loss = sum((c * m).sum() for c, m in zip(ce, masks)) / num_loss.clamp(min=1)
    num_tokens = sum(len(s) for s in batch)
    counts = [st.counts[:, 0] for st in stats]  # [L, E] of each sequence (alone: one sequence)
    probs = [st.prob_sums[:, 0] for st in stats]
    lengths = [len(s) for s in batch]
    if config.aux_loss_scope == "global":
        aux = balance(sum(counts), sum(probs), num_tokens, config.aux_loss_layers)
    elif config.aux_loss_scope == "microbatch":
        groups = greedy_plan(lengths, mc.BUDGET)  # one rank: the plan of the whole batch
        aux = sum(
            balance(
                sum(counts[i] for i in g), sum(probs[i] for i in g), sum(lengths[i] for i in g), config.aux_loss_layers
            )
            for g in groups
        ) / len(groups)
    else:
        aux = sum(balance(c, p, len(s), config.aux_loss_layers) for c, p, s in zip(counts, probs, batch)) / len(stats)
    z = sum(st.z_sums.sum() for st in stats) / num_tokens
    loss = token_loss + config.aux_loss_coef * aux + config.z_loss_coef * z
    grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
    # The busiest expert over the mean expert, per MoE layer, of the whole batch's top-k counts.
    total = sum(counts)  # float32, like the counts the metrics logger divides
    imbalance = (total.double().max(-1).values / total.double().mean(-1)).tolist()
    # (recorded choices the layer's own top-k also made, recorded choices) [L, 2] of the batch.
    agreement = sum(st.agreement for st in stats)
    return Reference(
        grads,
        float(token_loss.detach()),
        float(aux.detach()),
        float(z.detach()),
        config,
        imbalance,
        total,
        agreement,
    )


def lora_forward(model):
    """The model's forward with every adapted weight written out as W + alpha / r * B A, and the
    adapters (the only tensors that train) by name. The adapted layers are listed from the
    architecture: the attention projections of every layer, the dense MLP of layer 0."""
    settings = mc.LORA_SETTINGS
    adapted = [f"layers.{i}.attention.{w}" for i in range(mc.model_args().n_layers) for w in ("wq", "wo")]
    adapted += [f"layers.0.feed_forward.{w}" for w in ("w1", "w2")]
    model.requires_grad_(False)
    leaves, weights = {}, {}
    for module in adapted:
        out_features, in_features = model.get_submodule(module).weight.shape
        a, b = f"{module}.lora_a.weight", f"{module}.lora_b.weight"
        leaves[a] = lora_cases.adapter_values(a, (settings.rank, in_features)).requires_grad_()
        leaves[b] = lora_cases.adapter_values(b, (out_features, settings.rank)).requires_grad_()
        base = model.get_submodule(module).weight
        weights[f"{module}.weight"] = base + settings.alpha / settings.rank * leaves[b] @ leaves[a]
    return (lambda *args, **kwargs: functional_call(model, weights, args, kwargs)), leaves


def moe_entries(results, expert_parallel: bool = False):
    return {
        key: entry
        for world in results.values()
        for key, entry in world.items()
        if key.startswith("moe/") and ("_ep" in key.split("/")[1]) == expert_parallel
    }


def test_every_moe_layout_and_case_was_run(layout_results):
    expected = {
        mc.case_key(layout, name)
        for layout in mc.MOE_LAYOUTS
        for name in [*mc.moe_cases(layout), mc.AUX_ONLY, mc.LORA, mc.REPLAY]
    }
    expected |= {mc.case_key(layout, mc.MICROBATCH) for layout in mc.MOE_LAYOUTS if layout[0] * layout[1] == 1}
    assert set(moe_entries(layout_results)) == expected
    expected_ep = {
        mc.case_key(layout, name, ep)
        for layout, degrees in mc.EP_LAYOUTS.items()
        for ep in degrees
        for name in mc.ep_cases(layout)
    }
    expected_ep.add(mc.case_key(mc.EP_REPLAY[0], mc.REPLAY, mc.EP_REPLAY[1]))
    assert set(moe_entries(layout_results, expert_parallel=True)) == expected_ep


# The rank-2 adapters' gradients are products of small factors summed in another order on each
# layout: float32 rounding reaches 1.3e-5 of their norm on some CPUs (an Intel Xeon, measured),
# where a wrong weight or a missing rank would be off by far more than this.
LORA_GRAD_RTOL = 5e-5


def test_router_losses_and_gradients_equal_the_one_process_reference(layout_results):
    for key, entry in moe_entries(layout_results).items():
        name = key.split("/")[-1]
        grads, token_loss, aux, z, config, imbalance, _, agreement = reference(name)
        for fqn, g in grads.items():
            rtol = LORA_GRAD_RTOL if name == mc.LORA else RTOL
            assert_rel_close(entry["grads"][fqn], g, f"{key} grad {fqn}", rtol)
        logged = entry["logged"]
        assert logged["grad_norm"] == pytest.approx(grad_norm(grads), rel=RTOL), key
        assert logged["loss_metrics/global_avg_loss"] == pytest.approx(token_loss, rel=RTOL, abs=1e-12), key
        assert logged["moe/aux_loss"] == pytest.approx(aux, rel=RTOL), key
        if config.z_loss_coef > 0:
            assert logged["moe/z_loss"] == pytest.approx(z, rel=RTOL), key
        else:
            assert "moe/z_loss" not in logged
        for layer, value in zip(mc.model_args().moe_layers, imbalance, strict=True):
            assert logged[f"moe/load_imbalance/layer_{layer}"] == pytest.approx(value, rel=1e-6), (key, layer)
        assert_routing_agreement(logged, agreement, name == mc.REPLAY, mc.model_args().moe_layers, key)


def assert_routing_agreement(logged: dict, agreement: torch.Tensor, replay: bool, moe_layers, key: str) -> None:
    """moe/routing_agreement (and per layer) is the reference's matched / compared choices,
    logged only with replay on. Ratios of integer counts: equal up to the division's rounding."""
    tags = {tag for tag in logged if tag.startswith("moe/routing_agreement")}
    if not replay:
        assert not tags, key
        return
    assert tags == {"moe/routing_agreement", *(f"moe/routing_agreement/layer_{layer}" for layer in moe_layers)}, key
    matched, compared = agreement.double().unbind(-1)
    assert logged["moe/routing_agreement"] == pytest.approx(float(matched.sum() / compared.sum()), rel=1e-12), key
    for layer, m, c in zip(moe_layers, matched, compared, strict=True):
        assert logged[f"moe/routing_agreement/layer_{layer}"] == pytest.approx(float(m / c), rel=1e-12), (key, layer)


def test_routing_replay_case_routes_differently_from_the_router():
    """The replay case's premises: the batch records some rows of some samples (one sample
    without a record, one with -1 rows only), the recorded experts disagree with the router's
    own choice on a good share of them (agreement strictly between 0 and 1 in every layer), so
    the reference's gradient differs from the same losses without replay by far more than the
    tolerance: a layout that ignored the record would fail the comparison above."""
    args = mc.model_args()
    batch = mc.replay_batch(args)
    assert batch[mc.REPLAY_NONE].routed_experts is None
    # It shares a micro-batch with recorded sample 0 (on every layout, rank 0 holds both), so
    # packing fills its rows with -1.
    assert [0, mc.REPLAY_NONE] in greedy_plan([len(s) for s in batch], mc.BUDGET)
    assert (batch[mc.REPLAY_EMPTY].routed_experts == -1).all()
    rows = torch.cat([s.routed_experts for s in batch if s.routed_experts is not None]).flatten(0, 1)
    recorded = (rows >= 0).all(-1)
    assert 0 < recorded.float().mean() < 1
    assert ((rows >= 0).all(-1) | (rows == -1).all(-1)).all()  # a row is a record or all -1
    replayed, own = reference(mc.REPLAY), reference("global_pooled")
    matched, compared = replayed.agreement.unbind(-1)
    assert (compared == args.num_experts_per_tok * recorded.view(-1, len(args.moe_layers)).sum(0)).all()
    assert ((0 < matched) & (matched < 0.8 * compared)).all(), replayed.agreement
    assert own.agreement.sum() == 0
    for part in ("router", "experts"):
        diff = sum((replayed.grads[f] - own.grads[f]).norm() ** 2 for f in own.grads if f".{part}." in f) ** 0.5
        scale = sum(own.grads[f].norm() ** 2 for f in own.grads if f".{part}." in f) ** 0.5
        assert diff > 100 * RTOL * scale, (part, float(diff / scale))
    assert (replayed.counts != own.counts).any()  # the statistics count the experts used


def test_aux_only_gradient_norm_does_not_scale_with_cp_or_tp(layout_results):
    """A token count pre-multiplied under CP (a bug another framework shipped) left the router
    losses' gradient norm 10^4 times too large. The aux-only objective's norm is the same on 1 rank, cp 2 and tp 2."""
    norms = {
        layout: moe_entries(layout_results)[mc.case_key(layout, mc.AUX_ONLY)]["logged"]["grad_norm"]
        for layout in ((1, 1, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2), (1, 1, 2, 2))
    }
    grads, *_ = reference(mc.AUX_ONLY)
    assert grad_norm(grads) > 0
    for layout, norm in norms.items():
        assert norm == pytest.approx(grad_norm(grads), rel=RTOL), layout


def test_moe_cases_route_unevenly_and_split_into_several_microbatches(layout_results):
    """The premises: the router is far from uniform (so balancing has work to do), and the
    budget gives 3 micro-batches on one rank, 2 and 1 on the ranks of dp 2 (a filler)."""
    logged = layout_results[1][mc.case_key((1, 1, 1, 1), "global_pooled")]["logged"]
    assert max(logged[f"moe/load_imbalance/layer_{layer}"] for layer in mc.model_args().moe_layers) > 1.1
    lengths = [len(s) for s in lc.global_batch("uneven")]
    assert len(greedy_plan(lengths, mc.BUDGET)) == 3
    assert [len(greedy_plan(lengths[:4], mc.BUDGET)), len(greedy_plan(lengths[4:], mc.BUDGET))] == [2, 1]


# ---------------------------------------------------------------- expert parallel

EP_RTOL = 1e-4


@functools.cache
def stepped_reference(name: str) -> dict[str, torch.Tensor]:
    """The reference model after one AdamW step on the clipped reference gradient (the
    worker's schedule has no warmup: the step runs at the full lr)."""
    grads, *_ = reference(name, expert_parallel=True)
    model = reference_model(mc.ep_model_args())
    norm = grad_norm(grads)
    assert norm > mc.EP_MAX_NORM, "the case must exercise clipping"
    for fqn, p in model.named_parameters():
        p.grad = grads[fqn] * (mc.EP_MAX_NORM / (norm + 1e-6))
    torch.optim.AdamW(model.parameters(), lr=lc.LR, betas=(0.9, 0.95), eps=lc.ADAM_EPS, weight_decay=0.1).step()
    return {fqn: p.detach() for fqn, p in model.named_parameters()}


def test_expert_parallel_gradients_losses_and_step_equal_the_one_process_reference(layout_results):
    """EP 1, 2 and 4 on 4 ranks (EP x FSDP, EP alone), EP2 x TP2, EP2 x CP2, EP 2 under HSDP and
    over dp 2; global and sequence load balancing with the z-loss (the global one only under
    HSDP and on dp 2), several micro-batches and a filler: router and expert gradients, grad norm, loss, moe/aux_loss, moe/z_loss and the
    clipped AdamW step equal the one-process reference with every expert on one rank."""
    entries = moe_entries(layout_results, expert_parallel=True)
    assert entries
    for key, entry in entries.items():
        name = key.split("/")[-1]
        grads, token_loss, aux, z, _, imbalance, counts, agreement = reference(name, expert_parallel=True)
        assert set(entry["grads"]) == set(grads), key
        for fqn, g in grads.items():
            assert_rel_close(entry["grads"][fqn], g, f"{key} grad {fqn}", rtol=EP_RTOL)
        logged = entry["logged"]
        assert logged["grad_norm"] == pytest.approx(grad_norm(grads), rel=EP_RTOL), key
        assert logged["loss_metrics/global_avg_loss"] == pytest.approx(token_loss, rel=EP_RTOL), key
        assert logged["moe/aux_loss"] == pytest.approx(aux, rel=EP_RTOL), key
        assert logged["moe/z_loss"] == pytest.approx(z, rel=EP_RTOL), key
        for fqn, p in stepped_reference(name).items():
            torch.testing.assert_close(entry["params"][fqn], p, rtol=EP_RTOL, atol=1e-6, msg=f"{key} {fqn}")
        ep = int(key.split("/")[1].split("_ep")[1])
        per_rank = counts.unflatten(-1, (ep, -1)).sum(-1)  # [L, ep]: by hand, not tokens_per_rank
        expected = (per_rank.max(-1).values / per_rank.mean(-1)).tolist()
        for layer, value in zip(mc.ep_model_args().moe_layers, expected):
            tag = f"moe/rank_imbalance/layer_{layer}"
            if ep == 1:
                assert tag not in logged, key
            else:
                assert logged[tag] == pytest.approx(value, rel=1e-12), (key, tag)
        for layer, value in zip(mc.ep_model_args().moe_layers, imbalance, strict=True):
            assert logged[f"moe/load_imbalance/layer_{layer}"] == pytest.approx(value, rel=1e-6), (key, layer)
        assert_routing_agreement(logged, agreement, name == mc.REPLAY, mc.ep_model_args().moe_layers, key)
    replay = mc.case_key(mc.EP_REPLAY[0], mc.REPLAY, mc.EP_REPLAY[1])
    matched, compared = reference(mc.REPLAY, expert_parallel=True).agreement.sum(0)
    assert replay in entries and 0 < matched < compared  # replay changed routing under EP too


def test_expert_parallel_data_covers_the_dispatch_edge_cases(layout_results):
    """The premises, counted by the worker on every rank: a token whose two experts live on two
    other ranks (ep 4), a local expert that receives no token in a dispatch, and a rank that
    sends nothing to any other rank in a dispatch (a filler micro-batch's padding routed home)."""
    entries = moe_entries(layout_results, expert_parallel=True)
    dispatch = {key: entry["dispatch"] for key, entry in entries.items() if "dispatch" in entry}
    assert dispatch
    remote_pairs, idle_experts, silent = ({key: counts[i] for key, counts in dispatch.items()} for i in range(3))
    assert remote_pairs[mc.case_key((1, 4, 1, 1), "global_pooled", 4)] > 0
    assert max(idle_experts.values()) > 0
    assert max(silent.values()) > 0


def test_expert_parallel_checkpoint_resumes_onto_another_degree(layout_results):
    """A DCP checkpoint saved under ep 2 resumes under ep 1 and the other way round (dp 4): the
    stepped weights and both AdamW moments come back bitwise."""
    entries = layout_results[4]
    for source, target in ((2, 1), (1, 2)):
        trained = entries[f"moe_ep_checkpoint/trained_ep{source}"]
        loaded = entries[f"moe_ep_checkpoint/ep{source}_onto_ep{target}"]
        for part in ("params", "optimizer"):
            assert set(loaded[part]) == set(trained[part]) and trained[part], part
            for key, value in trained[part].items():
                assert torch.equal(loaded[part][key], value), f"ep {source} -> {target}: {part} {key}"


def _expert_of(key: str) -> int | None:
    return int(key.split(".experts.")[1].split(".")[0]) if ".experts." in key else None


def test_expert_parallel_hf_export_equals_ep1_and_each_rank_reads_its_own_experts(layout_results):
    """HF exports made under ep 2 and ep 4 (dp 4) hold ep 1's tensors bitwise; each expert's
    owner writes it in a file of its own, so no rank gathers every expert. Loading ep 1's export
    into an ep 2 model gives its weights back, each rank reading only the experts it holds."""
    hf = layout_results[4]["moe_ep_checkpoint/hf"]
    exports = hf["exports"]
    num_local = mc.EP_NUM_EXPERTS // 2
    for ep in (2, 4):
        assert set(exports[ep]) == set(exports[1])
        for key, (_, tensor) in exports[1].items():
            assert torch.equal(exports[ep][key][1], tensor), f"ep {ep}: {key}"
        owners_of_file = {}
        for key, (file, _) in exports[ep].items():
            expert = _expert_of(key)
            owners_of_file.setdefault(file, set()).add(0 if expert is None else expert // (mc.EP_NUM_EXPERTS // ep))
        assert all(len(owners) == 1 for owners in owners_of_file.values()), owners_of_file
        assert {owner for owners in owners_of_file.values() for owner in owners} == set(range(ep))
    assert len({file for file, _ in exports[1].values()}) == 1
    source = layout_results[4]["moe_ep_checkpoint/hf_source"]
    for fqn, value in source.items():
        assert torch.equal(hf["loaded_into_ep2"][fqn], value), fqn
    expert_reads = []
    for ep_rank, reads in hf["reads"]:
        for key, index in reads:
            if index is not None:
                assert index // num_local == ep_rank, f"ep rank {ep_rank} read expert {index} of {key}"
                expert_reads.append((key, index))
    expected = {(key, _expert_of(key)) for key in exports[1] if _expert_of(key) is not None}
    assert sorted(expert_reads) == sorted(expected)  # each expert read once, by a rank holding it
