"""Dedicated rollout ranks: the weights go out by broadcast, the step's rollouts come back.

With ``parallelism.rollout_ranks = N`` the last N ranks of the launch only generate. The
messages, all on torch.distributed (gloo on CPU, NCCL for the weights on GPU):

- start (training rank 0 -> every rollout rank, point to point): the version of the weights
  the run starts from, the first step to generate and the prompt stream's position there;
- weights (training rank 0 -> rollout ranks, a broadcast on their own group): a header
  (``weights_header``: version, full or trainable only, tensor and element counts, a
  fingerprint of the names and shapes) and the parameters flattened in name order into buckets
  of at most ``BUCKET_BYTES``, in the generator's dtype: a bounded number of collectives, each
  tensor once. The first weights a rollout rank gets are every parameter of the trained model,
  later ones only those that train (with LoRA: the adapters, merged on the rollout rank; see
  ``rl.generator``). Version v is the policy after RL step v (0: the one RL starts from);
- a step's rollouts (the first rollout rank -> every training rank, point to point): a
  pickled ``StepBatch``;
- finished (training rank 0 -> every rollout rank): training and its last checkpoint are done.

The schedule is a function of (step, max_staleness K, start) only: step t is generated with
version ``generation_version(t)`` = max(start, t - 1 - K), so the rollouts of a step, their
random numbers and their version never depend on N, the training layout or timing; K = 0
gives the colocated run's numbers. The rollout ranks generate up to K steps ahead while the
trainers train. Every wait has a timeout (``comm.rollout_timeout_seconds``) that stops the run
with a message naming the side that went silent; a rank that dies stops the launch through
torchrun.

A GPU inference engine would plug in here: it receives the weights message and answers with
token ids, their behaviour log-probs and the version.
"""

import datetime
import hashlib
import logging
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_rl.rl.generator import full_tensor, sync_names
from torchtitan_rl.rl.rollouts import ScoredGroup

logger = logging.getLogger(__name__)

BUCKET_BYTES = 1 << 30  # weights per broadcast, at most (one parameter larger than this goes alone)
FINISHED = "finished"  # training rank 0's last message to the rollout ranks


def generation_version(step: int, start: int, max_staleness: int) -> int:
    """The version of the weights that generates ``step``'s rollouts in a run that started (or
    resumed) with version ``start``."""
    return max(start, step - 1 - max_staleness)


def is_version_sent(version: int, num_steps: int, max_staleness: int) -> bool:
    """Whether the trainers broadcast the weights after step ``version``: some step up to
    ``num_steps`` is generated with them."""
    return version + 1 + max_staleness <= num_steps


def staleness(step: int, version: int) -> int:
    """How many updates the policy trained at ``step`` is ahead of weights ``version``."""
    return step - 1 - version


@dataclass
class StepBatch:
    """One step's rollouts, as the rollout ranks send them to every training rank."""

    step: int
    version: int
    generated: list[ScoredGroup]  # every group generated for the step, trained or not
    kept: list[ScoredGroup]  # the groups to train, every slot of the step
    values: dict[str, float]  # rl/dynamic_sampling/* of the step
    stream_state: dict[str, Any]  # the prompt stream's position after the step's prompts
    num_generated: int  # tokens generated
    generate_seconds: float


@dataclass
class RolloutTopology:
    """Who is who in a launch with rollout ranks, and their groups."""

    num_trainers: int  # the first ranks of the launch
    rollout_ranks: list[int]
    weight_group: dist.ProcessGroup  # training rank 0 and the rollout ranks
    rollout_mesh: DeviceMesh | None  # the rollout ranks, who split a step's generation (None: one)
    timeout_seconds: int

    @property
    def leader(self) -> int:
        """The rollout rank that sends each step's rollouts to the trainers."""
        return self.rollout_ranks[0]

    def wait(self, work, what: str) -> None:
        """Wait for ``work``; past the timeout, stop with ``what`` went silent."""
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_seconds))
        except RuntimeError as err:
            raise RuntimeError(
                f"{what} within comm.rollout_timeout_seconds={self.timeout_seconds} ({err}); stopping the run"
            ) from None


