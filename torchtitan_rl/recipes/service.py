"""The service recipe (``job.recipe = "service"``): the training ranks hold one base model with
LoRA adapters; rank 0 serves the tinker SDK's HTTP API and every rank runs the accepted operations
in the order rank 0 sends them (``service.dispatch``). With ``parallelism.rollout_ranks`` the last
ranks of the launch hold a generator replica alone and run the sampling operations
(``service.rollout_sampling``); the training ranks then never generate.
"""

import datetime
import json
import logging
import os
import signal
from dataclasses import dataclass

import torch.distributed as dist

from torchtitan_rl.config import JobConfig
from torchtitan_rl.hf_checkpoint import write_tokenizer_files
from torchtitan_rl.hf_tokenizer_files import ExportTokenizer
from torchtitan_rl.models.registry import spec_for_args
from torchtitan_rl.recipes.base import Recipe, RunContext, lora_settings, model_args_from_config, start_run
from torchtitan_rl.recipes.grpo_data import build_generator, generation_dtype
from torchtitan_rl.rl.generator import TorchGenerator
from torchtitan_rl.rl.rollout_ranks import WeightReceiver, WeightSender
from torchtitan_rl.rl.rollout_topology import RolloutTopology, build_rollout_topology
from torchtitan_rl.service.checkpoints import CheckpointStore
from torchtitan_rl.service.clients import ClientPool
from torchtitan_rl.service.dispatch import Dispatcher, follow
from torchtitan_rl.service.rollout_sampling import RolloutSampling, RolloutSamplingWorker
from torchtitan_rl.service.sampling import ColocatedSampling, SamplingSessions, ServiceSampler
from torchtitan_rl.service.worker import ServiceWorker

logger = logging.getLogger(__name__)

# Unnamed sampler snapshots kept (save_weights_and_get_sampling_client makes one per call).
MAX_SAMPLER_SNAPSHOTS = 16
SERVICE_FILE = "service.json"
TOKENIZER_FOLDER = "tokenizer"
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")  # what the exported generation_config stops at


def build_service(job_config: JobConfig):
    """The service of this rank: a ``ServiceRecipe`` on a training rank, a
    ``ServiceRolloutRank`` on a rollout rank (``parallelism.rollout_ranks``)."""
    run = start_run(job_config)
    if run.parallel_dims.is_trainer:
        return ServiceRecipe(job_config, run)
    return ServiceRolloutRank(run)


@dataclass
class LaunchGroups:
    dispatch: dist.ProcessGroup | None  # every rank: the operations (None: a single rank)
    topology: RolloutTopology | None = None  # with rollout ranks: the weight broadcast, heartbeats
    sampling: dist.ProcessGroup | None = None  # with rollout ranks: rank 0 and them (snapshots, samples)


def build_launch_groups(job_config: JobConfig, num_trainers: int, num_rollout_ranks: int, device_type: str):
    """The groups every rank of the launch shares, created in one order on every rank (after the
    training meshes). Operations, snapshots and samples travel over gloo groups of their own:
    pickled objects on the host, and a wait of their own between operations (the keep-alive
    bounds it, not the step's timeout)."""
    comm = job_config.comm
    timeout = datetime.timedelta(seconds=comm.collective_timeout_seconds)
    topology = None
    if num_rollout_ranks:
        topology = build_rollout_topology(
            num_trainers,
            num_rollout_ranks,
            device_type,
            comm.silent_peer_timeout_seconds,
            comm.collective_timeout_seconds,
        )
    dispatch = dist.new_group(backend="gloo", timeout=timeout) if dist.get_world_size() > 1 else None
    if topology is None:
        return LaunchGroups(dispatch)
    sampling = dist.new_group([0, *topology.rollout_ranks], backend="gloo", timeout=timeout)
    return LaunchGroups(dispatch, topology, sampling)


