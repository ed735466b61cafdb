"""Mixture-of-experts layouts inside the shared multi-rank launch (``layout_worker.run_all_layouts``).

On the layouts of ``MOE_LAYOUTS`` a tiny Qwen3-MoE (dense first layer, then MoE layers) runs
``forward_backward`` with the router losses on: the global and sequence scopes of the
load-balancing loss (pooled and summed over layers) with the z-loss, at a budget that gives
several micro-batches per rank (and a filler micro-batch on some ranks), and an aux-only
objective (the router losses' gradient must not scale with the CP / TP degree).
Routing replay (``REPLAY``): the "uneven" batch with the experts a sampler would have recorded
(``replay_batch``), replayed on every layout and on one expert-parallel layout (``EP_REPLAY``).
Expert parallel (``EP_LAYOUTS``): a model with more experts runs the global and sequence
scopes with the z-loss and a clipped AdamW step under each ep degree, recording what the
dispatch saw so that the test can assert its premises (``DispatchSpy``).
Rank 0 records gradients and logged numbers for test_moe_layout.py.
"""

import dataclasses
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

import layout_cases as lc
import lora_cases
import torchtitan_rl.hf_checkpoint as hf_checkpoint
from torchtitan_rl.checkpoint import _ModelState, _OptimizerState
from torchtitan_rl.data.sample import Sample
from torchtitan_rl.distributed.clip import clip_grad_norm_
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.engine import Engine, EngineOptions
from torchtitan_rl.losses.router import RouterLossConfig
from torchtitan_rl.metrics import MetricsLogger
from torchtitan_rl.models.lora import LoRASettings
from torchtitan_rl.models.qwen3.args import Qwen3ModelArgs
from torchtitan_rl.optim import build_lr_scheduler, build_optimizer
from torchtitan_rl.recipes.base import build_model

# (dp_replicate, dp_shard, cp, tp): dp 2, cp 2, tp 2, dp2 x cp2, cp2 x tp2 (and one rank).
MOE_LAYOUTS = ((1, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2), (1, 2, 2, 1), (1, 1, 2, 2))
# Budget 40: the "uneven" batch packs into 3 micro-batches on one rank, and dp 2's ranks get
# 2 and 1, so one of them runs a filler micro-batch.
BUDGET = 40
ROUTER_CONFIGS = {
    "global_pooled": RouterLossConfig(
        aux_loss_coef=0.3, aux_loss_scope="global", aux_loss_layers="pooled", z_loss_coef=0.01
    ),
    "global_sum": RouterLossConfig(aux_loss_coef=0.3, aux_loss_scope="global", aux_loss_layers="sum"),
    "sequence_pooled": RouterLossConfig(
        aux_loss_coef=0.3, aux_loss_scope="sequence", aux_loss_layers="pooled", z_loss_coef=0.01
    ),
}
# The aux-only objective: the token loss contributes nothing (no loss tokens), so the gradient
# is the router loss's alone.
AUX_ONLY = "aux_only"
AUX_ONLY_CONFIG = RouterLossConfig(aux_loss_coef=1.0)
MICROBATCH = "microbatch_pooled"
MICROBATCH_CONFIG = RouterLossConfig(aux_loss_coef=0.3, aux_loss_scope="microbatch", aux_loss_layers="pooled")
# The global_pooled case on a model whose attention and dense MLP carry LoRA adapters (the
# experts are not adapted): only the adapters train, the router losses still count.
LORA = "lora_global_pooled"
LORA_SETTINGS = LoRASettings(rank=2, alpha=4.0, target_modules=("wq", "wo", "w1", "w2"))
# Routing replay on: the global pooled losses of the "uneven" batch whose samples carry the
# experts a sampler recorded (``replay_batch``), routed to them (router_replay="rollout").
REPLAY = "replay_global_pooled"
REPLAY_CONFIG = ROUTER_CONFIGS["global_pooled"]
# Sample 1 carries no record (routed_experts None: packed as -1 rows beside recorded samples),
# sample 4 a record of -1 rows only; of the others' (token, layer) rows this share is recorded.
REPLAY_NONE, REPLAY_EMPTY = 1, 4
REPLAY_RECORDED_SHARE = 0.75
ROUTER_STD = 1.0  # HF's init std of 0.02 leaves top-k near-ties that float noise flips
# Expert parallel: world layout -> the ep degrees run on it. dp 4 with ep 1, 2 (EP x FSDP) and
# 4 (every rank its own experts); ep 2 over the tp pair (EP2 x TP2), over the cp pair
# (EP2 x CP2), under HSDP, and over dp 2.
EP_LAYOUTS = {(1, 4, 1, 1): (1, 2, 4), (1, 2, 1, 2): (2,), (1, 2, 2, 1): (2,), (2, 2, 1, 1): (2,), (1, 2, 1, 1): (2,)}
EP_CASES = ("global_pooled", "sequence_pooled")
# Layouts that run the global scope only (CI time): the sequence scope's counts never cross ranks.
EP_GLOBAL_ONLY = ((2, 2, 1, 1), (1, 2, 1, 1))
EP_NUM_EXPERTS = 8
# The one expert-parallel (layout, ep degree) that also runs the replay case (CI time): dp 4 with
# every rank its own experts, so replayed experts are dispatched to other ranks.
EP_REPLAY = ((1, 4, 1, 1), 4)
EP_MAX_NORM = 0.05  # below the cases' gradient norm: the step clips


