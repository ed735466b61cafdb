"""Hugging Face checkpoints of every registered model family (Qwen3 dense, the Mistral3-layout
VLM): read ``config.json``, load safetensors weights into a (possibly FSDP2 / TP sharded) model
in place, and export a model as an HF directory.

Loading reads, on every rank, only the block of each tensor that the rank's shard holds
(``safe_open(...).get_slice``), so no rank ever holds the full model. The files are read here
rather than through ``torch.distributed.checkpoint.HuggingFaceStorageReader`` so that errors
name the file and the key, dtypes are cast on the way in, tied checkpoints without
``lm_head.weight`` load, and one code path serves torch 2.11 and 2.13.

A model with LoRA adapters (``models.lora``) is a plain model here: its base loads as any model
does and the adapters keep their values. Exporting it plainly would silently drop the adapters,
so ``save_hf_checkpoint`` refuses; ``peft_checkpoint`` writes the adapters or the merged model.

An export given the run's tokenizer (``hf_tokenizer_files.ExportTokenizer``) is a complete HF
model: tokenizer files, chat template and the token ids generation stops at.
"""

import contextlib
import json
import os
import shutil
from collections.abc import Callable

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from torchtitan_rl.compat import local_shard_bounds
from torchtitan_rl.distributed.fsdp import reshard
from torchtitan_rl.hf_tokenizer_files import ExportTokenizer, byte_tokenizer_config, byte_tokenizer_json
from torchtitan_rl.models.lora import is_adapter_key, lora_modules
from torchtitan_rl.models.registry import spec_for_args, spec_for_hf_config
from torchtitan_rl.models.stages import whole_model

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# Copied into an export when present beside tokenizer.json, so the export is a complete HF model.
# A generation_config.json is not copied as it is: the export sets the run's token ids in it.
TOKENIZER_FILES = (
    TOKENIZER_FILE,
    TOKENIZER_CONFIG_FILE,
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def read_hf_model_args(path: str, attn_backend: str = "sdpa_dense"):
    """The model args of the HF checkpoint directory ``path`` (its ``config.json``), of the
    family its ``model_type`` names."""
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ValueError(f"no {CONFIG_FILE} in Hugging Face checkpoint directory {path!r}")
    config = _read_json(config_path)
    if not isinstance(config, dict):
        raise ValueError(f"{config_path!r} must hold a JSON object, got {type(config).__name__}")
    return spec_for_hf_config(config, config_path).args_cls.from_hf_config(config, attn_backend, source=config_path)


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str) -> None:
    """Copy the safetensors weights of the HF checkpoint directory ``path`` into ``model`` in place.

    ``model`` is a materialized model of a registered family (plain tensors, or DTensors after
    its parallelize function). Not collective: each rank reads its own blocks independently. Values
    are cast to each parameter's dtype. Every parameter must be in the files with its shape,
    and every tensor in the files must belong to a parameter; otherwise ValueError naming the file.
    LoRA adapters are not base weights: they are left as they are. A model holding pipeline
    stages (``recipes.base.build_model``) reads their tensors only. A reward model (score head)
    loads a language model's checkpoint too: its body, while its score head keeps its values
    and the LM head is not read.
    """
    files, listing = _tensor_files(path)
    params = hf_sources(model)
    to_hf = spec_for_args(model.args).to_hf
    lm_head = next(iter(to_hf({"output.weight": None})))
    # Tied HF checkpoints usually omit the output head; when one has it, it is the embedding again.
    unread_head = lm_head if model.args.tie_embeddings else None
    stored = read_hf_model_args(path) if model.args.score_head else None
    if stored is not None and not stored.score_head:
        # A language model's body: the score head stays as initialized.
        score_head = set(to_hf({"score.weight": None, "score.bias": None}))
        params, unread_head = {key: value for key, value in params.items() if key not in score_head}, lm_head
    elif stored is not None and model.args.score_per_token and not stored.score_per_token:
        # A reward model's: its head has no bias, which stays as initialized (0).
        bias = next(iter(to_hf({"score.bias": None})))
        params = {key: value for key, value in params.items() if key != bias}
    # A pipeline rank reads its stages' tensors; the other stages' ranks check theirs.
    others = hf_sources(whole_model(model)).keys() - hf_sources(model).keys()
    _check_same_keys(params.keys(), [key for key in files if key not in others], unread_head, listing)
    with contextlib.ExitStack() as stack:
        handles = {}  # file -> (open handle, the keys it holds)
        for key, (param, index) in params.items():
            file = files[key]
            if file not in handles:
                handle = stack.enter_context(_open_safetensors(file))
                handles[file] = handle, set(handle.keys())
            handle, keys_in_file = handles[file]
            if key not in keys_in_file:
                raise ValueError(f"the checkpoint index places tensor {key!r} in {file!r}, which does not contain it")
            _load_block(param, handle, key, file, index)


