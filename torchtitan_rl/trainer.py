"""The SFT recipe: builds the pieces from a JobConfig and runs the step loop.

The trainer knows mini-batches only; micro-batching, meshes and devices are the engine's.
"""

import dataclasses
import logging
from abc import ABC, abstractmethod
import os
import time

import torch
from torch import nn

from torchtitan_rl.checkpoint import CheckpointManager, TrainState
from torchtitan_rl.config import JobConfig, write_resolved_config
from torchtitan_rl.config.manager import HF_FLAVOR, check_model_settings, hf_config_dir
from torchtitan_rl.data.datasets import load_rows
from torchtitan_rl.data.loader import build_sft_dataloader
from torchtitan_rl.data.packing import VisionPacking
from torchtitan_rl.data.tokenizer import Tokenizer, build_tokenizer, image_token_ids
from torchtitan_rl.data.vision_samples import VisionDataConfig
from torchtitan_rl.distributed.activation_checkpoint import apply_activation_checkpointing
from torchtitan_rl.distributed.compile import apply_compile
from torchtitan_rl.distributed.init import init_weights_layout_invariant
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.distributed.utils import init_distributed
from torchtitan_rl.engine import Engine, EngineOptions
from torchtitan_rl.hf_checkpoint import read_hf_model_args
from torchtitan_rl.losses.loss_fns import LossFn, loss_fn_from_config
from torchtitan_rl.losses.reduction import GROUPED_MODES, NUM_TOKENS, SUM_SQUARED_SEQ_LENS
from torchtitan_rl.losses.router import RouterLossConfig
from torchtitan_rl.metrics import MetricsLogger
from torchtitan_rl.models.attention import resolve_attn_backend
from torchtitan_rl.models.qwen3.args import check_flavor
from torchtitan_rl.models.qwen3.model import param_seed
from torchtitan_rl.models.registry import get_model_spec, spec_for_args
from torchtitan_rl.optim import build_lr_scheduler, build_optimizer
from torchtitan_rl.profiling import MemoryProfiler

logger = logging.getLogger(__name__)


def build_parallel_dims(job_config: JobConfig, world_size: int) -> ParallelDims:
    p = job_config.parallelism
    return ParallelDims(
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
        world_size=world_size,
    )


def check_divisible_by_data_parallel(key: str, value: int, parallel_dims: ParallelDims) -> None:
    """Every data-parallel rank gets the same share of a global count."""
    if value % parallel_dims.batch_degree != 0:
        raise ValueError(
            f"{key}={value} is not divisible by the data-parallel degree {parallel_dims.batch_degree} "
            "(dp_replicate * dp_shard)"
        )


def model_args_from_config(job_config: JobConfig, device: torch.device, tokenizer: Tokenizer):
    """The flavor's args with this run's attention backend (and, for a VLM, the tokenizer's
    image token), checked against the initial HF checkpoint and the tokenizer."""
    spec = get_model_spec(job_config.model.name)
    backend = resolve_attn_backend(job_config.model.attn_backend, device)
    if job_config.model.flavor == HF_FLAVOR:
        args = hf_flavor_args(job_config, spec, backend)
    else:
        args = dataclasses.replace(spec.flavors[job_config.model.flavor], attn_backend=backend)
    if args.is_moe:
        args = dataclasses.replace(args, experts_impl=job_config.moe.experts_impl)
    if spec.takes_images:
        m = job_config.model
        image_id = image_token_ids(tokenizer, m.image_token, m.image_break_token, m.image_end_token).image
        args = dataclasses.replace(args, image_token_id=image_id, vision=dataclasses.replace(args.vision, attn_backend=backend))
    ckpt = job_config.checkpoint
    if ckpt.initial_load_in_hf and job_config.model.flavor != HF_FLAVOR:
        # Before building anything: a wrong flavor would otherwise surface as a shape error.
        hf_args = read_hf_model_args(ckpt.initial_load_path, args.attn_backend)
        source = os.path.join(ckpt.initial_load_path, "config.json")
        check_flavor(hf_args, job_config.model.flavor, source, spec.flavors)
    if tokenizer.vocab_size > args.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but model.flavor={job_config.model.flavor!r} "
            f"has only {args.vocab_size} embeddings"
        )
    return args


