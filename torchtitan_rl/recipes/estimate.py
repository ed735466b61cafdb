"""``train.py --estimate``: the memory estimate of a config's layout, and with
``--estimate.search`` the layouts that fit, printed instead of training (docs/memory.md)."""

from torchtitan_rl.config import JobConfig
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.estimate.memory import GIB, estimate_memory, fits_text, format_table
from torchtitan_rl.estimate.search import search_layouts
from torchtitan_rl.models.qwen3.args import as_reward_model
from torchtitan_rl.models.registry import get_model_spec
from torchtitan_rl.recipes.base import flavor_args, lora_settings


def estimate_model_args(job_config: JobConfig):
    """The architecture the run would build (the flavor's, or an HF ``config.json``'s), without
    a tokenizer or device: what memory depends on."""
    args = flavor_args(job_config, get_model_spec(job_config.model.name), "sdpa_varlen")
    return as_reward_model(args) if job_config.job.recipe == "reward_model" else args


def estimate_report(job_config: JobConfig) -> str:
    e = job_config.estimate
    if job_config.job.recipe == "service":
        # Its memory depends on the clients that connect (each with adapters and AdamW state).
        raise ValueError(
            "estimate.enable: job.recipe = 'service' is not estimated; sft, grpo, dpo and reward_model are"
        )
    args = estimate_model_args(job_config)
    lora = lora_settings(job_config)
    dims = ParallelDims.from_config(job_config.parallelism, e.world_size)
    device_bytes = e.device_memory * GIB
    dtype = job_config.training.mixed_precision_param
    lines = [
        f"memory estimate: {job_config.model.name} {job_config.model.flavor}, recipe {job_config.job.recipe}, "
        f"{e.world_size} ranks: pp={dims.pp} dp_replicate={dims.dp_replicate} dp_shard={dims.dp_shard} "
        f"cp={dims.cp} tp={dims.tp} ep={dims.ep} rollout_ranks={dims.num_rollout_ranks}; compute dtype {dtype}",
    ]
    estimates = estimate_memory(job_config, args, dims, lora, dtype)
    for estimate in estimates:
        lines += [format_table(estimate), fits_text(estimate, device_bytes)]
    if e.search:
        found = search_layouts(job_config, args, e.world_size, device_bytes, lora)
        lines.append(
            f"layouts of {e.world_size} ranks that fit {e.device_memory:g} GiB, fastest first "
            f"({len(found)} found, showing {min(len(found), e.num_layouts)}):"
        )
        lines += [
            f"  {c.describe():<60} peak {c.peak / GIB:7.2f} GiB  cost {c.seconds:.3g}" for c in found[: e.num_layouts]
        ]
    return "\n".join(lines)
