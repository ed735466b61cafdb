"""A training rank's memory under a config's layout, item by item, and its peak (docs/memory.md).

The items are what the run allocates (``parameters``, ``activations``, ...); the peak adds
them up by phase, because not everything is alive at once:

- forward / backward: the resident items, FSDP's gathered blocks, the activations of the
  micro-batches in flight with the loss's buffers, the gradients accumulated by the step's
  earlier micro-batches (with one micro-batch per step, the larger of the two: the optimizer
  sets the gradients to None before the next step, and backward frees a block's activations as
  it makes its gradients), plus the activations of the checkpointed block that backward
  rebuilds;
- the optimizer step: the resident items and the gradients;
- generation (GRPO): the resident items and the KV cache.

Resident: the parameters, AdamW's two float32 moments per trainable element, a reference
policy's frozen shards, the generator's unsharded replica, a critic's parameters and moments,
the step's rollouts.
"""

from dataclasses import dataclass

from torch import nn

from torchtitan_rl.config import JobConfig
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.distributed.pipeline import SCHEDULES, plan_pipeline
from torchtitan_rl.estimate.activations import (
    ADAPTABLE,
    FLOAT32,
    MicroBatch,
    forward_memory,
    loss_bytes,
    vision_tower_bytes,
)
from torchtitan_rl.estimate.params import ModelShard, meta_model, shard_model
from torchtitan_rl.models.lora import LoRALinear, LoRASettings
from torchtitan_rl.models.qwen3.args import as_critic

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
# A rollout's per-token tensors: token, position and sequence ids and labels (int64), the loss
# weight, sampler / proximal / reference log-probs and the advantage (float32).
ROLLOUT_BYTES_PER_TOKEN = 4 * 8 + 5 * 4


@dataclass(frozen=True)
class Item:
    name: str
    bytes: int
    what: str


@dataclass(frozen=True)
class MemoryEstimate:
    """One rank's items and peak; ``rank_kind`` says which rank (the busiest pipeline stage, a
    rollout rank) the figures are for."""

    rank_kind: str
    items: tuple[Item, ...]
    phases: dict[str, int]

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    def item(self, name: str) -> int:
        return sum(i.bytes for i in self.items if i.name == name)

    def fits(self, device_bytes: float) -> bool:
        return self.peak <= device_bytes


@dataclass(frozen=True)
class Sizes:
    """The workload of one rank: ``tokens`` per micro-batch (a CP rank's share), ``in_flight``
    micro-batches whose activations coexist (pipeline schedules), the step's micro-batches, and
    the rollouts (``rollout_tokens``) and KV-cache shape of a GRPO step. Every sample is taken
    ``training.seq_len`` tokens long: the most a micro-batch's budget can hold."""

    tokens: int
    in_flight: int
    num_microbatches: int = 1
    rollout_tokens: int = 0
    kv_rows: int = 0
    kv_slots: int = 0


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def workload(job_config: JobConfig, dims: ParallelDims) -> Sizes:
    t, rl = job_config.training, job_config.rl
    recipe = job_config.job.recipe
    # The rules the recipes apply before building anything: every data-parallel rank gets an equal share.
    if recipe == "grpo":
        per_minibatch = rl.prompts_per_step // rl.num_minibatches
        key, count = f"rl.prompts_per_step / rl.num_minibatches = {per_minibatch}", per_minibatch
    else:
        key, count = f"training.global_batch_size={t.global_batch_size}", t.global_batch_size
    if count % dims.batch_degree:
        raise ValueError(f"{key} is not divisible by the data-parallel degree {dims.batch_degree}")
    if recipe == "grpo":
        samples = per_minibatch // dims.batch_degree * rl.group_size
    else:
        # DPO packs both completions of a pair.
        samples = t.global_batch_size // dims.batch_degree * (2 if recipe == "dpo" else 1)
    step_tokens = samples * t.seq_len
    num_microbatches = max(1, _ceil_div(step_tokens, t.max_tokens_per_microbatch or step_tokens))
    in_flight = 1
    if dims.pp > 1:
        num_microbatches = max(num_microbatches, t.pipeline_microbatches or dims.pp)
        in_flight = num_microbatches if job_config.parallelism.pipeline_schedule == "GPipe" else dims.pp
    tokens = min(t.max_tokens_per_microbatch or step_tokens, _ceil_div(step_tokens, num_microbatches))
    sizes = Sizes(
        tokens=_ceil_div(tokens, dims.cp), in_flight=min(in_flight, num_microbatches), num_microbatches=num_microbatches
    )
    if recipe != "grpo":
        return sizes
    p = job_config.parallelism
    # Colocated, a replica's pipeline, CP and TP ranks split its prompts; rollout ranks split the step's.
    generators = p.rollout_ranks or dims.batch_degree * dims.pp * dims.cp * dims.tp
    prompts = _ceil_div(rl.prompts_per_step, generators)
    rows = min(job_config.generation.max_prompts_per_batch, prompts) * rl.group_size
    return Sizes(
        tokens=sizes.tokens,
        in_flight=sizes.in_flight,
        num_microbatches=sizes.num_microbatches,
        rollout_tokens=samples * rl.num_minibatches * t.seq_len,
        kv_rows=rows,
        kv_slots=t.seq_len,
    )


