"""Images of vision-language samples: decode, size, resize, normalize and cut into patches.

The layout is Pixtral's (Mistral3): an image is resized to whole multiples of
``patch_size * merge_size`` pixels (a "unit"), normalized with OpenAI CLIP's mean and std, and
cut into ``patch_size`` patches row-major; after the model's ``merge_size x merge_size`` patch
merge each unit becomes one feature, and the text holds one ``[IMG]`` placeholder per feature
(``placeholder_tokens``). Pillow and numpy only: torchvision is not a dependency.

Reading an image's size (``image_size``) parses its header only, so every rank can count the
tokens of every sample of a global mini-batch and decode pixels for its own share alone.
"""

import io
import os
import re
from typing import Any

import numpy as np
import torch
from PIL import Image

from torchtitan_rl.data.sample import SampleImage
from torchtitan_rl.data.tokenizer import ImageTokenIds

# OpenAI CLIP's per-channel statistics, which Pixtral's image processor normalizes with
# (PixtralImageProcessorPil.image_mean / image_std).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

ImageSource = Any
"""A path (str / PathLike), encoded bytes (PNG, JPEG, ...), a PIL image, or an HF ``Image``
feature's storage dict ``{"bytes": ..., "path": ...}`` (as parquet files written by
``datasets`` hold them)."""

# Pillow's decoders signal broken data with any of these.
_DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)
# ``scheme://...`` (http, https, s3, file, ...): a URL, never a local path.
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: str) -> bool:
    """Whether an image path is a URL (``scheme://...``), which is refused rather than looked up as a file."""
    return _URL.match(path) is not None


def _open(source: ImageSource, where: str) -> Image.Image:
    """``source`` as a PIL image whose pixels are not decoded yet (Pillow reads headers lazily)."""
    if isinstance(source, Image.Image):
        return source
    if isinstance(source, dict):
        # HF datasets' Image feature: the bytes when embedded, else the path.
        if source.get("bytes") is not None:
            source = source["bytes"]
        elif source.get("path") is not None:
            source = source["path"]
        else:
            raise ValueError(f"{where}: an image dict needs 'bytes' or 'path', got keys {sorted(source)}")
    if isinstance(source, (bytes, bytearray, memoryview)):
        data, name = io.BytesIO(bytes(source)), f"{len(source)} bytes of encoded image"
    elif isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if is_url(path):
            # Nothing is ever downloaded at run time (as for datasets): a URL is not looked up as a file.
            raise ValueError(
                f"{where}: image {path!r} is a URL; images must be local files (a path, relative to the row's "
                "file or absolute) or inline data (the encoded image's bytes)"
            )
        if not os.path.isfile(path):
            raise ValueError(f"{where}: image file {path!r} does not exist")
        data, name = path, f"image file {path!r}"
    else:
        raise ValueError(
            f"{where}: an image must be a path, encoded bytes, a PIL image or a {{'bytes', 'path'}} dict, "
            f"got {type(source).__name__}"
        )
    try:
        return Image.open(data)
    except _DECODE_ERRORS as err:
        raise ValueError(f"{where}: cannot decode {name}: {err}") from err


def image_size(source: ImageSource, where: str) -> tuple[int, int]:
    """``(height, width)`` of an image, from its header only (no pixels decoded)."""
    image = _open(source, where)
    width, height = image.size
    if image is not source:
        image.close()  # ours to close: Pillow keeps file handles open until the pixels are read
    if width < 1 or height < 1:
        raise ValueError(f"{where}: the image is empty ({width}x{height} pixels)")
    return height, width