class ServiceRecipe(Recipe):
    def __init__(self, job_config: JobConfig, run: RunContext | None = None):
        run = run or start_run(job_config)
        super().__init__(run, num_optimizer_steps=1)
        dims = self.parallel_dims
        self.groups = build_launch_groups(job_config, dims.world_size, dims.num_rollout_ranks, self.device.type)
        lora = lora_settings(job_config)
        spec = spec_for_args(self.model_args)
        service = job_config.service
        self.pool = ClientPool(
            self.engine.model,
            self.engine.optimizer,
            lora.rank,
            service.lora_alpha,
            lora.target_modules,
            spec.lora_targets,
        )
        # The replicas take the base weights in setup(), once checkpoint.initial_load_path is in.
        topology = self.groups.topology
        self.generator: TorchGenerator | None = None  # the training ranks' replica: colocated only
        self.sender: WeightSender | None = None  # with rollout ranks: their base weights
        if topology is None:
            self.generator = build_generator(job_config, self.model_args, self.device)
            sampling = ColocatedSampling(ServiceSampler(self.generator, self.tokenizer), self.groups.dispatch)
        else:
            self.sender = WeightSender(topology, generation_dtype(job_config, self.device), self.device)
            sampling = RolloutSampling(self.groups.sampling)
        self.worker = ServiceWorker(
            self.engine,
            self.pool,
            sampling,
            SamplingSessions(MAX_SAMPLER_SNAPSHOTS),
            CheckpointStore(os.path.join(job_config.job.dump_folder, "service"), dims.trainer_group()),
            group=dims.trainer_group(),
            base_models=list(service.base_models),
            vocab_size=self.model_args.vocab_size,
            max_len=job_config.training.seq_len,
            lora=lora,
        )
        # Base weights only (checkpoint.initial_load_path): clients save their own states.
        self.checkpointer = self.build_checkpointer(dataloader=None)

    def setup(self) -> bool:
        """The base weights (checkpoint.initial_load_path), then into the replicas that sample:
        the training ranks' own (a collective over their shards), or by broadcast to the rollout
        ranks'. Base weights never train: this is their only transfer."""
        resumed = super().setup()
        if self.sender is None:
            self.generator.update_weights(self.engine.model)
        else:
            self.sender.send(self.engine.model, 0)
            self.sender.wait()
        return resumed

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.groups.topology is not None:
                self.groups.topology.close()

    def train(self) -> None:
        if self.rank != 0:
            follow(self.worker, self.groups.dispatch)
            return
        from torchtitan_rl.service.http import ServiceServer, build_app  # rank 0 alone serves HTTP

        service = self.job_config.service
        dispatcher = Dispatcher(self.worker, self.groups.dispatch, service.keepalive_seconds)
        app = build_app(dispatcher, api_key=service.api_key or None)
        server = ServiceServer(app, service.host, service.port).start()
        # The model's tokenizer as Hugging Face files, for clients that load one by the model's
        # name from a local folder (the cookbook's get_tokenizer): link it as ./<base model name>.
        tokenizer_dir = os.path.join(self.job_config.job.dump_folder, TOKENIZER_FOLDER)
        os.makedirs(tokenizer_dir, exist_ok=True)
        write_tokenizer_files(
            ExportTokenizer.for_run(self.tokenizer, self.job_config.model.hf_assets_path, STOP_TOKENS), tokenizer_dir
        )
        path = os.path.join(self.job_config.job.dump_folder, SERVICE_FILE)
        with open(path + ".tmp", "w") as f:
            json.dump({"host": service.host, "port": server.port, "base_models": service.base_models}, f)
        os.replace(path + ".tmp", path)  # whole or absent, for whoever waits for it
        logger.info(
            "serving the tinker API at http://%s:%d (base models %s; %s)",
            service.host,
            server.port,
            ", ".join(service.base_models),
            path,
        )
        previous = {sig: signal.signal(sig, lambda *_: dispatcher.stop()) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            dispatcher.run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            server.stop()


class ServiceRolloutRank:
    """A rollout rank of the service, driven by ``train.py`` like a recipe: it builds the same
    meshes and launch groups as the training ranks (group creation is collective), takes the base
    weights in ``setup()`` and follows the operations in ``train()``, executing the sampling
    ones."""

    def __init__(self, run: RunContext):
        cfg, dims = run.job_config, run.parallel_dims
        dims.build_meshes(run.device.type)
        self.groups = build_launch_groups(cfg, dims.world_size, dims.num_rollout_ranks, run.device.type)
        generator = build_generator(cfg, model_args_from_config(cfg, run.device, run.tokenizer), run.device)
        self.receiver = WeightReceiver(self.groups.topology, generator, run.device)
        self.worker = RolloutSamplingWorker(
            ServiceSampler(generator, run.tokenizer),
            SamplingSessions(MAX_SAMPLER_SNAPSHOTS),
            self.groups.sampling,
            run.rank - dims.world_size,
            dims.num_rollout_ranks,
        )

    def setup(self) -> bool:
        self.receiver.receive(0)
        return False

    def train(self) -> None:
        follow(self.worker, self.groups.dispatch)

    def close(self) -> None:
        self.groups.topology.close()
