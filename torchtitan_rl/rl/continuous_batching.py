"""Continuous batching: the loop that turns a rank's prompts into finished rows, for single-turn
rollouts (``TorchGenerator.generate``) and multi-turn episodes (``rl/episodes.py``) alike.

A call holds at most ``capacity`` rows in its KV cache (``max_prompts_per_batch`` prompts times
``num_samples``); the other prompts wait in a queue, in order. Every iteration:

1. each running row samples its next token from its own random stream (``rl/sampling.py``);
2. rows that finished leave, and the cache is compacted so that the running rows are its first
   rows: the last running row moves into a freed row (its cache slots copied; its position and
   random stream are kept by row, so they go with it). The next forward costs what the running
   rows cost, never what the finished ones did;
3. the running rows' new tokens go through one forward that reads the cache through views: one
   sampled token per row (a decode step, ``TorchGenerator.decode``), or for a row starting a new
   turn, the last turn's stop token and the observation that answered it (``ExtendAttention``);
4. while a prompt's samples fit in the free rows, the next prompt is admitted: the admitted
   prompts' prefill is one packed forward that runs each prompt once for all its samples (its
   images through the vision tower) and writes its keys and values to its rows. The KV budget is
   a ceiling, never a point where every row waits for the slowest.

A row waiting for its environment (``respond`` runs inline) keeps its cache row and gives up
nothing. The cache has the slots the running turns can reach (a turn's start plus
``max_new_tokens``, within ``max_len``): every prompt's first turn from the start; a later turn
that starts beyond them grows it (the running rows' slots are copied).

Same rollouts whatever the batch: a row's tokens depend only on its own logits and its own
random stream, and its logits only on its own cache row, so compaction, refill and the order of
admission change nothing but the shape of the forwards its token goes through: with float
kernels that round differently for other shapes (batch rows, cache span), a log-prob can move in
its last bits, and a token only when its uniform falls within that rounding of a CDF step.

Without a KV cache (``kv_cache=False``) every forward reruns each row's whole sequence: the
reference the cache is tested against.

When the generator records routing, each row keeps the experts of the positions it feeds, from
the forward that feeds them (the one whose logits sample the next token): a prefill's are its
prompt's, shared by its samples; the recomputing path keeps those of the positions new to each
forward. They stay the host arrays each forward copied out (views, no per-token tensors) until
a finished row's are joined (``FinishedRow.routing``).
"""

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np
import torch

from torchtitan_rl.data.vision_samples import PlannedImage, VisionDataConfig, load_images
from torchtitan_rl.rl.kv_cache import ExtendAttention
from torchtitan_rl.rl.sampling import SamplingParams, rollout_seed, sample_tokens

PromptImages = tuple[PlannedImage, ...]
"""A prompt's images, in order, with their placeholders' positions in its tokens (none: text)."""

# (prompt index, sample index, the turn's sampled tokens, its stop token last) -> the tokens to
# append before the next turn, or None to end the episode.
Respond = Callable[[int, int, list[int]], list[int] | None]


@dataclass
class PromptBatch:
    """The prompts of one call; row ``i * num_samples + s`` (of its rollouts) is sample s of
    prompt i."""

    prompts: list[list[int]]
    num_samples: int
    device: torch.device
    images: list[PromptImages] | None = None  # per prompt; None: a text batch
    _loaded: dict = field(default_factory=dict)  # prompt -> its decoded images (SampleImage list)

    def loaded_images(self, prompt: int, vision: VisionDataConfig) -> list:
        """Prompt ``prompt``'s images, decoded and cut into patches once per call."""
        if prompt not in self._loaded:
            self._loaded[prompt] = load_images(self.images[prompt], vision)
        return self._loaded[prompt]

    def drop_images(self, prompts: list[int]) -> None:
        """Forget the decoded images of ``prompts`` (prefilled: nothing reads them again)."""
        for prompt in prompts:
            self._loaded.pop(prompt, None)

    @property
    def num_rows(self) -> int:
        return len(self.prompts) * self.num_samples


