"""The synthetic shapes task, and the SFT loader with images: placeholders, errors, resumption, balanced shares."""

import dataclasses
import io
import operator
import re

import numpy as np
import pytest
import tokenizers
import torch
import torch.nn.functional as F
from PIL import Image

from test_data import TOKENIZER, write_jsonl
from test_sft_loader import STREAM_ROWS, make_loader
from torchtitan_rl.data import shapes as shapes_task
from torchtitan_rl.data import vision_samples
from torchtitan_rl.data.balance import assign_to_ranks, contiguous_split, imbalance, sample_cost
from torchtitan_rl.data.datasets import load_rows
from torchtitan_rl.data.images import load_image, preprocess
from torchtitan_rl.data.loader import SFTDataLoader, build_sft_dataloader
from torchtitan_rl.data.sample import find_vision_problem
from torchtitan_rl.data.tasks import BUILTIN_TASKS
from torchtitan_rl.data.tokenizer import HFTokenizer, image_token_ids
from torchtitan_rl.data.vision_samples import VisionDataConfig

# ---------------------------------------------------------------- the shapes task

WHITE = shapes_task.BACKGROUND


def pixels_of(png: bytes) -> np.ndarray:
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG" and image.mode == "RGB"
    return np.asarray(image)


def count_components(mask: np.ndarray) -> int:
    """8-connected components of a boolean mask: every pixel takes the largest index around it until stable."""
    height, width = mask.shape
    inside = torch.from_numpy(mask).float()[None]
    labels = torch.arange(1, height * width + 1, dtype=torch.float32).reshape(1, height, width) * inside
    while True:
        updated = F.max_pool2d(labels, 3, stride=1, padding=1) * inside
        if torch.equal(updated, labels):
            return labels[labels > 0].unique().numel()
        labels = updated


def shape_colours(pixels: np.ndarray) -> set[str]:
    """The palette colours present; fails on any pixel that is neither background nor palette."""
    flat = {tuple(p) for p in np.unique(pixels.reshape(-1, 3), axis=0).tolist()} - {WHITE}
    names = {rgb: name for name, rgb in shapes_task.COLOURS.items()}
    assert flat <= set(names), f"unexpected colours {flat - set(names)}"
    return {names[rgb] for rgb in flat}


def check_shapes_row(row: dict) -> str:
    """Recomputes the row's answer from its pixels; returns the question kind."""
    user, assistant = row["messages"]
    answer = assistant["content"]
    if isinstance(user["content"], str):
        a, op, b = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", user["content"]).groups()
        assert answer == str({"+": operator.add, "-": operator.sub, "*": operator.mul}[op](int(a), int(b)))
        return "text"
    *images, question = user["content"]
    kind = {q: k for k, q in shapes_task.QUESTIONS.items()}[question["text"]]
    pixels = [pixels_of(part["image"]) for part in images]
    for image in pixels:
        height, width = image.shape[:2]
        assert 48 <= max(height, width) <= 192 and max(height, width) <= 4 * min(height, width) + 2
    shape_mask = [(image != WHITE).any(-1) for image in pixels]
    if kind == "colour":
        (colours,) = [shape_colours(pixels[0])]
        assert colours == {answer}
        ys, xs = shape_mask[0].nonzero()
        extent = max(ys.max() - ys.min(), xs.max() - xs.min()) + 1
        assert extent >= 0.7 * min(pixels[0].shape[:2])
    elif kind == "left_right":
        xs = shape_mask[0].nonzero()[1]
        half = pixels[0].shape[1] / 2
        assert answer == ("left" if xs.max() < half else "right") and (xs.max() < half or xs.min() >= half)
    elif kind == "count":
        assert answer == str(count_components(shape_mask[0]))
    else:
        first, second = (count_components(mask) for mask in shape_mask)
        assert first != second and answer == ("image 1" if first > second else "image 2")
    return kind


def test_shapes_answers_are_recomputed_from_the_pixels():
    kinds = [check_shapes_row(row) for row in BUILTIN_TASKS["shapes"](160, seed=0)]
    shares = {kind: kinds.count(kind) / len(kinds) for kind in set(kinds)}
    assert set(shares) == {"colour", "count", "more", "left_right", "text"}
    for kind, share in shapes_task.QUESTION_MIX:
        assert abs(shares[kind] - share) < 0.1, (kind, shares)


