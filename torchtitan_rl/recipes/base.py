"""What every recipe builds from a JobConfig: the process group and parallel dims, the model
(arguments from a named flavor or an HF ``config.json``), its dtype, the engine, the checkpointer
and the metrics.

A recipe knows mini-batches only; micro-batching, meshes and devices are the engine's. Its life
is ``Recipe(...)`` (build: nothing is loaded and no step runs), ``setup()`` (restore a checkpoint,
or prepare a fresh run), ``train()`` and ``close()``; ``train.py`` drives it.
"""

import dataclasses
import functools
import logging
import os
from abc import ABC, abstractmethod

import torch
from torch import nn

from torchtitan_rl.checkpoint import CheckpointManager, TrainState
from torchtitan_rl.config import JobConfig, write_resolved_config
from torchtitan_rl.config.validation import HF_FLAVOR, hf_config_dir
from torchtitan_rl.data.balance import CostModel
from torchtitan_rl.data.packing import VisionPacking
from torchtitan_rl.data.tokenizer import Tokenizer, build_tokenizer, image_token_ids, image_token_strings
from torchtitan_rl.data.vision_samples import VisionDataConfig
from torchtitan_rl.distributed.activation_checkpoint import apply_activation_checkpointing
from torchtitan_rl.distributed.compile import apply_compile
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.distributed.param_init import init_weights_layout_invariant
from torchtitan_rl.distributed.pipeline import PipelinePlan, plan_pipeline
from torchtitan_rl.distributed.utils import init_distributed
from torchtitan_rl.engine import Engine, EngineOptions
from torchtitan_rl.engine_pipeline import PipelineEngine
from torchtitan_rl.engine_scores import ScoreEngine
from torchtitan_rl.hf_checkpoint import read_hf_model_args
from torchtitan_rl.hf_tokenizer_files import ExportTokenizer
from torchtitan_rl.losses.router import RouterLossConfig
from torchtitan_rl.metrics import MetricsLogger
from torchtitan_rl.models.attention import resolve_attn_backend
from torchtitan_rl.models.config_checks import check_model_settings
from torchtitan_rl.models.lora import LoRASettings, add_adapters, init_adapter_, is_adapter_key
from torchtitan_rl.models.qwen3.args import as_reward_model, check_flavor, with_router_aux_loss
from torchtitan_rl.models.qwen3.model import param_seed
from torchtitan_rl.models.registry import get_model_spec, spec_for_args
from torchtitan_rl.models.stages import rank_module, stage_module
from torchtitan_rl.models.vlm.args import with_image_token_id
from torchtitan_rl.optim import build_lr_scheduler, build_optimizer
from torchtitan_rl.profiling import MemoryProfiler

logger = logging.getLogger(__name__)


def build_parallel_dims(job_config: JobConfig, world_size: int) -> ParallelDims:
    """The training ranks' degrees in a launch of ``world_size`` ranks (less the rollout ranks)."""
    return ParallelDims.from_config(job_config.parallelism, world_size)


def check_divisible_by_data_parallel(key: str, value: int, parallel_dims: ParallelDims) -> None:
    """Every data-parallel rank gets the same share of a global count."""
    if value % parallel_dims.batch_degree != 0:
        raise ValueError(
            f"{key}={value} is not divisible by the data-parallel degree {parallel_dims.batch_degree} "
            "(dp_replicate * dp_shard)"
        )


