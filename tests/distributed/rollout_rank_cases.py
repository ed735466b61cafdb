"""Rollout ranks inside the shared 4-rank launch (``layout_worker.run_all_layouts``).

Two training ranks (FSDP, or TP) and two rollout ranks: the trainers broadcast the weights
twice (version 0, then every parameter doubled as version 1) in buckets small enough that
there are several; the rollout ranks load each version into their replica, split a step's
generation between them over their ``rollout`` mesh with version 0 loaded, and the first one
sends the rollouts to both trainers. With LoRA (FSDP trainers) the first broadcast carries every
parameter and the second, after the adapters moved, the adapters alone, which the rollout ranks
merge. A MoE model under expert parallel (its experts split over the two trainers) broadcasts
whole experts. Every rank records what it holds for test_rollout_ranks.py.
"""

import torch
import torch.distributed as dist

import layout_cases as lc
import moe_cases
from generator_cases import prompts
from rl_cases import NUM_SAMPLES, PARAMS, SEED, STEP, gather_to_all, summary
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.models.lora import LoRASettings
from torchtitan_rl.recipes.base import build_model
from torchtitan_rl.rl import rollout_ranks
from torchtitan_rl.rl.generator import TorchGenerator
from torchtitan_rl.rl.rollout_ranks import (
    Outbox,
    WeightReceiver,
    WeightSender,
    build_rollout_topology,
    receive_object,
)
from torchtitan_rl.rl.rollouts import exchange_among_peers, generate_share

# (dp_replicate, dp_shard, cp, tp) of the two training ranks.
ROLLOUT_LAYOUTS = ((1, 2, 1, 1), (1, 1, 1, 2))
NUM_TRAINERS = NUM_ROLLOUT_RANKS = 2
BUCKET_BYTES = 16 * 1024  # the test model's 100 KiB of weights take several buckets
LORA = LoRASettings(rank=2, alpha=4.0)
LORA_LAYOUT = (1, 2, 1, 1)
ADAPTER_STEP = 0.125  # what the LoRA trainers add to every adapter between the two broadcasts


def layout_key(layout: tuple) -> str:
    return "rollout_ranks/rep{}_shard{}_cp{}_tp{}".format(*layout)


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
    finally:
        rollout_ranks.BUCKET_BYTES = saved


def run_layout(layout: tuple, results: dict) -> None:
    dims = ParallelDims(*layout, world_size=NUM_TRAINERS, num_rollout_ranks=NUM_ROLLOUT_RANKS)
    dims.build_meshes("cpu")
    topology = build_rollout_topology(NUM_TRAINERS, NUM_ROLLOUT_RANKS, "cpu", 120)
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
        rollouts = receive_object(topology.leader, topology, "no rollouts")
        sender.wait()
        mine = {"role": "trainer", "bytes": sent, "rollouts": rollouts}
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
            outbox = Outbox()
            for trainer in range(NUM_TRAINERS):
                outbox.send(summary(rollouts), trainer)
            outbox.flush(topology, "trainers took no rollouts")
        receiver.receive(1)
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
    topology = build_rollout_topology(NUM_TRAINERS, NUM_ROLLOUT_RANKS, "cpu", 120)
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
    topology = build_rollout_topology(NUM_TRAINERS, NUM_ROLLOUT_RANKS, "cpu", 120)
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
