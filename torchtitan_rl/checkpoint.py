"""Checkpoints: save and resume the whole training state with torch.distributed.checkpoint.

``{dump_folder}/{checkpoint.folder}/step-{N}/`` holds one checkpoint: DCP shards of the model,
optimizer, LR schedule, data-loader position, train state (step, tokens seen) and RNG
state, plus ``checkpoint.json`` describing it. DCP stores every tensor with its global shape
and offsets, so a checkpoint loads into any parallel layout (another DP degree, TP or CP).

Crash safety: a checkpoint is written to ``step-{N}.partial`` and renamed to ``step-{N}``
by rank 0 only after every rank finished writing (DCP's coordinator writes its metadata
last, after gathering every rank's result). The rename is atomic, so a process killed
during a save leaves only a ``.partial`` folder, which is never loaded and is removed by
the next save. Old checkpoints are deleted (``keep_latest_k``) only after a newer one is
complete.

LoRA (``models.lora``): a training checkpoint holds only what trains (the adapters, and the
input embedding with ``lora.train_embeddings``) and its optimizer state; ``checkpoint.json``
says so and records the adapters' settings. The frozen base is not saved: a resumed run loads
it again from ``checkpoint.initial_load_path`` (or initializes it from the seed, as the first
run did), then the checkpoint on top. The last save in Hugging Face format is a PEFT adapter
directory (``peft_checkpoint``), with the merged model in ``merged/`` on request.
"""

import dataclasses
import json
import logging
import os
import re
import shutil
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.utils import CheckpointException

from torchtitan_rl.config.job_config import Checkpoint
from torchtitan_rl.hf_checkpoint import load_hf_weights, save_hf_checkpoint
from torchtitan_rl.hf_tokenizer_files import ExportTokenizer
from torchtitan_rl.models.lora import LoRASettings, is_adapter_key, lora_modules
from torchtitan_rl.models.qwen3.args import architecture_differences
from torchtitan_rl.models.registry import spec_for_args
from torchtitan_rl.peft_checkpoint import load_peft_adapter, save_merged_hf, save_peft_adapter

logger = logging.getLogger(__name__)

