"""Pixtral vision transformer, single-device PyTorch on packed images.

All images of a micro-batch are one sequence of patches (image after image, each row-major over
its grid of patches). Attention is bidirectional and block-diagonal by image; positions enter
only through an axial 2-D RoPE of each patch's (row, column) in its own image, so images of any
size share the weights and there is no learned position table (and no buffers: the tables are
computed on every forward, like the language model's).

Pixels arrive patchified, ``[P, C * p * p]`` with each patch flattened channel-major
(``C, p, p``), so the patch "convolution" (stride = kernel = patch size) is one matmul. Its
weight keeps the Conv2d shape ``[dim, C, p, p]`` so checkpoints map 1:1 to HF's ``patch_conv``.
"""

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_rl.models.attention import LayerAttention, build_attention_context
from torchtitan_rl.models.qwen3.model import RMSNorm, TransformerBlock, apply_rotary
from torchtitan_rl.models.vision.args import VisionArgs


def axial_rotary_cos_sin(
    rows: torch.Tensor, cols: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[P, 1, head_dim]`` of Pixtral's axial RoPE for patches at (rows, cols).

    The usual 1-D frequencies ``theta ** (-2i / head_dim)`` (head_dim / 2 of them) are dealt
    out alternately: even-indexed ones rotate by the row, odd-indexed ones by the column. The
    head_dim / 2 angles [row part, column part] are then repeated for the rotate-half layout,
    as HF's ``PixtralVisionRotaryEmbedding`` lays them out.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=rows.device)
    inv_freq = 1.0 / (theta ** (exponents.float() / head_dim))
    angles = torch.cat(
        (rows.float()[:, None] * inv_freq[None, 0::2], cols.float()[:, None] * inv_freq[None, 1::2]), dim=-1
    )
    angles = torch.cat((angles, angles), dim=-1)[:, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def check_grids(grids: Sequence[Sequence[int]], max_patches_per_side: int | None = None) -> tuple[tuple[int, int], ...]:
    """``grids`` as a tuple of ``(rows, cols)`` int pairs; ValueError if malformed."""
    checked = []
    for i, grid in enumerate(grids):
        if len(grid) != 2 or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in grid):
            raise ValueError(f"image {i}: grid must be (rows, cols) of positive ints, got {grid!r}")
        if max_patches_per_side is not None and max(grid) > max_patches_per_side:
            raise ValueError(
                f"image {i}: grid {tuple(grid)} has a side longer than max_patches_per_side="
                f"{max_patches_per_side} patches (resize images to at most that many patches per side)"
            )
        checked.append((int(grid[0]), int(grid[1])))
    return tuple(checked)


def patch_coordinates(grids: Sequence[tuple[int, int]], device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """Per patch of the packed images: ``(rows, cols, image index, index within the image)``."""
    rows, cols, image, index = [], [], [], []
    for i, (r, c) in enumerate(grids):
        rows.append(torch.arange(r).repeat_interleave(c))
        cols.append(torch.arange(c).repeat(r))
        image.append(torch.full((r * c,), i))
        index.append(torch.arange(r * c))
    # Built on the host and moved once: a few small tensors per image.
    return tuple(torch.cat(parts).to(device) for parts in (rows, cols, image, index))


class PatchEmbedding(nn.Module):
    """Conv2d(kernel = stride = patch size, no bias) applied to pre-cut patches."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(args.dim, args.num_channels, args.patch_size, args.patch_size))
        # nn.Conv2d's own default, so an un-initialized model still holds finite numbers.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # [dim, C, p, p] flattened row-wise is [dim, C*p*p] in the same channel-major order
        # as the patch vectors, so this equals the convolution at each patch.
        return F.linear(patches.to(self.weight.dtype), self.weight.flatten(1))


class VisionAttention(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(
        self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], attention: LayerAttention
    ) -> torch.Tensor:
        num_patches = x.shape[0]
        # -1 heads: a tensor-parallel plan may give each rank a share of the heads.
        q = self.wq(x).view(num_patches, -1, self.head_dim)
        k = self.wk(x).view(num_patches, -1, self.head_dim)
        v = self.wv(x).view(num_patches, -1, self.head_dim)
        cos, sin = rotary
        out = attention(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v)
        return self.wo(out.reshape(num_patches, -1))


class VisionTransformer(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        self.patch_embedding = PatchEmbedding(args)
        self.ln_pre = RMSNorm(args.dim, args.norm_eps)
        self.layers = nn.ModuleDict(
            {
                str(i): TransformerBlock(VisionAttention(args), args.dim, args.hidden_dim, args.norm_eps)
                for i in range(args.n_layers)
            }
        )

    def forward(self, patches: torch.Tensor, grids: Sequence[tuple[int, int]]) -> torch.Tensor:
        """Last-layer features ``[P, dim]`` (no final norm, as Pixtral) of packed images.

        ``patches [P, C*p*p]``: image i's ``rows * cols`` patches row-major, images in the
        order of ``grids`` (each image's ``(rows, cols)`` in patches).
        """
        grids = check_grids(grids, self.args.max_patches_per_side)
        if patches.dim() != 2 or patches.shape[1] != self.args.patch_dim:
            raise ValueError(
                f"patches must be [P, num_channels * patch_size**2 = {self.args.patch_dim}], got {tuple(patches.shape)}"
            )
        num_patches = sum(r * c for r, c in grids)
        if num_patches != patches.shape[0]:
            raise ValueError(f"grids {grids} hold {num_patches} patches but patches has {patches.shape[0]} rows")
        rows, cols, image, index = patch_coordinates(grids, patches.device)
        attn_context = build_attention_context(self.args.attn_backend, image, index, causal=False)
        h = self.ln_pre(self.patch_embedding(patches))
        rotary = axial_rotary_cos_sin(rows, cols, self.args.head_dim, self.args.rope_theta, h.dtype)
        for name, layer in self.layers.items():
            h = layer(h, rotary, attn_context.for_layer(int(name)))
        return h
