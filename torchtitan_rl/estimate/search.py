"""Layouts of a world size that fit a device, fastest first by a simple cost model (docs/memory.md).

The cost model ranks layouts; it does not predict seconds. Per optimizer step and rank:

- compute: 6 FLOPs per active parameter (MoE: the routed experts only) and token (forward 2,
  backward 4), the tokens of the rank's batch share (GRPO: every mini-batch and epoch), the
  work split over ``tp x cp x pp``; a checkpointed block adds its forward again (2 FLOPs);
- tensor parallel: per block and micro-batch, four gathers / reduce-scatters of the
  ``T x dim`` residual forward and four backward, over the node's links, not overlapped;
- context parallel: per block and micro-batch the K / V all-gather forward and its reduce-scatter
  backward, not overlapped;
- FSDP: gathering the parameters twice (forward, backward) and reduce-scattering the gradients
  once, overlapped with compute: only what exceeds the compute time counts; over the network
  when the shard group spans nodes;
- pipeline: the schedule's bubble, ``(pp - 1) / micro-batches`` of the compute.

The constants (``DEVICE``) are an H100-class node: only their ratios matter for the order.
"""

import copy
from dataclasses import dataclass

from torch import nn

from torchtitan_rl.config import JobConfig
from torchtitan_rl.config.validation import validate_job_config
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.estimate.memory import DTYPE_BYTES, MemoryEstimate, estimate_memory, workload
from torchtitan_rl.estimate.params import is_expert, meta_model
from torchtitan_rl.models.config_checks import check_model_settings
from torchtitan_rl.models.lora import LoRASettings


@dataclass(frozen=True)
class DeviceModel:
    flops: float = 400e12  # sustained bf16 FLOP/s of one GPU (about 40 % of an H100's peak)
    node_bandwidth: float = 200e9  # bytes/s per GPU within a node (NVLink)
    network_bandwidth: float = 25e9  # bytes/s per GPU across nodes
    gpus_per_node: int = 8