def model_args_from_config(
    job_config: JobConfig, device: torch.device, tokenizer: Tokenizer, reward_model: bool = False
):
    """The flavor's args with this run's attention backend (and, for a VLM, the tokenizer's
    image token), checked against the initial HF checkpoint and the tokenizer. ``reward_model``:
    with a score head in place of the LM head (``as_reward_model``), whether the flavor or the
    initial checkpoint is a language model or already a reward model."""
    spec = get_model_spec(job_config.model.name)
    args = flavor_args(job_config, spec, resolve_attn_backend(job_config.model.attn_backend, device))
    if reward_model:
        args = as_reward_model(args)
    elif args.score_head:
        raise ValueError(
            f"model.flavor = 'hf': {hf_config_dir(job_config)} holds a reward model (a sequence classifier), "
            "which only job.recipe = 'reward_model' trains"
        )
    if args.is_moe:
        args = dataclasses.replace(args, experts_impl=job_config.moe.experts_impl)
        args = with_router_aux_loss(args, job_config.moe.aux_loss_coef)
    if spec.takes_images:
        m = job_config.model
        tokens = (m.image_token, m.image_break_token, m.image_end_token)
        image_id = image_token_ids(tokenizer, *tokens).image
        args = with_image_token_id(args, image_id, image_token_strings(tokenizer, *tokens)[0])
    # Now that the heads are known: flex cannot run heads below 16 dims (auto falls back).
    head_dims = (args.head_dim, args.vision.head_dim) if spec.takes_images else (args.head_dim,)
    backend = resolve_attn_backend(job_config.model.attn_backend, device, head_dims)
    args = dataclasses.replace(args, attn_backend=backend)
    if spec.takes_images:
        args = dataclasses.replace(args, vision=dataclasses.replace(args.vision, attn_backend=backend))
    ckpt = job_config.checkpoint
    if ckpt.initial_load_in_hf and job_config.model.flavor != HF_FLAVOR:
        # Before building anything: a wrong flavor would otherwise surface as a shape error.
        hf_args = read_hf_model_args(ckpt.initial_load_path, args.attn_backend)
        source = os.path.join(ckpt.initial_load_path, "config.json")
        flavors = spec.flavors
        if reward_model:  # the same body, whichever head the checkpoint has
            hf_args, flavors = as_reward_model(hf_args), {name: as_reward_model(f) for name, f in flavors.items()}
        check_flavor(hf_args, job_config.model.flavor, source, flavors)
    if tokenizer.vocab_size > args.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but model.flavor={job_config.model.flavor!r} "
            f"has only {args.vocab_size} embeddings"
        )
    return args


def flavor_args(job_config: JobConfig, spec, attn_backend: str):
    """The architecture ``model.flavor`` names: one of ``spec``'s flavors, or with
    ``model.flavor = "hf"`` that of the HF ``config.json`` (see ``hf_flavor_args``)."""
    if job_config.model.flavor == HF_FLAVOR:
        return hf_flavor_args(job_config, spec, attn_backend)
    return spec.flavors[job_config.model.flavor]


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


def build_model(
    args,
    *,
    parallel_dims: ParallelDims,
    device: torch.device,
    seed: int,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype = torch.float32,
    freeze_vision: bool = False,
    ac_mode: str = "none",
    ac_every: int = 1,
    compile_backend=None,
    reshard_after_forward: str = "default",
    lora: LoRASettings | None = None,
    pipeline: PipelinePlan | None = None,
) -> nn.Module:
    """Build on meta, parallelize, then materialize and initialize identically for any layout.

    ``param_dtype`` / ``reduce_dtype``: FSDP's mixed-precision policy (compute and gradient
    reduction dtypes).
    ``ac_mode`` / ``ac_every``: activation checkpointing of the transformer blocks
    (``distributed.activation_checkpoint``). ``compile_backend``: torch.compile the blocks
    with this backend, a name or a callable (``distributed.compile``); None leaves them eager.
    ``reshard_after_forward``: FSDP's policy for the blocks (``parallelism.fsdp_reshard_after_forward``).
    ``lora``: add adapters and freeze the rest (``models.lora.add_adapters``); the adapters are
    initialized by ``lora.init`` with the same per-name seeds as every parameter.
    ``pipeline``: build only this rank's pipeline stages (``models.stages``), each parallelized
    on its own; the module returned holds them all under the whole model's names, and its
    ``pipeline_stages`` maps each stage id to the module that runs it.
    """
    spec = spec_for_args(args)
    with torch.device("meta"):
        model = spec.model_cls(args)
    init_param = model.init_param_
    if lora is not None:
        # Before any wrapper or parallelism: they see the adapted layers as the model's own.
        add_adapters(model, lora, spec.lora_targets)
        init_param = functools.partial(_init_adapted_param, model.init_param_, lora.init)
    if freeze_vision:
        # Before FSDP, which fixes each sharded parameter's requires_grad when it wraps it.
        model.vision_tower.requires_grad_(False)
    if pipeline is None:
        parts = {0: model}
    else:
        last = pipeline.num_stages - 1
        parts = {
            i: stage_module(model, pipeline.layers[i], first=i == 0, last=i == last) for i in pipeline.local_stages
        }
    for part in parts.values():
        if compile_backend is not None:
            # Before activation checkpointing, which then recomputes the compiled forward.
            apply_compile(part.blocks(), compile_backend)
        apply_activation_checkpointing(part.blocks(), ac_mode, ac_every)
        spec.parallelize(part, parallel_dims, param_dtype, reduce_dtype, reshard_after_forward=reshard_after_forward)
        part.to_empty(device=device)
        init_weights_layout_invariant(part, seed, init_param, param_seed)
    if pipeline is None:
        return model
    held = rank_module(model, list(parts.values()))
    held.pipeline_stages = parts
    return held


