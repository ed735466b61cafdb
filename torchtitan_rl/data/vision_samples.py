"""Rows → samples in two stages, so that images cost pixels only on the rank that trains them.

``plan_row`` (every rank, every sample of a global mini-batch): tokenize, read each image's
size from its header, insert its placeholder tokens. That fixes the sample's token count,
which decides truncation and drops, and its patch count, which the DP balancing costs.
``build_sample`` (only for the rank's own share): decode, resize, normalize, patchify the
images and map placeholder tokens to feature rows (``Sample.vision_rows``).
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from torchtitan_rl.data.chat import TokenizedRow, insert_placeholders, tokenize_row_with_images
from torchtitan_rl.data.images import (
    CLIP_MEAN,
    CLIP_STD,
    image_grid,
    image_placeholder,
    image_size,
    load_image,
    preprocess,
    vision_rows,
)
from torchtitan_rl.data.sample import Sample, SampleImage
from torchtitan_rl.data.tokenizer import (
    IMAGE_BREAK_TOKEN,
    IMAGE_END_TOKEN,
    IMAGE_TOKEN,
    ImageTokenIds,
    Tokenizer,
    image_token_ids,
    image_token_strings,
)


@dataclass(frozen=True)
class VisionDataConfig:
    """How a vision-language model wants its images (None in the loader for text models).

    ``patch_size`` pixels per patch side, ``merge_size`` patches per merged feature side,
    ``max_image_tokens`` features per image at most (``images.target_size``), the placeholder
    token strings as configured (``token_strings``: those used with a given tokenizer), the
    per-channel normalization, the model's longest image side in patches (None: unbounded),
    and the vision-patch budget of a micro-batch (0: none), which no sample may exceed since
    samples are never split.
    """

    patch_size: int
    merge_size: int
    max_image_tokens: int
    image_token: str = IMAGE_TOKEN
    image_break_token: str = IMAGE_BREAK_TOKEN
    image_end_token: str = IMAGE_END_TOKEN
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    max_patches_per_side: int | None = None
    max_patches_per_microbatch: int = 0

    @property
    def max_units_per_side(self) -> int | None:
        return None if self.max_patches_per_side is None else self.max_patches_per_side // self.merge_size

    def __post_init__(self):
        for name in ("patch_size", "merge_size", "max_image_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"VisionDataConfig.{name} must be an int >= 1, got {value!r}")
        for name in ("image_mean", "image_std"):
            if len(getattr(self, name)) != 3:
                raise ValueError(
                    f"VisionDataConfig.{name} must have one value per RGB channel, got {getattr(self, name)}"
                )
        if self.max_patches_per_side is not None and self.max_patches_per_side < self.merge_size:
            raise ValueError(
                f"VisionDataConfig.max_patches_per_side must be >= merge_size, got {self.max_patches_per_side}"
            )
        if any(s <= 0 for s in self.image_std):
            raise ValueError(f"VisionDataConfig.image_std must be > 0, got {self.image_std}")

    def token_strings(self, tokenizer: Tokenizer) -> tuple[str, str, str]:
        """The placeholder strings used with ``tokenizer`` (``tokenizer.image_token_strings``)."""
        return image_token_strings(tokenizer, self.image_token, self.image_break_token, self.image_end_token)

    def token_ids(self, tokenizer: Tokenizer) -> ImageTokenIds:
        return image_token_ids(tokenizer, self.image_token, self.image_break_token, self.image_end_token)


@dataclass
class PlannedImage:
    source: Any
    where: str  # e.g. "image 0 (message 0 part 0)"
    grid: tuple[int, int]  # (rows, cols) of patches after resizing
    start: int  # index of its first placeholder token in PlannedSample.tokens
    num_placeholders: int

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]


@dataclass
class PlannedSample:
    """A sample of the global stream as every rank knows it: tokens (placeholders included), no pixels."""

    row_index: int
    where: str  # "dataset row 17 (file:line)"
    tokens: list[int]
    target_mask: list[bool]
    images: tuple[PlannedImage, ...] = ()
    margin: float = 0.0  # a preference pair's side: the pair's margin (``data.preferences``)

    @property
    def num_patches(self) -> int:
        return sum(image.num_patches for image in self.images)

    @property
    def images_end(self) -> int:
        """Index one past the last placeholder token (0 without images): a cut before it would split an image."""
        return self.images[-1].start + self.images[-1].num_placeholders if self.images else 0

    def truncated(self, num_tokens: int) -> "PlannedSample":
        if num_tokens < self.images_end:
            raise ValueError(f"{self.where}: cutting at {num_tokens} tokens would split an image")
        return replace(self, tokens=self.tokens[:num_tokens], target_mask=self.target_mask[:num_tokens])


class RowPlanner:
    """``plan_row`` with the tokenizer, the vision settings and the lazily resolved image token ids."""

    def __init__(self, tokenizer: Tokenizer, vision: VisionDataConfig | None):
        self.tokenizer = tokenizer
        self.vision = vision
        self._ids: ImageTokenIds | None = None
        # Placeholder ids the tokenizer has: text must never produce them (their embeddings
        # would be replaced by features no image provides). Missing ones are an error only
        # once a row has an image.
        self._reserved: dict[int, str] = {}
        if vision is not None:
            for token in vision.token_strings(tokenizer):
                token_id = tokenizer.token_to_id(token)
                if token_id is not None:
                    self._reserved[token_id] = token

    def image_ids(self, where: str) -> ImageTokenIds:
        if self._ids is None:
            try:
                self._ids = self.vision.token_ids(self.tokenizer)
            except ValueError as err:
                raise ValueError(f"{where} has images, but {err}") from err
        return self._ids

    def plan_row(self, row: dict[str, Any], row_index: int, where: str, base_dir: str | None) -> PlannedSample:
        """Tokens with image placeholders, and each image's patch grid (from its header only)."""
        try:
            tokenized = tokenize_row_with_images(row, self.tokenizer, base_dir)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from err
        return self.plan_tokenized(tokenized, row_index, where)

    def plan_tokenized(self, tokenized: TokenizedRow, row_index: int, where: str) -> PlannedSample:
        """``plan_row`` of a row already tokenized (e.g. an RL prompt, ``chat.tokenize_prompt_row``)."""
        if self._reserved and not self._reserved.keys().isdisjoint(tokenized.tokens):
            token_id = next(t for t in tokenized.tokens if t in self._reserved)
            raise ValueError(
                f"{where}: its text tokenizes to the image placeholder token {self._reserved[token_id]!r} "
                f"(id {token_id}); placeholders are only inserted for images"
            )
        if not tokenized.images:
            return PlannedSample(row_index, where, tokenized.tokens, tokenized.target_mask)
        if self.vision is None:
            raise ValueError(
                f"{where} has {len(tokenized.images)} image(s) but the model has no vision tower (a text "
                "model); train a vision-language model.name or remove the images"
            )
        ids = self.image_ids(where)
        vision = self.vision
        grids, placeholders = [], []
        for image in tokenized.images:
            image_where = f"{where} {image.where}"
            height, width = image_size(image.source, image_where)
            try:
                grid = image_grid(
                    height,
                    width,
                    vision.patch_size,
                    vision.merge_size,
                    vision.max_image_tokens,
                    vision.max_units_per_side,
                )
            except ValueError as err:
                raise ValueError(f"{image_where}: {err}") from err
            grids.append(grid)
            placeholders.append(image_placeholder(grid, vision.merge_size, ids))
        tokens, target_mask, starts = insert_placeholders(tokenized, placeholders)
        images = tuple(
            PlannedImage(image.source, image.where, grid, start, len(placeholder))
            for image, grid, start, placeholder in zip(tokenized.images, grids, starts, placeholders)
        )
        return PlannedSample(row_index, where, tokens, target_mask, images)