def test_shapes_colour_subset():
    rows = shapes_task.colour_rows(60, seed=1)
    assert all(check_shapes_row(row) == "colour" for row in rows)
    answers = [row["messages"][-1]["content"] for row in rows]
    assert set(answers) == set(shapes_task.COLOURS)  # every colour appears; chance is 1 / 6
    assert list(rows) == list(shapes_task.colour_rows(60, seed=1)) and rows[-1] == rows[59]


def test_shapes_rows_vary_in_images_and_sizes():
    rows = BUILTIN_TASKS["shapes"](200, seed=2)
    images = [
        [p["image"] for p in row["messages"][0]["content"] if isinstance(p, dict) and p["type"] == "image"]
        if not isinstance(row["messages"][0]["content"], str)
        else []
        for row in rows
    ]
    assert {len(i) for i in images} == {0, 1, 2}
    sizes = [Image.open(io.BytesIO(png)).size for row_images in images for png in row_images]
    aspects = [w / h for w, h in sizes]
    assert min(aspects) < 0.4 and max(aspects) > 2.5 and len(set(sizes)) > 100


# ---------------------------------------------------------------- the loader with images

VISION = VisionDataConfig(patch_size=4, merge_size=2, max_image_tokens=16)
IDS = image_token_ids(TOKENIZER)


def check_vision_sample(sample, vision=VISION):
    """vision_rows number the [IMG] inputs in order and match the images' merged patches."""
    merge = vision.merge_size
    assert find_vision_problem([sample], 3 * vision.patch_size**2, merge) is None
    is_image = sample.input_ids == IDS.image
    assert torch.equal(sample.vision_rows >= 0, is_image)
    num_features = sum(image.num_patches for image in sample.images) // merge**2
    assert sample.vision_rows[is_image].tolist() == list(range(num_features))
    assert not sample.loss_mask[sample.vision_rows >= 0].any()
    assert all(image.num_patches // merge**2 <= vision.max_image_tokens for image in sample.images)


def image_chat(parts, answer="ok"):
    return {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}]}


def solid_png(width, height, rgb=(10, 200, 30)):
    out = io.BytesIO()
    Image.new("RGB", (width, height), rgb).save(out, format="PNG")
    return out.getvalue()


def test_images_from_files_resolve_against_the_jsonl_and_match_preprocess(tmp_path, monkeypatch):
    data_dir = tmp_path / "data"
    (data_dir / "img").mkdir(parents=True)
    array = np.random.default_rng(0).integers(0, 256, (40, 21, 3), dtype=np.uint8)
    Image.fromarray(array).save(data_dir / "img" / "1.png")
    Image.new("RGBA", (9, 30), (0, 0, 255, 128)).save(data_dir / "img" / "2.png")
    rows = [
        image_chat([{"type": "image", "image": "img/1.png"}, {"type": "text", "text": "what?"}]),
        {
            "messages": [{"role": "user", "content": "<image> and <image>"}, {"role": "assistant", "content": "b"}],
            "images": ["img/2.png", "img/1.png"],
        },
        {"text": "plain"},
    ]
    write_jsonl(data_dir / "rows.jsonl", rows)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # paths are relative to the file, not the working directory
    loaded = load_rows("", str(data_dir / "rows.jsonl"), "train", 0, 0)
    loader = SFTDataLoader(loaded, TOKENIZER, 512, 3, "drop", 0, 0, 1, vision=VISION)
    by_text = {}
    for sample in next(loader):
        tokens = sample.input_ids.tolist() + sample.labels[-1:].tolist()
        by_text[TOKENIZER.decode([t for t in tokens if t < 256])] = sample
    plain = by_text["plain"]
    assert plain.images is None and plain.vision_rows is None
    first = by_text["user\nwhat?\nassistant\nok\n"]
    second = by_text["user\n and \nassistant\nb\n"]
    expected = {
        "1": preprocess(load_image(str(data_dir / "img/1.png"), "t"), 4, 2, 16),
        "2": preprocess(load_image(str(data_dir / "img/2.png"), "t"), 4, 2, 16),
    }
    for sample, names in [(first, "1"), (second, "21")]:
        check_vision_sample(sample)
        assert len(sample.images) == len(names)
        for image, name in zip(sample.images, names):
            assert (image.rows, image.cols) == (expected[name].rows, expected[name].cols)
            assert torch.equal(image.patches, expected[name].patches)
    # 40x21 pixels with 8-pixel units: natively 5 x 3 = 15 <= 16 units, rounded up to 40x24.
    assert (expected["1"].rows, expected["1"].cols) == (10, 6)
    # The placeholders sit where the image was: right after the user header.
    header = [TOKENIZER.im_start_id] + TOKENIZER.encode("user\n")
    assert first.input_ids[: len(header)].tolist() == header and int(first.input_ids[len(header)]) == IDS.image
    assert loader.stats()["num_images"] == 3


