"""The Pixtral vision encoder against HF transformers' PixtralVisionModel (tiny, offline)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from transformers import PixtralVisionConfig, PixtralVisionModel
from transformers.models.pixtral.modeling_pixtral import PixtralVisionRotaryEmbedding

from torchtitan_rl.models.qwen3.model import apply_rotary
from torchtitan_rl.models.vision.args import VisionArgs
from torchtitan_rl.models.vision.model import VisionTransformer, axial_rotary_cos_sin, patch_coordinates

ARGS = VisionArgs(
    dim=32,
    n_layers=2,
    n_heads=4,
    hidden_dim=48,
    patch_size=4,
    num_channels=3,
    rope_theta=1000.0,  # not the default, so a wrong theta would show
    max_patches_per_side=16,
)
# Pixel sizes (height, width); the first two are not whole patches (HF crops the remainder).
IMAGE_SIZES = [(18, 33), (32, 16), (48, 48)]


def hf_vision_config(args: VisionArgs) -> PixtralVisionConfig:
    config = PixtralVisionConfig(
        hidden_size=args.dim,
        intermediate_size=args.hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        head_dim=args.head_dim,
        num_channels=args.num_channels,
        image_size=args.max_patches_per_side * args.patch_size,
        patch_size=args.patch_size,
        hidden_act="silu",
        attention_dropout=0.0,
        rope_parameters={"rope_type": "axial", "rope_theta": args.rope_theta},
        initializer_range=0.02,
    )
    config._attn_implementation = "eager"  # plain math, independent of SDPA
    return config


def patchify(image: torch.Tensor, patch_size: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """``[C, H, W]`` -> ``[rows*cols, C*p*p]`` row-major patches (channel-major inside), cropping
    the pixels that do not fill a whole patch, as HF does."""
    channels, height, width = image.shape
    rows, cols = height // patch_size, width // patch_size
    grid = image[:, : rows * patch_size, : cols * patch_size].reshape(channels, rows, patch_size, cols, patch_size)
    return grid.permute(1, 3, 0, 2, 4).reshape(rows * cols, -1), (rows, cols)


def padded_pixels(sizes, channels: int, seed: int) -> torch.Tensor:
    """A batch ``[N, C, H_max, W_max]`` of random images; the padding is random too, so using it would show."""
    gen = torch.Generator().manual_seed(seed)
    height, width = max(h for h, _ in sizes), max(w for _, w in sizes)
    return torch.randn(len(sizes), channels, height, width, generator=gen)


def pack_images(pixel_values: torch.Tensor, sizes, patch_size: int):
    parts = [patchify(img[:, :h, :w], patch_size) for img, (h, w) in zip(pixel_values, sizes)]
    return torch.cat([p for p, _ in parts]), tuple(g for _, g in parts)


def hf_and_ours(args: VisionArgs = ARGS):
    torch.manual_seed(0)
    hf = PixtralVisionModel(hf_vision_config(args)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") or name.endswith("ln_pre.weight"):
                p.uniform_(0.5, 1.5)  # a misplaced norm weight would show
    ours = VisionTransformer(args)
    renamed = {}
    for key, tensor in hf.state_dict().items():
        key = key.replace("patch_conv.", "patch_embedding.").replace("transformer.layers.", "layers.")
        for hf_name, name in [
            ("q_proj", "wq"),
            ("k_proj", "wk"),
            ("v_proj", "wv"),
            ("o_proj", "wo"),
            ("gate_proj", "w1"),
            ("up_proj", "w3"),
            ("down_proj", "w2"),
        ]:
            key = key.replace(f".{hf_name}.", f".{name}.")
        renamed[key] = tensor
    ours.load_state_dict(renamed, strict=True)
    return hf, ours


def test_patch_embedding_as_linear_equals_conv2d():
    _, ours = hf_and_ours()
    pixels = padded_pixels([(20, 28)], ARGS.num_channels, seed=1)[0]
    patches, (rows, cols) = patchify(pixels, ARGS.patch_size)
    weight = ours.patch_embedding.weight
    conv = F.conv2d(pixels[None], weight, stride=ARGS.patch_size)[0]  # [dim, rows, cols]
    expected = conv.flatten(1).T  # row-major patches
    torch.testing.assert_close(ours.patch_embedding(patches), expected, rtol=1e-5, atol=1e-5)
    assert (rows, cols) == (5, 7)


@pytest.mark.parametrize("grid", [(1, 1), (3, 5), (6, 2), (16, 16)])
def test_axial_rotary_matches_hf(grid):
    rows, cols, _, _ = patch_coordinates([grid], "cpu")
    cos, sin = axial_rotary_cos_sin(rows, cols, ARGS.head_dim, ARGS.rope_theta, torch.float32)
    x = torch.randn(rows.numel(), ARGS.n_heads, ARGS.head_dim, generator=torch.Generator().manual_seed(2))
    hf_cos, hf_sin = PixtralVisionRotaryEmbedding(hf_vision_config(ARGS))(x, torch.stack([rows, cols], dim=-1))
    torch.testing.assert_close(cos[:, 0], hf_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[:, 0], hf_sin, rtol=0, atol=1e-6)
    # And the rotation itself, in HF's rotate-half convention.
    half = ARGS.head_dim // 2
    rotate_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    rotated = x * hf_cos[:, None] + rotate_half * hf_sin[:, None]
    torch.testing.assert_close(apply_rotary(x, cos, sin), rotated, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("attn_backend", ["sdpa_dense", "sdpa_varlen", "sdpa_loop"])
def test_packed_images_match_hf(attn_backend):
    hf, ours = hf_and_ours(dataclasses.replace(ARGS, attn_backend=attn_backend))
    pixel_values = padded_pixels(IMAGE_SIZES, ARGS.num_channels, seed=3)
    patches, grids = pack_images(pixel_values, IMAGE_SIZES, ARGS.patch_size)
    assert grids == ((4, 8), (8, 4), (12, 12))
    with torch.no_grad():
        expected = hf(pixel_values, image_sizes=torch.tensor(IMAGE_SIZES)).last_hidden_state[0]
        torch.testing.assert_close(ours(patches, grids), expected, rtol=1e-5, atol=1e-5)
        # Each image alone gives the same rows: attention is block-diagonal by image.
        starts = [0, 32, 64, 208]
        for i, grid in enumerate(grids):
            alone = ours(patches[starts[i] : starts[i + 1]], [grid])
            torch.testing.assert_close(alone, expected[starts[i] : starts[i + 1]], rtol=1e-5, atol=1e-5)


def test_rejects_bad_inputs():
    _, ours = hf_and_ours()
    patches = torch.zeros(6, ARGS.num_channels * ARGS.patch_size**2)
    with pytest.raises(ValueError, match="hold 8 patches"):
        ours(patches, [(2, 4)])
    with pytest.raises(ValueError, match="num_channels"):
        ours(patches[:, :-1], [(2, 3)])
    with pytest.raises(ValueError, match="max_patches_per_side"):
        ours(torch.zeros(17, patches.shape[1]), [(1, 17)])
    with pytest.raises(ValueError, match="positive ints"):
        ours(patches, [(0, 6)])


def test_args_validation():
    with pytest.raises(ValueError, match="multiple of 4"):
        VisionArgs(dim=24, n_layers=1, n_heads=4, hidden_dim=8, patch_size=4)  # head_dim 6
    with pytest.raises(ValueError, match="multiple of n_heads"):
        VisionArgs(dim=30, n_layers=1, n_heads=4, hidden_dim=8, patch_size=4)
    with pytest.raises(ValueError, match="positive int"):
        VisionArgs(dim=32, n_layers=0, n_heads=4, hidden_dim=8, patch_size=4)
    with pytest.raises(ValueError, match="attn_backend"):
        VisionArgs(dim=32, n_layers=1, n_heads=4, hidden_dim=8, patch_size=4, attn_backend="flash")
    assert ARGS.head_dim == 8 and ARGS.patch_dim == 48
