"""What a rollout rank runs (``parallelism.rollout_ranks``): generate every step's rollouts with
the weights the schedule names, reward and score them, and send them to the training ranks.

It reads the same task, builds the same meshes (group creation is collective over the launch)
and the same ``StepSampler`` as a colocated trainer; it holds no trainable model, only the
generator's replica. The rollout ranks split each step's prompts among themselves like the CP /
TP peers of a colocated data-parallel rank (``rollout`` mesh) and all of them hold the whole
step; the first one sends each training rank its share (``send_step_batch``).
"""

import logging

import torch.distributed as dist

from torchtitan_rl.distributed.utils import PeerFailedError
from torchtitan_rl.recipes.base import RunContext, model_args_from_config
from torchtitan_rl.recipes.grpo_data import build_generator, build_reward_model, read_task, sampling_params
from torchtitan_rl.rl.rollout_ranks import (
    Outbox,
    RolloutFailure,
    StepBatch,
    WeightReceiver,
    generation_version,
    receive_finished,
    receive_object,
    send_step_batch,
    step_values,
    trainer_slots,
)
from torchtitan_rl.rl.rollout_topology import build_rollout_topology
from torchtitan_rl.rl.rollouts import PromptStream
from torchtitan_rl.rl.step_sampler import StepSampler

logger = logging.getLogger(__name__)


class RolloutWorker:
    """A rollout rank's life, driven by ``train.py`` like a recipe: build, ``setup()`` (the
    start message from the training ranks), ``train()`` (the steps), ``close()``."""

    def __init__(self, run: RunContext):
        cfg = self.job_config = run.job_config
        self.rank, self.device = run.rank, run.device
        dims = run.parallel_dims
        data = read_task(run)
        dims.build_meshes(self.device.type)
        self.topology = build_rollout_topology(
            dims.world_size,
            dims.num_rollout_ranks,
            self.device.type,
            cfg.comm.silent_peer_timeout_seconds,
            cfg.comm.collective_timeout_seconds,
        )
        model_args = model_args_from_config(cfg, self.device, run.tokenizer)
        self.generator = build_generator(cfg, model_args, self.device, data.vision)
        self.stream = PromptStream(len(data.train_prompts), cfg.rl.prompts_per_step, cfg.debug.seed)
        self.sampler = StepSampler(
            cfg,
            data.task,
            data.train_prompts,
            run.tokenizer,
            self.generator,
            sampling_params(cfg, data.stop_token_ids),
            self.stream,
            data.env_class,
            data.train_images,
            build_reward_model(cfg, data, self.device),
        )
        self.receiver = WeightReceiver(self.topology, self.generator, self.device)
        self.slots_by_trainer = trainer_slots(dims, cfg.rl.prompts_per_step, cfg.rl.num_minibatches)
        self.outbox = Outbox(self.topology)
        self.start_version = self.first_step = 0

    def setup(self) -> bool:
        """Wait for the training ranks (their warm-up or checkpoint load) to say where to start."""
        waited = "waiting for training rank 0's start message (after its warm-up or checkpoint load)"
        start = receive_object(0, self.topology, waited)
        self.start_version, self.first_step = start["version"], start["first_step"]
        self.stream.load_state_dict(start["stream"])
        return self.start_version > 0

    def train(self) -> None:
        cfg = self.job_config
        steps, max_staleness = cfg.training.steps, cfg.rl.max_staleness
        slots = list(range(cfg.rl.prompts_per_step))
        is_leader = self.rank == self.topology.leader
        version = None
        logger.info("rollout rank %d: steps %d..%d, max_staleness %d", self.rank, self.first_step, steps, max_staleness)
        for step in range(self.first_step, steps + 1):
            needed = generation_version(step, self.start_version, max_staleness)
            while version is None or version < needed:
                version = self.start_version if version is None else version + 1
                self.receiver.receive(version)
            times: dict[str, float] = {}
            mesh = self.topology.rollout_mesh
            try:
                sampled = self.sampler.sample(
                    step, slots, None, mesh, None if mesh is None else mesh.get_group(), times, warn=is_leader
                )
            except Exception as err:
                if is_leader:  # every rollout rank knows (``failures_shared``): one tells the trainers
                    self._send_failure(step, err)
                raise
            num_generated, generate_seconds = self._all_generated(sampled.num_generated, times["generate"])
            if not is_leader:
                continue
            batch = StepBatch(
                step,
                version,
                sampled.kept,
                step_values(step, sampled.values, sampled.kept),
                self.stream.state_dict(),
                num_generated,
                generate_seconds,
            )
            send_step_batch(self.outbox, batch, self.slots_by_trainer)
        self.outbox.flush("waiting for the training ranks to take the last rollouts")
        receive_finished(self.topology)

    def _send_failure(self, step: int, err: Exception) -> None:
        """Tell every training rank, waiting for ``step``'s rollouts, why they will not come."""
        if isinstance(err, PeerFailedError):
            failure = RolloutFailure(step, err.rank, err.error)
        else:
            failure = RolloutFailure(step, self.rank, f"{type(err).__name__}: {err}")
        for trainer in range(self.topology.num_trainers):
            self.outbox.send(failure, trainer)
        # Also to trainers that wait for the rollout ranks to take the next weights.
        self.topology.liveness.report_failure(failure.rank, failure.error)
        self.outbox.flush("waiting for the training ranks to take the failure")

    def _all_generated(self, num_generated: int, seconds: float) -> tuple[int, float]:
        """The step's generated tokens over the rollout ranks (each generated a part) and the
        slowest one's generation seconds."""
        mesh = self.topology.rollout_mesh
        if mesh is None:
            return num_generated, seconds
        gathered: list = [None] * mesh.size()
        dist.all_gather_object(gathered, (num_generated, seconds), group=mesh.get_group())
        return sum(n for n, _ in gathered), max(s for _, s in gathered)

    def close(self) -> None:
        """Stop the heartbeat; nothing else outlives ``train()``, its sends are flushed there."""
        self.topology.close()