def load_image(source: ImageSource, where: str) -> Image.Image:
    """The decoded image as RGB; ``where`` (e.g. "dataset row 17 image 1") names it in errors.

    Transparent pixels are composited onto white, as HF's ``convert_to_rgb`` does, so a
    transparent background does not turn into whatever colour its hidden RGB values hold.
    """
    image = _open(source, where)
    try:
        image.load()
        if image.mode == "RGB":
            return image.copy() if image is source else image
        if "A" in image.getbands() or "transparency" in image.info:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        return image.convert("RGB")
    except _DECODE_ERRORS as err:
        name = f"image file {os.fspath(source)!r}" if isinstance(source, (str, os.PathLike)) else "the image"
        raise ValueError(f"{where}: cannot decode {name}: {err}") from err


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def target_size(
    height: int,
    width: int,
    patch_size: int,
    merge_size: int,
    max_image_tokens: int,
    max_units_per_side: int | None = None,
) -> tuple[int, int]:
    """``(height, width)`` an image is resized to before patchifying.

    With ``max_units_per_side`` (the model's largest image side, HF's ``image_size``, in units),
    a longer image is first scaled down, keeping its aspect ratio, until its long side is at
    most that many units (each side floored to whole pixels, as Pixtral's processor bounds its
    ``longest_edge``); the rule below then applies to that size.

    With ``u = patch_size * merge_size`` (one image token per u x u unit) and a scale
    ``s <= 1``, the target is ``(ceil(height*s/u) * u, ceil(width*s/u) * u)``: each side is
    scaled, then rounded *up* to whole units (as Pixtral's processor does), so its aspect
    ratio is kept up to one unit of rounding per side.

    - ``s = 1`` (native resolution, only rounded) when that gives at most ``max_image_tokens``
      tokens ``(H/u) * (W/u)``; small images are therefore never upscaled beyond rounding up
      to one unit.
    - Otherwise ``s`` is the largest scale below 1 whose rounded size has at most
      ``max_image_tokens`` tokens, provided the short side keeps at least one whole unit
      (``s >= u / min(height, width)``), so rounding never stretches a side more than 2x.
    - An image for which no such scale exists is a ValueError: that happens exactly when the
      native size does not fit and ``ceil(long side / short side) > max_image_tokens`` (a
      one-unit-high strip of its aspect ratio already has too many tokens).

    The token count only grows with ``s``, and it jumps just after the scales where
    ``height*s`` or ``width*s`` is a whole number of units, so the best ``s`` is one of those
    breakpoints; each family is searched by bisection, in exact integer arithmetic.
    """
    for name, value in [
        ("height", height),
        ("width", width),
        ("patch_size", patch_size),
        ("merge_size", merge_size),
        ("max_image_tokens", max_image_tokens),
    ]:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"target_size: {name} must be an int >= 1, got {value!r}")
    unit = patch_size * merge_size
    # Errors name the image's own size, which the user can look up, and the scaled one it came to.
    image = f"{width}x{height} image"
    if max_units_per_side is not None and max(height, width) > max_units_per_side * unit:
        longest = max_units_per_side * unit
        long_side = max(height, width)
        height, width = max(1, height * longest // long_side), max(1, width * longest // long_side)
        image += f" (scaled down to {width}x{height} for the model's longest image side of {longest} pixels)"
    rows, cols = _ceil_div(height, unit), _ceil_div(width, unit)
    if rows * cols <= max_image_tokens:
        return rows * unit, cols * unit
    long_side, short_side = max(height, width), min(height, width)
    if _ceil_div(long_side, short_side) > max_image_tokens:
        raise ValueError(
            f"a {image} cannot fit in max_image_tokens={max_image_tokens}: its aspect ratio "
            f"needs {_ceil_div(long_side, short_side)} tokens with a short side of one "
            f"{unit}-pixel unit (patch_size {patch_size} x merge_size {merge_size}); crop it or raise the limit"
        )

    def best(side: int, other: int) -> tuple[int, int]:
        # Scales s = k*unit/side make `side` exactly k units; the other side is then
        # ceil(other*k/side) units. The largest k whose token count fits.
        low, high = 0, min(rows if side == height else cols, max_image_tokens)
        while low < high:
            k = (low + high + 1) // 2
            if k * _ceil_div(other * k, side) <= max_image_tokens:
                low = k
            else:
                high = k - 1
        return low, _ceil_div(other * low, side)

    k_rows, cols_at_rows = best(height, width)
    k_cols, rows_at_cols = best(width, height)
    # Compare the two scales k_rows*u/height and k_cols*u/width exactly (k >= 1 in both: k = 1
    # of the long side always fits, and of the short side by the aspect check above).
    if k_rows * width >= k_cols * height:
        rows, cols = k_rows, cols_at_rows
    else:
        rows, cols = rows_at_cols, k_cols
    return rows * unit, cols * unit


def image_grid(
    height: int,
    width: int,
    patch_size: int,
    merge_size: int,
    max_image_tokens: int,
    max_units_per_side: int | None = None,
) -> tuple[int, int]:
    """The ``(rows, cols)`` patch grid of an image of this size after ``target_size``."""
    target_height, target_width = target_size(
        height, width, patch_size, merge_size, max_image_tokens, max_units_per_side
    )
    return target_height // patch_size, target_width // patch_size


def patchify(pixels: torch.Tensor, patch_size: int) -> torch.Tensor:
    """``[C, H, W]`` → ``[(H/p) * (W/p), C*p*p]``: patches row-major, each flattened channel-major.

    A linear layer with weight ``conv.weight.reshape(D, -1)`` applied to these rows equals a
    stride-p ``Conv2d`` patch embedding.
    """
    channels, height, width = pixels.shape
    if height % patch_size or width % patch_size:
        raise ValueError(f"patchify: a {height}x{width} image is not a whole number of {patch_size}-pixel patches")
    rows, cols = height // patch_size, width // patch_size
    grid = pixels.reshape(channels, rows, patch_size, cols, patch_size)
    return grid.permute(1, 3, 0, 2, 4).reshape(rows * cols, channels * patch_size * patch_size)


def normalize(image: Image.Image, mean=CLIP_MEAN, std=CLIP_STD) -> torch.Tensor:
    """An RGB image as a float32 ``[3, H, W]`` tensor: ``(pixel / 255 - mean) / std`` per channel."""
    # float64 arithmetic, one rounding to float32 at the end: the closest float32 to the formula.
    pixels = np.asarray(image, dtype=np.float64) / 255.0
    pixels = (pixels - np.asarray(mean, dtype=np.float64)) / np.asarray(std, dtype=np.float64)
    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1), dtype=np.float32))


