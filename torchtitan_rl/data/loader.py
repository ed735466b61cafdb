"""The SFT step loader: each step, this rank's share of the next global mini-batch (of
samples, or of preference pairs whose two samples may go to different ranks).

All ranks walk the same global sample stream and tokenize every sample of each global
mini-batch, so the mini-batch (and which samples are dropped) does not depend on the number
of data-parallel ranks; that is what makes global loss normalization layout-independent.
Images are sized from their headers for every sample (their placeholders count as tokens)
but decoded only for the rank's own share (``data.vision_samples``). With ``prefetch`` that
work for the next step runs in a background thread while the current step trains.
"""

import atexit
import logging
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan_rl.data.balance import DEFAULT_COST_MODEL, CostModel, assign_to_ranks, contiguous_split, imbalance
from torchtitan_rl.data.preferences import plan_preference_row
from torchtitan_rl.data.rows import row_base_dir, row_where
from torchtitan_rl.data.sample import Sample
from torchtitan_rl.data.tokenizer import Tokenizer
from torchtitan_rl.data.vision_samples import PlannedSample, RowPlanner, VisionDataConfig, build_sample

logger = logging.getLogger(__name__)

LONG_SAMPLE_POLICIES = ("truncate", "drop")
_COUNTERS = ("num_samples", "num_truncated", "num_dropped", "num_too_short", "num_without_loss_tokens")
# Only with a vision config, so text runs log and checkpoint exactly what they did before:
# num_images: images of the samples kept; num_dropped_image_cut: samples longer than seq_len
# that the truncate policy dropped because the cut would split an image.
_VISION_COUNTERS = ("num_images", "num_dropped_image_cut")
# Only with preference pairs: num_pairs kept, num_identical_pairs dropped (nothing to prefer).
_PREFERENCE_COUNTERS = ("num_pairs", "num_identical_pairs")


@dataclass(frozen=True)
class _Batch:
    """A step's samples for this rank (or what ``prepare`` made of them) and the loader's state
    and statistics right after them."""

    samples: Any
    state: dict[str, Any]
    balance_stats: dict[str, float]


class _Prefetch:
    """One call of ``produce`` running in a daemon thread; ``result`` waits for it and returns
    its value or raises its exception (with its message and the thread's traceback)."""

    def __init__(self, produce):
        self._value = self._error = None
        self._thread = threading.Thread(target=self._run, args=(produce,), name="sft-data-prefetch", daemon=True)
        _RUNNING.add(self)
        self._thread.start()

    def _run(self, produce) -> None:
        time.sleep(0)  # hands the GIL back at once, so ``start`` returns without a switch interval's wait
        try:
            self._value = produce()
        except BaseException as err:  # noqa: BLE001  (handed to the thread that wants the batch)
            self._error = err
        finally:
            _RUNNING.discard(self)

    def join(self, timeout_s: float | None = None) -> None:
        self._thread.join(timeout_s)

    def result(self) -> _Batch:
        self.join()
        if self._error is not None:
            raise self._error
        return self._value


# Prefetches in flight, joined at exit in case the loader's owner never called ``close``: a daemon
# thread still inside torch when the interpreter tears down can abort the process. The timeout
# keeps a thread stuck for good (e.g. on a hung file system) from hanging the exit instead.
_EXIT_JOIN_TIMEOUT_S = 60
_RUNNING: "weakref.WeakSet[_Prefetch]" = weakref.WeakSet()
atexit.register(lambda: [prefetch.join(_EXIT_JOIN_TIMEOUT_S) for prefetch in list(_RUNNING)])