def hf_flavor_args(job_config: JobConfig, spec, attn_backend: str):
    """The architecture of ``model.flavor = "hf"``: that of the HF ``config.json`` (every
    unsupported-field check applies), which must be of the ``model.name`` family."""
    path = hf_config_dir(job_config)
    args = read_hf_model_args(path, attn_backend)
    found = spec_for_args(args).name
    if found != spec.name:
        raise ValueError(
            f"model.flavor = 'hf': {os.path.join(path, 'config.json')} describes a {found!r} model, but "
            f"model.name = {spec.name!r}"
        )
    check_model_settings(job_config, args)
    return args


def build_model(args, parallel_dims: ParallelDims, device: torch.device, seed: int, param_dtype: torch.dtype,
                freeze_vision: bool = False, ac_mode: str = "none", ac_every: int = 1,
                compile_backend=None) -> nn.Module:
    """Build on meta, parallelize, then materialize and initialize identically for any layout.

    ``ac_mode`` / ``ac_every``: activation checkpointing of the transformer blocks
    (``distributed.activation_checkpoint``). ``compile_backend``: torch.compile the blocks
    with this backend, a name or a callable (``distributed.compile``); None leaves them eager.
    """
    spec = spec_for_args(args)
    with torch.device("meta"):
        model = spec.model_cls(args)
    if freeze_vision:
        # Before FSDP, which fixes each sharded parameter's requires_grad when it wraps it.
        model.vision_tower.requires_grad_(False)
    if compile_backend is not None:
        # Before activation checkpointing, which then recomputes the compiled forward.
        apply_compile(model.blocks(), compile_backend)
    apply_activation_checkpointing(model.blocks(), ac_mode, ac_every)
    spec.parallelize(model, parallel_dims, param_dtype, torch.float32)
    model.to_empty(device=device)
    init_weights_layout_invariant(model, seed, model.init_param_, param_seed)
    return model


def compute_dtype(job_config: JobConfig, device: torch.device) -> torch.dtype:
    """Compute dtype of the parameters: CPU always trains in float32."""
    if device.type == "cuda" and job_config.training.mixed_precision_param == "bfloat16":
        return torch.bfloat16
    return torch.float32


def build_engine(
    job_config: JobConfig,
    parallel_dims: ParallelDims,
    device: torch.device,
    tokenizer: Tokenizer,
    num_optimizer_steps: int,
    temperature: float = 1.0,
):
    """The engine and the model hyper-parameters it was built with; the LR schedule spans
    ``num_optimizer_steps``."""
    model_args = model_args_from_config(job_config, device, tokenizer)
    dtype = compute_dtype(job_config, device)
    ac, compile_config = job_config.activation_checkpoint, job_config.compile
    model = build_model(
        model_args, parallel_dims, device, job_config.debug.seed, dtype, job_config.model.freeze_vision,
        ac.mode, ac.selective_every, compile_config.backend if compile_config.enable else None,
    )
    # Without FSDP there is no mixed-precision policy; autocast stands in for it.
    autocast_dtype = dtype if (parallel_dims.fsdp_mesh() is None and dtype != torch.float32) else None
    o, s, t = job_config.optimizer, job_config.lr_scheduler, job_config.training
    optimizer = build_optimizer(model, o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.implementation)
    lr_scheduler = build_lr_scheduler(optimizer, num_optimizer_steps, s.warmup_steps, s.decay_type, s.min_lr_factor)
    horizon = job_config.loss.horizon if job_config.loss.horizon is not None else t.seq_len
    options = EngineOptions(
        reduction=job_config.loss.reduction,
        horizon=horizon,
        max_tokens_per_microbatch=t.max_tokens_per_microbatch,
        logits_chunk_size=job_config.loss.logits_chunk_size,
        max_norm=t.max_norm,
        loss_parallel=not job_config.parallelism.disable_loss_parallel,
        temperature=temperature,
        vision=vision_packing(model_args),
        max_patches_per_microbatch=t.max_patches_per_microbatch,
        router=router_loss_config(job_config) if model_args.is_moe else None,
    )
    return Engine(model, optimizer, lr_scheduler, parallel_dims, device, options, autocast_dtype), model_args