def _stages_of_rank(job_config: JobConfig, dims: ParallelDims, num_layers: int) -> list[list[tuple[range, bool, bool]]]:
    """Each pipeline rank's stages as ``(layers, first, last)`` (one rank holding all without PP)."""
    if dims.pp == 1:
        return [[(range(num_layers), True, True)]]
    p = job_config.parallelism
    plans = [
        plan_pipeline(num_layers, dims.pp, rank, p.pipeline_schedule, p.pipeline_layers_per_stage)
        for rank in range(dims.pp)
    ]
    return [[(plan.layers[s], s == 0, s == plan.num_stages - 1) for s in plan.local_stages] for plan in plans]


def estimate_memory(
    job_config: JobConfig,
    model_args,
    dims: ParallelDims,
    lora: LoRASettings | None = None,
    compute_dtype: str = "bfloat16",
    model: nn.Module | None = None,
) -> list[MemoryEstimate]:
    """The estimate of every kind of rank the layout has: the pipeline ranks (one without PP),
    then a rollout rank when ``parallelism.rollout_ranks`` reserves some. ``compute_dtype``: the
    trainer's (``training.mixed_precision_param`` on CUDA; CPU trains in float32). ``model``:
    ``meta_model(model_args, lora)`` when the caller has it (a search estimates many layouts)."""
    assert job_config.parallelism.pipeline_schedule in SCHEDULES
    b = DTYPE_BYTES[compute_dtype]
    model = meta_model(model_args, lora) if model is None else model
    sizes = workload(job_config, dims)
    estimates = [
        _training_rank(job_config, model_args, model, dims, stages, sizes, lora, b, f"pipeline rank {rank}")
        for rank, stages in enumerate(_stages_of_rank(job_config, dims, len(model.layers)))
    ]
    if dims.pp == 1:
        estimates[0] = MemoryEstimate("training rank", estimates[0].items, estimates[0].phases)
    if job_config.job.recipe == "grpo" and job_config.parallelism.rollout_ranks:
        gen = _generator_items(job_config, model_args, model, sizes, b)
        estimates.append(MemoryEstimate("rollout rank", tuple(gen), {"generation": sum(i.bytes for i in gen)}))
    return estimates