class SFTDataLoader(IterableDataset):
    """Infinite iterator over this rank's ``list[Sample]`` share of successive global mini-batches.

    The global stream visits the rows in a fresh ``torch.randperm`` order every epoch (seeded
    with ``seed + epoch``) and repeats forever; each global mini-batch takes the next
    ``global_batch_size`` usable samples and rank ``batch_rank`` keeps the slice
    ``[batch_rank * share, (batch_rank + 1) * share)`` — or, with ``balance_dp_compute``,
    the samples ``data.balance.assign_to_ranks`` gives it by estimated compute (ranks may
    then get different numbers of samples, each at least one, in global order), sized for
    micro-batches of ``max_tokens_per_microbatch`` tokens (and the vision patch budget)
    packed ``balanced`` as ``EngineOptions.balance_microbatches`` does, by the model's
    ``cost_model`` (``EngineOptions.cost_model``).

    ``vision`` (None for text models) sets how images are sized and normalized; a row with
    images and no ``vision`` is an error. Under the truncate policy a too-long sample is cut
    only when the cut falls after its last image placeholder; otherwise it is dropped and
    counted in ``num_dropped_image_cut``.

    ``prefetch`` computes each next mini-batch in a background thread as soon as the current
    one is taken, so planning, tokenization and image decoding overlap the training step. The
    batches are the same; ``state_dict`` and the statistics describe the batches taken, not
    the one being prepared, and an error of the background work is raised by the ``next``
    that wanted its batch. ``close`` waits for the background work.

    ``prepare`` (optional) turns the rank's samples into what the trainer steps on, e.g.
    ``Engine.prepare``'s planned and packed micro-batches; the loader then yields its results,
    computed on the prefetch thread like the rest. It must not run collectives.

    ``preference_pairs``: every row is a preference pair (``data.preferences``) that becomes two
    samples, the chosen then the rejected completion, kept or dropped together. A global
    mini-batch then takes ``global_batch_size`` pairs: pair k is its samples 2k and 2k + 1, both
    with ``group_id = k`` and the row's ``margin``, ``preferred`` True and False. The ``2 * global_batch_size`` samples
    are split over the ranks as above, so a pair's two samples may train on different ranks.
    A pair is never truncated, whatever ``long_sample_policy`` says (a cut answer would be
    compared with a whole one): a pair with a side longer than ``seq_len`` is dropped.
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
        vision: VisionDataConfig | None = None,
        balance_dp_compute: bool = False,
        prefetch: bool = False,
        prepare: Callable[[list[Sample]], Any] | None = None,
        max_tokens_per_microbatch: int = 0,
        cost_model: CostModel = DEFAULT_COST_MODEL,
        preference_pairs: bool = False,
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
        self.batch_degree = batch_degree
        self.vision = vision
        self.balance_dp_compute = balance_dp_compute
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        self.cost_model = cost_model
        self.preference_pairs = preference_pairs
        self._planner = RowPlanner(tokenizer, vision)
        self._counter_names = (
            _COUNTERS
            + (_VISION_COUNTERS if vision is not None else ())
            + (_PREFERENCE_COUNTERS if preference_pairs else ())
        )
        self._balance_stats: dict[str, float] = {}

        self._epoch = 0
        self._position = 0  # index of the next row to visit in this epoch's permutation
        self._num_usable_in_epoch = 0  # rows kept (samples, or pairs)
        self._counters = dict.fromkeys(self._counter_names, 0)
        self._order = self._epoch_order()
        self._warned_no_loss_tokens = False
        self.prefetch = prefetch
        self.prepare = prepare
        self._prefetch: _Prefetch | None = None
        # What the caller sees: the state and statistics after the last batch it took (the
        # fields above run ahead while the next batch is prepared).
        self._taken_state = self._live_state()
        self._taken_balance_stats: dict[str, float] = {}

    def _epoch_order(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + self._epoch)
        return torch.randperm(len(self.rows), generator=generator).tolist()

    def _advance_epoch(self) -> None:
        # Usability depends only on the row, so an epoch without a usable sample means none ever comes.
        if self._num_usable_in_epoch == 0:
            unit = "preference pair" if self.preference_pairs else "sample"
            raise ValueError(
                f"no usable {unit} in the whole dataset of {len(self.rows)} rows "
                f"(seq_len={self.seq_len}, long-sample policy {self.long_sample_policy!r}): {self._counters}"
            )
        self._epoch += 1
        self._position = 0
        self._num_usable_in_epoch = 0
        self._order = self._epoch_order()

    def _plan_row(self, row_index: int) -> list[PlannedSample]:
        """The samples of one row: one, or a preference pair's chosen and rejected."""
        row, where, base_dir = self.rows[row_index], row_where(self.rows, row_index), row_base_dir(self.rows, row_index)
        if self.preference_pairs:
            return list(plan_preference_row(self._planner, row, row_index, where, base_dir))
        return [self._planner.plan_row(row, row_index, where, base_dir)]

    def _usable(self, unit: list[PlannedSample]) -> list[PlannedSample] | None:
        """The samples of a row as trained (possibly truncated), or None when dropped (counted)."""
        budget = self.vision.max_patches_per_microbatch if self.vision is not None else 0
        for planned in unit:
            if budget and planned.num_patches > budget:
                raise ValueError(
                    f"{planned.where}: its {len(planned.images)} image(s) have {planned.num_patches} vision "
                    f"patches, more than training.max_patches_per_microbatch={budget} (samples are never split)"
                )
        if any(len(planned.tokens) < 2 for planned in unit):
            self._counters["num_too_short"] += 1
            return None
        if any(len(planned.tokens) - 1 > self.seq_len for planned in unit):
            if self.preference_pairs or self.long_sample_policy == "drop":
                self._counters["num_dropped"] += 1
                return None
            [planned] = unit
            # Every placeholder must be an input token (inputs are tokens[:seq_len]), or the
            # image's features would have nowhere to go.
            if planned.images_end > self.seq_len:
                self._counters["num_dropped_image_cut"] += 1
                return None
            self._counters["num_truncated"] += 1
            unit = [planned.truncated(self.seq_len + 1)]
        if self.preference_pairs and unit[0].tokens == unit[1].tokens:
            self._counters["num_identical_pairs"] += 1
            return None
        return unit

    def _next_usable(self) -> list[PlannedSample]:
        """The samples of the next row that is kept."""
        while True:
            if self._position == len(self._order):
                self._advance_epoch()
            row_index = self._order[self._position]
            self._position += 1
            unit = self._usable(self._plan_row(row_index))
            if unit is None:
                continue
            for planned in unit:
                if not any(planned.target_mask[1:]):
                    # Kept on purpose: it carries zero loss weight but still counts as a sample of the batch.
                    self._counters["num_without_loss_tokens"] += 1
                self._counters["num_samples"] += 1
                if self.vision is not None:
                    self._counters["num_images"] += len(planned.images)
            if self.preference_pairs:
                self._counters["num_pairs"] += 1
            self._num_usable_in_epoch += 1
            return unit

    def __iter__(self) -> "SFTDataLoader":
        return self

    def __next__(self) -> Any:
        if self._prefetch is None:
            batch = self._produce()
        else:
            prefetch, self._prefetch = self._prefetch, None
            batch = prefetch.result()
        self._taken_state, self._taken_balance_stats = batch.state, batch.balance_stats
        if self.prefetch:
            self._prefetch = _Prefetch(self._produce)
        return batch.samples

    def close(self) -> None:
        """Wait for the mini-batch being prepared in the background, if any, and drop it."""
        if self._prefetch is not None:
            self._prefetch.join()
            self._prefetch = None

    def _produce(self) -> _Batch:
        """The next mini-batch: this rank's samples, with the state and statistics after it."""
        global_batch = [planned for _ in range(self.global_batch_size) for planned in self._next_usable()]
        if not self._warned_no_loss_tokens and not any(any(p.target_mask[1:]) for p in global_batch):
            self._warned_no_loss_tokens = True
            logger.warning(
                "a global mini-batch of %d samples has no loss tokens at all (e.g. prompts truncated "
                "away their answers); such steps do not train. Counters so far: %s",
                len(global_batch),
                self._counters,
            )
        mine = self._assign(global_batch)[self.batch_rank]
        # Pixels only for this rank's share: decoding is the expensive part of an image.
        samples = [build_sample(global_batch[i], self.vision) for i in mine]
        if self.preference_pairs:
            for i, sample in zip(mine, samples):
                # Pair k is samples 2k (chosen) and 2k + 1 (rejected) of the global mini-batch.
                sample.group_id, sample.preferred, sample.margin = i // 2, i % 2 == 0, global_batch[i].margin
        batch = samples if self.prepare is None else self.prepare(samples)
        return _Batch(batch, self._live_state(), dict(self._balance_stats))

    def _assign(self, global_batch: list[PlannedSample]) -> list[list[int]]:
        """Per DP rank, the global-batch indices it trains; records both splits' imbalance."""
        seq_lens, num_patches = [len(p.tokens) - 1 for p in global_batch], [p.num_patches for p in global_batch]
        costs = [self.cost_model.sample_cost(n, p) for n, p in zip(seq_lens, num_patches)]
        contiguous = contiguous_split(len(global_batch), self.batch_degree)
        balanced = assign_to_ranks(
            seq_lens,
            self.batch_degree,
            num_patches=num_patches,
            max_tokens=self.max_tokens_per_microbatch,
            max_patches=self.vision.max_patches_per_microbatch if self.vision is not None else 0,
            cost_model=self.cost_model,
        )
        chosen = balanced if self.balance_dp_compute else contiguous
        self._balance_stats = {
            "dp_cost_imbalance": imbalance(costs, chosen),
            "dp_cost_imbalance_contiguous": imbalance(costs, contiguous),
            "dp_cost_imbalance_balanced": imbalance(costs, balanced),
        }
        return chosen

    def balance_stats(self) -> dict[str, float]:
        """The last mini-batch's slowest-rank cost over the mean rank cost (``data.balance``
        cost model; 1.0 is perfect): ``dp_cost_imbalance`` of the split used, and of the
        contiguous and the balanced split (whichever is in use). Identical on every rank."""
        return dict(self._taken_balance_stats)

    def stats(self) -> dict[str, int]:
        """Global counters (identical on every rank) over all rows visited so far.

        num_samples (kept), num_truncated, num_dropped (too long, drop policy), num_too_short
        (fewer than 2 tokens), num_without_loss_tokens (kept, zero weight); with ``vision``
        also num_images and num_dropped_image_cut (see the class docstring).

        With ``preference_pairs`` a row is a pair, kept or dropped whole: num_samples counts
        the kept samples (two per pair) and num_pairs the kept pairs; num_dropped the pairs
        with a side longer than ``seq_len`` (never truncated: a cut answer would be compared,
        so num_truncated stays 0), num_too_short those with a side of fewer than 2 tokens, and
        num_identical_pairs those whose chosen and rejected tokens are the same (nothing to
        prefer).
        """
        return {name: self._taken_state[name] for name in self._counter_names}

    def _live_state(self) -> dict[str, Any]:
        # Rank-independent, so a resume may even use a different DP degree.
        return {
            "epoch": self._epoch,
            "position": self._position,
            "num_usable_in_epoch": self._num_usable_in_epoch,
            **self._counters,
        }

    def state_dict(self) -> dict[str, Any]:
        return dict(self._taken_state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.close()  # a batch prepared from the old position is not the next one any more
        self._epoch = state_dict["epoch"]
        self._position = state_dict["position"]
        self._num_usable_in_epoch = state_dict["num_usable_in_epoch"]
        # A checkpoint of a text run has no vision counters (nor an SFT run preference ones): they start from 0.
        self._counters = {
            name: state_dict[name] if name in _COUNTERS else state_dict.get(name, 0) for name in self._counter_names
        }
        self._order = self._epoch_order()
        self._taken_state = self._live_state()


def _keep_samples(batch):
    # Samples are already tensors of different lengths; packing them is the engine's job.
    return batch


def build_sft_dataloader(
    rows: Sequence[dict[str, Any]],
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    global_batch_size: int,
    long_sample_policy: str,
    seed: int,
    batch_rank: int,
    batch_degree: int,
    vision: VisionDataConfig | None = None,
    balance_dp_compute: bool = False,
    prefetch: bool = False,
    prepare: Callable[[list[Sample]], Any] | None = None,
    max_tokens_per_microbatch: int = 0,
    cost_model: CostModel = DEFAULT_COST_MODEL,
    preference_pairs: bool = False,
) -> StatefulDataLoader:
    """A checkpointable loader whose ``state_dict`` carries the exact stream position (see
    ``SFTDataLoader``; with ``prefetch``, call ``.dataset.close()`` when done with it)."""
    dataset = SFTDataLoader(
        rows,
        tokenizer,
        seq_len,
        global_batch_size,
        long_sample_policy,
        seed,
        batch_rank,
        batch_degree,
        vision=vision,
        balance_dp_compute=balance_dp_compute,
        prefetch=prefetch,
        prepare=prepare,
        max_tokens_per_microbatch=max_tokens_per_microbatch,
        cost_model=cost_model,
        preference_pairs=preference_pairs,
    )
    with warnings.catch_warnings():
        # StatefulDataLoader's constructor calls torch.set_vital, which torch deprecated (it does
        # nothing now): every run would print that warning once per rank, about nothing of the run.
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
        return StatefulDataLoader(dataset, batch_size=None, num_workers=0, collate_fn=_keep_samples)
