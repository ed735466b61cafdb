"""The service recipe (``job.recipe = "service"``): the ranks hold one base model with LoRA
adapters; rank 0 serves the tinker SDK's HTTP API and every rank runs the accepted operations in
the order rank 0 sends them (``service.dispatch``).
"""

import datetime
import json
import logging
import os
import signal

import torch.distributed as dist

from torchtitan_rl.config import JobConfig
from torchtitan_rl.hf_checkpoint import write_tokenizer_files
from torchtitan_rl.hf_tokenizer_files import ExportTokenizer
from torchtitan_rl.models.registry import spec_for_args
from torchtitan_rl.recipes.base import Recipe, lora_settings, start_run
from torchtitan_rl.recipes.grpo_data import build_generator
from torchtitan_rl.service.checkpoints import CheckpointStore
from torchtitan_rl.service.clients import ClientPool
from torchtitan_rl.service.dispatch import Dispatcher, follow
from torchtitan_rl.service.sampling import SamplingSessions, ServiceSampler
from torchtitan_rl.service.worker import ServiceWorker

logger = logging.getLogger(__name__)

# Unnamed sampler snapshots kept (save_weights_and_get_sampling_client makes one per call).
MAX_SAMPLER_SNAPSHOTS = 16
SERVICE_FILE = "service.json"
TOKENIZER_FOLDER = "tokenizer"
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")  # what the exported generation_config stops at


class ServiceRecipe(Recipe):
    def __init__(self, job_config: JobConfig):
        run = start_run(job_config)
        super().__init__(run, num_optimizer_steps=1)
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
        generator = build_generator(job_config, self.model_args, self.device)
        self.worker = ServiceWorker(
            self.engine,
            self.pool,
            ServiceSampler(generator, self.tokenizer, self.engine.model),
            SamplingSessions(MAX_SAMPLER_SNAPSHOTS),
            CheckpointStore(os.path.join(job_config.job.dump_folder, "service")),
            base_models=list(service.base_models),
            vocab_size=self.model_args.vocab_size,
            max_len=job_config.training.seq_len,
            lora=lora,
        )
        # Operations travel over a gloo group of their own: pickled objects on the host, and a
        # wait of their own between operations (the keep-alive bounds it, not the step's timeout).
        timeout = datetime.timedelta(seconds=job_config.comm.collective_timeout_seconds)
        self.group = dist.new_group(backend="gloo", timeout=timeout) if dist.get_world_size() > 1 else None
        # Base weights only (checkpoint.initial_load_path): clients save their own states.
        self.checkpointer = self.build_checkpointer(dataloader=None)

    def train(self) -> None:
        if self.rank != 0:
            follow(self.worker, self.group)
            return
        from torchtitan_rl.service.http import ServiceServer, build_app  # rank 0 alone serves HTTP

        service = self.job_config.service
        dispatcher = Dispatcher(self.worker, self.group, service.keepalive_seconds)
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