@torch.no_grad()
def save_hf_checkpoint(
    model: nn.Module,
    path: str,
    dtype: torch.dtype,
    tokenizer: ExportTokenizer | None = None,
    max_shard_bytes: int = 5 * 2**30,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Export ``model`` as an HF directory at ``path`` (which must not exist): a
    ``Qwen3ForCausalLM`` (a reward model: ``Qwen3ForSequenceClassification``), or a
    ``Mistral3ForConditionalGeneration`` for the VLM.

    Collective: every rank of ``group`` (default: the launch) calls it; parameters are gathered
    one shard file at a time and global rank 0 writes, so it holds at most one file's worth of
    tensors (under expert parallel, each expert's owner writes its experts' files: see
    ``_writer``). Weights are cast to
    ``dtype``, written as ``model.safetensors`` or, above ``max_shard_bytes``, as numbered shards
    with ``model.safetensors.index.json``, next to ``config.json`` and, given the run's
    ``tokenizer``, its files and token ids (``write_tokenizer_files``). Everything is written
    into a hidden folder beside ``path`` and renamed at the end, so a crash never leaves a
    partial export at ``path``. Returns once the export is there.
    A model with LoRA adapters is refused (ValueError): see ``peft_checkpoint``.
    """
    if lora_modules(model):
        # Every rank alike (same modules everywhere), before any collective.
        raise ValueError(
            f"cannot export {path!r} as a plain Hugging Face model: the model has LoRA adapters, which it would "
            "drop; export the adapters (peft_checkpoint.save_peft_adapter) or the merged model "
            "(peft_checkpoint.save_merged_hf)"
        )
    export_hf(model, path, dtype, hf_sources, tokenizer, max_shard_bytes, group)


@torch.no_grad()
def export_hf(
    model: nn.Module,
    path: str,
    dtype: torch.dtype,
    sources: Callable[[nn.Module], dict[str, tuple]],
    tokenizer: ExportTokenizer | None = None,
    max_shard_bytes: int = 5 * 2**30,
    group: dist.ProcessGroup | None = None,
) -> None:
    """``save_hf_checkpoint`` with the tensors ``sources(model)`` gives (HF key -> (source, index),
    see ``hf_sources``). A source is a tensor, a DTensor, or any object with ``shape``,
    ``numel()`` and a collective ``full_tensor()`` (e.g. a weight merged with its adapters)."""
    _check_export_target(path, tokenizer)
    if dist.is_initialized():
        # Rank 0 may finish the export before a slow rank checked the target: under HSDP each
        # replica group gathers on its own, so nothing else holds rank 0 back.
        dist.barrier(group=group)
    rank = dist.get_rank() if dist.is_initialized() else 0
    tensors = sources(model)
    sizes = {key: _numel(param, index) * dtype.itemsize for key, (param, index) in tensors.items()}
    writers = {key: _writer(param, index) for key, (param, index) in tensors.items()}
    sizes, writers = agree_on_tensors(sizes, writers, rank, group)
    shards = _plan_shards(sizes, max_shard_bytes, writers)
    staging = _make_staging_dir(path) if rank == 0 else None
    several_writers = len(set(writers.values())) > 1
    if several_writers:
        staging = _share(staging, group)  # every writer writes its own files into rank 0's folder
    try:
        for file_name, (writer, keys) in shards.items():
            if keys[0] not in tensors:
                continue  # another pipeline stage's parameters: its ranks gather and write them
            gathered = _gather(tensors, keys, dtype, keep=rank == writer)
            if rank == writer:
                save_file(gathered, os.path.join(staging, file_name), metadata={"format": "pt"})
        if several_writers:
            dist.barrier(group=group)  # every file is written before rank 0 completes the export
        if rank == 0:
            _write_metadata(staging, model.args, dtype, sum(sizes.values()), shards, tokenizer)
            os.rename(staging, path)
    except BaseException:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    if dist.is_initialized():
        dist.barrier(group=group)  # callers on any rank may read the export once this returns


def hf_sources(model: nn.Module) -> dict[str, tuple[torch.Tensor, int | None]]:
    """HF key -> (our parameter, the index along its dim 0 the key is, or None for all of it),
    of the base weights (LoRA adapters are not listed).

    Reshards ``model`` first: after a forward without backward, ``named_parameters`` would yield
    temporary gathered copies, which a load would write into and lose at the next reshard.
    Most parameters are one HF tensor each; stacked MoE experts are one HF tensor per expert,
    which loading and export address by index so a sharded stack is never gathered whole
    just to be split. ``named_parameters`` lists a tied head once, as the embedding: HF's tied
    checkpoints (and transformers' saves) do the same.
    """
    reshard(model)
    spec = spec_for_args(model.args)
    sources, plain = {}, {}
    for fqn, param in model.named_parameters():
        if is_adapter_key(fqn):
            continue
        stacked = spec.stacked_hf_keys(fqn, param.shape[0])
        if stacked is None:
            plain[fqn] = param
        else:
            sources.update({key: (param, index) for index, key in enumerate(stacked)})
    sources.update({key: (param, None) for key, param in spec.to_hf(plain).items()})
    return sources


def _numel(param: torch.Tensor, index: int | None) -> int:
    """Elements of the HF tensor: the parameter's, or one slice's (a DTensor's numel is global)."""
    return param.numel() if index is None else param.numel() // param.shape[0]


# ---------------------------------------------------------------- loading


def _read_json(path: str) -> object:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path!r} is not valid JSON: {e}") from e


def _tensor_files(path: str) -> tuple[dict[str, str], str]:
    """{HF key: safetensors file holding it} of the checkpoint at ``path``, and the file that says so."""
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index_path):
        return _sharded_tensor_files(path, index_path), index_path
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        with _open_safetensors(single) as f:
            return {key: single for key in f.keys()}, single
    raise ValueError(f"no {SINGLE_FILE} or {INDEX_FILE} in Hugging Face checkpoint directory {path!r}")


def _sharded_tensor_files(path: str, index_path: str) -> dict[str, str]:
    index = _read_json(index_path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(file, str) for file in weight_map.values()):
        raise ValueError(f'{index_path!r} has no "weight_map" object mapping tensor names to shard files')
    for shard in sorted(set(weight_map.values())):
        if not os.path.isfile(os.path.join(path, shard)):
            raise ValueError(f"{index_path!r} lists shard file {shard!r}, which is missing from {path!r}")
    return {key: os.path.join(path, shard) for key, shard in weight_map.items()}


@contextlib.contextmanager
def _open_safetensors(file: str):
    try:
        handle = safe_open(file, framework="pt", device="cpu")
    except SafetensorError as e:
        raise ValueError(f"{file!r} is not a readable safetensors file: {e}") from e
    with handle as f:
        yield f


def _check_same_keys(expected, found, unread: str | None, listing: str) -> None:
    missing = [key for key in expected if key not in found]
    unexpected = [key for key in found if key not in expected and key != unread]
    if missing:
        raise ValueError(f"{listing!r} has no tensor {_names(missing)} that the model needs")
    if unexpected:
        raise ValueError(f"{listing!r} has tensor {_names(unexpected)} that the model does not have")


def _names(keys: list[str], limit: int = 3) -> str:
    shown = ", ".join(repr(key) for key in keys[:limit])
    return shown if len(keys) <= limit else f"{shown} (and {len(keys) - limit} more)"


def _load_block(param: torch.Tensor, handle, key: str, file: str, index: int | None = None) -> None:
    """Copy this rank's block of tensor ``key`` from the open ``file`` into ``param`` (or, with
    ``index``, into its slice ``param[index]``)."""
    tensor_slice = handle.get_slice(key)
    file_shape = tuple(tensor_slice.get_shape())
    expected = tuple(param.shape) if index is None else tuple(param.shape[1:])
    if file_shape != expected:
        raise ValueError(f"{file!r}: tensor {key!r} has shape {file_shape}, the model expects {expected}")
    local = param.to_local() if isinstance(param, DTensor) else param
    if local.is_meta:
        raise ValueError(f"cannot load {key!r} into a model on the meta device: materialize it (to_empty) first")
    shape, offset = local_shard_bounds(param)
    assert tuple(local.shape) == shape, (key, tuple(local.shape), shape)
    if local.numel() == 0:  # uneven FSDP shards can leave a rank nothing of a small tensor
        return
    block = tuple(slice(start, start + size) for start, size in zip(offset, shape))
    if index is None:
        local.copy_(tensor_slice[block])
    elif offset[0] <= index < offset[0] + shape[0]:  # this rank holds that slice
        local[index - offset[0]].copy_(tensor_slice[block[1:]])


# ---------------------------------------------------------------- saving


def _check_export_target(path: str, tokenizer: ExportTokenizer | None) -> None:
    # On every rank before any collective, so a bad argument fails all ranks alike.
    if os.path.lexists(path):
        raise ValueError(f"export path {path!r} already exists; Hugging Face exports are never overwritten")
    source = tokenizer.source_dir if tokenizer is not None else None
    if source is not None:
        if not os.path.isfile(os.path.join(source, TOKENIZER_FILE)):
            raise ValueError(f"tokenizer directory {source!r} has no {TOKENIZER_FILE} to copy into the export")
        _source_generation_config(tokenizer)  # a broken file fails every rank here, not rank 0 alone later


def _plan_shards(
    sizes: dict[str, int], max_shard_bytes: int, writers: dict[str, int]
) -> dict[str, tuple[int, list[str]]]:
    """{file name: (the rank writing it, its keys)}: each writer's keys in order, filled up to
    ``max_shard_bytes`` per file (a bigger tensor gets its own file); the writers' files are
    numbered in rank order."""
    groups: list[tuple[int, list[str]]] = []
    used = 0
    for writer in sorted(set(writers.values())):
        groups.append((writer, []))
        used = 0
        for key, size in sizes.items():
            if writers[key] != writer:
                continue
            if groups[-1][1] and used + size > max_shard_bytes:
                groups.append((writer, []))
                used = 0
            groups[-1][1].append(key)
            used += size
    if len(groups) == 1:
        return {SINGLE_FILE: groups[0]}
    return {f"model-{i:05d}-of-{len(groups):05d}.safetensors": group for i, group in enumerate(groups, start=1)}


def _writer(param: torch.Tensor, index: int | None) -> int | None:
    """The global rank that writes the HF tensor: the owner of an expert under expert parallel
    (the first of the ranks holding it); None for everything else, which the first rank holding
    it writes (``agree_on_tensors``)."""
    block = _expert_parallel_block(param)
    if index is None or block is None:
        return None
    mesh, num_local = block
    owner = index // num_local
    return int(mesh.mesh[(0,) * (mesh.ndim - 1) + (owner,)])


def agree_on_tensors(
    sizes: dict[str, int], writers: dict[str, int | None], rank: int, group: dist.ProcessGroup | None
) -> tuple[dict[str, int], dict[str, int]]:
    """Every HF tensor of the model with its size and writer, the same on every rank of ``group``
    (collective): pipeline stages hold different parameters, and the first rank holding a tensor
    writes it unless ``_writer`` named its owner."""
    if not dist.is_initialized():
        return sizes, {key: 0 if writer is None else writer for key, writer in writers.items()}
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (rank, sizes, writers), group=group)
    all_sizes, all_writers = {}, {}
    for holder, held_sizes, held_writers in sorted(everyone, key=lambda entry: entry[0]):
        for key, size in held_sizes.items():
            all_sizes.setdefault(key, size)
            all_writers.setdefault(key, holder if held_writers[key] is None else held_writers[key])
    return all_sizes, all_writers