def _init_adapted_param(init_param_, lora_init: str, fqn: str, tensor: torch.Tensor, generator) -> None:
    if is_adapter_key(fqn):
        init_adapter_(fqn, tensor, generator, lora_init)
    else:
        init_param_(fqn, tensor, generator)


def lora_settings(job_config: JobConfig) -> LoRASettings | None:
    """The adapters ``[lora]`` asks for; None when LoRA is off."""
    lora = job_config.lora
    if not lora.enable:
        return None
    return LoRASettings(
        rank=lora.rank,
        alpha=lora.alpha,
        dropout=lora.dropout,
        target_modules=tuple(lora.target_modules),
        init=lora.init,
        train_embeddings=lora.train_embeddings,
        base_dtype=LORA_BASE_DTYPES[lora.base_dtype],
    )


LORA_BASE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Gradients are reduced in float32 whatever the compute dtype: a sum over many ranks in bf16
# would lose the exactness the loss weights buy.
REDUCE_DTYPES = {"float32": torch.float32}


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
    *,
    num_optimizer_steps: int,
    temperature: float = 1.0,
    reward_model: bool = False,
):
    """The engine and the model hyper-parameters it was built with; the LR schedule spans
    ``num_optimizer_steps``. ``reward_model``: a model with a score head, in a ``ScoreEngine``."""
    model_args = model_args_from_config(job_config, device, tokenizer, reward_model)
    dtype = compute_dtype(job_config, device)
    if job_config.lora.enable and job_config.lora.dropout > 0:
        logger.warning(
            "lora.dropout = %g draws its masks per rank and micro-batch: the gradient depends on the parallel "
            "layout (set it to 0 for layout-independent gradients)",
            job_config.lora.dropout,
        )
    ac, compile_config = job_config.activation_checkpoint, job_config.compile
    pipeline = pipeline_plan(job_config, parallel_dims, model_args.n_layers)
    model = build_model(
        model_args,
        parallel_dims=parallel_dims,
        device=device,
        seed=job_config.debug.seed,
        param_dtype=dtype,
        reduce_dtype=REDUCE_DTYPES[job_config.training.mixed_precision_reduce],
        freeze_vision=job_config.model.freeze_vision,
        ac_mode=ac.mode,
        ac_every=ac.selective_every,
        compile_backend=compile_config.backend if compile_config.enable else None,
        reshard_after_forward=job_config.parallelism.fsdp_reshard_after_forward,
        lora=lora_settings(job_config),
        pipeline=pipeline,
    )
    # Without FSDP there is no mixed-precision policy; autocast stands in for it.
    autocast_dtype = dtype if (parallel_dims.fsdp_mesh() is None and dtype != torch.float32) else None
    o, s, t = job_config.optimizer, job_config.lr_scheduler, job_config.training
    optimizer = build_optimizer(model, o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.implementation)
    if job_config.lora.enable:
        # Global sizes: an FSDP / TP shard reports its whole parameter's.
        trained = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
        total = sum(p.numel() for p in model.parameters())
        logger.info("LoRA: training %d of %d parameters (%.2f%%)", trained, total, 100 * trained / total)
    lr_scheduler = build_lr_scheduler(optimizer, num_optimizer_steps, s.warmup_steps, s.decay_type, s.min_lr_factor)
    horizon = job_config.loss.horizon if job_config.loss.horizon is not None else t.seq_len
    options = EngineOptions(
        reduction=job_config.loss.reduction,
        horizon=horizon,
        max_tokens_per_microbatch=t.max_tokens_per_microbatch,
        logits_chunk_size=job_config.loss.logits_chunk_size,
        max_norm=t.max_norm,
        loss_parallel=not job_config.parallelism.disable_loss_parallel,
        balance_microbatches=t.balance_dp_compute,
        cost_model=balance_cost_model(model_args),
        temperature=temperature,
        vision=vision_packing(model_args),
        max_patches_per_microbatch=t.max_patches_per_microbatch,
        router=router_loss_config(job_config) if model_args.is_moe else None,
        router_replay=job_config.moe.router_replay,
        min_microbatches=(t.pipeline_microbatches or pipeline.num_stages) if pipeline else 1,
    )
    engine_kwargs = dict(
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        parallel_dims=parallel_dims,
        device=device,
        options=options,
        autocast_dtype=autocast_dtype,
    )
    if pipeline is not None:
        return PipelineEngine(model, pipeline=pipeline, activation_dtype=dtype, **engine_kwargs), model_args
    return (ScoreEngine if reward_model else Engine)(model, **engine_kwargs), model_args