def preprocess(
    image: Image.Image,
    patch_size: int,
    merge_size: int,
    max_image_tokens: int,
    mean=CLIP_MEAN,
    std=CLIP_STD,
    max_units_per_side: int | None = None,
) -> SampleImage:
    """Resize (bicubic, as Pixtral's processor) to ``target_size``, normalize, patchify."""
    width, height = image.size
    target_height, target_width = target_size(
        height, width, patch_size, merge_size, max_image_tokens, max_units_per_side
    )
    if (target_height, target_width) != (height, width):
        image = image.resize((target_width, target_height), resample=Image.Resampling.BICUBIC)
    patches = patchify(normalize(image, mean, std), patch_size)
    return SampleImage(patches=patches, rows=target_height // patch_size, cols=target_width // patch_size)


def placeholder_tokens(rows: int, cols: int, merge_size: int, image_id: int, break_id: int, end_id: int) -> list[int]:
    """The tokens that stand for one image with a ``rows x cols`` patch grid (Pixtral layout).

    Per merged row: ``[IMG]`` x (cols / m), then ``[IMG_BREAK]``; the last ``[IMG_BREAK]`` is
    ``[IMG_END]``. Only the ``[IMG]`` tokens receive image features, in row-major order.
    """
    if rows % merge_size or cols % merge_size or rows < 1 or cols < 1:
        raise ValueError(f"a {rows}x{cols} patch grid is not a whole number of {merge_size}x{merge_size} merges")
    merged_rows, merged_cols = rows // merge_size, cols // merge_size
    tokens = ([image_id] * merged_cols + [break_id]) * merged_rows
    tokens[-1] = end_id
    return tokens


def image_placeholder(grid: tuple[int, int], merge_size: int, ids: ImageTokenIds) -> list[int]:
    """``placeholder_tokens`` of a ``(rows, cols)`` grid with the ids of ``ids``."""
    return placeholder_tokens(grid[0], grid[1], merge_size, ids.image, ids.image_break, ids.image_end)


def vision_rows(num_inputs: int, starts: list[int], grids: list[tuple[int, int]], merge_size: int) -> torch.Tensor:
    """Per input token, the feature row it takes, or -1 (``Sample.vision_rows``).

    ``starts[k]`` is the index of image k's first placeholder token; features are numbered
    row-major within an image and images follow each other, matching ``placeholder_tokens``.
    """
    rows = torch.full((num_inputs,), -1, dtype=torch.long)
    offset = 0
    for start, (grid_rows, grid_cols) in zip(starts, grids, strict=True):
        merged_rows, merged_cols = grid_rows // merge_size, grid_cols // merge_size
        # Each merged row is merged_cols [IMG] tokens plus one break/end token.
        line_starts = torch.arange(merged_rows)[:, None] * (merged_cols + 1)
        positions = start + (line_starts + torch.arange(merged_cols)).flatten()
        if int(positions[-1]) >= num_inputs:
            raise ValueError(
                f"image placeholders end at token {int(positions[-1])}, past the {num_inputs} input tokens"
            )
        rows[positions] = torch.arange(offset, offset + positions.numel())
        offset += positions.numel()
    return rows


def num_image_tokens(height: int, width: int, patch_size: int, merge_size: int, max_image_tokens: int) -> int:
    """How many ``[IMG]`` tokens (features) an image of this size becomes."""
    rows, cols = image_grid(height, width, patch_size, merge_size, max_image_tokens)
    return (rows // merge_size) * (cols // merge_size)