DESCRIPTION_FILE = "checkpoint.json"
_STEP_FOLDER = re.compile(r"step-(\d+)")
_EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass
class TrainState(Stateful):
    """Where the run is: the last finished step and the real (unpadded) tokens trained on."""

    step: int = 0
    tokens_seen: int | torch.Tensor = 0

    def state_dict(self) -> dict[str, Any]:
        # tokens_seen may be a device tensor (summed without host syncs during training).
        return {"step": self.step, "tokens_seen": int(self.tokens_seen)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step, self.tokens_seen = int(state_dict["step"]), int(state_dict["tokens_seen"])


class _ModelState(Stateful):
    """The model's parameters as DTensors/tensors with global shapes (any layout loads them);
    with ``select``, only the parameters whose names it accepts (the rest are left alone)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype | None = None, select=None):
        self.model, self.dtype, self.select = model, dtype, select

    def state_dict(self) -> dict[str, Any]:
        state = get_model_state_dict(self.model)
        if self.select is not None:
            state = {k: v for k, v in state.items() if self.select(k)}
        if self.dtype is not None:
            state = {k: v.to(self.dtype) for k, v in state.items()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # DCP loads every key state_dict() asked for or fails, so non-strict drops nothing here.
        set_model_state_dict(self.model, state_dict, options=StateDictOptions(strict=self.select is None))


def trainable_names(model: torch.nn.Module) -> set[str]:
    """Names of the parameters that train, a tied one under each of its names."""
    return {name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}


def lora_description(settings: LoRASettings) -> dict[str, Any]:
    return {
        "rank": settings.rank,
        "alpha": settings.alpha,
        "dropout": settings.dropout,
        "target_modules": list(settings.target_modules),
        "init": settings.init,
        "train_embeddings": settings.train_embeddings,
        "base_dtype": str(settings.base_dtype).removeprefix("torch."),
    }


def check_lora(description: dict[str, Any], settings: LoRASettings | None, path: str) -> None:
    """The adapters of the checkpoint at ``path`` must be those this run builds (or both have
    none): the rank, alpha, targets and trained embedding decide which tensors exist."""
    file = os.path.join(path, DESCRIPTION_FILE)
    saved = description.get("lora")
    if saved is None and settings is not None:
        raise ValueError(
            f"checkpoint {path} is a training checkpoint without LoRA adapters (according to {file}), but this "
            "run has lora.enable = true; start the LoRA run in another job.dump_folder, with "
            "checkpoint.initial_load_path naming this checkpoint as its base"
        )
    if saved is not None and settings is None:
        raise ValueError(
            f"checkpoint {path} holds a model with LoRA adapters (according to {file}); this run has "
            "lora.enable = false: enable it with the checkpoint's lora settings"
        )
    if saved is None:
        return
    ours = lora_description(settings)
    diffs = [
        f"lora.{key}={saved.get(key)!r} (this run: {ours[key]!r})"
        for key in ("rank", "alpha", "target_modules", "train_embeddings")
        if (sorted(saved.get(key) or []) if key == "target_modules" else saved.get(key))
        != (sorted(ours[key]) if key == "target_modules" else ours[key])
    ]
    if diffs:
        raise ValueError(f"checkpoint {path} holds other LoRA adapters: {', '.join(diffs)} according to {file}")


class _OptimizerState(Stateful):
    """The optimizer's state and hyperparameters keyed by parameter name: flattened, so that a
    layout with other parameter groups loads it (``optim.build_optimizer`` makes one group per
    device mesh, and expert parallel or tensor parallel add meshes)."""

    _OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer, options=self._OPTIONS)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict, options=self._OPTIONS)


class _RNGState(Stateful):
    """Every rank seeds the same generators the same way, so one copy describes all ranks."""

    def state_dict(self) -> dict[str, Any]:
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["cpu"])
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["cuda"])


def step_folders(folder: str) -> dict[int, str]:
    """Complete checkpoints in ``folder``: step -> path (``.partial`` folders are not listed)."""
    if not os.path.isdir(folder):
        return {}
    found = {}
    for name in os.listdir(folder):
        match = _STEP_FOLDER.fullmatch(name)
        path = os.path.join(folder, name)
        if match and os.path.isfile(os.path.join(path, DESCRIPTION_FILE)):
            found[int(match.group(1))] = path
    return found


def read_description(path: str) -> dict[str, Any]:
    file = os.path.join(path, DESCRIPTION_FILE)
    try:
        with open(file) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path} is not a checkpoint of this project: {DESCRIPTION_FILE} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"checkpoint description {file} is corrupted: {err}") from None


def check_model_args(description: dict[str, Any], args, path: str) -> None:
    """The checkpoint must hold the model this run builds; else say which hyper-parameters differ."""
    file = os.path.join(path, DESCRIPTION_FILE)
    # Checkpoints written before the registry hold Qwen3 models and name no family.
    saved_name, name = description.get("model_name", "qwen3"), spec_for_args(args).name
    if saved_name != name:
        raise ValueError(
            f"checkpoint {path} holds a {saved_name!r} model, this run builds model.name={name!r} (according to {file})"
        )
    try:
        saved = type(args).from_dict(description["model_args"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"checkpoint description {file} has no valid model_args: {err}") from None
    diffs = architecture_differences(saved, args)
    if diffs:
        listed = ", ".join(f"{name}={theirs!r} (this run: {ours!r})" for name, theirs, ours in diffs)
        raise ValueError(
            f"checkpoint {path} holds another model (from another model.flavor?): {listed} according to {file}"
        )


def check_dcp_files(path: str) -> None:
    """Fail with the file's name, on every rank alike, before a collective load could hang or
    report a bare traceback: the metadata must parse and every shard it names must exist."""
    reader = dcp.FileSystemReader(path)
    try:
        metadata = reader.read_metadata()
    except FileNotFoundError:
        raise ValueError(f"checkpoint {path} has no DCP metadata file {os.path.join(path, '.metadata')}") from None
    except Exception as err:  # unpickling garbage raises many exception types
        raise ValueError(f"checkpoint metadata {os.path.join(path, '.metadata')} is corrupted: {err!r}") from None
    files = sorted({info.relative_path for info in (metadata.storage_data or {}).values()})
    missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise ValueError(f"checkpoint {path} is incomplete: missing shard file(s) {', '.join(missing)}")


def _unwrap(err: CheckpointException) -> str:
    """The first rank's underlying error of a failed DCP call (its own message is a traceback dump)."""
    for rank, failure in sorted(err.failures.items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {type(exc).__name__}: {exc}"
    return str(err)


class CheckpointManager:
    """Saves at ``interval`` steps and the last step; on start-up resumes or loads initial weights.

    Every rank calls every method (saves and loads are collective).
    """

    def __init__(
        self,
        config: Checkpoint,
        *,
        dump_folder: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler,
        dataloader,
        train_state: TrainState,
        model_args,
        export_tokenizer: ExportTokenizer | None = None,
        extra_models: dict[str, torch.nn.Module] | None = None,
        extra_states: dict[str, Stateful] | None = None,
        extra_engines: dict[str, Any] | None = None,
        process_group: dist.ProcessGroup | None = None,
        lora: LoRASettings | None = None,
        export_merged: bool = False,
        seed: int = 0,
    ):
        """``export_tokenizer``: the run's tokenizer as a Hugging Face save writes it (its files and
        the token ids generation stops at; None: neither). ``extra_states``: more of the training
        state, e.g. rollouts generated ahead. ``extra_engines``: more trained models (anything
        with ``model``, ``optimizer`` and ``lr_scheduler``, e.g. PPO's critic), saved with their
        optimizer and schedule, in model-only saves too, and exported in Hugging Face format to
        ``<step>/<name>`` by a Hugging Face save.
        ``process_group``: the ranks that save and load (the training ranks when GRPO has
        rollout ranks); None is the whole launch. ``lora``: the adapters ``model`` has (None:
        none); ``export_merged``: the last save in HF format adds the merged model; ``seed``: the
        seed the base was initialized with when no ``initial_load_path`` replaces it."""
        if config.initial_load_adapter_path and lora is None:
            raise ValueError(
                f"checkpoint.initial_load_adapter_path={config.initial_load_adapter_path!r} needs lora.enable = true"
            )
        self.lora, self.export_merged = lora, export_merged
        # Where the frozen base comes from: an adapters-only checkpoint only resumes onto it.
        self.base = config.initial_load_path or f"the seeded init (debug.seed = {seed})"
        self.config = config
        self.group = process_group
        self.folder = os.path.join(dump_folder, config.folder)
        self.model = model
        self.model_args = model_args
        self.export_tokenizer = export_tokenizer
        self.train_state = train_state
        # With LoRA the frozen base is not part of the training state (see the module's doc).
        trainable = trainable_names(model) if lora is not None else None
        self.states = {
            "model": _ModelState(model, select=None if trainable is None else trainable.__contains__),
            "optimizer": _OptimizerState(model, optimizer),
            "lr_scheduler": lr_scheduler,
            "dataloader": dataloader,
            "train_state": train_state,
            "rng": _RNGState(),
            # e.g. RL's frozen reference policy: part of the training state, not of the model.
            **{name: _ModelState(m) for name, m in (extra_models or {}).items()},
            **(extra_states or {}),
        }
        self.extra_engines = extra_engines or {}
        for name, engine in self.extra_engines.items():
            self.states[name] = _ModelState(engine.model)
            self.states[f"{name}_optimizer"] = _OptimizerState(engine.model, engine.optimizer)
            self.states[f"{name}_lr_scheduler"] = engine.lr_scheduler
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._pending: Future | None = None
        # Background saves run their collectives on a group of their own, so they never
        # interleave with the training step's collectives on the default group.
        self._async_group = None
        if config.enable and config.async_mode == "async" and dist.is_initialized():
            if process_group is None:
                self._async_group = dist.new_group(backend="gloo")
            else:
                # Only the members create it: the other ranks of the launch never save.
                ranks = dist.get_process_group_ranks(process_group)
                self._async_group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)

    # ------------------------------------------------------------------ loading

    def load(self) -> bool:
        """Resume from the latest complete checkpoint (or ``load_step``), else load the initial
        weights if configured. True when the whole training state was restored."""
        if self.config.enable:
            steps = step_folders(self.folder)
            resumable = {s: p for s, p in steps.items() if not read_description(p)["model_only"]}
            if self.config.load_step != -1:
                if self.config.load_step not in resumable:
                    raise ValueError(
                        f"checkpoint.load_step={self.config.load_step}: no complete training checkpoint "
                        f"step-{self.config.load_step} in {self.folder} (found: {sorted(resumable) or 'none'})"
                    )
                path = resumable[self.config.load_step]
            else:
                path = resumable[max(resumable)] if resumable else None
            if path is not None:
                # Checked before the base is read, which may take long.
                description = read_description(path)
                check_lora(description, self.lora, path)
                if self.lora is not None:
                    if description.get("base") != self.base:
                        raise ValueError(
                            f"checkpoint {path} holds adapters trained on the base {description.get('base')!r} "
                            f"(according to {os.path.join(path, DESCRIPTION_FILE)}), but this run's base is "
                            f"{self.base!r}: set checkpoint.initial_load_path (or debug.seed) as in that run"
                        )
                    self._load_initial(resuming=True)
                self._load_dcp(path, self.states, "the training state")
                return True
        return self._load_initial(resuming=False)

    def _load_initial(self, resuming: bool) -> bool:
        """The initial weights (resuming with LoRA: the frozen base alone); True when they came
        with a whole training state."""
        path = self.config.initial_load_path
        restored = False
        if not path:
            pass
        elif not os.path.isdir(path):
            raise ValueError(f"checkpoint.initial_load_path={path!r} does not exist")
        elif self.config.initial_load_in_hf:
            load_hf_weights(self.model, path)
            logger.info("loaded Hugging Face weights from %s", path)
        else:
            restored = self._load_initial_dcp(path)
        adapter = self.config.initial_load_adapter_path
        if adapter and not resuming:
            if not os.path.isdir(adapter):
                raise ValueError(f"checkpoint.initial_load_adapter_path={adapter!r} does not exist")
            load_peft_adapter(self.model, adapter, self.lora)
            logger.info("loaded LoRA adapters from %s", adapter)
        return restored

    def _load_initial_dcp(self, path: str) -> bool:
        description = read_description(path)
        if description["format"] == "peft":
            raise ValueError(
                f"checkpoint.initial_load_path={path!r} is a PEFT adapter export, not a base model; name it in "
                "checkpoint.initial_load_adapter_path"
            )
        if description["format"] != "dcp":
            raise ValueError(
                f"checkpoint.initial_load_path={path!r} is a Hugging Face export; set checkpoint.initial_load_in_hf = true"
            )
        if self.lora is None:
            check_lora(description, None, path)
            model_only = self.config.initial_load_model_only or description["model_only"]
            states = {"model": self.states["model"]} if model_only else self.states
            self._load_dcp(path, states, "model weights" if model_only else "the training state")
            return not model_only
        # A LoRA run starts from base weights: the optimizer state of another run does not fit it.
        if description.get("adapters_only"):
            raise ValueError(
                f"checkpoint.initial_load_path={path!r} holds LoRA adapters only, not the base model (according to "
                f"{os.path.join(path, DESCRIPTION_FILE)}); name the base model that run started from"
            )
        if description.get("lora") is not None:
            check_lora(description, self.lora, path)
            select = None  # a model-only save of an adapted model: base and adapters
        else:
            select = lambda name: not is_adapter_key(name)  # noqa: E731
        self._load_dcp(path, {"model": _ModelState(self.model, select=select)}, "model weights")
        return False

    def _load_dcp(self, path: str, states: dict[str, Stateful], what: str) -> None:
        description = read_description(path)
        check_model_args(description, self.model_args, path)
        check_dcp_files(path)
        try:
            dcp.load(states, checkpoint_id=path, process_group=self.group, no_dist=not dist.is_initialized())
        except CheckpointException as err:
            raise ValueError(f"could not load checkpoint {path}: {_unwrap(err)}") from None
        logger.info("loaded %s from %s", what, path)

    # ------------------------------------------------------------------ saving

    def will_save(self, step: int, last: bool) -> bool:
        """Whether ``maybe_save(step, last)`` saves the whole training state."""
        saves = self.config.enable and (last or step % self.config.interval == 0)
        return saves and not (last and self.config.last_save_model_only)

    def maybe_save(self, step: int, last: bool) -> None:
        if not self.config.enable or not (last or step % self.config.interval == 0):
            return
        self._save(step, model_only=last and self.config.last_save_model_only)

    def save_model(self, step: int) -> None:
        """Save the model alone as checkpoint ``step`` (as a last save with
        ``last_save_model_only`` would: in ``export_dtype``, in HF format with ``last_save_in_hf``)
        and wait until it is complete."""
        assert self.config.enable
        self._save(step, model_only=True)
        self.wait()

    def _save(self, step: int, model_only: bool) -> None:
        final = os.path.join(self.folder, f"step-{step}")
        partial = final + ".partial"
        self.wait()
        if self.rank == 0:
            # Leftovers of a crashed save (or of this step in an earlier attempt) are garbage.
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(self.folder, exist_ok=True)
        self._barrier()
        in_hf = model_only and self.config.last_save_in_hf
        description = {
            "step": step,
            "model_only": model_only,
            "format": ("hf" if self.lora is None else "peft") if in_hf else "dcp",
            "model_name": spec_for_args(self.model_args).name,
            "model_args": dataclasses.asdict(self.model_args),
            "world_size": dist.get_world_size(self.group) if dist.is_initialized() else 1,
        }
        if self.lora is not None:
            description["lora"] = lora_description(self.lora)
            description["adapters_only"] = not model_only
            description["base"] = self.base
        if in_hf:
            self._save_hf(partial)
            self._commit(partial, final, description)
            return
        if model_only:
            dtype = _EXPORT_DTYPES[self.config.export_dtype]
            states = {"model": _ModelState(self.model, dtype)}
            states.update({name: _ModelState(engine.model, dtype) for name, engine in self.extra_engines.items()})
        else:
            states = self.states
        if self.config.async_mode == "async":
            written = dcp.async_save(
                states, checkpoint_id=partial, process_group=self._async_group, no_dist=not dist.is_initialized()
            )
            # What wait() waits for: the write *and* the completion mark. The write's own future
            # is resolved before its callbacks run, so waiting on it alone would let the next
            # save, or the exit, overlap the rename and pruning.
            committed: Future = Future()

            def commit_when_written(done: Future) -> None:
                # Runs in the writer thread. A failed write stays .partial; wait() re-raises its
                # error (or the commit's) in the training thread.
                try:
                    done.result()
                    self._commit(partial, final, description)
                except BaseException as err:  # noqa: BLE001  (any error must reach wait(), else it waits forever)
                    committed.set_exception(err)
                else:
                    committed.set_result(None)

            written.add_done_callback(commit_when_written)
            self._pending = committed
            return
        dcp.save(states, checkpoint_id=partial, process_group=self.group, no_dist=not dist.is_initialized())
        self._commit(partial, final, description)

    def _save_hf(self, partial: str) -> None:
        dtype, tokenizer = _EXPORT_DTYPES[self.config.export_dtype], self.export_tokenizer
        if self.lora is None:
            save_hf_checkpoint(self.model, partial, dtype, tokenizer, group=self.group)
        else:
            save_peft_adapter(self.model, partial, self.lora, dtype, tokenizer, group=self.group)
            if self.export_merged:
                save_merged_hf(self.model, os.path.join(partial, "merged"), dtype, tokenizer, group=self.group)
        for name, engine in self.extra_engines.items():  # into the policy's folder, which now exists
            # A model with adapters is exported merged: a plain model of its architecture.
            save = save_merged_hf if lora_modules(engine.model) else save_hf_checkpoint
            save(engine.model, os.path.join(partial, name), dtype, tokenizer, group=self.group)

    def _commit(self, partial: str, final: str, description: dict) -> None:
        """Rank 0: mark complete (description file, then the atomic rename), then prune."""
        if self.rank != 0:
            return
        with open(os.path.join(partial, DESCRIPTION_FILE), "w") as f:
            json.dump(description, f, indent=1)
        shutil.rmtree(final, ignore_errors=True)  # a re-run of a step replaces its checkpoint
        os.replace(partial, final)
        logger.info("saved checkpoint %s", final)
        self._prune()

    def _prune(self) -> None:
        keep = self.config.keep_latest_k
        if keep == 0:
            return
        for _, path in sorted(step_folders(self.folder).items())[:-keep]:
            shutil.rmtree(path, ignore_errors=True)
            logger.info("deleted checkpoint %s (checkpoint.keep_latest_k=%d)", path, keep)

    def wait(self) -> None:
        """Block until a background save is written and marked complete (and surface its error)."""
        if self._pending is not None:
            future, self._pending = self._pending, None
            future.result()

    def close(self) -> None:
        """Finish a background save (raising its error), then destroy the group it wrote with."""
        try:
            self.wait()
        finally:
            if self._async_group is not None:
                dist.destroy_process_group(self._async_group)
                self._async_group = None

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier(group=self.group)
