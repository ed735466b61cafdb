"""Rollout ranks inside the shared 4-rank launch (``layout_worker.run_all_layouts``).

Two training ranks (FSDP, or TP) and two rollout ranks: the trainers broadcast the weights
twice (version 0, then every parameter doubled as version 1) in buckets small enough that
there are several; the rollout ranks load each version into their replica, split a step's
generation between them over their ``rollout`` mesh with version 0 loaded, and the first one
sends each trainer its share of the scored step (``send_step_batch``), whose bytes the trainer
counts; the trainers then gather their shares into the whole step a checkpoint holds. A wider
model (many buckets) measures the bytes each trainer holds while it sends the weights
(``HeldBytesMode``). With LoRA (FSDP trainers) the first broadcast carries every
parameter and the second, after the adapters moved, the adapters alone, which the rollout ranks
merge. A MoE model under expert parallel (its experts split over the two trainers) broadcasts
whole experts. Every rank records what it holds for test_rollout_ranks.py.
"""

import dataclasses
import pickle
import threading
import weakref

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import layout_cases as lc
import moe_cases
from generator_cases import prompts
from rl_cases import NUM_MINIBATCHES, NUM_SAMPLES, PARAMS, SEED, STEP, gather_to_all, reward, summary
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.models.lora import LoRASettings
from torchtitan_rl.recipes.base import build_model
from torchtitan_rl.rl import rollout_ranks
from torchtitan_rl.rl.generator import TorchGenerator
from torchtitan_rl.rl.rollout_ranks import (
    Outbox,
    RolloutClient,
    StepBatch,
    WeightReceiver,
    WeightSender,
    receive_payload,
    send_step_batch,
    trainer_slots,
)
from torchtitan_rl.rl.rollout_topology import RolloutTopology, build_rollout_topology
from torchtitan_rl.rl.rollouts import exchange_among_peers, generate_share, rank_prompt_slots, score_groups

# (dp_replicate, dp_shard, cp, tp) of the two training ranks.
ROLLOUT_LAYOUTS = ((1, 2, 1, 1), (1, 1, 1, 2))
NUM_TRAINERS = NUM_ROLLOUT_RANKS = 2
BUCKET_BYTES = 16 * 1024  # the test model's 100 KiB of weights take several buckets
LORA = LoRASettings(rank=2, alpha=4.0)
LORA_LAYOUT = (1, 2, 1, 1)
ADAPTER_STEP = 0.125  # what the LoRA trainers add to every adapter between the two broadcasts
# The step batch the rollout ranks send, but for its groups (the test pickles it to bound the bytes).
BATCH_VALUES, BATCH_STREAM = {"rl/reward_mean": 0.5, "rl/staleness_max": 0.0}, {"epoch": 0, "position": 8}
# Weights wide and deep enough for several 64 KiB buckets of parameters of at most 8 KiB each.
MEMORY_ARGS = dataclasses.replace(lc.model_args(False), vocab_size=16, n_layers=8)
MEMORY_BUCKET_BYTES = 64 * 1024


def step_batch(groups: list) -> StepBatch:
    return StepBatch(STEP, 0, groups, BATCH_VALUES, BATCH_STREAM, 0, 0.0)


def layout_key(layout: tuple) -> str:
    return "rollout_ranks/rep{}_shard{}_cp{}_tp{}".format(*layout)


_topologies: list[RolloutTopology] = []  # those of the cases run, closed at the end


def rollout_topology() -> RolloutTopology:
    topology = build_rollout_topology(NUM_TRAINERS, NUM_ROLLOUT_RANKS, "cpu", 60, 120)
    _topologies.append(topology)
    return topology


def run_rollout_rank_checks(world_size: int, results: dict) -> None:
    if world_size != NUM_TRAINERS + NUM_ROLLOUT_RANKS:
        return
    saved = rollout_ranks.BUCKET_BYTES
    rollout_ranks.BUCKET_BYTES = BUCKET_BYTES
    try:
        for layout in ROLLOUT_LAYOUTS:
            run_layout(layout, results)
        run_lora(results)
        run_expert_parallel(results)
        rollout_ranks.BUCKET_BYTES = MEMORY_BUCKET_BYTES
        run_weight_memory(results)
    finally:
        rollout_ranks.BUCKET_BYTES = saved
        for topology in _topologies:
            topology.close()
        _topologies.clear()  # their groups go with the launch's (shutdown_distributed)