def test_pixels_are_decoded_only_for_the_ranks_share(monkeypatch):
    rows = BUILTIN_TASKS["shapes"](64, seed=3)
    decoded, sized = [], []
    real_load, real_size = vision_samples.load_image, vision_samples.image_size
    monkeypatch.setattr(
        vision_samples, "load_image", lambda source, where: decoded.append(where) or real_load(source, where)
    )
    monkeypatch.setattr(
        vision_samples, "image_size", lambda source, where: sized.append(where) or real_size(source, where)
    )
    whole = SFTDataLoader(rows, TOKENIZER, 1024, 8, "drop", 5, 0, 1, vision=VISION)
    global_batch = next(whole)
    all_images = list(decoded)
    assert sized == all_images and len(all_images) > 4  # every image sized once, decoded once
    for rank in range(4):
        decoded.clear()
        sized.clear()
        share = next(SFTDataLoader(rows, TOKENIZER, 1024, 8, "drop", 5, rank, 4, vision=VISION))
        assert sized == all_images  # every rank sizes every image of the global batch ...
        assert len(decoded) == sum(len(s.images or ()) for s in share)  # ... and decodes its own only
        for sample, reference in zip(share, global_batch[rank * 2 : rank * 2 + 2], strict=True):
            assert torch.equal(sample.input_ids, reference.input_ids)
            if sample.images:
                check_vision_sample(sample)
                assert all(torch.equal(a.patches, b.patches) for a, b in zip(sample.images, reference.images))


def test_truncation_never_cuts_an_image():
    # 2 x 2 units: ([IMG] [IMG] [IMG_BREAK] [IMG] [IMG] [IMG_END]), 6 placeholder tokens. image_first's
    # placeholders end at token 12, image_last's at 42: with seq_len 20 only image_first can be cut.
    image = solid_png(16, 16)
    image_first = image_chat([{"type": "image", "image": image}, {"type": "text", "text": "q"}], answer="a" * 30)
    image_last = image_chat([{"type": "text", "text": "q" * 30}, {"type": "image", "image": image}])
    header = 1 + len("user\n")
    loader = SFTDataLoader([image_first, image_last], TOKENIZER, 20, 2, "truncate", 0, 0, 1, vision=VISION)
    batch = next(loader)
    assert all(len(sample) == 20 for sample in batch)
    for sample in batch:
        check_vision_sample(sample)
        assert sample.input_ids[header : header + 6].tolist() == [IDS.image] * 2 + [IDS.image_break] + [
            IDS.image
        ] * 2 + [IDS.image_end]
    stats = loader.stats()
    # Every visit of image_last (its image would be cut) is dropped and counted; image_first is truncated.
    assert stats["num_dropped_image_cut"] > 0 and stats["num_truncated"] == 2
    assert stats["num_samples"] == 2 and stats["num_images"] == 2
    # The boundary: every placeholder must be an input token (inputs are the first seq_len tokens).
    for seq_len, kept in [(12, True), (11, False)]:
        boundary = SFTDataLoader(
            [image_first, {"text": "x"}], TOKENIZER, seq_len, 1, "truncate", 0, 0, 1, vision=VISION
        )
        for _ in range(2):  # kept: exactly one epoch of the two rows
            next(boundary)
        stats = boundary.stats()
        assert (stats["num_images"], stats["num_dropped_image_cut"] > 0) == ((1, False) if kept else (0, True))
    dropping = SFTDataLoader([image_first, {"text": "x"}], TOKENIZER, 20, 2, "drop", 0, 0, 1, vision=VISION)
    next(dropping)
    assert dropping.stats()["num_dropped"] > 0 and dropping.stats()["num_dropped_image_cut"] == 0


def test_text_runs_have_no_vision_counters():
    assert set(make_loader(STREAM_ROWS).stats()) == {
        "num_samples",
        "num_truncated",
        "num_dropped",
        "num_too_short",
        "num_without_loss_tokens",
    }


