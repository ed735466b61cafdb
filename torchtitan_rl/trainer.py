"""The SFT recipe: builds the pieces from a JobConfig and runs the step loop.

The trainer knows mini-batches only; micro-batching, meshes and devices are the engine's.
"""

import dataclasses
import logging
import os
import time

import torch
import torch.distributed as dist

from torchtitan_rl.checkpoint import CheckpointManager, TrainState
from torchtitan_rl.config import JobConfig, write_resolved_config
from torchtitan_rl.data.datasets import load_rows
from torchtitan_rl.data.loader import build_sft_dataloader
from torchtitan_rl.data.tokenizer import build_tokenizer
from torchtitan_rl.distributed.init import init_weights_layout_invariant
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.distributed.utils import init_distributed
from torchtitan_rl.engine import Engine, EngineOptions
from torchtitan_rl.hf_checkpoint import read_hf_model_args
from torchtitan_rl.losses.loss_fns import LossFn, loss_fn_from_config
from torchtitan_rl.losses.reduction import GROUPED_MODES, NUM_TOKENS, SUM_SQUARED_SEQ_LENS
from torchtitan_rl.metrics import MetricsLogger
from torchtitan_rl.models.attention import resolve_attn_backend
from torchtitan_rl.models.qwen3.args import Qwen3ModelArgs, check_flavor, qwen3_flavors
from torchtitan_rl.models.qwen3.model import Qwen3Model, param_seed
from torchtitan_rl.models.qwen3.parallelize import parallelize_qwen3
from torchtitan_rl.optim import build_lr_scheduler, build_optimizer
from torchtitan_rl.profiling import MemoryProfiler

logger = logging.getLogger(__name__)


def build_parallel_dims(job_config: JobConfig, world_size: int) -> ParallelDims:
    p = job_config.parallelism
    dims = ParallelDims(
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
        world_size=world_size,
    )
    if job_config.training.global_batch_size % dims.batch_degree != 0:
        raise ValueError(
            f"training.global_batch_size={job_config.training.global_batch_size} is not divisible by the "
            f"data-parallel degree {dims.batch_degree} (dp_replicate * dp_shard)"
        )
    return dims


def model_args_from_config(job_config: JobConfig, device: torch.device, vocab_size: int) -> Qwen3ModelArgs:
    args = dataclasses.replace(
        qwen3_flavors[job_config.model.flavor],
        attn_backend=resolve_attn_backend(job_config.model.attn_backend, device),
    )
    ckpt = job_config.checkpoint
    if ckpt.initial_load_in_hf:
        # Before building anything: a wrong flavor would otherwise surface as a shape error.
        hf_args = read_hf_model_args(ckpt.initial_load_path, args.attn_backend)
        check_flavor(hf_args, job_config.model.flavor, os.path.join(ckpt.initial_load_path, "config.json"))
    if vocab_size > args.vocab_size:
        raise ValueError(
            f"the tokenizer has {vocab_size} tokens but model.flavor={job_config.model.flavor!r} "
            f"has only {args.vocab_size} embeddings"
        )
    return args


def build_model(
    args: Qwen3ModelArgs, parallel_dims: ParallelDims, device: torch.device, seed: int, param_dtype: torch.dtype
) -> Qwen3Model:
    """Build on meta, parallelize, then materialize and initialize identically for any layout."""
    with torch.device("meta"):
        model = Qwen3Model(args)
    parallelize_qwen3(model, parallel_dims, param_dtype, torch.float32)
    model.to_empty(device=device)
    init_weights_layout_invariant(model, seed, model.init_param_, param_seed)
    return model


def build_engine(job_config: JobConfig, parallel_dims: ParallelDims, device: torch.device, vocab_size: int):
    """The engine and the model hyper-parameters it was built with."""
    model_args = model_args_from_config(job_config, device, vocab_size)
    param_dtype = torch.float32
    if device.type == "cuda" and job_config.training.mixed_precision_param == "bfloat16":
        param_dtype = torch.bfloat16
    model = build_model(model_args, parallel_dims, device, job_config.debug.seed, param_dtype)
    # Without FSDP there is no mixed-precision policy; autocast stands in for it.
    autocast_dtype = param_dtype if (parallel_dims.fsdp_mesh() is None and param_dtype != torch.float32) else None
    o, s, t = job_config.optimizer, job_config.lr_scheduler, job_config.training
    optimizer = build_optimizer(model, o.lr, o.beta1, o.beta2, o.eps, o.weight_decay)
    lr_scheduler = build_lr_scheduler(optimizer, t.steps, s.warmup_steps, s.decay_type, s.min_lr_factor)
    horizon = job_config.loss.horizon if job_config.loss.horizon is not None else t.seq_len
    options = EngineOptions(
        reduction=job_config.loss.reduction,
        horizon=horizon,
        max_tokens_per_microbatch=t.max_tokens_per_microbatch,
        logits_chunk_size=job_config.loss.logits_chunk_size,
        max_norm=t.max_norm,
        loss_parallel=not job_config.parallelism.disable_loss_parallel,
    )
    return Engine(model, optimizer, lr_scheduler, parallel_dims, device, options, autocast_dtype), model_args


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


class SFTTrainer:
    def __init__(self, job_config: JobConfig):
        self.job_config = job_config
        self.loss_fn = sft_loss_fn(job_config)
        self.rank, world_size, self.device = init_distributed(job_config.comm.init_timeout_seconds)
        self.parallel_dims = build_parallel_dims(job_config, world_size)
        torch.manual_seed(job_config.debug.seed)
        if job_config.debug.deterministic:
            torch.use_deterministic_algorithms(True)
        tokenizer = build_tokenizer(job_config.model.hf_assets_path)
        t = job_config.training
        rows = load_rows(t.dataset, t.dataset_path, t.dataset_split, t.num_synthetic_samples, job_config.debug.seed)

        self.parallel_dims.build_meshes(self.device.type)
        self.engine, args = build_engine(job_config, self.parallel_dims, self.device, tokenizer.vocab_size)
        self.dataloader = build_sft_dataloader(
            rows,
            tokenizer,
            t.seq_len,
            t.global_batch_size,
            t.long_sample_policy,
            job_config.debug.seed,
            self.parallel_dims.batch_rank(),
            self.parallel_dims.batch_degree,
        )
        if self.rank == 0:
            write_resolved_config(job_config, os.path.join(job_config.job.dump_folder, "config.toml"))
        m = job_config.metrics
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
        self.checkpointer = CheckpointManager(
            job_config.checkpoint,
            job_config.job.dump_folder,
            self.engine.model,
            self.engine.optimizer,
            self.engine.lr_scheduler,
            self.dataloader,
            self.train_state,
            args,
            tokenizer_dir=job_config.model.hf_assets_path,
        )
        if self.checkpointer.load():
            logger.info("resuming after step %d", self.train_state.step)

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
                    self.dataloader.dataset.stats(),
                )
                window_start = time.perf_counter()
                window_tokens = window_squared_lens = 0
            self.checkpointer.maybe_save(step, last=step == steps)
        self.checkpointer.wait()
        self.metrics.close()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