def pipeline_plan(job_config: JobConfig, parallel_dims: ParallelDims, num_layers: int) -> PipelinePlan | None:
    """This rank's share of the pipeline (None without pipeline parallel); meshes built."""
    p = job_config.parallelism
    if parallel_dims.pp == 1:
        return None
    pp_rank = parallel_dims.mesh("pp").get_local_rank()
    return plan_pipeline(num_layers, parallel_dims.pp, pp_rank, p.pipeline_schedule, p.pipeline_layers_per_stage)


def balance_cost_model(model_args) -> CostModel:
    """The estimated compute per sample that data-parallel balancing evens out, from the
    model's forward FLOPs (its widths): per token, per attended pair, per vision patch."""
    per_patch = model_args.linear_flops_per_patch() if spec_for_args(model_args).takes_images else 0.0
    return CostModel.from_flops(model_args.linear_flops_per_token(), model_args.attention_flops_per_pair(), per_patch)


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


@dataclasses.dataclass(frozen=True)
class RunContext:
    """What a recipe has before any collective: enough to read and check its data, so that a
    user mistake in the data is reported on every rank before a rank waits for another."""

    job_config: JobConfig
    rank: int
    device: torch.device
    parallel_dims: ParallelDims  # meshes not built yet
    tokenizer: Tokenizer