@pytest.mark.parametrize(
    "row, vision, message",
    [
        (
            image_chat([{"type": "image", "image": "missing.png"}]),
            VISION,
            r"dataset row 0 image 0 \(message 0 part 0\): image file 'missing.png' does not exist",
        ),
        (
            image_chat([{"type": "image", "image": b"garbage"}]),
            VISION,
            r"dataset row 0 image 0 \(message 0 part 0\): cannot decode 7 bytes",
        ),
        (
            {"text": "<image><image>", "images": [b"x"]},
            VISION,
            r"dataset row 0: .*2 '<image>' markers but its 'images' list has 1",
        ),
        (
            image_chat([{"type": "image", "image": solid_png(400, 2)}]),
            VISION,
            r"dataset row 0 image 0 .*: a 400x2 image cannot fit in max_image_tokens=16",
        ),
        (
            image_chat([{"type": "image", "image": solid_png(2000, 10)}]),
            dataclasses.replace(VISION, max_patches_per_side=80),
            r"dataset row 0 image 0 .*: a 2000x10 image \(scaled down to 320x1 .*\) cannot fit in max_image_tokens=16",
        ),
        (
            image_chat([{"type": "image", "image": solid_png(8, 8)}]),
            None,
            r"dataset row 0 has 1 image\(s\) but the model has no vision tower",
        ),
        (
            image_chat([{"type": "image", "image": solid_png(64, 64)}, {"type": "image", "image": solid_png(64, 64)}]),
            dataclasses.replace(VISION, max_patches_per_microbatch=100),
            r"dataset row 0: its 2 image\(s\) have 128 vision patches, more than training.max_patches_per_microbatch=100",
        ),
    ],
    ids=[
        "missing-file",
        "undecodable",
        "marker-count",
        "cannot-fit",
        "cannot-fit-scaled",
        "text-model",
        "over-patch-budget",
    ],
)
def test_image_row_errors_name_the_row(row, vision, message):
    loader = SFTDataLoader([row], TOKENIZER, 512, 1, "drop", 0, 0, 1, vision=vision)
    with pytest.raises(ValueError, match=message):
        next(loader)


def test_an_image_url_is_refused_naming_the_file_and_line(tmp_path):
    url = "https://example.com/cat.png"
    rows = [{"text": "plain"}, {"text": "<image> a cat", "images": [url]}]
    write_jsonl(tmp_path / "rows.jsonl", rows)
    loaded = load_rows("", str(tmp_path / "rows.jsonl"), "train", 0, 0)
    loader = SFTDataLoader(loaded, TOKENIZER, 512, 2, "drop", 0, 0, 1, vision=VISION)
    where = re.escape(f"dataset row 1 ({tmp_path / 'rows.jsonl'}:2) image 0 (text, images[0])")
    with pytest.raises(ValueError, match=rf"{where}: image '{re.escape(url)}' is a URL; images must be local files"):
        next(loader)


def test_image_tokens_of_the_tokenizer(tmp_path):
    from test_tokenizer import SPECIAL_TOKENS, make_hf_tokenizer_dir

    text_tokenizer = HFTokenizer(str(make_hf_tokenizer_dir(tmp_path / "text")))
    # A tokenizer without image tokens is fine for text rows, even with a vision config ...
    assert len(next(SFTDataLoader([{"text": "hi"}], text_tokenizer, 64, 1, "drop", 0, 0, 1, vision=VISION))) == 1
    # ... and an error naming the missing token once a row has an image.
    loader = SFTDataLoader(
        [image_chat([{"type": "image", "image": solid_png(8, 8)}])],
        text_tokenizer,
        64,
        1,
        "drop",
        0,
        0,
        1,
        vision=VISION,
    )
    with pytest.raises(
        ValueError, match=r"dataset row 0 has images, but the tokenizer has no token for image_token='\[IMG\]'"
    ):
        next(loader)
    # Text that tokenizes to a placeholder token would take a feature no image provides.
    vlm_tokenizer = HFTokenizer(
        str(make_hf_tokenizer_dir(tmp_path / "vlm", SPECIAL_TOKENS + ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]))
    )
    loader = SFTDataLoader([{"text": "look: [IMG]"}], vlm_tokenizer, 64, 1, "drop", 0, 0, 1, vision=VISION)
    with pytest.raises(ValueError, match=r"dataset row 0: its text tokenizes to the image placeholder token '\[IMG\]'"):
        next(loader)