def vision_packing(model_args) -> VisionPacking | None:
    """How micro-batches carry images for this model; None for a text model."""
    if not spec_for_args(model_args).takes_images:
        return None
    return VisionPacking(patch_dim=model_args.vision.patch_dim, merge_size=model_args.spatial_merge_size)


def router_loss_config(job_config: JobConfig) -> RouterLossConfig:
    m = job_config.moe
    if m.aux_loss_coef > 0 and m.aux_loss_scope == "microbatch":
        logger.warning(
            "moe.aux_loss_scope = 'microbatch' balances each micro-batch on its own: the loss and gradient depend "
            "on how the mini-batch is split over micro-batches and ranks (use 'global' or 'sequence' for exact ones)"
        )
    return RouterLossConfig(m.aux_loss_coef, m.aux_loss_scope, m.aux_loss_layers, m.z_loss_coef)


def vision_data_config(job_config: JobConfig, model_args) -> VisionDataConfig | None:
    """How the data loader sizes, normalizes and marks images for this model; None for a text model."""
    if not spec_for_args(model_args).takes_images:
        return None
    m = job_config.model
    return VisionDataConfig(
        patch_size=model_args.vision.patch_size,
        merge_size=model_args.spatial_merge_size,
        max_image_tokens=job_config.training.max_image_tokens,
        image_token=m.image_token,
        image_break_token=m.image_break_token,
        image_end_token=m.image_end_token,
        max_patches_per_side=model_args.vision.max_patches_per_side,
        max_patches_per_microbatch=job_config.training.max_patches_per_microbatch,
    )


def sft_loss_fn(job_config: JobConfig) -> LossFn:
    """The ``[loss]`` of an SFT run; SFT rows carry no advantages, log-probs or prompt groups."""
    loss = job_config.loss
    if loss.loss_fn != "cross_entropy":
        raise ValueError(
            f"loss.loss_fn: {loss.loss_fn!r} needs advantages and sampler log-probs, which SFT data "
            "does not have; SFT trains with 'cross_entropy'"
        )
    if loss.kl_coef > 0:
        raise ValueError("loss.kl_coef: the KL penalty needs reference log-probs, which SFT data does not have")
    if loss.reduction in GROUPED_MODES:
        raise ValueError(f"loss.reduction: {loss.reduction!r} weighs prompt groups, which SFT data does not have")
    return loss_fn_from_config(loss)


class Trainer(ABC):
    """What every recipe builds, in an order that reports user mistakes (config, data) before
    any collective: the process group and meshes, the tokenizer, the engine (model, optimizer,
    LR schedule), metrics, memory profiling and the train state. Recipes add their data and
    checkpoints."""

    def __init__(self, job_config: JobConfig, num_optimizer_steps: int, temperature: float = 1.0):
        self.job_config = job_config
        self.rank, world_size, self.device = init_distributed(job_config.comm.init_timeout_seconds)
        self.parallel_dims = build_parallel_dims(job_config, world_size)
        torch.manual_seed(job_config.debug.seed)
        if job_config.debug.deterministic:
            torch.use_deterministic_algorithms(True)
        self.tokenizer = build_tokenizer(job_config.model.hf_assets_path)
        self.load_data()

        self.parallel_dims.build_meshes(self.device.type)
        self.engine, self.model_args = build_engine(
            job_config, self.parallel_dims, self.device, self.tokenizer, num_optimizer_steps, temperature
        )
        if self.rank == 0:
            write_resolved_config(job_config, os.path.join(job_config.job.dump_folder, "config.toml"))
        m = job_config.metrics
        args = self.model_args
        self.metrics = MetricsLogger(
            self.parallel_dims,
            self.device,
            self.rank,
            os.path.join(job_config.job.dump_folder, m.save_tb_folder) if m.enable_tensorboard else None,
            num_params=sum(p.numel() for p in self.engine.model.parameters()),
            flops_per_token_context=6 * args.n_layers * args.n_heads * args.head_dim,
        )
        self.memory_profiler = MemoryProfiler(
            job_config.profiling, job_config.job.dump_folder, self.parallel_dims, self.rank, self.device
        )
        self.train_state = TrainState()

    @abstractmethod
    def load_data(self) -> None:
        """Read and check the recipe's data (runs before any collective)."""

    def build_checkpointer(self, dataloader, extra_models: dict | None = None) -> CheckpointManager:
        """Checkpoints of the engine's state, ``dataloader``'s position and ``extra_models``."""
        return CheckpointManager(
            self.job_config.checkpoint,
            self.job_config.job.dump_folder,
            self.engine.model,
            self.engine.optimizer,
            self.engine.lr_scheduler,
            dataloader,
            self.train_state,
            self.model_args,
            tokenizer_dir=self.job_config.model.hf_assets_path,
            extra_models=extra_models,
        )

    def close(self) -> None:
        """Finish the asynchronous work the trainer started: a background checkpoint write (and
        its group), then TensorBoard's writer thread. The process groups outlive the trainer:
        ``shutdown_distributed`` tears them down once nothing references it."""
        try:
            self.checkpointer.close()
        finally:
            self.metrics.close()