DEVICE = DeviceModel()
AC_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class Candidate:
    parallelism: dict[str, int]
    ac_mode: str
    kv_prompts: int | None  # GRPO: generation.max_prompts_per_batch
    estimates: tuple[MemoryEstimate, ...]
    seconds: float  # the cost model's step time: for ordering only

    @property
    def peak(self) -> int:
        return max(e.peak for e in self.estimates)

    def describe(self) -> str:
        short = {
            "data_parallel_replicate_degree": "dp_replicate",
            "data_parallel_shard_degree": "dp_shard",
            "tensor_parallel_degree": "tp",
            "context_parallel_degree": "cp",
            "expert_parallel_degree": "ep",
            "pipeline_parallel_degree": "pp",
            "rollout_ranks": "rollout_ranks",
        }
        # The shard degree always, the others where they are not their default (1; 0 rollout ranks).
        degrees = " ".join(
            f"{short[k]}={v}"
            for k, v in self.parallelism.items()
            if k.endswith("shard_degree") or v != (0 if k == "rollout_ranks" else 1)
        )
        kv = "" if self.kv_prompts is None else f" kv_prompts={self.kv_prompts}"
        return f"{degrees} ac={self.ac_mode}{kv}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _layouts(world: int, args, gpus_per_node: int) -> list[dict[str, int]]:
    layouts = []
    for pp in _divisors(world):
        for tp in _divisors(min(world // pp, gpus_per_node)):
            for cp in _divisors(world // (pp * tp)):
                if tp * cp > gpus_per_node:
                    continue  # TP and CP talk every block: within a node
                dp = world // (pp * tp * cp)
                # HSDP replicates across nodes once a replica fills a node.
                replicas = [1] + ([dp // (gpus_per_node // (tp * cp))] if dp * tp * cp > gpus_per_node else [])
                for dp_replicate in sorted(set(replicas)):
                    if dp % dp_replicate:
                        continue
                    eps = [e for e in _divisors(args.num_experts) if (dp // dp_replicate) * cp * tp % e == 0]
                    for ep in eps if args.is_moe else [1]:
                        layouts.append(
                            {
                                "data_parallel_replicate_degree": dp_replicate,
                                "data_parallel_shard_degree": dp // dp_replicate,
                                "tensor_parallel_degree": tp,
                                "context_parallel_degree": cp,
                                "expert_parallel_degree": ep,
                                "pipeline_parallel_degree": pp,
                            }
                        )
    return layouts


def with_layout(job_config: JobConfig, parallelism: dict[str, int], ac_mode: str) -> JobConfig:
    config = copy.deepcopy(job_config)
    for key, value in parallelism.items():
        setattr(config.parallelism, key, value)
    config.activation_checkpoint.mode = ac_mode
    return config


def step_seconds(job_config: JobConfig, model: nn.Module, dims: ParallelDims, device: DeviceModel = DEVICE) -> float:
    """The cost model's time of one training step on a rank (see the module docstring);
    ``model``: the model on meta (``params.meta_model``), whose parameters are counted."""
    args = model.args
    sizes = workload(job_config, dims)
    b = DTYPE_BYTES[job_config.training.mixed_precision_param]
    # A GRPO step trains its rollouts in mini-batches, each of ``sizes``' micro-batches.
    rl = job_config.rl
    passes = rl.num_minibatches * rl.ppo_epochs if job_config.job.recipe == "grpo" else 1
    micro_batches = sizes.num_microbatches * passes
    total = sum(p.numel() for p in model.parameters())
    # A token passes through its top-k experts only.
    experts = sum(p.numel() for name, p in model.named_parameters() if is_expert(name))
    active = total - experts * (1 - args.num_experts_per_tok / args.num_experts) if args.is_moe else total
    ac = job_config.activation_checkpoint
    recompute = {"none": 0.0, "full": 1.0, "selective": 1.0 / ac.selective_every}[ac.mode]
    tokens = sizes.tokens * dims.cp * micro_batches  # all CP shares
    compute = (6 + 2 * recompute) * active * tokens / (dims.tp * dims.cp * dims.pp) / device.flops
    tp_bytes = 8 * sizes.tokens * args.dim * b * (dims.tp - 1) / dims.tp
    cp_bytes = 2 * sizes.tokens * 2 * args.n_kv_heads * args.head_dim // dims.tp * b * (dims.cp - 1)
    exposed = args.n_layers / dims.pp * micro_batches * (tp_bytes + cp_bytes) / device.node_bandwidth
    fsdp = dims.fsdp_degree
    if dims.dp_replicate * fsdp > 1:
        link = device.network_bandwidth if fsdp * dims.tp > device.gpus_per_node else device.node_bandwidth
        fsdp_seconds = passes * 3 * total / (dims.tp * dims.pp) * b * (fsdp - 1) / fsdp / link
        exposed += max(0.0, fsdp_seconds - compute)
    bubble = (dims.pp - 1) / sizes.num_microbatches if dims.pp > 1 else 0.0
    return compute * (1 + bubble) + exposed


def search_layouts(
    job_config: JobConfig,
    model_args,
    world_size: int,
    device_bytes: float,
    lora: LoRASettings | None = None,
    device: DeviceModel = DEVICE,
) -> list[Candidate]:
    """Every layout of ``world_size`` ranks (degrees, activation checkpointing mode, and for GRPO
    0, 1, 2 or 4 rollout ranks) that the config's rules accept and whose every rank fits
    ``device_bytes``, fastest first. A GRPO layout takes the largest
    ``generation.max_prompts_per_batch`` (the configured one, or a half, a quarter, ... of it)
    with which it fits."""
    compute_dtype = job_config.training.mixed_precision_param
    model = meta_model(model_args, lora)
    # GRPO may also hand generation to ranks of their own.
    rollout_options = [0, 1, 2, 4] if job_config.job.recipe == "grpo" else [0]
    layouts = [
        {**layout, "rollout_ranks": r}
        for r in rollout_options
        if r < world_size
        for layout in _layouts(world_size - r, model_args, device.gpus_per_node)
    ]
    # GRPO's KV budget is a memory knob too: the most prompts per generation batch that fit.
    kv_options = _halvings(job_config.generation.max_prompts_per_batch) if job_config.job.recipe == "grpo" else [None]
    fitting = []
    for parallelism in layouts:
        for ac_mode in AC_MODES:
            config = with_layout(job_config, parallelism, ac_mode)
            try:
                validate_job_config(config)
                check_model_settings(config, model_args)
                dims = ParallelDims.from_config(config.parallelism, world_size)
                model_args.check_tensor_parallel(dims.tp)
                workload(config, dims)
            except ValueError:
                continue  # a layout the config cannot run: not a candidate
            for kv_prompts in kv_options:
                if kv_prompts is not None:
                    config.generation.max_prompts_per_batch = kv_prompts
                estimates = estimate_memory(config, model_args, dims, lora, compute_dtype, model)
                if all(e.fits(device_bytes) for e in estimates):
                    seconds = step_seconds(config, model, dims, device)
                    fitting.append(Candidate(parallelism, ac_mode, kv_prompts, tuple(estimates), seconds))
                    break
    return sorted(fitting, key=lambda c: (c.seconds, c.peak))


def _halvings(n: int) -> list[int]:
    """``n, n / 2, ...`` down to 1."""
    values = [n]
    while values[-1] > 1:
        values.append(values[-1] // 2)
    return values
