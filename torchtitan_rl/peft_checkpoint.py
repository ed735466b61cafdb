"""LoRA adapters in PEFT's format, and the base with its adapters merged as a plain HF model.

A PEFT LoRA directory is ``adapter_config.json`` (``peft_type`` LORA, ``r``, ``lora_alpha``,
``target_modules``, ...) and ``adapter_model.safetensors``, whose keys are the HF model's module
paths under ``base_model.model.``: ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``
(our ``layers.0.attention.wq.lora_a.weight``) and ``.lora_B.weight``; a whole trained module
(``modules_to_save``, here the input embedding) is stored under its own path,
``base_model.model.model.embed_tokens.weight``. ``PeftModel.from_pretrained`` puts such a
directory on top of the HF base model; ``load_peft_adapter`` reads one (ours or PEFT's) into an
adapted model.

HF module paths come from the family's ``to_hf`` on the base weight's key (the names in the HF
checkpoint files), then its ``hf_in_memory_name``: PEFT sees the modules of the model in memory,
which transformers 5 names otherwise for the VLM (``model.language_model.layers...`` in memory,
``language_model.model.layers...`` on disk).
"""

import contextlib
import os
import shutil

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan_rl.distributed.fsdp import reshard
from torchtitan_rl.hf_checkpoint import (
    _check_export_target,
    _load_block,
    _make_staging_dir,
    _open_safetensors,
    _read_json,
    _write_json,
    agree_on_tensors,
    export_hf,
    hf_sources,
    write_tokenizer_files,
)
from torchtitan_rl.hf_tokenizer_files import ExportTokenizer
from torchtitan_rl.models.lora import LoRASettings, is_adapter_key, lora_modules, merged_weight
from torchtitan_rl.models.registry import spec_for_args
from torchtitan_rl.models.stages import whole_model

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# PEFT's names of our adapter matrices.
_PEFT_MATRIX = {"lora_a": "lora_A", "lora_b": "lora_B"}
# Our lora.init -> PEFT's init_lora_weights (same distributions: see models.lora.init_adapter_).
_PEFT_INIT = {"kaiming": True, "gaussian": "gaussian"}


# ---------------------------------------------------------------- names


def _hf_module(model: nn.Module, module: str) -> str:
    """The HF module path of our module ``module`` (``model.layers.0.self_attn.q_proj`` for
    ``layers.0.attention.wq``), from the family's key mapping of its weight."""
    spec = spec_for_args(model.args)
    (hf_key,) = spec.to_hf({f"{module}.weight": None})
    return spec.hf_in_memory_name(hf_key).removesuffix(".weight")


def peft_sources(model: nn.Module, settings: LoRASettings) -> dict[str, torch.Tensor]:
    """PEFT key -> our parameter (possibly a DTensor), of every adapter (and, with
    ``train_embeddings``, of the input embedding, and of a head tied to it)."""
    sources = {}
    for module, layer in lora_modules(model).items():
        hf = PEFT_PREFIX + _hf_module(model, module)
        for ours, peft in _PEFT_MATRIX.items():
            sources[f"{hf}.{peft}.weight"] = getattr(layer, ours).weight
    if settings.train_embeddings and model.tok_embeddings is not None:  # a pipeline's first stage holds it
        # A tied head is the trained embedding too; PEFT (ensure_weight_tying) stores it twice.
        trained = ("tok_embeddings", "output") if model.args.tie_embeddings else ("tok_embeddings",)
        for module in trained:
            sources[PEFT_PREFIX + _hf_module(model, module) + ".weight"] = model.tok_embeddings.weight
    return sources


def _target_modules(model: nn.Module) -> list[str]:
    """PEFT's ``target_modules`` for the adapted modules: their HF leaf names (``q_proj``) when
    each leaf name picks exactly the adapted modules among the model's linear layers, else the
    full HF paths (PEFT matches a name against a module path's end, so a full path picks one)."""
    adapted = {_hf_module(model, name) for name in lora_modules(model)}
    linears = {
        _hf_module(model, name)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and not is_adapter_key(f"{name}.weight")
    }
    leaves = {path.rsplit(".", 1)[-1] for path in adapted}
    picked = {path for path in linears if path.rsplit(".", 1)[-1] in leaves}
    return sorted(leaves) if picked == adapted else sorted(adapted)