def build_rollout_topology(num_trainers: int, num_rollout_ranks: int, device_type: str, timeout_seconds: int):
    """The groups of a launch with rollout ranks. Collective: every rank of the launch calls it,
    after the training meshes are built."""
    ranks = list(range(num_trainers, num_trainers + num_rollout_ranks))
    weight_group = dist.new_group([0, *ranks], timeout=datetime.timedelta(seconds=timeout_seconds))
    mesh = None
    if num_rollout_ranks > 1:
        mesh = DeviceMesh(device_type, torch.tensor(ranks), mesh_dim_names=("rollout",))
    return RolloutTopology(num_trainers, ranks, weight_group, mesh, timeout_seconds)


# ------------------------------------------------------------------ objects, point to point


@dataclass
class Outbox:
    """Sends in flight: their buffers must live until the receiver has them."""

    pending: list[tuple[Any, torch.Tensor]] = field(default_factory=list)

    def send(self, obj: Any, dst: int) -> None:
        """Start sending ``obj`` (pickled) to rank ``dst``."""
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        self.pending += [(dist.isend(size, dst), size), (dist.isend(payload, dst), payload)]
        self.pending = [(work, buffer) for work, buffer in self.pending if not work.is_completed()]

    def flush(self, topology: RolloutTopology, what: str) -> None:
        for work, _ in self.pending:
            topology.wait(work, what)
        self.pending = []


def receive_object(src: int, topology: RolloutTopology, what: str) -> Any:
    """The next object rank ``src`` sent to this rank."""
    size = torch.zeros(1, dtype=torch.int64)
    topology.wait(dist.irecv(size, src), what)
    payload = torch.empty(int(size), dtype=torch.uint8)
    topology.wait(dist.irecv(payload, src), what)
    return pickle.loads(payload.numpy().tobytes())


# ------------------------------------------------------------------ weights


def weight_buckets(numels: list[int], itemsize: int, limit: int) -> list[list[int]]:
    """Consecutive parameter indices per broadcast, filled in order up to ``limit`` bytes each
    (a parameter larger than that alone)."""
    buckets: list[list[int]] = [[]]
    size = 0
    for index, numel in enumerate(numels):
        if buckets[-1] and size + numel * itemsize > limit:
            buckets.append([])
            size = 0
        buckets[-1].append(index)
        size += numel * itemsize
    return buckets


def weights_header(version: int, full: bool, names: list[str], shapes: list) -> list[int]:
    """What a weights message carries: [version, full (1) or trainable only (0), tensors,
    elements, fingerprint]; the fingerprint (63 bits of a SHA-256 of the names and shapes) makes
    two sides that would cut the same number of elements differently disagree too."""
    described = ";".join(f"{name}:{tuple(shape)}" for name, shape in zip(names, shapes))
    fingerprint = int.from_bytes(hashlib.sha256(described.encode()).digest()[:8], "little") & (2**63 - 1)
    return [version, int(full), len(names), sum(torch.Size(shape).numel() for shape in shapes), fingerprint]


def check_weights_header(got: list[int], expected: list[int]) -> None:
    """A clear error when the weights that arrived are not the ones this rollout rank expects."""
    if got == expected:
        return
    if got[0] != expected[0]:
        raise RuntimeError(f"weights out of order: expected version {expected[0]}, got version {got[0]}")

    def describe(header: list[int]) -> str:
        kind = "every parameter" if header[1] else "the trainable parameters"
        return f"{kind}: {header[2]} tensors, {header[3]} elements, names and shapes {header[4]:#x}"

    raise RuntimeError(
        f"weights of version {got[0]}: training rank 0 sent {describe(got)}; this rollout rank expects "
        f"{describe(expected)}. Both sides build the model from the same [model] and [lora] settings; "
        "they differ here"
    )