def _generator_items(job_config: JobConfig, args, model, sizes: Sizes, b: int) -> list[Item]:
    dtype = job_config.generation.dtype
    gen_b = b if dtype == "auto" else DTYPE_BYTES[dtype]
    numel = sum(p.numel() for p in model.parameters())
    # Under LoRA the replica holds merged weights and a copy of each adapted layer's base.
    numel += sum(m.weight.numel() for m in model.modules() if isinstance(m, LoRALinear))
    kv = 2 * args.n_layers * sizes.kv_rows * sizes.kv_slots * args.n_kv_heads * args.head_dim * gen_b
    return [
        Item("generator", numel * gen_b, "the sampler's unsharded replica of the whole model"),
        Item(
            "kv_cache",
            kv,
            f"K and V of {sizes.kv_rows} rows x {sizes.kv_slots} slots (training.seq_len) in every layer",
        ),
        Item(
            "rollouts",
            sizes.rollout_tokens * rollout_bytes_per_token(job_config, args),
            "the step's rollouts, per-token tensors",
        ),
    ]


def rollout_bytes_per_token(job_config: JobConfig, args) -> int:
    """A rollout's bytes per token, with routing replay also each token's recorded experts
    (int16, every MoE layer's top-k)."""
    if not args.is_moe or job_config.moe.router_replay == "off":
        return ROLLOUT_BYTES_PER_TOKEN
    return ROLLOUT_BYTES_PER_TOKEN + 2 * len(args.moe_layers) * args.num_experts_per_tok


def _training_rank(
    job_config: JobConfig,
    args,
    model,
    dims: ParallelDims,
    stages,
    sizes: Sizes,
    lora: LoRASettings | None,
    b: int,
    kind: str,
) -> MemoryEstimate:
    shard = shard_model(model, dims, stages)
    frozen_b = DTYPE_BYTES[job_config.lora.base_dtype] if lora is not None else FLOAT32
    recipe, rl, loss = job_config.job.recipe, job_config.rl, job_config.loss
    ac = job_config.activation_checkpoint
    mb = MicroBatch(
        sizes.tokens,
        dims.tp,
        b,
        lora.rank if lora is not None else 0,
        frozenset(lora.target_modules) & frozenset(ADAPTABLE) if lora is not None else frozenset(),
        frozen_input=lora is not None and not lora.train_embeddings,
    )
    fwd = forward_memory(args, [tuple(layers) for layers, _, _ in stages], mb, ac.mode, ac.selective_every)
    items = [
        Item("parameters", shard.trainable * FLOAT32 + shard.frozen * frozen_b, _params_note(shard, lora)),
        Item("gradients", shard.trainable * FLOAT32, "float32, sharded like the parameters"),
        Item("optimizer", 2 * shard.trainable * FLOAT32, "AdamW's two float32 moments"),
        Item("fsdp_working", _fsdp_working(shard, dims, job_config, b), "blocks FSDP holds gathered at once"),
        Item(
            "activations",
            fwd.saved * sizes.in_flight,
            f"{sizes.tokens} tokens per micro-batch, {sizes.in_flight} in flight, checkpointing {ac.mode}",
        ),
        Item(
            "loss",
            loss_bytes(
                args,
                mb,
                shard.output_rows,
                loss.logits_chunk_size,
                loss.loss_fn != "cross_entropy" or loss.entropy_coef != 0,
                head_trainable=lora is None or "output" in lora.target_modules,
            ),
            f"hidden-state gradient, head gradient, one {loss.logits_chunk_size}-token logits chunk",
        ),
    ]
    if dims.pp > 1:
        # Each micro-batch in flight keeps the hidden states a stage received and those it sent.
        buffers = sizes.in_flight * 2 * mb.local * args.dim * b
        items.append(Item("pipeline_buffers", buffers, "hidden states received and sent, per micro-batch in flight"))
    # Rebuilding a checkpointed block in backward may need more than the end of the forward.
    moving = sum(i.bytes for i in items if i.name in ("activations", "loss", "pipeline_buffers"))
    rebuild = fwd.rebuild + fwd.saved * (sizes.in_flight - 1)
    items.append(Item("recompute", max(0, rebuild - moving), "what rebuilding a checkpointed block adds in backward"))
    if shard.has_vision and not job_config.model.freeze_vision:
        patches = job_config.training.max_patches_per_microbatch or sizes.tokens
        items.append(Item("vision_activations", vision_tower_bytes(args.vision, patches, b), "the vision tower's"))
    uses_reference = (recipe == "grpo" and rl.use_reference) or (recipe == "dpo" and loss.loss_fn != "simpo")
    if uses_reference and lora is None:  # under LoRA the reference is the base with the adapters off
        items.append(Item("reference", (shard.trainable + shard.frozen) * FLOAT32, "the frozen reference policy"))
    if recipe == "grpo" and rl.advantage == "gae":
        critic = shard_model(meta_model(as_critic(args), None), dims, stages)
        items.append(Item("critic", critic.trainable * FLOAT32 * 4, "parameters, gradients, AdamW moments"))
    if recipe == "grpo" and not job_config.parallelism.rollout_ranks:
        items += _generator_items(job_config, args, model, sizes, b)
    return MemoryEstimate(kind, tuple(items), _phases(items, sizes.num_microbatches))