def use_deterministic_algorithms() -> None:
    """PyTorch's deterministic kernels (``debug.deterministic``): on CUDA a float ``index_add_``
    (per-sequence loss sums, an MoE layer's combine) or an indexing backward otherwise adds
    with atomics in a varying order. cuBLAS refuses deterministic mode without a fixed
    workspace configuration: set here unless the environment chose one."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def start_run(job_config: JobConfig) -> RunContext:
    """Join the process group, check the layout, seed, and read the tokenizer."""
    rank, world_size, device = init_distributed(job_config.comm.collective_timeout_seconds)
    parallel_dims = build_parallel_dims(job_config, world_size)
    torch.manual_seed(job_config.debug.seed)
    if job_config.debug.deterministic:
        use_deterministic_algorithms()
    tokenizer = build_tokenizer(job_config.model.hf_assets_path)
    return RunContext(job_config, rank, device, parallel_dims, tokenizer)


class Recipe(ABC):
    """What every recipe builds once its data is read: the meshes, the engine (model, optimizer,
    LR schedule), the resolved config file, metrics, memory profiling and the train state.

    A recipe's constructor reads its data from ``start_run``'s context, then calls this one, then
    builds its loader and ``self.checkpointer``. Loading a checkpoint is ``setup()``'s job.
    """

    def __init__(
        self, run: RunContext, *, num_optimizer_steps: int, temperature: float = 1.0, reward_model: bool = False
    ):
        job_config = run.job_config
        self.job_config = job_config
        self.rank, self.device, self.parallel_dims, self.tokenizer = (
            run.rank,
            run.device,
            run.parallel_dims,
            run.tokenizer,
        )
        self.parallel_dims.build_meshes(self.device.type)
        self.engine, self.model_args = build_engine(
            job_config,
            self.parallel_dims,
            self.device,
            self.tokenizer,
            num_optimizer_steps=num_optimizer_steps,
            temperature=temperature,
            reward_model=reward_model,
        )
        if self.rank == 0:
            write_resolved_config(job_config, os.path.join(job_config.job.dump_folder, "config.toml"))
        m = job_config.metrics
        args = self.model_args
        self.metrics = MetricsLogger(
            self.parallel_dims,
            self.device,
            self.rank,
            tb_folder=os.path.join(job_config.job.dump_folder, m.save_tb_folder) if m.enable_tensorboard else None,
            num_params=self.engine.num_params(),
            flops_per_token_context=6 * args.n_layers * args.n_heads * args.head_dim,
        )
        self.memory_profiler = MemoryProfiler(
            job_config.profiling, job_config.job.dump_folder, self.parallel_dims, self.rank, self.device
        )
        self.train_state = TrainState()
        self.checkpointer: CheckpointManager | None = None

    def build_checkpointer(
        self,
        dataloader,
        extra_models: dict | None = None,
        extra_states: dict | None = None,
        extra_engines: dict | None = None,
    ) -> CheckpointManager:
        """Checkpoints of the engine's state, ``dataloader``'s position, ``extra_models``,
        ``extra_states`` and ``extra_engines`` (see ``CheckpointManager``). A Hugging Face export
        writes the run's tokenizer and stops generating at ``generation.stop_tokens`` (which only
        GRPO runs may set: an SFT run's are the defaults, special tokens of every tokenizer)."""
        stop_tokens, tokenizer_dir = self.job_config.generation.stop_tokens, self.job_config.model.hf_assets_path
        return CheckpointManager(
            self.job_config.checkpoint,
            dump_folder=self.job_config.job.dump_folder,
            model=self.engine.model,
            optimizer=self.engine.optimizer,
            lr_scheduler=self.engine.lr_scheduler,
            dataloader=dataloader,
            train_state=self.train_state,
            model_args=self.model_args,
            export_tokenizer=ExportTokenizer.for_run(self.tokenizer, tokenizer_dir, stop_tokens),
            extra_models=extra_models,
            extra_states=extra_states,
            extra_engines=extra_engines,
            process_group=self.parallel_dims.trainer_group(),
            lora=lora_settings(self.job_config),
            export_merged=self.job_config.lora.export_merged,
            seed=self.job_config.debug.seed,
        )

    def setup(self) -> bool:
        """Restore the latest checkpoint, if any; True when the run resumes."""
        if self.checkpointer.load():
            logger.info("resuming after step %d", self.train_state.step)
            return True
        return False

    @abstractmethod
    def train(self) -> None:
        """Run the steps from ``train_state.step + 1`` to ``training.steps``."""

    def close(self) -> None:
        """Finish the asynchronous work the recipe started: a background checkpoint write (and
        its group), then TensorBoard's writer thread. The process groups outlive the recipe:
        ``shutdown_distributed`` tears them down once nothing references it."""
        try:
            if self.checkpointer is not None:
                self.checkpointer.close()
        finally:
            self.metrics.close()


def describe_os_error(err: OSError, job_config: JobConfig) -> str:
    """``err`` with the config keys whose path it failed on, e.g. a cache directory that is a file."""
    failed = [os.path.abspath(name) for name in (err.filename, err.filename2) if name]
    keys = [
        f"{section.name}.{field.name} = {value!r}"
        for section in dataclasses.fields(job_config)
        for field in dataclasses.fields(getattr(job_config, section.name))
        if isinstance(value := getattr(getattr(job_config, section.name), field.name), str)
        and value
        and any(path == os.path.abspath(value) or path.startswith(os.path.abspath(value) + os.sep) for path in failed)
    ]
    return f"{err} (from {', '.join(keys)})" if keys else str(err)