def pack_sequences(sequences: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, positions, seq_ids, index of each sequence's last token) of packed sequences."""
    device = sequences[0].device
    lens = torch.tensor([s.numel() for s in sequences], device=device)
    seq_ids = torch.repeat_interleave(torch.arange(len(sequences), device=device), lens)
    starts = lens.cumsum(0) - lens
    positions = torch.arange(seq_ids.numel(), device=device) - starts[seq_ids]
    return torch.cat(sequences), positions, seq_ids, lens.cumsum(0) - 1


@dataclass
class FinishedRow:
    tokens: list[int]  # the prompt, every sampled turn and every observation, in order
    sampled: list[bool]  # per token: sampled by the policy (a loss token)
    logprobs: list[float]  # per token: its behaviour log-prob where sampled, else 0
    num_turns: int
    end_reason: str  # "done" (a stop token, no observation after it), "max_turns", "length"
    # With recorded routing: [m, MoE layers, top_k], the experts of the last m positions of
    # tokens but the last (never fed), from the first recorded one (``Rollout.routing``).
    routing: np.ndarray | None = None


class ContinuousBatch:
    """One call's rows, run to the end by ``run``. ``generator`` is a ``TorchGenerator``;
    ``pairs[r]`` the (prompt index, sample index) of row r, which seeds its random stream;
    ``respond`` answers a turn that ended with a stop token (None: single-turn, the row is done)."""

    def __init__(
        self,
        generator,
        batch: PromptBatch,
        pairs: list[tuple[int, int]],
        params: SamplingParams,
        seed: int,
        step: int,
        respond: Respond | None,
        max_turns: int,
        max_len: int,
    ):
        self.gen, self.batch, self.pairs, self.params = generator, batch, pairs, params
        self.respond, self.max_turns, self.max_len = respond, max_turns, max_len
        samples = batch.num_samples
        self.capacity = min(generator.max_prompts_per_batch, len(batch.prompts)) * samples
        self.rngs = [torch.Generator().manual_seed(rollout_seed(seed, step, p, s)) for p, s in pairs]
        self.tokens = [list(batch.prompts[r // samples]) for r in range(len(pairs))]
        self.sampled = [[False] * len(t) for t in self.tokens]
        self.logprobs = [[0.0] * len(t) for t in self.tokens]
        self.turn = [[] for _ in pairs]  # the running turn's sampled tokens
        self.turn_start = [len(t) for t in self.tokens]  # where each row's running turn began
        self.num_turns = [1] * len(pairs)
        self.end_reason = [""] * len(pairs)
        self.cached_len = [0] * len(pairs)  # tokens of each row already fed (in its cache row, with one)
        # Per row: the recorded experts of the positions it fed, as parts [n, L, k] in order.
        self.routing = None if generator.record_routing == "off" else [[] for _ in pairs]
        self.running: list[int] = []  # cache row i holds row running[i]
        self.queue = deque(range(len(batch.prompts)))
        self.stop_ids = set(params.stop_token_ids)
        self.cache = None
        if generator.kv_cache:
            self.cache = generator.new_cache(self.capacity, max(self._reach(r) for r in range(len(pairs))))

    def _reach(self, row: int) -> int:
        """The cache slots ``row``'s running turn can fill: every token of the turn but its last
        (fed with the observation after it, when the next turn starts), within ``max_len``
        tokens (the last of which is never fed)."""
        return min(self.turn_start[row] + self.params.max_new_tokens - 1, self.max_len - 1)

    @torch.no_grad()
    def run(self) -> list[FinishedRow]:
        logits = self._admit()
        while self.running:
            start = time.perf_counter()
            uniforms = torch.cat([torch.rand(1, generator=self.rngs[r], dtype=torch.float64) for r in self.running])
            tokens, logprobs = sample_tokens(logits, self.params, uniforms.to(self.gen.device))
            still = [
                r
                for r, token, logprob in zip(self.running, tokens.tolist(), logprobs.tolist())
                if self._take(r, token, logprob)
            ]
            self._compact(still)
            logits = self._feed()
            self.gen.add_phase_seconds("decode", time.perf_counter() - start)
            if self.queue and self.capacity - len(self.running) >= self.batch.num_samples:
                logits = torch.cat((logits, self._admit()))
        return [
            FinishedRow(
                self.tokens[r],
                self.sampled[r],
                self.logprobs[r],
                self.num_turns[r],
                self.end_reason[r],
                None if self.routing is None else np.concatenate(self.routing[r]),
            )
            for r in range(len(self.pairs))
        ]

    def _take(self, r: int, token: int, logprob: float) -> bool:
        """Append row r's sampled token; answer a finished turn. Whether the row runs on."""
        self.tokens[r].append(token)
        self.sampled[r].append(True)
        self.logprobs[r].append(logprob)
        self.turn[r].append(token)
        if token not in self.stop_ids:
            if len(self.turn[r]) < self.params.max_new_tokens and len(self.tokens[r]) < self.max_len:
                return True
            self.end_reason[r] = "length"
            return False
        observation = None if self.respond is None else self.respond(*self.pairs[r], self.turn[r])
        self.turn[r] = []
        if observation is None:
            self.end_reason[r] = "done"
        elif self.num_turns[r] == self.max_turns:
            self.end_reason[r] = "max_turns"
        elif len(self.tokens[r]) + len(observation) >= self.max_len:
            self.end_reason[r] = "length"  # the observation and a next turn do not fit
        else:
            self.tokens[r] += observation
            self.sampled[r] += [False] * len(observation)
            self.logprobs[r] += [0.0] * len(observation)
            self.turn_start[r] = len(self.tokens[r])
            self.num_turns[r] += 1
            return True
        return False

    def _compact(self, still: list[int]) -> None:
        """Keep the rows in ``still`` as the cache's first rows: each running row beyond them
        moves into a row freed below, its cached slots copied."""
        order, keep, num_kept = list(self.running), set(still), len(still)
        holes = [i for i in range(num_kept) if order[i] not in keep]
        movers = [i for i in range(num_kept, len(order)) if order[i] in keep]
        for hole, mover in zip(holes, movers, strict=True):
            if self.cache is not None:
                self.cache.move_row(mover, hole, self.cached_len[order[mover]])
            order[hole] = order[mover]
        self.running = order[:num_kept]

    def _feed(self) -> torch.Tensor:
        """Logits after each running row's tokens so far, feeding what its cache row lacks."""
        rows = self.running
        if not rows:
            return torch.empty(0, self.gen.args.vocab_size, device=self.gen.device)
        positions = [self.cached_len[r] for r in rows]  # of each row's first new token
        for r in rows:
            self.cached_len[r] = len(self.tokens[r])
        new = [self.tokens[r][start:] for r, start in zip(rows, positions)]
        if self.cache is None:
            logits, experts = self._recomputed_logits(rows, positions)
        else:
            if (reach := max(self._reach(r) for r in rows)) > self.cache.num_slots:
                self.cache = self.gen.new_cache(self.capacity, reach, self.cache, len(rows))
            if all(len(part) == 1 for part in new):
                logits, experts = self.gen.decode([part[0] for part in new], positions, self.cache)
            else:
                attention = ExtendAttention.build(self.cache, list(range(len(rows))), positions, [len(n) for n in new])
                ids = torch.tensor([t for part in new for t in part], device=self.gen.device)
                last = torch.tensor([len(part) for part in new], device=self.gen.device).cumsum(0) - 1
                keep = None if self.routing is None else slice(None)
                logits, experts = self.gen.logits_and_routing(
                    ids, attention.positions, attention.rows, attention, last, keep=keep
                )
        if experts is not None:
            for r, part in zip(rows, np.split(experts, np.cumsum([len(part) for part in new])[:-1])):
                self.routing[r].append(part)
        return logits

    def _admit(self) -> torch.Tensor:
        """Admit the queued prompts whose samples fit in the free rows, in order: prefill them
        into the rows after the running ones; their first logits."""
        start = time.perf_counter()
        samples = self.batch.num_samples
        admitted = []
        while self.queue and self.capacity - len(self.running) - samples * len(admitted) >= samples:
            admitted.append(self.queue.popleft())
        rows = [p * samples + s for p in admitted for s in range(samples)]
        if self.cache is None:
            firsts = [self._first_recorded(p) for p in admitted]
            logits, experts = self._recomputed_logits([p * samples for p in admitted], firsts)
            logits = logits.repeat_interleave(samples, dim=0)
        else:
            if (reach := max(self._reach(r) for r in rows)) > self.cache.num_slots:
                self.cache = self.gen.new_cache(self.capacity, reach, self.cache, len(self.running))
            logits, experts = self.gen.prefill(self.batch, self.cache, admitted, len(self.running))
            self.batch.drop_images(admitted)
        if experts is not None:
            counts = [len(self.batch.prompts[p]) - self._first_recorded(p) for p in admitted]
            for p, part in zip(admitted, np.split(experts, np.cumsum(counts)[:-1])):
                for s in range(samples):
                    self.routing[p * samples + s].append(part)  # one prefill for all the prompt's samples
        for r in rows:
            self.cached_len[r] = len(self.tokens[r])
        self.running += rows
        self.gen.add_phase_seconds("prefill", time.perf_counter() - start)
        return logits

    def _first_recorded(self, prompt: int) -> int:
        """The first position of ``prompt``'s rows whose routing is recorded: 0, or with
        ``"completion"`` the prompt's last (the first to sample a token)."""
        return 0 if self.gen.record_routing == "all" else len(self.batch.prompts[prompt]) - 1

    def _recomputed_logits(self, rows: list[int], recorded: list[int]) -> tuple[torch.Tensor, np.ndarray | None]:
        """Last-position logits of ``rows``' whole sequences, rerun through the packed model, and
        when recording routing the experts of row i's positions from ``recorded[i]`` on, row after row."""
        sequences = [torch.tensor(self.tokens[r], device=self.gen.device) for r in rows]
        ids, positions, seq_ids, last = pack_sequences(sequences)
        prompt_of = [r // self.batch.num_samples for r in rows]
        vision = self.gen.vision_inputs(self.batch, [s.numel() for s in sequences], prompt_of)
        keep = None
        if self.routing is not None:
            lengths = [s.numel() for s in sequences]
            offsets = accumulate(lengths, initial=0)  # of each sequence in the packed tokens
            where = [o + j for o, n, start in zip(offsets, lengths, recorded) for j in range(start, n)]
            keep = torch.tensor(where, device=self.gen.device)
        return self.gen.logits_and_routing(ids, positions, seq_ids, rows=last, vision=vision, keep=keep)