def _expert_parallel_block(param: torch.Tensor) -> tuple | None:
    """(mesh, experts per rank) of a stacked parameter split over an ``ep`` mesh dim (the last
    one, see ``ParallelDims``); None for any other tensor."""
    if not isinstance(param, DTensor) or "ep" not in (param.device_mesh.mesh_dim_names or ()):
        return None
    mesh = param.device_mesh
    assert mesh.mesh_dim_names[-1] == "ep", mesh.mesh_dim_names
    return mesh, param.shape[0] // mesh.size(-1)


def _share(staging: str | None, group: dist.ProcessGroup | None) -> str:
    """Rank 0's staging folder, on every rank of ``group`` (collective)."""
    box = [staging]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _make_staging_dir(path: str) -> str:
    parent, name = os.path.split(os.path.abspath(path))
    # Same parent, so the final rename stays on one filesystem (atomic); makedirs, unlike
    # mkdtemp, creates it with the user's usual permissions, which the export keeps.
    staging = os.path.join(parent, f".{name}.partial-{os.getpid()}")
    os.makedirs(staging)
    return staging


def _gather(
    tensors: dict[str, tuple[torch.Tensor, int | None]], keys: list[str], dtype: torch.dtype, keep: bool
) -> dict[str, torch.Tensor]:
    """The full tensors ``keys`` (see ``hf_sources``) as ``dtype`` on the CPU if ``keep``, else {}.

    Collective: every rank takes part in each DTensor's all-gather (a stacked parameter's once
    per file); ranks that do not write drop each full tensor at once instead of copying it.
    A stacked parameter split over expert parallel is gathered over its other mesh dims only:
    each ep rank gets its own experts, so no rank ever holds every expert (``_writer`` gives
    each expert's keys to a rank that holds it).
    """
    gathered, stacks = {}, {}
    for key in keys:
        param, index = tensors[key]
        if index is None:
            full, offset = (param.full_tensor() if hasattr(param, "full_tensor") else param), 0
        elif id(param) in stacks:
            full, offset = stacks[id(param)]
        else:
            full, offset = stacks[id(param)] = _stack_block(param)
        if keep:
            gathered[key] = (full if index is None else full[index - offset]).detach().to(dtype).cpu().contiguous()
    return gathered