class WeightSender:
    """The training ranks' side of the weight broadcast. Every training rank calls ``send`` (a
    sharded parameter is gathered with ``full_tensor()``); rank 0 broadcasts without waiting
    and keeps the buffers until the next send, which first waits for the previous one.

    The first send carries every parameter (the rollout ranks start without weights, also in a
    resumed run), later ones only those that train (``sync_names``)."""

    def __init__(self, topology: RolloutTopology, dtype: torch.dtype, device: torch.device):
        self.topology, self.dtype, self.device = topology, dtype, device
        self.is_sender = dist.get_rank() == 0
        self._pending: list[tuple[Any, torch.Tensor]] = []
        self._sent_full = False

    @torch.no_grad()
    def send(self, model: nn.Module, version: int) -> int:
        """Broadcast ``model``'s weights as ``version``; returns the bytes sent."""
        self.wait()
        params = dict(model.named_parameters())
        full = not self._sent_full
        names = sync_names({name: p.requires_grad for name, p in params.items()}, full)
        shapes = [params[name].shape for name in names]  # global shapes, DTensor or not
        numels = [shape.numel() for shape in shapes]
        header = torch.tensor(weights_header(version, full, names, shapes), dtype=torch.int64)
        group = self.topology.weight_group
        if self.is_sender:
            self._pending = [(dist.broadcast(header, src=0, group=group, async_op=True), header)]
        for bucket in weight_buckets(numels, self.dtype.itemsize, BUCKET_BYTES):
            # One bucket's full tensors at a time: every rank joins each gather, rank 0 keeps them.
            parts = [full_tensor(params[names[i]]) for i in bucket]
            if self.is_sender:
                flat = torch.cat([p.to(self.dtype).reshape(-1) for p in parts]).to(self.device)
                self._pending.append((dist.broadcast(flat, src=0, group=group, async_op=True), flat))
        self._sent_full = True
        if not self.is_sender:
            return 0
        return sum(numels) * self.dtype.itemsize

    def wait(self) -> None:
        """Until the rollout ranks have the last weights sent."""
        for work, _ in self._pending:
            self.topology.wait(work, f"rollout ranks {self.topology.rollout_ranks} took no weights")
        self._pending = []


class WeightReceiver:
    """The rollout ranks' side: weights of the next version into ``generator``'s replica, the
    tensors its ``next_sync`` names."""

    def __init__(self, topology: RolloutTopology, generator, device: torch.device):
        self.topology, self.generator, self.device = topology, generator, device
        self.dtype = generator.model.output.weight.dtype

    def receive(self, version: int) -> int:
        """The weights of ``version`` into the replica; the bytes received."""
        group = self.topology.weight_group
        expected = self.generator.next_sync()
        names = [name for name, _ in expected]
        shapes = [shape for _, shape in expected]
        header = torch.zeros(5, dtype=torch.int64)
        what = f"training rank 0 sent no weights of version {version}"
        self.topology.wait(dist.broadcast(header, src=0, group=group, async_op=True), what)
        check_weights_header(header.tolist(), weights_header(version, not self.generator.is_loaded, names, shapes))
        numels = [shape.numel() for shape in shapes]
        tensors = {}
        for bucket in weight_buckets(numels, self.dtype.itemsize, BUCKET_BYTES):
            flat = torch.empty(sum(numels[i] for i in bucket), dtype=self.dtype, device=self.device)
            self.topology.wait(dist.broadcast(flat, src=0, group=group, async_op=True), what)
            for i, part in zip(bucket, flat.split([numels[i] for i in bucket])):
                tensors[names[i]] = part.view(shapes[i])
        return self.generator.load_weights(tensors, version)


# ------------------------------------------------------------------ the training ranks' side


def usable_in_flight(in_flight: dict[int, StepBatch], version: int, max_staleness: int) -> dict[int, StepBatch]:
    """The saved batches a run resuming after step ``version`` trains: those of the steps
    version+1, version+2, ... up to the first one missing or lagging more than
    ``max_staleness``. The steps after that are generated again (the prompt stream goes on
    from the last batch kept), so a later batch is dropped too."""
    kept = {}
    step = version + 1
    while step in in_flight and staleness(step, in_flight[step].version) <= max_staleness:
        kept[step] = in_flight[step]
        step += 1
    return kept