def model_args() -> Qwen3ModelArgs:
    return dataclasses.replace(
        lc.model_args(False),
        n_layers=3,
        num_experts=4,
        num_experts_per_tok=2,
        moe_hidden_dim=16,
        mlp_only_layers=(0,),
        experts_impl="grouped_mm",
    )


def ep_model_args() -> Qwen3ModelArgs:
    return dataclasses.replace(model_args(), num_experts=EP_NUM_EXPERTS)


@torch.no_grad()
def set_router_weights(model: torch.nn.Module) -> None:
    """Router weights drawn with std ROUTER_STD from a fixed seed, identical for every layout."""
    for fqn, param in model.named_parameters():
        if fqn.endswith("router.weight"):
            layer = int(fqn.split("layers.")[1].split(".")[0])
            full = ROUTER_STD * torch.randn(param.shape, generator=torch.Generator().manual_seed(100 + layer))
            lc.set_full_(param, full)


def replay_batch(args: Qwen3ModelArgs) -> list[Sample]:
    """The "uneven" batch with ``routed_experts``: each recorded (token, MoE layer) row holds k
    distinct experts drawn uniformly, independently of the model, so about 1 - k / E of the
    recorded choices differ from the router's own and replay changes the routing. The same on
    every rank and in the reference (a fixed seed)."""
    gen = torch.Generator().manual_seed(7)
    num_layers, k, num_experts = len(args.moe_layers), args.num_experts_per_tok, args.num_experts
    samples = lc.global_batch("uneven")
    for i, sample in enumerate(samples):
        experts = torch.rand(len(sample), num_layers, num_experts, generator=gen).argsort(-1)[..., :k]
        recorded = torch.rand(len(sample), num_layers, 1, generator=gen) < REPLAY_RECORDED_SHARE
        if i == REPLAY_EMPTY:
            recorded.zero_()
        if i != REPLAY_NONE:
            sample.routed_experts = torch.where(recorded, experts, -1).to(torch.int16)
    return samples


def case_key(layout: tuple, name: str, ep: int | None = None) -> str:
    return "moe/rep{}_shard{}_cp{}_tp{}".format(*layout) + ("" if ep is None else f"_ep{ep}") + f"/{name}"