def _stack_block(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the experts of a stacked parameter this rank can see whole, the index of the first)."""
    block = _expert_parallel_block(param)
    if block is None:
        return (param.full_tensor() if hasattr(param, "full_tensor") else param), 0
    mesh, num_local = block
    ep_only = [Shard(0) if name == "ep" else Replicate() for name in mesh.mesh_dim_names]
    return param.redistribute(mesh, ep_only).to_local(), mesh.get_local_rank("ep") * num_local


def _write_metadata(
    staging: str,
    args,
    dtype: torch.dtype,
    total_bytes: int,
    shards: dict[str, tuple[int, list[str]]],
    tokenizer: ExportTokenizer | None,
) -> None:
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": total_bytes},
            "weight_map": {key: file_name for file_name, (_, keys) in shards.items() for key in keys},
        }
        _write_json(os.path.join(staging, INDEX_FILE), index)
    config = args.to_hf_config(str(dtype).removeprefix("torch."))
    _write_json(os.path.join(staging, CONFIG_FILE), config | (tokenizer.token_ids() if tokenizer is not None else {}))
    write_tokenizer_files(tokenizer, staging)


def write_tokenizer_files(tokenizer: ExportTokenizer | None, dest: str) -> None:
    """Into the directory ``dest``: the tokenizer files (written for the byte tokenizer, else
    copied from ``tokenizer.source_dir``), then ``generation_config.json`` with the run's token
    ids (and the other fields of the source's own, if it has one). None writes nothing."""
    if tokenizer is None:
        return
    if tokenizer.source_dir is None:
        byte_tokenizer_json().save(os.path.join(dest, TOKENIZER_FILE))
        _write_json(os.path.join(dest, TOKENIZER_CONFIG_FILE), byte_tokenizer_config())
    else:
        for file_name in TOKENIZER_FILES:
            source = os.path.join(tokenizer.source_dir, file_name)
            if os.path.isfile(source):
                shutil.copyfile(source, os.path.join(dest, file_name))
    generation_config = _source_generation_config(tokenizer) | tokenizer.token_ids()
    _write_json(os.path.join(dest, GENERATION_CONFIG_FILE), generation_config)


def _source_generation_config(tokenizer: ExportTokenizer) -> dict:
    """The copied tokenizer directory's own generation_config.json; {} when there is none."""
    if tokenizer.source_dir is None:
        return {}
    path = os.path.join(tokenizer.source_dir, GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        return {}
    config = _read_json(path)
    if not isinstance(config, dict):
        raise ValueError(f"{path!r} must hold a JSON object, got {type(config).__name__}")
    return config


def _write_json(path: str, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")
