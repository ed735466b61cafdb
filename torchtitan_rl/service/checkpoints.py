"""Saved states of training clients: ``tinker://<model_id>/weights/<name>`` is a folder under
``job.dump_folder/service/`` with a DCP checkpoint of the client's adapters and AdamW state
(resharded on load, so a state moves between layouts), the client's LoRA settings, and the
adapters as a PEFT directory. Names cannot leave that folder.
"""

import json
import os
import re

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from torchtitan_rl.service.clients import LoRAClientConfig
from torchtitan_rl.service.operations import UserError

SCHEME = "tinker://"
KINDS = ("weights", "sampler_weights")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")
_MODEL_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:\-]{0,255}")
CLIENT_FILE = "client.json"
DCP_FOLDER = "dcp"
PEFT_FOLDER = "peft"


def check_name(name: str, field: str = "path") -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise UserError(
            f"{field}: {name!r} is not a checkpoint name (letters, digits, '_', '-', '.', at most 128, no '..' "
            "and no '/'): names cannot leave the service's folder"
        )
    return name


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"{SCHEME}{model_id}/{kind}/{name}"


def parse_path(path: str, field: str = "path") -> tuple[str, str, str]:
    """(model_id, kind, name) of a ``tinker://`` path."""
    if not isinstance(path, str) or not path.startswith(SCHEME):
        raise UserError(f"{field}: {path!r} is not a tinker:// path")
    parts = path[len(SCHEME) :].split("/")
    if len(parts) != 3 or parts[1] not in KINDS or not _MODEL_ID.fullmatch(parts[0]):
        raise UserError(f"{field}: {path!r} is not tinker://<model id>/{{{'|'.join(KINDS)}}}/<name>")
    check_name(parts[2], field)
    return parts[0], parts[1], parts[2]


class CheckpointStore:
    """Saved client states under ``root``; ``group``: the training ranks, who save and load
    together (None: the whole launch)."""

    def __init__(self, root: str, group: dist.ProcessGroup | None = None):
        self.root = root
        self.group = group

    def folder(self, model_id: str, kind: str, name: str) -> str:
        return os.path.join(self.root, model_id.replace(":", "_"), kind, name)

    def existing(self, path: str, field: str = "path") -> tuple[str, str, str, str]:
        """(folder, model_id, kind, name) of a saved state; UserError when there is none."""
        model_id, kind, name = parse_path(path, field)
        folder = self.folder(model_id, kind, name)
        if not os.path.isfile(os.path.join(folder, CLIENT_FILE)):
            raise UserError(f"{field}: nothing was saved at {path!r}")
        return folder, model_id, kind, name

    @staticmethod
    def read_client(folder: str) -> tuple[LoRAClientConfig, str, bool]:
        """(LoRA settings, base model, whether an optimizer state was saved)."""
        with open(os.path.join(folder, CLIENT_FILE)) as f:
            meta = json.load(f)
        return LoRAClientConfig(**meta["lora"]), meta["base_model"], meta["has_optimizer_state"]

    def save(
        self,
        folder: str,
        config: LoRAClientConfig,
        base_model: str,
        adapters: dict[str, torch.Tensor],
        optimizer_state: dict[str, dict[str, torch.Tensor]],
    ) -> None:
        """Collective: every rank writes its shards; rank 0 writes the settings last (their
        presence marks a complete save)."""
        state = {"adapters": adapters, "optimizer": optimizer_state}
        dcp.save(state, checkpoint_id=os.path.join(folder, DCP_FOLDER), process_group=self.group)
        if dist.is_initialized():
            dist.barrier(group=self.group)
        if not dist.is_initialized() or dist.get_rank() == 0:
            meta = {
                "lora": vars(config),
                "base_model": base_model,
                "has_optimizer_state": bool(optimizer_state),
            }
            with open(os.path.join(folder, CLIENT_FILE), "w") as f:
                json.dump(meta, f, indent=1)

    def load(self, folder: str, adapters: dict[str, torch.Tensor], optimizer_state: dict | None) -> None:
        """Fill ``adapters`` (and ``optimizer_state``'s tensors, shaped like the saved ones) in place."""
        state = {"adapters": adapters}
        if optimizer_state:
            state["optimizer"] = optimizer_state
        dcp.load(state, checkpoint_id=os.path.join(folder, DCP_FOLDER), process_group=self.group)
