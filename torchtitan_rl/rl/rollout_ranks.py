"""Dedicated rollout ranks: the weights go out by broadcast, the step's rollouts come back.

With ``parallelism.rollout_ranks = N`` the last N ranks of the launch only generate. The
messages, all on torch.distributed (gloo on CPU, NCCL for the weights on GPU):

- start (training rank 0 -> every rollout rank, point to point): the version of the weights
  the run starts from, the first step to generate and the prompt stream's position there;
- weights (training rank 0 -> rollout ranks, a broadcast on their own group): a header
  (``weights_header``: version, full or trainable only, tensor and element counts, a
  fingerprint of the names and shapes) and the parameters flattened in name order into buckets
  of at most ``BUCKET_BYTES``, in the generator's dtype: a bounded number of collectives, each
  tensor once, at most two buckets in flight (``WeightSender``). The first weights a rollout rank gets are every parameter of the trained model,
  later ones only those that train (with LoRA: the adapters, merged on the rollout rank; see
  ``rl.generator``). Version v is the policy after RL step v (0: the one RL starts from);
- a step's rollouts (the first rollout rank -> every training rank, point to point): a
  pickled ``StepBatch`` holding the groups of that rank's prompt slots alone and the step's
  metrics, pickled once per distinct share (CP / TP peers get the same bytes;
  ``send_step_batch``);
- finished (training rank 0 -> every rollout rank): training and its last checkpoint are done.

The schedule is a function of (step, max_staleness K, start) only: step t is generated with
version ``generation_version(t)`` = max(start, t - 1 - K), so the rollouts of a step, their
random numbers and their version never depend on N, the training layout or timing; K = 0
gives the colocated run's numbers. The rollout ranks generate up to K steps ahead while the
trainers train. A wait lasts as long as the other side's healthy work; a rank that sends no
heartbeat for ``comm.silent_peer_timeout_seconds`` stops the run with an error naming it
(``RolloutTopology``); a rank that dies stops the launch through torchrun.

A GPU inference engine would plug in here: it receives the weights message and answers with
token ids, their behaviour log-probs and the version.
"""

import dataclasses
import hashlib
import logging
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.distributed.pipeline import full_parameters
from torchtitan_rl.distributed.utils import PeerFailedError
from torchtitan_rl.rl.generator import sync_names
from torchtitan_rl.rl.rollout_topology import RolloutTopology
from torchtitan_rl.rl.rollouts import ScoredGroup, rank_prompt_slots

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
    """One step's rollouts, as the rollout ranks send a training rank its share."""

    step: int
    version: int
    kept: list[ScoredGroup]  # the groups to train: of the receiver's slots (in a checkpoint, of every slot)
    values: dict[str, float]  # rl/* of the step, over every group generated (``step_values``)
    stream_state: dict[str, Any]  # the prompt stream's position after the step's prompts
    num_generated: int  # tokens generated, by every rollout rank
    generate_seconds: float  # the slowest rollout rank's generation seconds


@dataclass
class RolloutFailure:
    """Sent in place of a step's ``StepBatch`` when a rollout rank failed making it (e.g. a
    user's environment or reward raised): the trainers stop with its error."""

    step: int
    rank: int
    error: str


# ------------------------------------------------------------------ objects, point to point


@dataclass
class Outbox:
    """Sends in flight: their buffers live until the receiver has them, which it tells through
    the launch's store (``RolloutTopology.acknowledge``): a gloo send cannot be polled."""

    topology: RolloutTopology
    pending: list[tuple[int, int, list]] = field(default_factory=list)  # (dst, message number, [(work, buffer)])

    def send(self, obj: Any, *dsts: int) -> None:
        """Start sending ``obj``, pickled once, to each rank of ``dsts``."""
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        for dst in dsts:
            works = [(dist.isend(size, dst), size), (dist.isend(payload, dst), payload)]
            self.pending.append((dst, self.topology.announce(dst), works))
        self._drop_taken("sending a message")

    def flush(self, what: str) -> None:
        """Until every receiver has its messages (``what``: what they take)."""
        for dst, number, _ in self.pending:
            self.topology.wait_taken(dst, number, what)
        self._drop_taken(what)

    def _drop_taken(self, what: str) -> None:
        kept = []
        for dst, number, works in self.pending:
            if not self.topology.is_taken(dst, number):
                kept.append((dst, number, works))
                continue
            for work, _ in works:
                self.topology.transfer(work, dst, what)
        self.pending = kept