def run_layout(layout: tuple, results: dict) -> None:
    dims = ParallelDims(*layout, world_size=NUM_TRAINERS, num_rollout_ranks=NUM_ROLLOUT_RANKS)
    dims.build_meshes("cpu")
    topology = rollout_topology()
    args = lc.model_args(False)
    cpu = torch.device("cpu")
    if dims.is_trainer:
        model = build_model(args, parallel_dims=dims, device=cpu, seed=lc.SEED, param_dtype=torch.float32)
        sender = WeightSender(topology, torch.float32, cpu)
        sent = [sender.send(model, 0)]
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(2)
        sent.append(sender.send(model, 1))
        payload = receive_payload(topology.leader, topology, "no rollouts")
        share = pickle.loads(payload.numpy().tobytes())
        sender.wait()
        # What a checkpoint would hold: the shares of the trainers, gathered into the whole step.
        own = rank_prompt_slots(len(prompts()), NUM_MINIBATCHES, dims.batch_rank(), dims.batch_degree)
        slots = [s for minibatch in own for s in minibatch]
        client = RolloutClient(topology, sender, 1, 0, slots, dims.mesh("batch"))
        client.in_flight = {share.step: share}
        client.prepare_checkpoint()
        mine = {
            "role": "trainer",
            "bytes": sent,
            "batch_rank": (dims.batch_rank(), dims.batch_rank_of(dist.get_rank())),
            "payload": payload.numpy().tobytes(),
            "groups": [(g.slot, summary(g.rollouts), g.advantages) for g in share.kept],
            "checkpoint": client.state_dict()["in_flight"],
        }
    else:
        generator = TorchGenerator(args, cpu, max_prompts_per_batch=1)
        receiver = WeightReceiver(topology, generator, cpu)
        receiver.receive(0)
        weights = [{name: p.clone() for name, p in generator.model.named_parameters()}]
        step_prompts = prompts()
        mesh = topology.rollout_mesh
        local = generate_share(
            generator, step_prompts, list(range(len(step_prompts))), NUM_SAMPLES, PARAMS, SEED, STEP, mesh
        )
        rollouts = exchange_among_peers(local, mesh)
        if dist.get_rank() == topology.leader:
            groups = score_groups(rollouts, [reward(r) for r in rollouts], NUM_SAMPLES, "grpo", 1e-6)
            outbox = Outbox(topology)
            send_step_batch(outbox, step_batch(groups), trainer_slots(dims, len(step_prompts), NUM_MINIBATCHES))
        receiver.receive(1)  # the trainers send it before they take the rollouts
        if dist.get_rank() == topology.leader:
            outbox.flush("trainers took no rollouts")
        weights.append({name: p.clone() for name, p in generator.model.named_parameters()})
        mine = {
            "role": "rollout",
            "weights": weights,
            "version": generator.version,
            "versions": sorted({r.version for r in rollouts}),
            "local": summary(local),
            "rollouts": summary(rollouts),
        }
    results[layout_key(layout)] = gather_to_all(mine)


def run_lora(results: dict) -> None:
    dims = ParallelDims(*LORA_LAYOUT, world_size=NUM_TRAINERS, num_rollout_ranks=NUM_ROLLOUT_RANKS)
    dims.build_meshes("cpu")
    topology = rollout_topology()
    args = lc.model_args(False)
    cpu = torch.device("cpu")
    if dims.is_trainer:
        model = build_model(args, parallel_dims=dims, device=cpu, seed=lc.SEED, param_dtype=torch.float32, lora=LORA)
        sender = WeightSender(topology, torch.float32, cpu)
        sent = [sender.send(model, 0)]
        with torch.no_grad():
            for param in model.parameters():
                if param.requires_grad:
                    param.add_(ADAPTER_STEP)
        sent.append(sender.send(model, 1))
        sender.wait()
        mine = {"role": "trainer", "bytes": sent}
    else:
        generator = TorchGenerator(args, cpu, lora=LORA)
        receiver = WeightReceiver(topology, generator, cpu)
        received = [receiver.receive(0), receiver.receive(1)]
        weights = {name: p.clone() for name, p in generator.model.named_parameters()}
        mine = {"role": "rollout", "bytes": received, "weights": weights, "version": generator.version}
    results["rollout_ranks/lora"] = gather_to_all(mine)