def _params_note(shard: ModelShard, lora: LoRASettings | None) -> str:
    trainable = f"{shard.trainable / 1e6:.1f}M trainable float32"
    return trainable + (f", {shard.frozen / 1e6:.1f}M frozen base" if lora is not None else "")


def _fsdp_working(shard: ModelShard, dims: ParallelDims, job_config: JobConfig, b: int) -> int:
    """Gathered parameters: the root group (kept gathered from forward to backward), the block
    running and the next one being prefetched in the compute dtype, and one block's unsharded
    float32 gradient before its reduce-scatter; with ``never`` every block held stays gathered."""
    if dims.dp_replicate * dims.fsdp_degree == 1:
        return 0
    policy = job_config.parallelism.fsdp_reshard_after_forward
    blocks = len(shard.layers) if policy == "never" else 2
    return (shard.root + blocks * shard.largest_block) * b + shard.largest_block * FLOAT32


_RESIDENT = ("parameters", "optimizer", "reference", "critic", "generator", "rollouts")


def _phases(items: list[Item], num_microbatches: int) -> dict[str, int]:
    size = {}
    for item in items:
        size[item.name] = size.get(item.name, 0) + item.bytes
    resident = sum(size.get(name, 0) for name in _RESIDENT)
    moving = size["activations"] + size.get("vision_activations", 0) + size.get("pipeline_buffers", 0) + size["loss"]
    # The gradients of a step's earlier micro-batches are alive while a later one runs forward.
    transient = moving + size["gradients"] if num_microbatches > 1 else max(moving, size["gradients"])
    phases = {
        "forward_backward": resident + size["fsdp_working"] + transient + size["recompute"],
        "optimizer_step": resident + size["gradients"],
    }
    if "kv_cache" in size:
        phases["generation"] = resident + size["kv_cache"]
    return phases


def fits_text(estimate: MemoryEstimate, device_bytes: float) -> str:
    verdict = "fits" if estimate.fits(device_bytes) else "does NOT fit"
    return (
        f"{estimate.rank_kind}: peak {estimate.peak / GIB:.2f} GiB ({estimate.peak_phase}) {verdict} "
        f"in {device_bytes / GIB:.0f} GiB"
    )


def format_table(estimate: MemoryEstimate) -> str:
    width = max(len(name) for name in [*(i.name for i in estimate.items), *(f"peak: {p}" for p in estimate.phases)])
    lines = [f"{estimate.rank_kind}:"]
    lines += [f"  {i.name:<{width}} {i.bytes / GIB:10.3f} GiB  {i.what}" for i in estimate.items]
    lines += [f"  {'peak: ' + name:<{width}} {value / GIB:10.3f} GiB" for name, value in estimate.phases.items()]
    return "\n".join(lines)
