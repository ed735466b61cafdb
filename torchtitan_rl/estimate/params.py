"""What one rank holds of a model's parameters under a layout, read off the model built on the
meta device (no weights): the same names and shapes the trainer builds, sharded by the rules
``models.qwen3.parallelize`` applies.

- Tensor parallel splits the decoder's linear layers (column-parallel ``wq wk wv w1 w3`` and the
  output head on dim 0, row-parallel ``wo w2`` on dim 1, the input embedding over the
  vocabulary); a LoRA adapter follows its base (``models.lora_parallel``). Norms, the router, a
  score head, MoE experts and the vision tower stay whole on every TP rank.
- Expert parallel splits the stacked experts over ``ep`` (dim 0).
- FSDP2 then shards dim 0 of every parameter over ``dp_shard x cp`` (experts over the ranks of a
  replica that hold the same experts), padding dim 0 up to a multiple of the degree.
- A pipeline stage holds its layers, the first stage the embeddings (and a VLM's vision tower
  and projector), the last the final norm and the head (``models.stages``).
"""

import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.models.lora import LoRASettings, add_adapters
from torchtitan_rl.models.registry import spec_for_args

_COLWISE = re.compile(r"^(layers\.\d+\.(attention\.w[qkv]|feed_forward\.w[13])|output)\.")
_ROWWISE = re.compile(r"^layers\.\d+\.(attention\.wo|feed_forward\.w2)\.")
_LAYER = re.compile(r"^layers\.(\d+)\.")
_FIRST_STAGE = ("tok_embeddings.", "vision_tower.", "projector.")
_LAST_STAGE = ("norm.", "output.", "score.")


def tp_shard_dim(name: str) -> int | None:
    """The dim tensor parallel splits parameter ``name`` on, None when every TP rank holds it whole."""
    if name.startswith("tok_embeddings."):
        return 0
    if _COLWISE.match(name):
        # Column-parallel: the weight and LoRA's B on the output features, A whole.
        return None if ".lora_a." in name else 0
    if _ROWWISE.match(name):
        # Row-parallel: the weight and LoRA's A on the input features, B whole.
        return None if ".lora_b." in name else 1
    return None


def is_expert(name: str) -> bool:
    return ".moe.experts." in name


@dataclass(frozen=True)
class ModelShard:
    """One rank's parameters, in elements (bytes follow from the dtypes the caller knows).

    ``trainable`` / ``frozen``: the rank's shards. ``largest_block``: the most elements one
    transformer block (or vision block) holds on this rank after TP/EP, before FSDP shards it:
    what FSDP gathers at once. ``root``: the same for the parameters outside the blocks
    (embeddings, final norm, head), which stay gathered from forward to backward.
    ``output_rows``: the rows of the output head this rank multiplies by (the vocabulary under
    TP's split), 0 on a stage without the head. ``num_layers``: the decoder layers held (their
    indices in ``layers``). ``full_model``: every parameter of the whole model (a generator's
    unsharded replica).
    """

    trainable: int
    frozen: int
    largest_block: int
    root: int
    output_rows: int
    layers: tuple[int, ...]
    has_vision: bool
    full_model: int


def meta_model(model_args, lora: LoRASettings | None) -> nn.Module:
    """The model on the meta device, with LoRA's adapters (frozen base) when ``lora`` is set."""
    spec = spec_for_args(model_args)
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    if lora is not None:
        add_adapters(model, lora, spec.lora_targets)
    return model


def stage_holds(name: str, layers: range, first: bool, last: bool) -> bool:
    """Whether the pipeline stage of ``layers`` (first / last of the pipeline) holds ``name``."""
    if match := _LAYER.match(name):
        return int(match.group(1)) in layers
    if name.startswith(_FIRST_STAGE):
        return first
    if name.startswith(_LAST_STAGE):
        return last
    raise AssertionError(f"no pipeline stage rule for parameter {name!r}")


def local_numel(name: str, shape: tuple[int, ...], dims: ParallelDims, fsdp: bool) -> int:
    """Elements of parameter ``name`` one rank holds, after TP/EP and (``fsdp``) FSDP's shard."""
    shape = list(shape)
    if is_expert(name):
        shape[0] //= dims.ep
    elif (dim := tp_shard_dim(name)) is not None:
        shape[dim] //= dims.tp
    if fsdp:
        degree = dims.expert_fsdp_degree if is_expert(name) else dims.fsdp_degree
        shape[0] = math.ceil(shape[0] / degree)
    return math.prod(shape)


def _unit_of(name: str) -> str:
    """The FSDP unit a parameter belongs to: its block, else the root."""
    match = re.match(r"^((?:vision_tower\.)?layers\.\d+)\.", name)
    if match:
        return match.group(1)
    return "projector" if name.startswith("projector.") else "root"


def shard_model(
    model: nn.Module, dims: ParallelDims, stages: list[tuple[range, bool, bool]] | None = None
) -> ModelShard:
    """What one rank of ``dims`` holds of ``model`` (from ``meta_model``); ``stages``: the
    pipeline stages it runs, each ``(layers, first, last)`` (None: the whole model)."""
    named = list(model.named_parameters())
    num_layers = len(model.layers)
    stages = stages or [(range(num_layers), True, True)]
    held = [(n, p) for n, p in named if any(stage_holds(n, *stage) for stage in stages)]
    # FSDP2 shards over its mesh, which exists once a stage has more than one rank holding
    # the same layers (HSDP's replicas included: they take FSDP's 2-D form).
    fsdp = dims.dp_replicate * dims.fsdp_degree > 1
    trainable = sum(local_numel(n, p.shape, dims, fsdp) for n, p in held if p.requires_grad)
    frozen = sum(local_numel(n, p.shape, dims, fsdp) for n, p in held if not p.requires_grad)
    units: dict[str, int] = {}
    for n, p in held:
        unit = _unit_of(n)
        units[unit] = units.get(unit, 0) + local_numel(n, p.shape, dims, fsdp=False)
    root = units.pop("root", 0)
    # Not from named_parameters, which lists a tied head only as the embedding.
    output = model.output.weight if getattr(model, "output", None) is not None else None
    has_head = output is not None and any(last for _, _, last in stages)
    layers = tuple(i for stage_layers, _, _ in stages for i in stage_layers)
    return ModelShard(
        trainable=trainable,
        frozen=frozen,
        largest_block=max(units.values(), default=0),
        root=root,
        output_rows=output.shape[0] // dims.tp if has_head else 0,
        layers=layers,
        has_vision=any(n.startswith("vision_tower.") for n, _ in held),
        full_model=sum(p.numel() for p in model.parameters()),
    )