def run_expert_parallel(results: dict) -> None:
    """Trainers on dp 2 with ep 2 (each holds half the experts); one broadcast."""
    dims = ParallelDims(1, 2, 1, 1, world_size=NUM_TRAINERS, num_rollout_ranks=NUM_ROLLOUT_RANKS, ep=2)
    dims.build_meshes("cpu")
    topology = rollout_topology()
    args = moe_cases.ep_model_args()
    cpu = torch.device("cpu")
    if dims.is_trainer:
        model = build_model(args, parallel_dims=dims, device=cpu, seed=lc.SEED, param_dtype=torch.float32)
        local = model.layers["1"].moe.experts.w1.to_local()
        sender = WeightSender(topology, torch.float32, cpu)
        mine = {"role": "trainer", "ep_size": dims.mesh("ep").size(), "local_experts": local.shape[0]}
        mine["bytes"] = sender.send(model, 0)
        sender.wait()
    else:
        assert dims.mesh("ep") is None
        generator = TorchGenerator(args, cpu, max_prompts_per_batch=1)
        WeightReceiver(topology, generator, cpu).receive(0)
        weights = {name: p.clone() for name, p in generator.model.named_parameters()}
        mine = {"role": "rollout", "weights": weights}
    results["rollout_ranks/expert_parallel"] = gather_to_all(mine)


class HeldBytesMode(TorchDispatchMode):
    """The bytes of the storages that ops create while it is active, each held until the last
    tensor an op returned on it has lost its last Python reference, whichever thread drops it (a
    weakref callback: deterministic, where allocator events miss the frees a collective's worker
    thread makes); ``peak``: the most held at once. An op's result that aliases a storage from
    before (a view of a parameter) holds nothing."""

    def __init__(self):
        super().__init__()
        self.held = self.peak = 0
        self._storages: dict[int, list[int]] = {}  # data pointer -> [bytes, tensors alive]
        self._lock = threading.RLock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if type(t) is torch.Tensor}
        for t in tree_leaves(out):
            if type(t) is not torch.Tensor:  # a DTensor: its local tensors come from ops seen here
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            with self._lock:
                if key not in self._storages:
                    if key in inputs or not storage.nbytes():
                        continue
                    self._storages[key] = [storage.nbytes(), 0]
                    self.held += storage.nbytes()
                    self.peak = max(self.peak, self.held)
                self._storages[key][1] += 1
            weakref.finalize(t, self._release, key)
        return out

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._storages[key]
            entry[1] -= 1
            if not entry[1]:
                self.held -= entry[0]
                del self._storages[key]


def run_weight_memory(results: dict) -> None:
    """FSDP trainers send ``MEMORY_ARGS``'s weights twice (the second time doubled); each records
    the most bytes it held during the second send (the first send's buffers, freed in it, do not
    count); the rollout ranks record what they loaded."""
    dims = ParallelDims(1, 2, 1, 1, world_size=NUM_TRAINERS, num_rollout_ranks=NUM_ROLLOUT_RANKS)
    dims.build_meshes("cpu")
    topology = rollout_topology()
    cpu = torch.device("cpu")
    if dims.is_trainer:
        model = build_model(MEMORY_ARGS, parallel_dims=dims, device=cpu, seed=lc.SEED, param_dtype=torch.float32)
        sender = WeightSender(topology, torch.float32, cpu)
        sender.send(model, 0)
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(2)
        with HeldBytesMode() as mode:
            sender.send(model, 1)
        sender.wait()
        mine = {"role": "trainer", "peak_bytes": mode.peak}
    else:
        generator = TorchGenerator(MEMORY_ARGS, cpu)
        receiver = WeightReceiver(topology, generator, cpu)
        receiver.receive(0)
        with HeldBytesMode() as mode:
            receiver.receive(1)
        weights = {name: p.clone() for name, p in generator.model.named_parameters()}
        mine = {"role": "rollout", "weights": weights, "peak_bytes": mode.peak}
    results["rollout_ranks/weight_memory"] = gather_to_all(mine)