def test_a_stock_qwen_tokenizer_gets_its_vision_specials_as_placeholders(tmp_path):
    from test_tokenizer import QWEN_SPECIAL_TOKENS, make_hf_tokenizer_dir

    directory = make_hf_tokenizer_dir(tmp_path / "qwen", QWEN_SPECIAL_TOKENS)
    reference = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    pad, row_end, end = (reference.token_to_id(t) for t in ["<|image_pad|>", "<|vision_pad|>", "<|vision_end|>"])
    tokenizer = HFTokenizer(str(directory))
    # A 16 x 24 pixel image in 8-pixel units: 2 rows of 3 features.
    (sample,) = next(
        SFTDataLoader(
            [image_chat([{"type": "image", "image": solid_png(24, 16)}])],
            tokenizer,
            128,
            1,
            "drop",
            0,
            0,
            1,
            vision=VISION,
        )
    )
    header = [tokenizer.im_start_id] + tokenizer.encode("user\n")
    placeholders = [pad, pad, pad, row_end, pad, pad, pad, end]
    assert sample.input_ids[: len(header) + 8].tolist() == header + placeholders
    assert sample.vision_rows[len(header) : len(header) + 8].tolist() == [0, 1, 2, -1, 3, 4, 5, -1]
    # Those specials are now placeholders: text that tokenizes to one is refused.
    loader = SFTDataLoader([{"text": "see <|vision_pad|>"}], tokenizer, 64, 1, "drop", 0, 0, 1, vision=VISION)
    with pytest.raises(
        ValueError, match=r"dataset row 0: its text tokenizes to the image placeholder token '<\|vision_pad\|>'"
    ):
        next(loader)


def test_resume_with_images_and_balancing_is_exact():
    rows = BUILTIN_TASKS["shapes"](40, seed=4)
    kwargs = dict(
        seq_len=256,
        global_batch_size=8,
        long_sample_policy="truncate",
        seed=3,
        batch_rank=1,
        batch_degree=2,
        vision=VISION,
        balance_dp_compute=True,
    )
    uninterrupted = iter(build_sft_dataloader(rows, TOKENIZER, **kwargs))
    expected = [next(uninterrupted) for _ in range(8)]  # 64 samples: more than one epoch
    first = build_sft_dataloader(rows, TOKENIZER, **kwargs)
    first_iter = iter(first)
    for _ in range(3):
        next(first_iter)
    state = first.state_dict()
    resumed = build_sft_dataloader(rows, TOKENIZER, **kwargs)
    resumed.load_state_dict(state)
    resumed_iter = iter(resumed)
    for step in range(3, 8):
        batch = next(resumed_iter)
        for sample, reference in zip(batch, expected[step], strict=True):
            assert torch.equal(sample.input_ids, reference.input_ids) and torch.equal(
                sample.loss_mask, reference.loss_mask
            )
            assert (sample.vision_rows is None) == (reference.vision_rows is None)
            if sample.images:
                assert torch.equal(sample.vision_rows, reference.vision_rows)
                assert all(
                    torch.equal(a.patches, b.patches) for a, b in zip(sample.images, reference.images, strict=True)
                )
    assert resumed.dataset.stats()["num_images"] > 0


def sample_key(sample):
    return tuple(sample.input_ids.tolist())


@pytest.mark.parametrize("degree", [2, 4])
def test_balanced_shares_cover_the_same_global_batch(degree):
    rows = BUILTIN_TASKS["shapes"](48, seed=6)
    whole = SFTDataLoader(rows, TOKENIZER, 512, 8, "drop", 1, 0, 1, vision=VISION)
    split = [
        SFTDataLoader(rows, TOKENIZER, 512, 8, "drop", 1, r, degree, vision=VISION, balance_dp_compute=True)
        for r in range(degree)
    ]
    num_moved = 0
    for _ in range(4):
        global_batch = next(whole)
        shares = [next(loader) for loader in split]
        costs = [sample_cost(len(s), s.num_patches) for s in global_batch]
        expected = assign_to_ranks(
            [len(s) for s in global_batch],
            degree,
            num_patches=[s.num_patches for s in global_batch],
            max_patches=VISION.max_patches_per_microbatch,
        )
        # The global stream does not change; each rank gets the cost model's assignment, in global order.
        for share, indices in zip(shares, expected, strict=True):
            assert [sample_key(s) for s in share] == [sample_key(global_batch[i]) for i in indices]
            assert len(share) >= 1
        num_moved += expected != contiguous_split(8, degree)
        stats = [loader.balance_stats() for loader in split]
        assert all(s == stats[0] for s in stats)
        assert (
            stats[0]["dp_cost_imbalance"]
            == stats[0]["dp_cost_imbalance_balanced"]
            == pytest.approx(imbalance(costs, expected))
        )
        assert stats[0]["dp_cost_imbalance_balanced"] <= stats[0]["dp_cost_imbalance_contiguous"]
        assert whole.balance_stats()["dp_cost_imbalance"] == 1.0
    assert num_moved > 0
    assert all(loader.stats() == whole.stats() for loader in split)
