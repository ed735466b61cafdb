"""A GRPO run's prompts with images (``recipes.grpo_data.read_task``): planned from the image
headers at start-up, paths relative to the task file, and every bad image named by its file and
row, whether it fails at start-up (unreadable header) or when the generator decodes it."""

import io
import json

import pytest
import torch
from PIL import Image

from test_config import parse
from torchtitan_rl.data.images import image_placeholder
from torchtitan_rl.data.tokenizer import ByteTokenizer
from torchtitan_rl.data.vision_samples import load_images
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.recipes.base import RunContext
from torchtitan_rl.recipes.grpo_data import read_task


def run_context(*argv: str, model: str = "vlm") -> RunContext:
    cfg = parse(
        "--job.recipe", "grpo", "--loss.loss_fn", "ppo", "--model.name", model, "--training.seq_len", "128", *argv
    )
    return RunContext(cfg, 0, torch.device("cpu"), ParallelDims(1, 1, 1, 1, world_size=1), ByteTokenizer())


def png_bytes(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(out, format="PNG")
    return out.getvalue()


def jsonl_task(tmp_path, rows: list[dict]) -> str:
    (tmp_path / "images").mkdir(exist_ok=True)
    (tmp_path / "images" / "red.png").write_bytes(png_bytes(56, 28))
    path = tmp_path / "task.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def image_row(image: str, answer: str = "red") -> dict:
    content = [{"type": "image", "image": image}, {"type": "text", "text": "What colour?"}]
    return {"messages": [{"role": "user", "content": content}], "answer": answer}


def read(path: str, *argv: str, model: str = "vlm"):
    return read_task(
        run_context("--rl.task", "dataset", "--rl.task_path", path, "--rl.num_eval_prompts", "1", *argv, model=model)
    )


def test_image_paths_are_relative_to_the_task_file_and_placeholders_match_the_grid(tmp_path, monkeypatch):
    path = jsonl_task(
        tmp_path, [image_row("images/red.png"), image_row("images/red.png", "blue"), {"prompt": "2+2?", "answer": "4"}]
    )
    monkeypatch.chdir("/")
    data = read(path)
    prompts = [*data.train_prompts, *data.eval_prompts]
    images = [*data.train_images, *data.eval_images]
    assert sorted(len(i) for i in images) == [0, 1, 1]
    ids = data.vision.token_ids(ByteTokenizer())
    for tokens, planned in zip(prompts, images):
        for image in planned:
            assert image.source == str(tmp_path / "images" / "red.png")
            placeholder = image_placeholder(image.grid, data.vision.merge_size, ids)
            assert tokens[image.start : image.start + len(placeholder)] == placeholder
            # Decodes to the grid its header promised (56 x 28 px: 2 x 4 patches of 14).
            (loaded,) = load_images([image], data.vision)
            assert (loaded.rows, loaded.cols) == image.grid == (2, 4)


@pytest.mark.parametrize("kind", ["missing", "not an image"])
def test_an_unreadable_image_is_named_by_file_and_row_at_start_up(tmp_path, kind):
    if kind == "not an image":
        (tmp_path / "bad.png").write_bytes(b"this is no image")
    path = jsonl_task(tmp_path, [image_row("images/red.png"), image_row("images/red.png"), image_row("bad.png")])
    with pytest.raises(ValueError) as info:
        read(path)
    assert f"{path}:3" in str(info.value) and "bad.png" in str(info.value)


def test_an_image_whose_pixels_cannot_be_decoded_is_named_when_generating(tmp_path):
    """A valid header with a cut body passes start-up; decoding it for the generator (or the
    training sample) names the file and row."""
    whole = png_bytes(56, 28)
    (tmp_path / "cut.png").write_bytes(whole[: len(whole) // 2])
    path = jsonl_task(tmp_path, [image_row("cut.png"), image_row("images/red.png"), image_row("cut.png")])
    data = read(path)
    bad = next(images for images in [*data.train_images, *data.eval_images] if "cut.png" in str(images[0].source))
    with pytest.raises(ValueError) as info:
        load_images(bad, data.vision)
    assert f"{path}:" in str(info.value) and "cut.png" in str(info.value)


def test_prompts_with_images_need_a_vision_language_model(tmp_path):
    path = jsonl_task(tmp_path, [image_row("images/red.png"), {"prompt": "2+2?", "answer": "4"}])
    with pytest.raises(ValueError, match=r"task.jsonl:1: the prompt has 1 image\(s\), but model.name = 'qwen3'"):
        read(path, model="qwen3")


def test_shapes_prompts_carry_their_images():
    data = read_task(
        run_context(
            "--rl.task",
            "shapes",
            "--rl.num_train_prompts",
            "8",
            "--rl.num_eval_prompts",
            "4",
            "--rl.eval_interval",
            "5",
        )
    )
    assert len(data.train_images) == 8 and len(data.eval_images) == 4
    assert all(len(images) >= 1 for images in [*data.train_images, *data.eval_images])
    assert data.train_images[0][0].where.startswith("shapes train #0")