class RolloutClient:
    """The training ranks' side of the rollout ranks: start them, send the weights after each
    step that some later step is generated with, and take each step's ``StepBatch``.

    Checkpointable (``Stateful``): a checkpoint after step s holds the batches of steps
    s+1..s+K, which were generated with weights older than the checkpoint's (the trainers wait
    for them before saving); the rollout ranks of a resumed run generate from step s+K+1 on
    with the checkpoint's weights, as the uninterrupted run does. Saved batches that lag more
    than the resumed run's K are dropped (and counted): those steps are generated again.
    """

    def __init__(self, topology: RolloutTopology, sender: WeightSender, num_steps: int, max_staleness: int):
        self.topology, self.sender = topology, sender
        self.num_steps, self.max_staleness = num_steps, max_staleness
        self.in_flight: dict[int, StepBatch] = {}
        self._num_dropped = 0
        self._outbox = Outbox()
        self._next_received = 0  # the step of the next batch the rollout ranks send

    def start(self, model: nn.Module, version: int, stream_state: dict[str, Any]) -> int:
        """Tell the rollout ranks where the run starts (after step ``version``, with the prompt
        stream at ``stream_state``) and send them the weights (every parameter: the rollout
        ranks start without any). Every training rank calls it; the bytes sent (0 on ranks that
        only gather, and when no step is left to generate)."""
        kept = usable_in_flight(self.in_flight, version, self.max_staleness)
        self._num_dropped = len(self.in_flight) - len(kept)
        self.in_flight = kept
        step = self._next_received = version + 1 + len(kept)
        start = {
            "version": version,
            "first_step": step,
            "stream": kept[step - 1].stream_state if kept else stream_state,
        }
        if dist.get_rank() == 0:
            for rank in self.topology.rollout_ranks:
                self._outbox.send(start, rank)
        return self.sender.send(model, version) if step <= self.num_steps else 0

    def send_weights(self, model: nn.Module, version: int) -> int:
        """Broadcast the policy after step ``version``; the bytes sent (0 on ranks that only
        gather)."""
        return self.sender.send(model, version)

    def batch(self, step: int) -> tuple[StepBatch, int]:
        """The rollouts of ``step`` and how many stale batches were dropped since the last call."""
        self.receive_until(step)
        batch = self.in_flight.pop(step)
        assert staleness(step, batch.version) <= self.max_staleness, (step, batch.version)
        num_dropped, self._num_dropped = self._num_dropped, 0
        return batch, num_dropped

    def receive_until(self, step: int) -> None:
        """Receive the batches of the steps up to ``step`` (at most the last step)."""
        while self._next_received <= min(step, self.num_steps):
            what = f"rollout rank {self.topology.leader} sent no rollouts of step {self._next_received}"
            batch = receive_object(self.topology.leader, self.topology, what)
            assert batch.step == self._next_received, (batch.step, self._next_received)
            self.in_flight[batch.step] = batch
            self._next_received += 1

    def finish(self) -> None:
        """Tell the rollout ranks that training is over (the last checkpoint written) and wait
        until they have everything sent to them: until then they wait with the rollout
        timeout, not at the launch's final barrier, whose timeout is the init one."""
        if dist.get_rank() == 0:
            for rank in self.topology.rollout_ranks:
                self._outbox.send(FINISHED, rank)
        self.sender.wait()
        self._outbox.flush(self.topology, f"rollout ranks {self.topology.rollout_ranks} took no message")

    def state_dict(self) -> dict[str, Any]:
        return {"in_flight": pickle.dumps(sorted(self.in_flight.values(), key=lambda b: b.step))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.in_flight = {batch.step: batch for batch in pickle.loads(state_dict["in_flight"])}