def load_images(images: Sequence[PlannedImage], vision: VisionDataConfig, where: str = "") -> list[SampleImage]:
    """``images`` decoded, resized, normalized and cut into patches; ``where`` names their row in
    errors (leave it empty when each image's ``where`` already does)."""
    loaded = []
    for image in images:
        image_where = f"{where} {image.where}" if where else image.where
        processed = preprocess(
            load_image(image.source, image_where),
            vision.patch_size,
            vision.merge_size,
            vision.max_image_tokens,
            vision.image_mean,
            vision.image_std,
            vision.max_units_per_side,
        )
        if (processed.rows, processed.cols) != image.grid:
            # The header and the decoded pixels disagree (e.g. a file replaced while training).
            raise ValueError(
                f"{image_where}: the decoded image gives a {processed.rows}x{processed.cols} patch grid, but its "
                f"header gave {image.grid[0]}x{image.grid[1]}"
            )
        loaded.append(processed)
    return loaded


def image_vision_rows(images: Sequence[PlannedImage], num_inputs: int, merge_size: int) -> torch.Tensor:
    """``Sample.vision_rows`` of a sequence of ``num_inputs`` input tokens that holds ``images``."""
    return vision_rows(num_inputs, [image.start for image in images], [image.grid for image in images], merge_size)


def build_sample(planned: PlannedSample, vision: VisionDataConfig | None) -> Sample:
    """The training sample of ``planned``, with decoded, preprocessed images and ``vision_rows``."""
    sample = Sample.from_tokens(planned.tokens, planned.target_mask)
    if not planned.images:
        return sample
    sample.images = load_images(planned.images, vision, planned.where)
    sample.vision_rows = image_vision_rows(planned.images, len(sample.input_ids), vision.merge_size)
    return sample
