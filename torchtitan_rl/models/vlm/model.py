"""Vision-language model: Pixtral encoder -> patch merger + MLP projector -> Qwen3 decoder.

The language model is ``Qwen3Model`` itself (same module names, so its TP plan and FSDP
wrapping apply unchanged); the vision tower and projector are extra children. Image features
replace the embeddings of placeholder tokens named by an explicit per-token ``vision_index``,
built on the host when samples are packed, so the model never searches for image tokens.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_rl.models.attention import AttentionState
from torchtitan_rl.models.qwen3.model import (
    INIT_STD,
    LORA_TARGETS,
    Qwen3Model,
    RMSNorm,
    check_packed_inputs,
)
from torchtitan_rl.models.vision.model import VisionTransformer, check_grids
from torchtitan_rl.models.vlm.args import VLMModelArgs


@dataclass(frozen=True)
class VisionInputs:
    """The images of one packed micro-batch.

    ``patches [P, C*p*p]``: every image's patches row-major over its grid, images in order
    (see ``VisionTransformer.forward``); ``grids``: each image's ``(rows, cols)`` in patches;
    ``vision_index [T]`` (int64): for token t, the row of the merged, projected features
    (images in order, each image's merged patches row-major) that replaces its embedding, or -1.
    """

    patches: torch.Tensor
    grids: tuple[tuple[int, int], ...]
    vision_index: torch.Tensor


def merge_vision_features(h: torch.Tensor, features: torch.Tensor, vision_index: torch.Tensor) -> torch.Tensor:
    """``h [T, D]`` with row t replaced by ``features[vision_index[t]]`` where that is >= 0.

    Text tokens gather row 0 and then discard it, instead of indexing only the image tokens:
    that keeps every vision parameter in the autograd graph (with a zero gradient when no token
    uses a feature), so every rank's backward produces gradients for the same parameters and
    FSDP's reduce-scatters match even on a micro-batch whose only image is a zero-weight dummy.
    """
    gathered = features.index_select(0, vision_index.clamp(min=0)).to(h.dtype)
    return torch.where(vision_index[:, None] >= 0, gathered, h)


# The language model's layers, and the projector's linear layers as one target.
VLM_LORA_TARGETS = {**LORA_TARGETS, "projector": r"projector\.(merger|linear_1|linear_2)"}


class Projector(nn.Module):
    """Mistral3's multi-modal projector: RMSNorm, merge x merge patch merger, Linear-GELU-Linear."""

    def __init__(self, args: VLMModelArgs):
        super().__init__()
        vision_dim, merge = args.vision.dim, args.spatial_merge_size
        self.merge = merge
        # The text model's eps, not the vision one (as HF's Mistral3 builds it).
        self.norm = RMSNorm(vision_dim, args.norm_eps)
        self.merger = nn.Linear(vision_dim * merge * merge, vision_dim, bias=False)
        self.linear_1 = nn.Linear(vision_dim, args.dim, bias=args.projector_bias)
        self.linear_2 = nn.Linear(args.dim, args.dim, bias=args.projector_bias)

    def forward(self, features: torch.Tensor, grids: Sequence[tuple[int, int]]) -> torch.Tensor:
        """``features [P, D_vision]`` of packed images -> ``[F, D_text]``, F = sum(rows*cols) / merge**2."""
        features = self.norm(features)
        m = self.merge
        merged = []
        for image, (rows, cols) in zip(features.split([r * c for r, c in grids]), grids):
            # Each merged unit's m x m patches become one vector ordered (channel, row in unit,
            # column in unit): the channel-major order of ``F.unfold`` that HF's merger uses.
            units = image.view(rows // m, m, cols // m, m, -1).permute(0, 2, 4, 1, 3)
            merged.append(units.reshape((rows // m) * (cols // m), -1))
        hidden = self.merger(torch.cat(merged))
        return self.linear_2(F.gelu(self.linear_1(hidden)))


class VLMModel(Qwen3Model):
    def __init__(self, args: VLMModelArgs):
        super().__init__(args)
        self.vision_tower = VisionTransformer(args.vision)
        self.projector = Projector(args)

    def blocks(self) -> list[nn.Module]:
        vision = (
            [] if self.vision_tower is None else list(self.vision_tower.layers.values())
        )  # a later pipeline stage's
        return [*vision, *super().blocks()]

    def encode_images(self, patches: torch.Tensor, grids: Sequence[tuple[int, int]]) -> torch.Tensor:
        """Projected image features ``[F, dim]``: per image ``(rows/m) * (cols/m)`` rows, row-major."""
        m = self.args.spatial_merge_size
        grids = check_grids(grids)
        if not grids:
            raise ValueError("no images to encode (pass vision=None for a text-only micro-batch)")
        for i, (rows, cols) in enumerate(grids):
            # HF's unfold would silently drop a last odd row/column of patches.
            if rows % m or cols % m:
                raise ValueError(f"image {i}: grid ({rows}, {cols}) is not a multiple of spatial_merge_size={m}")
        return self.projector(self.vision_tower(patches, grids), grids)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        seq_ids: torch.Tensor,
        vision: VisionInputs | None = None,
        *,
        attention: AttentionState | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states ``[T, dim]``, as ``Qwen3Model.forward``; ``vision=None``
        is text only. ``attention`` is the language model's (``Qwen3Model.run_layers``): the
        vision tower always attends within each image. A pipeline stage after the first
        (``models.stages``: no embeddings, no vision tower) takes the previous stage's hidden
        states."""
        if self.tok_embeddings is None:
            return self.run_layers(tokens, positions, seq_ids, attention=attention)
        check_packed_inputs(tokens, positions, seq_ids)
        h = self.tok_embeddings(tokens)
        if vision is not None:
            index = vision.vision_index
            if index.dim() != 1 or index.shape != tokens.shape or index.dtype != torch.int64:
                raise ValueError(
                    f"vision_index must be int64 of the tokens' shape {tuple(tokens.shape)}, "
                    f"got {index.dtype} {tuple(index.shape)}"
                )
            features = self.encode_images(vision.patches, vision.grids)
            if index.device.type == "cpu":
                # Free on the host; on an accelerator it would cost a sync per forward (there an
                # out-of-range gather fails on its own).
                _check_vision_index(index, features.shape[0])
            # Under sequence-parallel TP the residual stream holds this rank's token shard only:
            # every TP rank encodes all images and takes its tokens' feature rows, so the
            # features' gradient is summed over the TP ranks (models/vlm/parallelize.py).
            h = merge_vision_features(h, self.token_shard.replicated(features), self.shard_tokens(index))
        return self.run_layers(h, positions, seq_ids, attention=attention)

    @torch.no_grad()
    def init_param_(self, fqn: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Fill ``tensor`` (the full-shape parameter named ``fqn``) in place from ``generator``."""
        if not fqn.startswith(("vision_tower.", "projector.")):
            return super().init_param_(fqn, tensor, generator)
        *_, module_name, param_name = fqn.split(".")
        if param_name == "bias":
            tensor.zero_()
            return
        if param_name != "weight":
            raise ValueError(f"no init rule for parameter {fqn!r}")
        if module_name.endswith(("norm", "ln_pre")):
            tensor.fill_(1.0)
            return
        if module_name in ("patch_embedding", "wq", "wk", "wv", "w1", "w3", "merger", "linear_1", "linear_2"):
            std = INIT_STD
        elif module_name in ("wo", "w2"):
            # Residual-stream writers of the vision tower: depth-independent residual variance.
            std = INIT_STD / math.sqrt(2 * self.args.vision.n_layers)
        else:
            raise ValueError(f"no init rule for parameter {fqn!r}")
        nn.init.trunc_normal_(tensor, std=std, a=-3 * std, b=3 * std, generator=generator)


def _check_vision_index(index: torch.Tensor, num_features: int) -> None:
    used = index[index >= 0]
    if used.numel() > num_features:
        raise ValueError(f"{used.numel()} tokens take image features but the images give only {num_features}")
    if bool((index < -1).any()) or (used.numel() and int(used.max()) >= num_features):
        raise ValueError(f"vision_index holds values outside [-1, {num_features}) ({num_features} image features)")