class SFTTrainer(Trainer):
    def __init__(self, job_config: JobConfig):
        self.loss_fn = sft_loss_fn(job_config)
        super().__init__(job_config, num_optimizer_steps=job_config.training.steps)
        t = job_config.training
        self.dataloader = build_sft_dataloader(
            self.rows,
            self.tokenizer,
            t.seq_len,
            t.global_batch_size,
            t.long_sample_policy,
            job_config.debug.seed,
            self.parallel_dims.batch_rank(),
            self.parallel_dims.batch_degree,
            vision=vision_data_config(job_config, self.model_args),
            balance_dp_compute=t.balance_dp_compute,
            prefetch=t.dataset_prefetch,
        )
        self.checkpointer = self.build_checkpointer(self.dataloader)
        if self.checkpointer.load():
            logger.info("resuming after step %d", self.train_state.step)

    def load_data(self) -> None:
        t = self.job_config.training
        check_divisible_by_data_parallel("training.global_batch_size", t.global_batch_size, self.parallel_dims)
        cache_dir = t.dataset_cache_dir or os.path.join(self.job_config.job.dump_folder, "dataset_cache")
        self.rows = load_rows(t.dataset, t.dataset_path, t.dataset_split, t.num_synthetic_samples, self.job_config.debug.seed,
                              cache_dir=cache_dir, cache_timeout_s=t.dataset_cache_timeout_seconds)

    def train(self) -> None:
        log_freq = self.job_config.metrics.log_freq
        steps = self.job_config.training.steps
        data_iter = iter(self.dataloader)
        window_start = time.perf_counter()
        window_tokens = window_squared_lens = 0
        first = self.train_state.step + 1
        logger.info("training steps %d..%d on %d rank(s)", first, steps, self.parallel_dims.world_size)
        for step in range(first, steps + 1):
            samples = next(data_iter)
            with self.memory_profiler.step(step):
                fb = self.engine.forward_backward(samples, self.loss_fn.name, self.loss_fn.options)
                optim = self.engine.optim_step()
            window_tokens = window_tokens + fb.counts[NUM_TOKENS]
            window_squared_lens = window_squared_lens + fb.counts[SUM_SQUARED_SEQ_LENS]
            self.train_state.step = step
            # Summed on the host only when a checkpoint is written.
            self.train_state.tokens_seen = self.train_state.tokens_seen + fb.counts[NUM_TOKENS]
            if step % log_freq == 0 or step == first or step == steps:
                self.metrics.log(
                    step,
                    fb,
                    optim,
                    window_tokens,
                    window_squared_lens,
                    time.perf_counter() - window_start,
                    {**self.dataloader.dataset.stats(), **self.dataloader.dataset.balance_stats()},
                )
                window_start = time.perf_counter()
                window_tokens = window_squared_lens = 0
            self.checkpointer.maybe_save(step, last=step == steps)
        self.checkpointer.wait()

    def close(self) -> None:
        try:
            self.dataloader.dataset.close()  # its prefetch thread
        finally:
            super().close()
