"""The SFT step loader: each step, this rank's contiguous share of the next global mini-batch.

All ranks walk the same global sample stream and tokenize every sample of each global
mini-batch, so the mini-batch (and which samples are dropped) does not depend on the number
of data-parallel ranks; that is what makes global loss normalization layout-independent.
"""

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan_rl.data.chat import tokenize_row
from torchtitan_rl.data.sample import Sample
from torchtitan_rl.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

LONG_SAMPLE_POLICIES = ("truncate", "drop")
_COUNTERS = ("num_samples", "num_truncated", "num_dropped", "num_too_short", "num_without_loss_tokens")


class SFTDataLoader(IterableDataset):
    """Infinite iterator over this rank's ``list[Sample]`` share of successive global mini-batches.

    The global stream visits the rows in a fresh ``torch.randperm`` order every epoch (seeded
    with ``seed + epoch``) and repeats forever; each global mini-batch takes the next
    ``global_batch_size`` usable samples and rank ``batch_rank`` keeps the slice
    ``[batch_rank * share, (batch_rank + 1) * share)``.
    """

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        tokenizer: Tokenizer,
        seq_len: int,
        global_batch_size: int,
        long_sample_policy: str,
        seed: int,
        batch_rank: int,
        batch_degree: int,
    ):
        if len(rows) == 0:
            raise ValueError("the dataset has no rows")
        if seq_len < 1:
            raise ValueError(f"training.seq_len must be >= 1, got {seq_len}")
        if global_batch_size < 1:
            raise ValueError(f"training.global_batch_size must be >= 1, got {global_batch_size}")
        if long_sample_policy not in LONG_SAMPLE_POLICIES:
            raise ValueError(f"long-sample policy {long_sample_policy!r} is not one of {LONG_SAMPLE_POLICIES}")
        if not 0 <= batch_rank < batch_degree:
            raise ValueError(f"batch rank {batch_rank} is outside the DP (batch mesh) degree {batch_degree}")
        if global_batch_size % batch_degree != 0:
            raise ValueError(
                f"training.global_batch_size={global_batch_size} is not divisible by the DP (batch mesh) "
                f"degree {batch_degree}; every DP rank must get the same number of samples"
            )
        self.rows = rows
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.long_sample_policy = long_sample_policy
        self.seed = seed
        self.batch_rank = batch_rank
        self.share = global_batch_size // batch_degree

        self._epoch = 0
        self._position = 0  # index of the next row to visit in this epoch's permutation
        self._num_usable_in_epoch = 0
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._order = self._epoch_order()
        self._warned_no_loss_tokens = False

    def _epoch_order(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + self._epoch)
        return torch.randperm(len(self.rows), generator=generator).tolist()

    def _advance_epoch(self) -> None:
        # Usability depends only on the row, so an epoch without a usable sample means none ever comes.
        if self._num_usable_in_epoch == 0:
            raise ValueError(
                f"no usable sample in the whole dataset of {len(self.rows)} rows "
                f"(seq_len={self.seq_len}, long-sample policy {self.long_sample_policy!r}): {self.stats()}"
            )
        self._epoch += 1
        self._position = 0
        self._num_usable_in_epoch = 0
        self._order = self._epoch_order()

    def _next_usable(self) -> tuple[list[int], list[bool]]:
        while True:
            if self._position == len(self._order):
                self._advance_epoch()
            row_index = self._order[self._position]
            self._position += 1
            try:
                tokens, target_mask = tokenize_row(self.rows[row_index], self.tokenizer)
            except ValueError as err:
                raise ValueError(f"dataset row {row_index}: {err}") from err
            if len(tokens) < 2:
                self._counters["num_too_short"] += 1
                continue
            if len(tokens) - 1 > self.seq_len:
                if self.long_sample_policy == "drop":
                    self._counters["num_dropped"] += 1
                    continue
                self._counters["num_truncated"] += 1
                tokens, target_mask = tokens[: self.seq_len + 1], target_mask[: self.seq_len + 1]
            if not any(target_mask[1:]):
                # Kept on purpose: it carries zero loss weight but still counts as a sample of the batch.
                self._counters["num_without_loss_tokens"] += 1
            self._counters["num_samples"] += 1
            self._num_usable_in_epoch += 1
            return tokens, target_mask

    def __iter__(self) -> "SFTDataLoader":
        return self

    def __next__(self) -> list[Sample]:
        global_batch = [self._next_usable() for _ in range(self.global_batch_size)]
        if not self._warned_no_loss_tokens and not any(any(mask[1:]) for _, mask in global_batch):
            self._warned_no_loss_tokens = True
            logger.warning(
                "a global mini-batch of %d samples has no loss tokens at all (e.g. prompts truncated "
                "away their answers); such steps do not train. Counters so far: %s",
                self.global_batch_size,
                self.stats(),
            )
        start = self.batch_rank * self.share
        return [Sample.from_tokens(tokens, mask) for tokens, mask in global_batch[start : start + self.share]]

    def stats(self) -> dict[str, int]:
        """Global counters (identical on every rank) over all samples visited so far."""
        return dict(self._counters)

    def state_dict(self) -> dict[str, Any]:
        # Rank-independent, so a resume may even use a different DP degree.
        return {
            "epoch": self._epoch,
            "position": self._position,
            "num_usable_in_epoch": self._num_usable_in_epoch,
            **self._counters,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._epoch = state_dict["epoch"]
        self._position = state_dict["position"]
        self._num_usable_in_epoch = state_dict["num_usable_in_epoch"]
        self._counters = {name: state_dict[name] for name in _COUNTERS}
        self._order = self._epoch_order()


def _keep_samples(batch: list[Sample]) -> list[Sample]:
    # Samples are already tensors of different lengths; packing them is the next stage's job.
    return batch


def build_sft_dataloader(
    rows: Sequence[dict[str, Any]],
    tokenizer: Tokenizer,
    seq_len: int,
    global_batch_size: int,
    long_sample_policy: str,
    seed: int,
    batch_rank: int,
    batch_degree: int,
) -> StatefulDataLoader:
    """A checkpointable loader whose ``state_dict`` carries the exact stream position."""
    dataset = SFTDataLoader(
        rows, tokenizer, seq_len, global_batch_size, long_sample_policy, seed, batch_rank, batch_degree
    )
    return StatefulDataLoader(dataset, batch_size=None, num_workers=0, collate_fn=_keep_samples)
