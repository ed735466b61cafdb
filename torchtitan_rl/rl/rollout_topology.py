"""Who is who in a launch with dedicated rollout ranks (``parallelism.rollout_ranks``), their
process groups, and how a rank of the rollout-rank protocol (``rl/rollout_ranks.py``) waits on
the others: as long as they are alive, each transfer once both sides are at it."""

import datetime
import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_rl.compat import launch_store
from torchtitan_rl.distributed.liveness import Liveness


@dataclass
class RolloutTopology:
    """Who is who in a launch with rollout ranks, their groups, and how they wait on each other.

    A wait on a peer has no time limit while every rank of the launch is alive: the trainers'
    warm-up, checkpoint load and saves, evaluation and export, or the rollout ranks' generation
    ahead, take what they take. The run stops when a rank sends no heartbeat for
    comm.silent_peer_timeout_seconds (``Liveness``), with an error naming that rank, also when
    it is not the one waited on directly (a rollout rank that stalls the others' generation).
    A message or a weight broadcast is posted on its group only once both sides are at it (a
    count in the launch's store says so: ``announce`` / ``wait_announced``, ``meet``), so a
    transfer takes the time of its bytes, bounded by comm.collective_timeout_seconds, and a rank
    that gives up a wait leaves nothing posted."""

    num_trainers: int  # the first ranks of the launch
    rollout_ranks: list[int]
    weight_group: dist.ProcessGroup  # training rank 0 and the rollout ranks
    rollout_mesh: DeviceMesh | None  # the rollout ranks, who split a step's generation (None: one)
    liveness: Liveness  # every other rank of the launch is watched
    transfer_seconds: int  # comm.collective_timeout_seconds
    _num_sent: dict[int, int] = field(default_factory=dict)  # messages to each rank
    _num_received: dict[int, int] = field(default_factory=dict)  # messages from each rank

    @property
    def leader(self) -> int:
        """The rollout rank that sends each step's rollouts to the trainers."""
        return self.rollout_ranks[0]

    def wait(self, work, what: str) -> None:
        """Wait for a collective ``work`` of the weight group (``what``: what it brings), as long
        as every rank is alive."""
        self.liveness.wait_until(work.is_completed, what)
        work.wait()

    def meet(self, name: str, arrive: bool, what: str) -> None:
        """Wait until training rank 0 and every rollout rank have called ``meet(name, True)``;
        the other training ranks wait with ``arrive=False``. Before a weight broadcast: rank 0
        posts it only once the rollout ranks take it, and they post theirs once it comes."""
        key = f"meet/{name}"
        self.liveness.add(key, int(arrive))
        expected = 1 + len(self.rollout_ranks)
        self.liveness.wait_until(lambda: self.liveness.add(key, 0) >= expected, what)

    def announce(self, dst: int) -> int:
        """After posting a message to ``dst``: tell it (``wait_announced``); the message's number."""
        number = self._num_sent[dst] = self._num_sent.get(dst, 0) + 1
        self.liveness.add(f"sent/{dist.get_rank()}/{dst}", 1)
        return number

    def is_taken(self, dst: int, number: int) -> bool:
        """Whether ``dst`` has received the message ``number`` this rank sent it."""
        return self.liveness.add(f"taken/{dist.get_rank()}/{dst}", 0) >= number

    def wait_taken(self, dst: int, number: int, what: str) -> None:
        self.liveness.wait_until(lambda: self.is_taken(dst, number), what)

    def wait_announced(self, src: int, what: str) -> None:
        """Until ``src`` has posted the next message to this rank."""
        number = self._num_received.get(src, 0) + 1
        key = f"sent/{src}/{dist.get_rank()}"
        self.liveness.wait_until(lambda: self.liveness.add(key, 0) >= number, what)

    def acknowledge(self, src: int) -> None:
        """After receiving a message from ``src``: tell it (``is_taken``)."""
        self._num_received[src] = self._num_received.get(src, 0) + 1
        self.liveness.add(f"taken/{src}/{dist.get_rank()}", 1)

    def transfer(self, work, peer: int, what: str) -> None:
        """Wait for a point-to-point ``work`` that both sides posted (gloo cannot poll one)."""
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.transfer_seconds))
        except RuntimeError as err:
            raise RuntimeError(
                f"{what}: the transfer with {self.liveness.describe(peer)} did not finish within "
                f"comm.collective_timeout_seconds={self.transfer_seconds} ({err}); stopping the run"
            ) from None

    def close(self) -> None:
        """Stop this rank's heartbeat."""
        self.liveness.close()


_num_topologies = itertools.count()  # every rank builds them in the same order: their keys agree


def build_rollout_topology(
    num_trainers: int, num_rollout_ranks: int, device_type: str, silent_peer_seconds: int, collective_seconds: int
) -> RolloutTopology:
    """The groups of a launch with rollout ranks, and this rank's heartbeat. Collective: every
    rank of the launch calls it, after the training meshes are built; ``close()`` the result.

    The weight group's own timeout (on NCCL, its watchdog's) is the collective one plus the
    silent-peer one: a broadcast starts once both sides are at it (``meet``), so a healthy one
    ends within the first, and a peer that goes silent during one is named before the group
    gives up on it."""
    ranks = list(range(num_trainers, num_trainers + num_rollout_ranks))
    timeout = datetime.timedelta(seconds=collective_seconds + silent_peer_seconds)
    weight_group = dist.new_group([0, *ranks], timeout=timeout)
    mesh = None
    if num_rollout_ranks > 1:
        mesh = DeviceMesh(device_type, torch.tensor(ranks), mesh_dim_names=("rollout",))
    rank, world_size = dist.get_rank(), num_trainers + num_rollout_ranks
    liveness = Liveness(
        launch_store(),
        f"rollout_ranks/{next(_num_topologies)}/",
        rank,
        [peer for peer in range(world_size) if peer != rank],
        silent_peer_seconds,
        "comm.silent_peer_timeout_seconds",
        lambda peer: f"{'rollout' if peer >= num_trainers else 'training'} rank {peer}",
    )
    return RolloutTopology(num_trainers, ranks, weight_group, mesh, liveness, collective_seconds)