def receive_payload(src: int, topology: RolloutTopology, what: str) -> torch.Tensor:
    """The bytes of the next object rank ``src`` sent to this rank, pickled. Posted once ``src``
    has posted its send: until then this rank waits as long as every rank is alive."""
    topology.wait_announced(src, what)
    size = torch.zeros(1, dtype=torch.int64)
    topology.transfer(dist.irecv(size, src), src, what)
    payload = torch.empty(int(size), dtype=torch.uint8)
    topology.transfer(dist.irecv(payload, src), src, what)
    topology.acknowledge(src)
    return payload


def receive_object(src: int, topology: RolloutTopology, what: str) -> Any:
    """The next object rank ``src`` sent to this rank."""
    return pickle.loads(memoryview(receive_payload(src, topology, what).numpy()))


def receive_finished(topology: RolloutTopology) -> None:
    """A rollout rank's last wait: for training rank 0's ``FINISHED`` (its last steps, checkpoint
    and export done)."""
    message = receive_object(0, topology, "waiting for training rank 0 to finish (its last steps, checkpoint, export)")
    if message != FINISHED:
        raise RuntimeError(
            f"training rank 0 sent a {type(message).__name__} where its last message ({FINISHED!r}) was due: the two "
            "sides' schedules disagree"
        )


def trainer_slots(dims: ParallelDims, num_prompts: int, num_minibatches: int) -> list[list[int]]:
    """Per training rank, the prompt slots it trains: ``rank_prompt_slots`` of its batch rank,
    every mini-batch's (CP / TP peers: the same)."""
    shares = [
        rank_prompt_slots(num_prompts, num_minibatches, batch_rank, dims.batch_degree)
        for batch_rank in range(dims.batch_degree)
    ]
    return [[s for minibatch in shares[dims.batch_rank_of(rank)] for s in minibatch] for rank in range(dims.world_size)]


def send_step_batch(outbox: Outbox, batch: StepBatch, slots_by_trainer: list[list[int]]) -> None:
    """Start sending training rank r its share of ``batch``: the kept groups of
    ``slots_by_trainer[r]``, the rest of the batch as it is. Each distinct share is pickled
    once; ranks with the same slots (CP / TP peers) get the same bytes."""
    trainers_by_share: dict[tuple[int, ...], list[int]] = {}
    for trainer, slots in enumerate(slots_by_trainer):
        trainers_by_share.setdefault(tuple(slots), []).append(trainer)
    for slots, trainers in trainers_by_share.items():
        mine = set(slots)
        outbox.send(dataclasses.replace(batch, kept=[g for g in batch.kept if g.slot in mine]), *trainers)


