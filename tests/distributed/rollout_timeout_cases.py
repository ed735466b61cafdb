"""The rollout-rank protocol's waits against a silent-peer timeout of ``SILENT_SECONDS``, inside
the shared 4-rank launch (``layout_worker.run_all_layouts``): two training ranks (FSDP) and two
rollout ranks, with the recipe's parts (``RolloutClient``, the weight sender and receiver, the
outbox); the work between the waits is a sleep, the rollouts are empty.

- The trainers' warm-up (``WARMUP_SECONDS``, longer than the timeout) comes before the start
  message, which the rollout ranks wait for.
- Step 1: the trainers take its rollouts, then save a checkpoint (``SAVE_SECONDS``) before they
  send the weights of version 1, which the rollout ranks wait for.
- Step 2: the second rollout rank stops (no heartbeat, ``Liveness.paused``) before the rollout
  mesh's collective, in which the first one (the leader, who sends the trainers the rollouts)
  waits for it. The trainers, waiting for the leader's rollouts, name the stopped rank; once
  both have, it goes on, and the run ends as usual.

Every rank records what it waited and saw for test_rollout_ranks.py.
"""

import time

import torch
import torch.distributed as dist

import layout_cases as lc
from rl_cases import gather_to_all
from torchtitan_rl.distributed.liveness import PeerSilentError
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.recipes.base import build_model
from torchtitan_rl.rl.generator import TorchGenerator
from torchtitan_rl.rl.rollout_ranks import (
    Outbox,
    RolloutClient,
    StepBatch,
    WeightReceiver,
    WeightSender,
    receive_finished,
    receive_object,
)
from torchtitan_rl.rl.rollout_topology import RolloutTopology, build_rollout_topology

NUM_TRAINERS = NUM_ROLLOUT_RANKS = 2
SILENT_SECONDS = 2
WARMUP_SECONDS = SAVE_SECONDS = 2 * SILENT_SECONDS
NUM_STEPS = 2
CAUGHT, RESUMED = "test/caught", "test/resumed"  # counters in the launch's store


def run_rollout_timeout_checks(world_size: int, results: dict) -> None:
    if world_size != NUM_TRAINERS + NUM_ROLLOUT_RANKS:
        return
    dims = ParallelDims(1, 2, 1, 1, world_size=NUM_TRAINERS, num_rollout_ranks=NUM_ROLLOUT_RANKS)
    dims.build_meshes("cpu")
    topology = build_rollout_topology(NUM_TRAINERS, NUM_ROLLOUT_RANKS, "cpu", SILENT_SECONDS, 120)
    try:
        mine = run_trainer(dims, topology) if dims.is_trainer else run_rollout_rank(topology)
    finally:
        topology.close()
    results["rollout_timeouts"] = gather_to_all(mine)


def empty_batch(step: int, version: int) -> StepBatch:
    return StepBatch(
        step=step, version=version, kept=[], values={}, stream_state={}, num_generated=0, generate_seconds=0.0
    )


def wait_for_count(topology: RolloutTopology, key: str, count: int) -> None:
    while topology.liveness.add(key, 0) < count:
        time.sleep(0.01)


def run_trainer(dims: ParallelDims, topology: RolloutTopology) -> dict:
    cpu = torch.device("cpu")
    model = build_model(lc.model_args(False), parallel_dims=dims, device=cpu, seed=lc.SEED, param_dtype=torch.float32)
    client = RolloutClient(topology, WeightSender(topology, torch.float32, cpu), NUM_STEPS, 0, [], dims.mesh("batch"))
    time.sleep(WARMUP_SECONDS)  # the SFT warm-up
    client.start(model, 0, {})
    steps = [client.batch(1)[0].step]
    time.sleep(SAVE_SECONDS)  # the checkpoint after step 1
    client.send_weights(model, 1)
    silent = None
    start = time.monotonic()
    try:
        client.batch(2)
    except PeerSilentError as err:
        silent = (str(err), time.monotonic() - start)
    topology.liveness.add(CAUGHT, 1)
    wait_for_count(topology, RESUMED, 1)
    steps.append(client.batch(2)[0].step)
    client.finish()
    return {"role": "trainer", "silent": silent, "steps": steps}


def run_rollout_rank(topology: RolloutTopology) -> dict:
    cpu = torch.device("cpu")
    is_leader = dist.get_rank() == topology.leader
    receiver = WeightReceiver(topology, TorchGenerator(lc.model_args(False), cpu, max_prompts_per_batch=1), cpu)
    outbox = Outbox(topology)
    trainers = range(NUM_TRAINERS)
    start = time.monotonic()
    receive_object(0, topology, "waiting for the start message")
    waited = {"start": time.monotonic() - start}
    receiver.receive(0)
    if is_leader:
        outbox.send(empty_batch(1, 0), *trainers)
    start = time.monotonic()
    receiver.receive(1)
    waited["weights"] = time.monotonic() - start
    if not is_leader:
        with topology.liveness.paused():  # stopped until both trainers have named this rank
            wait_for_count(topology, CAUGHT, NUM_TRAINERS)
        topology.liveness.add(RESUMED, 1)
    # Step 2's generation, split over the rollout mesh: the leader waits here for the stopped rank.
    dist.barrier(group=topology.rollout_mesh.get_group())
    if is_leader:
        outbox.send(empty_batch(2, 1), *trainers)
    outbox.flush("waiting for the trainers to take the rollouts")
    receive_finished(topology)
    return {"role": "rollout", "waited": waited}