def run_moe_checks(dims: ParallelDims, results: dict) -> None:
    layout = (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)
    run_expert_parallel_checks(layout, dims.world_size, results)
    run_expert_parallel_checkpoint_checks(layout, dims.world_size, results)
    if layout not in MOE_LAYOUTS:
        return
    device = torch.device("cpu")
    model = build_model(model_args(), parallel_dims=dims, device=device, seed=lc.SEED, param_dtype=torch.float32)
    set_router_weights(model)
    lora_model = build_model(
        model_args(), parallel_dims=dims, device=device, seed=lc.SEED, param_dtype=torch.float32, lora=LORA_SETTINGS
    )
    set_router_weights(lora_model)
    lora_cases.set_adapters(lora_model)
    cases = [(name, ROUTER_CONFIGS[name], "uneven", model) for name in moe_cases(layout)]
    cases.append((AUX_ONLY, AUX_ONLY_CONFIG, "no_loss", model))
    cases.append((LORA, ROUTER_CONFIGS["global_pooled"], "uneven", lora_model))
    cases.append((REPLAY, REPLAY_CONFIG, "replay", model))
    if dims.batch_degree == 1:
        # Layout-dependent on purpose, but exact for a given micro-batch plan (here the same
        # 3 micro-batches on every layout without data parallel), whatever CP / TP split them.
        cases.append((MICROBATCH, MICROBATCH_CONFIG, "uneven", model))
    for name, config, variant, model in cases:
        results[case_key(layout, name)] = run_case(model, dims, config, variant)


def run_case(
    model, dims: ParallelDims, config: RouterLossConfig, variant: str, max_norm: float | None = None, optimizer=None
):
    """One ``forward_backward`` of this rank's share of the batch ``variant`` ("replay": the
    ``replay_batch`` of ``model``, its recorded experts replayed): the gradients and logged
    values; with ``max_norm``, then a clipped AdamW step (of ``optimizer``, else a
    new one) and the stepped weights."""
    optimizer = optimizer or build_optimizer(model, lc.LR, 0.9, 0.95, lc.ADAM_EPS, 0.1)
    scheduler = build_lr_scheduler(optimizer, 10, 0, "linear", 0.0)
    options = EngineOptions(
        reduction="token_mean",
        horizon=lc.HORIZON,
        max_tokens_per_microbatch=BUDGET,
        logits_chunk_size=16,
        max_norm=max_norm or 0.0,
        router=config,
        router_replay="rollout" if variant == "replay" else "off",
    )
    engine = Engine(
        model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        parallel_dims=dims,
        device=torch.device("cpu"),
        options=options,
    )
    samples = replay_batch(model.args) if variant == "replay" else lc.global_batch(variant)
    share = lc.GLOBAL_BATCH_SIZE // dims.batch_degree
    fb = engine.forward_backward(samples[dims.batch_rank() * share : (dims.batch_rank() + 1) * share])
    grads = {fqn: lc.full(p.grad) for fqn, p in model.named_parameters() if p.requires_grad}
    if max_norm is None:
        optim = {"grad_norm": clip_grad_norm_(list(model.parameters()), 0.0), "lr": lc.LR}
        model.zero_grad(set_to_none=True)
    else:
        optim = engine.optim_step()
    rank = dist.get_rank() if dist.is_initialized() else 0
    metrics = MetricsLogger(dims, torch.device("cpu"), rank, tb_folder=None, num_params=1, flops_per_token_context=1)
    logged = metrics.log(
        1,
        fb=fb,
        optim=optim,
        window_tokens=fb.counts[0],
        window_squared_lens=fb.counts[0],
        window_seconds=1.0,
        data_stats={},
    )
    entry = {"grads": grads, "logged": logged}
    if max_norm is not None:
        entry["params"] = {fqn: lc.full(p) for fqn, p in model.named_parameters()}
    return entry


