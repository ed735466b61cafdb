import io
import math
import os
import random
import re
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from torchtitan_rl.data.images import (
    CLIP_MEAN,
    CLIP_STD,
    image_grid,
    image_size,
    load_image,
    patchify,
    placeholder_tokens,
    preprocess,
    target_size,
    vision_rows,
)

IMG, BREAK, END = 1000, 1001, 1002

# ---------------------------------------------------------------- target size


def ceil_div(a, b):
    return -(-a // b)


def reference_target_size(height, width, patch_size, merge_size, max_tokens):
    """Brute force of the documented rule: every scale where a side is a whole number of units,
    in exact fractions; the largest one below 1 whose rounded-up size fits (native size first)."""
    unit = patch_size * merge_size

    def grid(scale):
        return math.ceil(height * scale / unit), math.ceil(width * scale / unit)

    rows, cols = grid(Fraction(1))
    if rows * cols <= max_tokens:
        return rows * unit, cols * unit
    smallest = Fraction(unit, min(height, width))  # the short side keeps one whole unit
    candidates = [Fraction(k * unit, side) for side in (height, width) for k in range(1, ceil_div(side, unit) + 1)]
    fitting = [s for s in candidates if smallest <= s < 1 and math.prod(grid(s)) <= max_tokens]
    if not fitting:
        return None
    rows, cols = grid(max(fitting))
    return rows * unit, cols * unit


def random_cases(count, seed):
    rng = random.Random(seed)
    for _ in range(count):
        patch_size, merge_size = rng.choice([(14, 2), (16, 2), (8, 2), (4, 1), (16, 1)])
        aspect = math.exp(rng.uniform(math.log(1 / 6), math.log(6)))
        long_side = rng.randint(1, 2500)
        other_side = max(1, round(long_side / aspect))
        height, width = (long_side, other_side) if rng.random() < 0.5 else (other_side, long_side)
        yield height, width, patch_size, merge_size, rng.choice([1, 2, 3, 16, 64, 256, 1024])


@pytest.mark.parametrize("seed", range(4))
def test_target_size_matches_the_brute_force_rule(seed):
    num_errors = 0
    for case in random_cases(100, seed):
        num_errors += check_target_size(case)
    assert 0 < num_errors < 50  # the cases exercise both outcomes


def check_target_size(case) -> bool:
    """Checks one case against the reference; True when it is the cannot-fit error."""
    height, width, patch_size, merge_size, max_tokens = case
    expected = reference_target_size(*case)
    if expected is None:
        with pytest.raises(ValueError, match="cannot fit"):
            target_size(*case)
        return True
    target_height, target_width = target_size(*case)
    assert (target_height, target_width) == expected
    unit = patch_size * merge_size
    assert target_height % unit == 0 and target_width % unit == 0
    assert (target_height // unit) * (target_width // unit) <= max_tokens
    # Never larger than the native size rounded up to whole units.
    assert target_height <= ceil_div(height, unit) * unit and target_width <= ceil_div(width, unit) * unit
    # Aspect ratio kept up to one unit of rounding per side: there is a scale s with each
    # target side in [side * s, side * s + unit).
    low = max(Fraction(target_height - unit, height), Fraction(target_width - unit, width))
    high = min(Fraction(target_height, height), Fraction(target_width, width))
    assert low < high, case
    return False


@pytest.mark.parametrize(
    "size, expected",
    [
        ((32, 48), (32, 48)),  # whole units and fits: unchanged
        ((33, 40), (48, 48)),  # rounded up to whole 16-pixel units, never down
        ((5, 3), (16, 16)),  # tiny: one unit, the only upscale allowed
        ((1000, 500), (160, 80)),  # downscaled to 10 x 5 = 50 <= 64 units (11 x 6 = 66 would not fit)
        ((300, 1200), (64, 256)),  # exactly 4 x 16 = 64 units
    ],
)
def test_target_size_examples(size, expected):
    assert target_size(*size, patch_size=8, merge_size=2, max_image_tokens=64) == expected


def test_image_that_cannot_fit_is_an_error_naming_why():
    # A one-unit-high strip of a 1:100 image needs 100 tokens.
    with pytest.raises(ValueError, match=r"1000x10 image cannot fit in max_image_tokens=16.*needs 100 tokens"):
        target_size(10, 1000, 8, 2, 16)
    assert target_size(10, 1000, 8, 2, 100) == (16, 1008)  # native: 1 x 63 units
    assert target_size(100, 10000, 8, 2, 100) == (16, 1600)  # one-unit short side, 100 units long
    with pytest.raises(ValueError, match="max_image_tokens must be an int >= 1"):
        target_size(10, 10, 8, 2, 0)


def test_an_image_scaled_to_the_longest_side_is_named_at_its_own_size():
    # 4000 x 20 under a 40-unit (640 px) side bound: scaled to 640 x 3.2, floored to 640 x 3 pixels,
    # whose strip one 16-pixel unit high needs ceil(640 / 3) = 214 tokens. The message gives the file's size.
    message = (
        r"a 4000x20 image \(scaled down to 640x3 for the model's longest image side of 640 pixels\) "
        r"cannot fit in max_image_tokens=16: its aspect ratio needs 214 tokens"
    )
    with pytest.raises(ValueError, match=message):
        target_size(20, 4000, 8, 2, 16, max_units_per_side=40)


@pytest.mark.parametrize("seed", range(2))
def test_longest_side_bound_scales_down_first_keeping_the_aspect_ratio(seed):
    """With the model's longest side (units), the result is the rule on the image scaled so its
    long side fits (floored pixels), so no side exceeds the bound."""
    rng = random.Random(seed)
    for height, width, patch_size, merge_size, max_tokens in random_cases(100, seed):
        max_units = rng.randint(1, 40)
        unit = patch_size * merge_size
        long_side = max(height, width)
        scaled = (height, width)
        if long_side > max_units * unit:
            scaled = (max(1, height * max_units * unit // long_side), max(1, width * max_units * unit // long_side))
        expected = reference_target_size(*scaled, patch_size, merge_size, max_tokens)
        if expected is None:
            with pytest.raises(ValueError, match="cannot fit"):
                target_size(height, width, patch_size, merge_size, max_tokens, max_units)
            continue
        got = target_size(height, width, patch_size, merge_size, max_tokens, max_units)
        assert got == expected and max(got) <= max_units * unit
    # A 1000 x 500 image under a 4-unit (64 px) side bound: 64 x 32, well inside 64 tokens.
    assert target_size(1000, 500, 8, 2, 64, max_units_per_side=4) == (64, 32)


def test_image_grid_is_the_patch_grid_of_the_target():
    assert image_grid(1000, 500, 8, 2, 64) == (20, 10)
    assert image_grid(33, 40, 14, 2, 64) == (4, 4)


# ---------------------------------------------------------------- patches


def test_patchify_then_linear_equals_conv2d_patch_embedding():
    torch.manual_seed(0)
    pixels = torch.randn(3, 24, 40)
    weight = torch.randn(5, 3, 8, 8)
    patches = patchify(pixels, 8)
    assert patches.shape == (3 * 5, 3 * 64)
    embedded = patches @ weight.reshape(5, -1).T
    reference = F.conv2d(pixels[None], weight, stride=8)[0]  # [D, rows, cols]
    torch.testing.assert_close(embedded, reference.flatten(1).T, rtol=1e-5, atol=1e-5)
    # Row-major: patch (r, c) is rows r*8.., cols c*8.., channel-major inside.
    assert torch.equal(patches[1 * 5 + 3], pixels[:, 8:16, 24:32].reshape(-1))
    with pytest.raises(ValueError, match="whole number of 8-pixel patches"):
        patchify(torch.zeros(3, 20, 16), 8)


def random_image(height, width, seed=0, mode="RGB"):
    channels = len(mode)
    array = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(array, mode)


def hf_patches(image, unit, patch_size):
    """HF's Pixtral processor (pillow backend), resizing to whole units, patchified here."""
    processing = pytest.importorskip("transformers.models.pixtral.image_processing_pil_pixtral")
    processor = processing.PixtralImageProcessorPil(patch_size={"height": unit, "width": unit})
    assert tuple(processor.image_mean) == CLIP_MEAN and tuple(processor.image_std) == CLIP_STD
    pixel_values = processor(image, return_tensors="np")["pixel_values"][0]
    return patchify(torch.from_numpy(pixel_values), patch_size)


@pytest.mark.parametrize("size", [(48, 80), (70, 100)], ids=["at-target-size", "resized"])
def test_preprocess_matches_hf_pixtral_processor(size):
    # (48, 80) is whole 16-pixel units: neither side resizes. (70, 100) is rounded up to
    # (80, 112) by both (HF's longest_edge 1024 leaves it alone, our budget is not reached).
    image = random_image(*size)
    ours = preprocess(image, patch_size=8, merge_size=2, max_image_tokens=1024)
    reference = hf_patches(image, unit=16, patch_size=8)
    assert (ours.rows, ours.cols) == (ceil_div(size[0], 16) * 2, ceil_div(size[1], 16) * 2)
    assert ours.patches.dtype == torch.float32
    torch.testing.assert_close(ours.patches, reference, rtol=0, atol=1e-6)


def test_transparent_pixels_become_white_like_hf():
    image = random_image(32, 48, mode="RGBA")
    ours = preprocess(load_image(image, "test"), 8, 2, 1024)
    torch.testing.assert_close(ours.patches, hf_patches(image, 16, 8), rtol=0, atol=1e-6)
    transparent = Image.new("RGBA", (16, 16), (0, 0, 0, 0))
    assert load_image(transparent, "test").getpixel((3, 3)) == (255, 255, 255)


def test_preprocess_downscales_to_the_token_budget():
    processed = preprocess(random_image(300, 1200), patch_size=8, merge_size=2, max_image_tokens=64)
    assert (processed.rows, processed.cols) == (8, 32)
    assert processed.patches.shape == (8 * 32, 3 * 64)


# ---------------------------------------------------------------- placeholders


@pytest.mark.parametrize("rows, cols, merge", [(2, 2, 2), (4, 6, 2), (6, 2, 2), (3, 5, 1), (8, 8, 2)])
def test_placeholder_layout_is_pixtrals(rows, cols, merge):
    tokens = placeholder_tokens(rows, cols, merge, IMG, BREAK, END)
    # Pixtral/Mistral3: one line per merged row, [IMG] per merged column, [IMG_BREAK] after
    # each line except the last, which ends with [IMG_END].
    lines = "".join("I" * (cols // merge) + "B" for _ in range(rows // merge))[:-1] + "E"
    assert "".join({IMG: "I", BREAK: "B", END: "E"}[t] for t in tokens) == lines
    assert tokens.count(IMG) == (rows // merge) * (cols // merge)
    assert len(tokens) == (rows // merge) * (cols // merge + 1)


def test_placeholder_rejects_grids_that_do_not_merge():
    with pytest.raises(ValueError, match="3x4 patch grid"):
        placeholder_tokens(3, 4, 2, IMG, BREAK, END)


def test_vision_rows_number_the_image_tokens_in_order():
    grids = [(4, 6), (2, 2)]
    text = [7, 7]
    first = placeholder_tokens(*grids[0], 2, IMG, BREAK, END)
    second = placeholder_tokens(*grids[1], 2, IMG, BREAK, END)
    tokens = text + first + text + second + text
    starts = [2, 2 + len(first) + 2]
    rows = vision_rows(len(tokens) - 1, starts, grids, merge_size=2)
    is_image = torch.tensor(tokens[:-1]) == IMG
    assert torch.equal(rows >= 0, is_image)
    assert rows[is_image].tolist() == list(range(2 * 3 + 1 * 1))
    with pytest.raises(ValueError, match="past the"):
        vision_rows(starts[1], starts, grids, merge_size=2)


# ---------------------------------------------------------------- loading


def png_bytes(image):
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def test_load_image_sources(tmp_path):
    image = random_image(20, 30)
    path = tmp_path / "a.png"
    image.save(path)
    data = png_bytes(image)
    for source in [
        str(path),
        path,
        data,
        bytearray(data),
        image,
        {"bytes": data, "path": None},
        {"bytes": None, "path": str(path)},
    ]:
        loaded = load_image(source, "test")
        assert loaded.mode == "RGB" and np.array_equal(np.asarray(loaded), np.asarray(image))
        assert image_size(source, "test") == (20, 30)
    # A greyscale JPEG still comes out RGB.
    out = io.BytesIO()
    Image.new("L", (9, 7), 128).save(out, format="JPEG")
    assert load_image(out.getvalue(), "test").mode == "RGB" and image_size(out.getvalue(), "test") == (7, 9)


def test_size_is_read_from_the_header_alone():
    data = png_bytes(random_image(40, 50))
    truncated = data[: len(data) // 2]  # header intact, pixel data cut short
    assert image_size(truncated, "row 3 image 0") == (40, 50)
    with pytest.raises(ValueError, match="row 3 image 0: cannot decode"):
        load_image(truncated, "row 3 image 0")


def test_load_errors_name_the_image(tmp_path):
    with pytest.raises(ValueError, match=r"dataset row 17 image 1: image file .*missing\.png.* does not exist"):
        load_image(str(tmp_path / "missing.png"), "dataset row 17 image 1")
    with pytest.raises(ValueError, match="dataset row 2 image 0: cannot decode 9 bytes"):
        image_size(b"not a png", "dataset row 2 image 0")
    (tmp_path / "text.png").write_text("hello")
    with pytest.raises(ValueError, match=r"row 5 image 0: cannot decode image file .*text\.png"):
        load_image(str(tmp_path / "text.png"), "row 5 image 0")
    with pytest.raises(ValueError, match="got int"):
        load_image(3, "row 0 image 0")
    with pytest.raises(ValueError, match="needs 'bytes' or 'path'"):
        image_size({"bytes": None, "path": None}, "row 0 image 0")


@pytest.mark.parametrize(
    "url", ["https://example.com/cat.png", "http://host/a.png", "s3://bucket/key.jpg", "file:///tmp/a.png"]
)
def test_a_url_is_refused_as_a_url(tmp_path, monkeypatch, url):
    # Even where a local file has the URL's name, the URL is not looked up as a path.
    monkeypatch.chdir(tmp_path)
    local = tmp_path / url.replace("://", ":/", 1)  # e.g. ./https:/example.com/cat.png
    local.parent.mkdir(parents=True)
    random_image(4, 4).save(local, format="PNG")
    assert os.path.isfile(url)
    message = rf"row 4 image 0: image '{re.escape(url)}' is a URL; images must be local files .* or inline data"
    for source in [url, {"bytes": None, "path": url}]:
        with pytest.raises(ValueError, match=message):
            image_size(source, "row 4 image 0")
        with pytest.raises(ValueError, match=message):
            load_image(source, "row 4 image 0")
