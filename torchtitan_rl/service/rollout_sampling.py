"""Sampling on rollout ranks (``parallelism.rollout_ranks``): the training ranks train and never
generate; the last ranks of the launch hold a generator replica alone and run the requests'
sampling.

Every rank follows the dispatch layer's operations in one order (``service.dispatch``). A rollout
rank executes those that concern sampling (``SAMPLING_KINDS``) and passes over the rest, so its
session table is the training ranks' one. Rank 0 and the rollout ranks share a gloo group of
their own (``group``): a snapshot (a client's adapters, whole, on the CPU) goes from rank 0 to the
rollout ranks inside its ``save_weights_for_sampler``; a sample request's samples are split over
the rollout ranks alone (sample j draws from ``rollout_seed(seed, 0, j, 0)`` there too, so the
sequences are the colocated ones) and their shares come back to rank 0. The base weights reach
the replicas once, at start, by the rollout-rank weight broadcast (``WeightSender`` /
``WeightReceiver``: buckets, never a second copy of the model).
"""

from typing import Any

import torch.distributed as dist

from torchtitan_rl.service.operations import Operation
from torchtitan_rl.service.sampling import SampleResult, SamplingSessions, ServiceSampler, Snapshot, gather_shares

# What a rollout rank executes; it passes over the training operations.
SAMPLING_KINDS = ("create_sampling_session", "save_weights_for_sampler", "sample")


class RolloutSampling:
    """The training ranks' side (``SamplingBackend``): rank 0 sends snapshots and gathers the
    samples over ``group`` (rank 0 first, then the rollout ranks); the other training ranks take
    no part."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.is_sender = dist.get_rank() == 0

    def publish(self, snapshot: Snapshot) -> None:
        if self.is_sender:
            dist.broadcast_object_list([snapshot], src=0, group=self.group)

    def sample(self, snapshot: Snapshot, args: dict) -> SampleResult | None:
        return gather_shares(None, self.group) if self.is_sender else None


class RolloutSamplingWorker:
    """A rollout rank's worker: ``execute`` as ``service.dispatch.follow`` calls it, for the
    operations of ``SAMPLING_KINDS``. ``index``: this rank's place among the ``num_rollout_ranks``."""

    def __init__(
        self,
        sampler: ServiceSampler,
        sessions: SamplingSessions,
        group: dist.ProcessGroup,
        index: int,
        num_rollout_ranks: int,
    ):
        self.sampler, self.sessions, self.group = sampler, sessions, group
        self.index, self.num_rollout_ranks = index, num_rollout_ranks

    def execute(self, op: Operation) -> Any:
        if op.kind in SAMPLING_KINDS:
            getattr(self, f"_{op.kind}")(op.args)

    def _create_sampling_session(self, args: dict) -> None:
        self.sessions.open(args["sampling_session_id"], args.get("base_model"), args.get("model_path"))

    def _save_weights_for_sampler(self, args: dict) -> None:
        box: list = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        self.sessions.keep(box[0], args.get("sampling_session_id"))

    def _sample(self, args: dict) -> None:
        snapshot = self.sessions.get(args["sampling_session_id"])
        gather_shares(self.sampler.share(snapshot, args, self.index, self.num_rollout_ranks), self.group)