class DispatchSpy:
    """Counts, on this rank, what the expert-parallel dispatch of every MoE layer sees:
    ``remote_pairs``: tokens whose top-k experts live on k different ranks, none of them this one;
    ``idle_experts``: (dispatch, local expert) pairs that received no token from any rank;
    ``silent``: dispatches in which this rank sent nothing to another rank."""

    def __init__(self, model: torch.nn.Module, ep_mesh):
        self.ep_rank, self.ep = ep_mesh.get_local_rank(), ep_mesh.size()
        self.counts = torch.zeros(3)
        self.handles = []
        for block in model.layers.values():
            if hasattr(block, "moe"):
                self.handles.append(block.moe.router.register_forward_hook(self._routed))
                # Before the dispatch hook (global counts) and after it (this rank's experts).
                self.handles.append(block.moe.experts.register_forward_pre_hook(self._sending, prepend=True))
                self.handles.append(block.moe.experts.register_forward_pre_hook(self._received))

    def _routed(self, router, inputs, logits):
        top = torch.softmax(logits.float(), -1).topk(router.top_k, -1).indices
        owners = top // (logits.shape[-1] // self.ep)
        distinct = (owners[:, :1] != owners[:, 1:]).all(-1) if router.top_k == 2 else torch.zeros_like(owners[:, 0])
        self.counts[0] += ((owners != self.ep_rank).all(-1) & distinct.bool()).sum()

    def _sending(self, experts, inputs):
        per_rank = inputs[1].view(self.ep, -1).sum(1)
        self.counts[2] += int(per_rank.sum() == per_rank[self.ep_rank])

    def _received(self, experts, inputs):
        self.counts[1] += (inputs[1] == 0).sum()

    def totals(self) -> list[int]:
        """The counts summed over every rank (collective)."""
        for handle in self.handles:
            handle.remove()
        dist.all_reduce(self.counts)
        return [int(c) for c in self.counts]


def ep_cases(layout: tuple) -> tuple[str, ...]:
    return EP_CASES[:1] if layout in EP_GLOBAL_ONLY else EP_CASES


def moe_cases(layout: tuple) -> list[str]:
    """The router configs run on a (non-EP) MoE layout: composite layouts skip the per-layer
    sum, which only changes how layers combine (checked on every single-dim layout)."""
    composite = sum(d > 1 for d in layout) > 1
    return [name for name in ROUTER_CONFIGS if not (composite and name == "global_sum")]


def run_expert_parallel_checks(layout: tuple, world_size: int, results: dict) -> None:
    for ep in EP_LAYOUTS.get(layout, ()):
        dims = ParallelDims(*layout, world_size=world_size, ep=ep)
        dims.build_meshes("cpu")
        for name in ep_cases(layout):
            model, optimizer = _ep_model(dims, lc.SEED)
            spy = DispatchSpy(model, dims.mesh("ep")) if ep > 1 else None
            entry = run_case(model, dims, ROUTER_CONFIGS[name], "uneven", max_norm=EP_MAX_NORM, optimizer=optimizer)
            if spy is not None:
                entry["dispatch"] = spy.totals()
            results[case_key(layout, name, ep)] = entry
        if (layout, ep) == EP_REPLAY:
            model, optimizer = _ep_model(dims, lc.SEED)
            entry = run_case(model, dims, REPLAY_CONFIG, "replay", max_norm=EP_MAX_NORM, optimizer=optimizer)
            results[case_key(layout, REPLAY, ep)] = entry


# Checkpoints under expert parallel, on dp 4: DCP resume across ep 1 <-> 2, and HF exports of
# ep 1, 2 and 4 (loaded back into ep 2).
EP_CHECKPOINT_LAYOUT = (1, 4, 1, 1)


def _ep_model(dims: ParallelDims, seed: int):
    model = build_model(
        ep_model_args(), parallel_dims=dims, device=torch.device("cpu"), seed=seed, param_dtype=torch.float32
    )
    set_router_weights(model)
    optimizer = build_optimizer(model, lc.LR, 0.9, 0.95, lc.ADAM_EPS, 0.1)
    return model, optimizer


def _training_state(model, optimizer) -> dict:
    """What a training checkpoint holds, through the checkpoint module's own stateful wrappers."""
    return {"model": _ModelState(model), "optimizer": _OptimizerState(model, optimizer)}


def _snapshot(model, optimizer) -> dict:
    """The whole weights and AdamW moments, gathered."""
    return {
        "params": {fqn: lc.full(p) for fqn, p in model.named_parameters()},
        "optimizer": _optimizer_state(model, optimizer),
    }