def adapter_config(model: nn.Module, settings: LoRASettings) -> dict:
    """``adapter_config.json`` of ``model``'s adapters: the fields PEFT's ``LoraConfig`` needs to
    rebuild them; the rest take PEFT's defaults."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": _target_modules(whole_model(model, settings)),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": _PEFT_INIT[settings.init],
        "modules_to_save": ["embed_tokens"] if settings.train_embeddings else None,
        # A tied head is the embedding: PEFT must keep it tied to the trained copy.
        "ensure_weight_tying": bool(settings.train_embeddings and model.args.tie_embeddings),
        "inference_mode": True,
    }


# ---------------------------------------------------------------- saving


@torch.no_grad()
def save_peft_adapter(
    model: nn.Module,
    path: str,
    settings: LoRASettings,
    dtype: torch.dtype,
    tokenizer: ExportTokenizer | None = None,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Write ``model``'s adapters as a PEFT LoRA directory at ``path`` (which must not exist),
    the tensors cast to ``dtype``, with the files of the run's ``tokenizer`` (see
    ``hf_checkpoint.write_tokenizer_files``).

    Collective like ``hf_checkpoint.save_hf_checkpoint``: every rank of ``group`` calls it, each
    adapter is gathered on every rank, global rank 0 writes into a hidden folder beside ``path``
    and renames it at the end.
    """
    if not lora_modules(model):
        raise ValueError(f"cannot write PEFT adapter {path!r}: the model has no LoRA adapters")
    _check_export_target(path, tokenizer)
    if dist.is_initialized():
        dist.barrier(group=group)
    rank = dist.get_rank() if dist.is_initialized() else 0
    reshard(model)
    sources = peft_sources(model, settings)
    # Pipeline stages hold different adapters: the first rank holding each one sends it to rank 0.
    _, writers = agree_on_tensors({key: p.numel() for key, p in sources.items()}, dict.fromkeys(sources), rank, group)
    staging = _make_staging_dir(path) if rank == 0 else None
    try:
        tensors = {}
        for key, param in sources.items():
            full = param.full_tensor() if isinstance(param, DTensor) else param
            if writers[key] == rank:
                # A copy, so the tied head's two entries are no shared storage (which safetensors refuses).
                tensors[key] = full.detach().to(dtype, copy=True).cpu().contiguous()
        if len(set(writers.values())) > 1:
            held = [None] * dist.get_world_size(group) if rank == 0 else None
            dist.gather_object(tensors, held, dst=0, group=group)
            tensors = {key: t for part in held or () for key, t in part.items()}
        if staging is not None:
            save_file(tensors, os.path.join(staging, ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
            _write_json(os.path.join(staging, ADAPTER_CONFIG_FILE), adapter_config(model, settings))
            write_tokenizer_files(tokenizer, staging)
            os.rename(staging, path)
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    if dist.is_initialized():
        dist.barrier(group=group)


class _MergedWeight:
    """An adapted layer's weight with its adapters merged, gathered when the export asks for it."""

    def __init__(self, base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float):
        self.base, self.lora_a, self.lora_b, self.scale = base, lora_a, lora_b, scale
        self.shape = base.shape

    def numel(self) -> int:
        return self.base.numel()

    def full_tensor(self) -> torch.Tensor:
        # Collective, the same calls in the same order on every rank.
        base, a, b = (t.full_tensor() if isinstance(t, DTensor) else t for t in (self.base, self.lora_a, self.lora_b))
        return merged_weight(base, a, b, self.scale)


def _merged_sources(model: nn.Module) -> dict[str, tuple]:
    sources = hf_sources(model)
    for module, layer in lora_modules(model).items():
        (key,) = spec_for_args(model.args).to_hf({f"{module}.weight": None})
        sources[key] = (_MergedWeight(layer.weight, layer.lora_a.weight, layer.lora_b.weight, layer.scale), None)
    return sources


def save_merged_hf(
    model: nn.Module,
    path: str,
    dtype: torch.dtype,
    tokenizer: ExportTokenizer | None = None,
    max_shard_bytes: int = 5 * 2**30,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Export ``model`` with every adapter merged into its base weight (``W + scale * B A``, in
    float32, then cast to ``dtype``) as a plain HF model, like ``save_hf_checkpoint``."""
    export_hf(model, path, dtype, _merged_sources, tokenizer, max_shard_bytes, group)


# ---------------------------------------------------------------- loading


def _check_adapter_config(model: nn.Module, path: str, settings: LoRASettings) -> None:
    file = os.path.join(path, ADAPTER_CONFIG_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"no {ADAPTER_CONFIG_FILE} in PEFT adapter directory {path!r}")
    config = _read_json(file)
    if not isinstance(config, dict):
        raise ValueError(f"{file!r} must hold a JSON object, got {type(config).__name__}")
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise ValueError(f'{file!r}: "peft_type" is {peft_type!r}; only LORA adapters load')
    for key, ours, expected in (("r", "lora.rank", settings.rank), ("lora_alpha", "lora.alpha", settings.alpha)):
        if config.get(key) != expected:
            raise ValueError(f'{file!r}: "{key}" is {config.get(key)!r}, but this run has {ours} = {expected!r}')
    unsupported = {
        "use_dora": False,
        "use_rslora": False,
        "fan_in_fan_out": False,
        "bias": "none",
        "rank_pattern": {},
        "alpha_pattern": {},
        "layers_to_transform": None,
    }
    for key, default in unsupported.items():
        if config.get(key, default) not in (default, None, [], {}):
            raise ValueError(f'{file!r}: "{key}" = {config[key]!r} is not supported (only {default!r})')
    if config.get("target_parameters"):
        raise ValueError(f'{file!r}: "target_parameters" is not supported')
    theirs = config.get("target_modules")
    ours = _target_modules(whole_model(model, settings))
    if isinstance(theirs, str) or sorted(theirs or []) != ours:
        raise ValueError(
            f'{file!r}: "target_modules" is {theirs!r}, but this run adapts {ours} '
            f"(lora.target_modules = {list(settings.target_modules)})"
        )
    saved = config.get("modules_to_save") or []
    expected = ["embed_tokens"] if settings.train_embeddings else []
    if sorted(saved) != expected:
        raise ValueError(
            f'{file!r}: "modules_to_save" is {config.get("modules_to_save")!r}, but this run has '
            f"lora.train_embeddings = {str(settings.train_embeddings).lower()} (trains {expected or 'no module'} whole)"
        )


@torch.no_grad()
def load_peft_adapter(model: nn.Module, path: str, settings: LoRASettings) -> None:
    """Copy the adapters of the PEFT LoRA directory ``path`` into ``model`` in place.

    ``model`` is adapted with ``settings`` and may be sharded (each rank reads only its block
    of each tensor, not collective). Its ``r``, ``lora_alpha``, ``target_modules`` and
    ``modules_to_save`` must be ``settings``' (ValueError naming the file and the key), and its
    tensors exactly the adapters (PEFT's copy of a base layer it adapted as an embedding,
    ``*.base_layer.weight``, is not read: the base comes from the base checkpoint).
    """
    _check_adapter_config(model, path, settings)
    file = os.path.join(path, ADAPTER_WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"no {ADAPTER_WEIGHTS_FILE} in PEFT adapter directory {path!r}")
    reshard(model)
    sources = peft_sources(model, settings)
    with contextlib.ExitStack() as stack:
        handle = stack.enter_context(_open_safetensors(file))
        # A pipeline rank reads its stages' adapters; the other stages' ranks check theirs.
        others = peft_sources(whole_model(model, settings), settings).keys() - sources.keys()
        found = [key for key in handle.keys() if not key.endswith(".base_layer.weight") and key not in others]
        missing = [key for key in sources if key not in found]
        unexpected = [key for key in found if key not in sources]
        if missing or unexpected:
            listed = "; ".join(
                f"{what} {', '.join(repr(k) for k in keys[:3])}{' ...' if len(keys) > 3 else ''}"
                for what, keys in (("lacks", missing), ("has unexpected", unexpected))
                if keys
            )
            raise ValueError(f"{file!r} {listed}")
        for key, param in sources.items():
            _load_block(param, handle, key, file)