def step_values(step: int, values: dict[str, float], kept: list[ScoredGroup]) -> dict[str, float]:
    """The ``values`` of a step's batch (its rollout metrics, rl/dynamic_sampling/*) with
    ``rl/staleness_mean`` and ``_max`` of the rollouts trained (``kept``, every slot's), from
    their own versions: what is trained, not what the schedule meant."""
    lags = [staleness(step, r.version) for g in kept for r in g.rollouts] or [0]
    return {**values, "rl/staleness_mean": sum(lags) / len(lags), "rl/staleness_max": float(max(lags))}


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
    """The training ranks' side of the weight broadcast. Every training rank calls ``send``: a
    sharded parameter is gathered with ``full_tensor()``, a collective of the training ranks,
    one parameter at a time. Rank 0 copies each into the bucket it fills (in the generator's
    dtype), the other ranks drop it at once. Rank 0 broadcasts a bucket without waiting and
    holds at most two in flight: before filling a third it waits until the rollout ranks have
    the oldest. So ``send`` costs rank 0 at most two buckets and one gathered parameter, the
    other ranks one gathered parameter; the last two buckets stay in flight after it returns,
    until the next send (or ``wait``). The rollout ranks take a version when they start the
    first step generated with it: rank 0 may wait inside ``send`` for the step they are
    generating, rather than hold a second copy of the model.

    The first send carries every parameter (the rollout ranks start without weights, also in a
    resumed run), later ones only those that train (``sync_names``).

    ``sources`` (``generator.trained_parameters``: name -> (shape, trains) of the whole model)
    names what is sent when the training ranks hold pipeline stages (``pp_mesh``), each with a
    part of the parameters: each is then gathered in its stage and broadcast over the pipeline
    to rank 0 (``distributed.pipeline.full_parameters``). None: the model's own."""

    def __init__(
        self,
        topology: RolloutTopology,
        dtype: torch.dtype,
        device: torch.device,
        sources: dict[str, tuple[torch.Size, bool]] | None = None,
        pp_mesh: DeviceMesh | None = None,
    ):
        self.topology, self.dtype, self.device = topology, dtype, device
        self.sources, self.pp_mesh = sources, pp_mesh
        self.is_sender = dist.get_rank() == 0
        self._pending: list[tuple[Any, torch.Tensor]] = []  # broadcasts in flight, oldest first
        self._sent_full = False

    @torch.no_grad()
    def send(self, model: nn.Module, version: int) -> int:
        """Broadcast ``model``'s weights as ``version``; returns the bytes sent."""
        self.wait()
        waited = f"the rollout ranks to take the weights of version {version}"
        self.topology.meet(f"weights/{version}", self.is_sender, f"waiting for {waited}")
        sources = self.sources or {name: (p.shape, p.requires_grad) for name, p in model.named_parameters()}
        full = not self._sent_full
        names = sync_names({name: trains for name, (_, trains) in sources.items()}, full)
        shapes = [sources[name][0] for name in names]  # global shapes, DTensor or not
        values = full_parameters(model, names, self.pp_mesh)
        numels = [shape.numel() for shape in shapes]
        header = torch.tensor(weights_header(version, full, names, shapes), dtype=torch.int64)
        group = self.topology.weight_group
        if self.is_sender:
            self._pending = [(dist.broadcast(header, src=0, group=group, async_op=True), header)]
        for bucket in weight_buckets(numels, self.dtype.itemsize, BUCKET_BYTES):
            if not self.is_sender:
                for _ in bucket:
                    next(values)  # joins the gather; the result is dropped at once
                continue
            self._wait_until(1)
            flat = torch.empty(sum(numels[i] for i in bucket), dtype=self.dtype, device=self.device)
            offset = 0
            for i in bucket:
                flat[offset : offset + numels[i]].copy_(next(values)[1].reshape(-1))
                offset += numels[i]
            self._pending.append((dist.broadcast(flat, src=0, group=group, async_op=True), flat))
        self._sent_full = True
        if not self.is_sender:
            return 0
        return sum(numels) * self.dtype.itemsize

    def wait(self) -> None:
        """Until the rollout ranks have the last weights sent."""
        self._wait_until(0)

    def _wait_until(self, num_in_flight: int) -> None:
        """Until at most ``num_in_flight`` broadcasts are unfinished (their buffers freed)."""
        while len(self._pending) > num_in_flight:
            work, _ = self._pending.pop(0)
            self.topology.wait(work, "waiting for the rollout ranks to take the weights")


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
        what = f"waiting for training rank 0's weights of version {version}"
        self.topology.meet(f"weights/{version}", True, what)
        self.topology.wait(dist.broadcast(header, src=0, group=group, async_op=True), what)
        check_weights_header(header.tolist(), weights_header(version, not self.generator.is_loaded, names, shapes))
        numels = [shape.numel() for shape in shapes]

        def arrivals():
            # One bucket at a time: the replica takes its tensors before the next one arrives.
            for bucket in weight_buckets(numels, self.dtype.itemsize, BUCKET_BYTES):
                flat = torch.empty(sum(numels[i] for i in bucket), dtype=self.dtype, device=self.device)
                self.topology.wait(dist.broadcast(flat, src=0, group=group, async_op=True), what)
                for i, part in zip(bucket, flat.split([numels[i] for i in bucket])):
                    yield names[i], part.view(shapes[i])
                del flat, part

        return self.generator.load_weight_stream(arrivals(), version)


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

    A training rank receives its share of each step alone (the groups of ``slots``, its prompt
    slots); a checkpoint holds whole batches (``prepare_checkpoint``), which a resumed run on
    any layout cuts to its ranks' shares.
    """

    def __init__(
        self,
        topology: RolloutTopology,
        sender: WeightSender,
        num_steps: int,
        max_staleness: int,
        slots: list[int],
        batch_mesh: DeviceMesh | None,
    ):
        self.topology, self.sender = topology, sender
        self.num_steps, self.max_staleness = num_steps, max_staleness
        self.slots, self.batch_mesh = slots, batch_mesh
        self.in_flight: dict[int, StepBatch] = {}  # this rank's shares of the steps received, not yet trained
        self._saved_in_flight = pickle.dumps([])  # whole batches, as the next checkpoint holds them
        self._num_dropped = 0
        self._outbox = Outbox(topology)
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
        if staleness(step, batch.version) > self.max_staleness:
            raise RuntimeError(
                f"the rollouts of step {step} come from the weights of version {batch.version}, "
                f"{staleness(step, batch.version)} steps behind, more than rl.max_staleness={self.max_staleness}: "
                "the rollout ranks did not follow the schedule"
            )
        num_dropped, self._num_dropped = self._num_dropped, 0
        return batch, num_dropped

    def receive_until(self, step: int) -> None:
        """Receive the batches of the steps up to ``step`` (at most the last step)."""
        while self._next_received <= min(step, self.num_steps):
            what = f"waiting for rollout rank {self.topology.leader}'s rollouts of step {self._next_received}"
            batch = receive_object(self.topology.leader, self.topology, what)
            if isinstance(batch, RolloutFailure):
                raise PeerFailedError(batch.rank, f"{batch.error} (a rollout rank, generating step {batch.step})")
            if batch.step != self._next_received:
                raise RuntimeError(
                    f"rollout rank {self.topology.leader} sent the rollouts of step {batch.step} where those of "
                    f"step {self._next_received} were due: the two sides' schedules disagree"
                )
            self.in_flight[batch.step] = batch
            self._next_received += 1

    def finish(self) -> None:
        """Tell the rollout ranks that training is over (the last checkpoint written) and wait
        until they have everything sent to them: until then they wait on the trainers as long
        as these are alive, not at the launch's final barrier, whose timeout is the collective
        one."""
        if dist.get_rank() == 0:
            for rank in self.topology.rollout_ranks:
                self._outbox.send(FINISHED, rank)
        self.sender.wait()
        self._outbox.flush("waiting for the rollout ranks to take the last message")

    def prepare_checkpoint(self) -> None:
        """Before a save (once the batches it holds are received): gather each batch's shares
        over the ``batch`` mesh into the whole batch, which the checkpoint holds: the same bytes
        on every rank, whatever layout resumes from it. Collective over the ``batch`` mesh."""
        batches = sorted(self.in_flight.values(), key=lambda b: b.step)
        if self.batch_mesh is not None:
            shares: list = [None] * self.batch_mesh.size()
            dist.all_gather_object(shares, [b.kept for b in batches], group=self.batch_mesh.get_group())
            batches = [
                dataclasses.replace(b, kept=sorted((g for share in shares for g in share[i]), key=lambda g: g.slot))
                for i, b in enumerate(batches)
            ]
        self._saved_in_flight = pickle.dumps(batches)

    def state_dict(self) -> dict[str, Any]:
        return {"in_flight": self._saved_in_flight}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The saved whole batches, each cut to this rank's share."""
        mine = set(self.slots)
        self.in_flight = {
            b.step: dataclasses.replace(b, kept=[g for g in b.kept if g.slot in mine])
            for b in pickle.loads(state_dict["in_flight"])
        }
