"""A length-skewed generation workload with a controlled stop schedule, for benchmarking the
rollout generator (``scripts/benchmark_generator.py``) with a randomly initialized model.

A random model does not stop when a benchmark needs it to, so the schedule overrides the
generator's logits: every forward of ``TorchGenerator`` goes through
``TorchGenerator.logits_and_routing(tokens, positions, seq_ids, attention, rows, vision, keep)``,
and ``with_stop_schedule`` post-processes the logits it returns using only the fed token of each output
row and its absolute position. The schedule (``StopSchedule``), for prompts of exactly
``prompt_len`` tokens and ``M = num_classes``:

- The token sampled at new-token index ``j`` (0-based; fed token at position ``prompt_len - 1 + j``).
- ``j = 0`` (the first completion token) picks the row's class: each residue class ``r`` of
  the token ids mod M gets the same probability 1/M, flat over its tokens, the stop token
  excluded. The model's logits are ignored for this one token, so the share of rows in a
  class is 1/M in expectation whatever the weights.
- ``j >= 1``: the fed token's residue ``r`` is the row's class. Only tokens of residue ``r``
  (not the stop token) can be drawn, from the model's own logits restricted to them, so the
  residue persists; at ``j = n(r) - 1`` only the stop token can be drawn. ``n(r)`` is the
  class's completion length, the stop token included: residues in ``long_classes`` never
  stop (they run to ``SamplingParams.max_new_tokens``); the other residues, in increasing
  order, get lengths spread evenly over ``min_short..max_short``.
- Positions before the last prompt token (a packed prompt's inner tokens) are left as the
  model gives them: nothing is sampled from them.

With the defaults (M = 8, ``long_classes=(0,)``, 8..32) one row in 8 runs to
``max_new_tokens`` and the others stop after 8, 12, ..., 32 tokens. Randomness still comes
only from the generator's per-row uniforms, so two generators that sample alike (same
weights, seeds and float results) draw the same tokens under the schedule too.

This module imports only torch: it is loaded next to the generator of any git ref.
"""

import functools
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StopSchedule:
    """When a row stops, decided by the residue mod ``num_classes`` of its tokens (module doc)."""

    prompt_len: int
    stop_token: int
    num_classes: int = 8
    long_classes: tuple[int, ...] = (0,)
    min_short: int = 8
    max_short: int = 32

    def __post_init__(self) -> None:
        if self.prompt_len < 1:
            raise ValueError(f"prompt_len must be >= 1, got {self.prompt_len}")
        if self.num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {self.num_classes}")
        if not set(self.long_classes) <= set(range(self.num_classes)) or len(self.long_classes) >= self.num_classes:
            raise ValueError(f"long_classes {self.long_classes} must be some, not all, of 0..{self.num_classes - 1}")
        if not 2 <= self.min_short <= self.max_short:
            raise ValueError(f"need 2 <= min_short <= max_short, got {self.min_short}..{self.max_short}")

    def class_lengths(self) -> list[int | None]:
        """Completion length (stop token included) of each residue class; None: never stops."""
        short = [r for r in range(self.num_classes) if r not in self.long_classes]
        span = self.max_short - self.min_short
        lengths: list[int | None] = [None] * self.num_classes
        for index, r in enumerate(short):
            lengths[r] = self.min_short + round(index * span / max(len(short) - 1, 1))
        return lengths

    def apply(self, logits: torch.Tensor, fed_tokens: torch.Tensor, fed_positions: torch.Tensor) -> torch.Tensor:
        """``logits [R, V]`` of the rows whose last fed token is ``fed_tokens [R]`` at absolute
        positions ``fed_positions [R]``, with the schedule applied; no host sync (the rows'
        classes and positions are read on the device)."""
        token_class, is_stop, lengths, first_logits = _constants(self, logits.shape[-1], logits.device, logits.dtype)
        index = fed_positions + 1 - self.prompt_len  # new-token index of the token to sample
        fed_class = fed_tokens % self.num_classes
        first = (index == 0)[:, None]
        first_logits = first_logits.expand_as(logits)
        must_stop = ((index >= 1) & (index >= lengths[fed_class] - 1))[:, None]
        same_class = (token_class[None, :] == fed_class[:, None]) & ~is_stop
        allowed = torch.where(first, ~is_stop, torch.where(must_stop, is_stop, same_class))
        scheduled = torch.where(first, first_logits, logits).masked_fill(~allowed, -math.inf)
        return torch.where((index >= 0)[:, None], scheduled, logits)


@functools.lru_cache(maxsize=16)
def _constants(schedule: StopSchedule, vocab: int, device: torch.device, dtype: torch.dtype):
    """The schedule's tensors over a vocabulary: each token's class, which token stops, each
    class's length (2**62: never stops), and the first token's logits."""
    if not 0 <= schedule.stop_token < vocab:
        raise ValueError(f"stop token {schedule.stop_token} is outside the vocabulary [0, {vocab})")
    ids = torch.arange(vocab, device=device)
    token_class = ids % schedule.num_classes
    is_stop = ids == schedule.stop_token
    lengths = torch.tensor([2**62 if n is None else n for n in schedule.class_lengths()], device=device)
    # Flat within a class, every class 1/M in all: -log(number of the class's drawable tokens).
    class_sizes = torch.zeros(schedule.num_classes, dtype=dtype, device=device)
    class_sizes.index_add_(0, token_class, (~is_stop).to(dtype))
    return token_class, is_stop, lengths, (-class_sizes.log())[token_class]


def with_stop_schedule(generator_or_class, schedule: StopSchedule):
    """``generator_or_class`` (a ``TorchGenerator`` subclass or instance) whose forwards
    (``logits_and_routing``, which every one goes through) apply ``schedule``: a class gives a
    subclass to construct as usual; an instance has its class swapped for that subclass (and is
    returned)."""
    cls = generator_or_class if isinstance(generator_or_class, type) else type(generator_or_class)

    class ScheduledGenerator(cls):
        stop_schedule = schedule

        def logits_and_routing(self, tokens, positions, seq_ids, attention=None, rows=None, vision=None, keep=None):
            out, routing = super().logits_and_routing(tokens, positions, seq_ids, attention, rows, vision, keep)
            if rows is not None:
                tokens, positions = tokens.index_select(0, rows), positions.index_select(0, rows)
            return self.stop_schedule.apply(out, tokens, positions), routing

    ScheduledGenerator.__name__ = ScheduledGenerator.__qualname__ = f"Scheduled{cls.__name__}"
    if isinstance(generator_or_class, type):
        return ScheduledGenerator
    generator_or_class.__class__ = ScheduledGenerator
    return generator_or_class


def skewed_prompts(num_prompts: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``num_prompts`` random prompts of exactly ``prompt_len`` tokens from ``0..vocab_size - 2``
    (the last id is left for the stop token, ``default_stop_token``)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size - 1, (num_prompts, prompt_len), generator=gen).tolist()


def default_stop_token(vocab_size: int) -> int:
    return vocab_size - 1


def schedule_mismatches(rollouts, schedule: StopSchedule, max_new_tokens: int) -> int:
    """How many rollouts did not follow ``schedule``: a wrong length, or a stop token where none
    was due (or none where one was)."""
    bad = 0
    for r in rollouts:
        tokens = r.completion_tokens
        length = schedule.class_lengths()[tokens[0] % schedule.num_classes] if tokens else None
        stops = length is not None and length <= max_new_tokens
        expected = length if stops else max_new_tokens
        bad += len(tokens) != expected or (tokens[-1:] == [schedule.stop_token]) != stops
    return bad