def _optimizer_state(model, optimizer) -> dict:
    return {
        f"{fqn}/{name}": lc.full(value)
        for fqn, param in model.named_parameters()
        for name, value in optimizer.state[param].items()
        if name != "step"
    }


class ReadSpy:
    """Records the HF keys (and expert index) whose values this rank reads from the files."""

    def __init__(self):
        self.reads = []
        self.load_block = hf_checkpoint._load_block

    def __enter__(self):
        def load_block(param, handle, key, file, index=None):
            spy = self

            class Handle:
                def get_slice(self, name):
                    tensor_slice = handle.get_slice(name)

                    class Slice:
                        def get_shape(self):
                            return tensor_slice.get_shape()

                        def __getitem__(self, block):
                            spy.reads.append((key, index))
                            return tensor_slice[block]

                    return Slice()

            return spy.load_block(param, Handle(), key, file, index)

        hf_checkpoint._load_block = load_block
        return self

    def __exit__(self, *exc):
        hf_checkpoint._load_block = self.load_block


def run_expert_parallel_checkpoint_checks(layout: tuple, world_size: int, results: dict) -> None:
    if layout != EP_CHECKPOINT_LAYOUT:
        return
    rank = dist.get_rank()
    box = [tempfile.mkdtemp(prefix="ep_checkpoints_") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    folder = box[0]
    dims_of = {}
    for ep in (1, 2, 4):
        dims_of[ep] = ParallelDims(*layout, world_size=world_size, ep=ep)
        dims_of[ep].build_meshes("cpu")
    for ep in (1, 2):
        dims = dims_of[ep]
        model, optimizer = _ep_model(dims, lc.SEED)
        run_case(model, dims, ROUTER_CONFIGS["global_pooled"], "uneven", max_norm=0.0, optimizer=optimizer)
        dcp.save(_training_state(model, optimizer), checkpoint_id=os.path.join(folder, f"dcp_ep{ep}"))
        results[f"moe_ep_checkpoint/trained_ep{ep}"] = _snapshot(model, optimizer)
    for source, target in ((2, 1), (1, 2)):
        model, optimizer = _ep_model(dims_of[target], lc.SEED + 1)
        dcp.load(_training_state(model, optimizer), checkpoint_id=os.path.join(folder, f"dcp_ep{source}"))
        results[f"moe_ep_checkpoint/ep{source}_onto_ep{target}"] = _snapshot(model, optimizer)
    # HF exports of the same (seeded) weights from every ep degree, then ep 1's read by ep 2.
    exports = {}
    for ep in (1, 2, 4):
        model, _ = _ep_model(dims_of[ep], lc.SEED)
        path = os.path.join(folder, f"hf_ep{ep}")
        hf_checkpoint.save_hf_checkpoint(model, path, torch.float32)
        if ep == 1:
            results["moe_ep_checkpoint/hf_source"] = {fqn: lc.full(p) for fqn, p in model.named_parameters()}
        if rank == 0:
            exports[ep] = {}
            for file in sorted(os.listdir(path)):
                if file.endswith(".safetensors"):
                    with safe_open(os.path.join(path, file), framework="pt") as f:
                        exports[ep].update({key: (file, f.get_tensor(key)) for key in f.keys()})
    model, _ = _ep_model(dims_of[2], lc.SEED + 1)
    with ReadSpy() as spy:
        hf_checkpoint.load_hf_weights(model, os.path.join(folder, "hf_ep1"))
    ep_mesh = dims_of[2].mesh("ep")
    reads = [None] * world_size
    dist.all_gather_object(reads, (ep_mesh.get_local_rank(), spy.reads))
    loaded = {fqn: lc.full(p) for fqn, p in model.named_parameters()}
    if rank == 0:
        results["moe_ep_checkpoint/hf"] = {"exports": exports, "loaded_into_ep2": loaded, "reads": reads}
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder)
