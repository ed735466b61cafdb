"""Multi-turn episodes, token in and token out: the policy samples a turn, the caller answers with
the tokens of an observation (or ends the episode), and the policy goes on from there.

An episode is one token stream owned by the generator: sampled tokens are never re-tokenized,
observations are tokenized once by the caller (``respond``) and appended. The result marks
which tokens were sampled (the loss tokens, the turn's stop token included) and their
behaviour log-probs; observation and template tokens carry neither.

With the KV cache (the default) each running row's cache holds its episode so far: turn 0
prefills the prompts (each prompt once for its samples), and every later call feeds only what
is new, one sampled token per running row, or, for a row starting a new turn, the last turn's
stop token followed by the observation's tokens, all rows packed into one forward
(``ExtendAttention``, which reads the cache through views). Finished episodes drop out of the
forward. The cache has the slots the running turns can reach (a turn's start plus
``max_new_tokens``, within ``max_len``): a turn that starts beyond them grows it, keeping the
running rows only. ``kv_cache=False`` recomputes every running row's whole episode at every
token: the reference the cache is tested against.

Randomness: row (prompt index p, sample s) draws one uniform per sampled token, in order, from
its own generator seeded like a single-turn rollout's (``rollout_seed``), so an episode depends
only on (weights, prompt, the environment's answers, params, seed, step, p, s).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from torchtitan_rl.rl.generator import (
    PromptBatch,
    SamplingParams,
    TorchGenerator,
    pack_sequences,
    rollout_seed,
    sample_tokens,
)
from torchtitan_rl.rl.kv_cache import ExtendAttention

# (prompt index, sample index, the turn's sampled tokens, its stop token last) -> the tokens to
# append before the next turn, or None to end the episode.
Respond = Callable[[int, int, list[int]], list[int] | None]


@dataclass
class EpisodeTokens:
    prompt_index: int
    sample_index: int
    tokens: list[int]  # the prompt, every sampled turn and every observation, in order
    sampled: list[bool]  # per token: sampled by the policy (a loss token)
    logprobs: list[float]  # per token: its behaviour log-prob where sampled, else 0
    num_turns: int
    end_reason: str  # "done" (respond ended it), "max_turns", "length" (budget or max_new_tokens)
    version: int


def generate_episodes(
    generator: TorchGenerator,
    prompts: list[list[int]],
    prompt_indices: list[int],
    num_samples: int,
    params: SamplingParams,
    seed: int,
    step: int,
    respond: Respond,
    max_turns: int,
    max_len: int,
) -> list[EpisodeTokens]:
    """``num_samples`` episodes of each prompt, in (prompt, sample) order.

    A turn ends at a stop token of ``params`` or after ``params.max_new_tokens`` tokens (then the
    episode ends, ``length``). ``respond(prompt_index, sample_index, turn_tokens)`` (a turn that
    ended with a stop token, that token last) returns the observation's tokens (the chat template's glue included) or None when the
    episode is done. An episode also ends after ``max_turns`` turns and when it would exceed
    ``max_len`` tokens (a turn cut there, or an observation that does not fit: ``length``).
    """
    generator.check_inputs(prompts, prompt_indices, num_samples, params)
    for index, prompt in zip(prompt_indices, prompts):
        if len(prompt) >= max_len:
            raise ValueError(f"prompt {index}: {len(prompt)} tokens leave no room in an episode of {max_len} tokens")
    if max_len > generator.args.max_seq_len:
        raise ValueError(f"episodes of {max_len} tokens exceed the model's max_seq_len {generator.args.max_seq_len}")
    episodes = []
    size = generator.max_prompts_per_batch
    for start in range(0, len(prompts), size):
        end = start + size
        batch = PromptBatch(prompts[start:end], num_samples, generator.device)
        pairs = [(p, s) for p in prompt_indices[start:end] for s in range(num_samples)]
        episodes += _EpisodeBatch(generator, batch, pairs, params, seed, step, max_len).run(respond, max_turns)
    return episodes


class _EpisodeBatch:
    def __init__(self, generator, batch: PromptBatch, pairs, params, seed: int, step: int, max_len: int):
        self.gen, self.batch, self.pairs, self.params, self.max_len = generator, batch, pairs, params, max_len
        self.rngs = [torch.Generator().manual_seed(rollout_seed(seed, step, p, s)) for p, s in pairs]
        self.tokens = [list(batch.prompts[r // batch.num_samples]) for r in range(len(pairs))]
        self.sampled = [[False] * len(t) for t in self.tokens]
        self.logprobs = [[0.0] * len(t) for t in self.tokens]
        self.turn_start = [len(t) for t in self.tokens]  # where each row's running turn began
        self.cache_row = {r: r for r in range(len(pairs))}  # each running row's row in the cache
        self.cache = generator.new_cache(len(pairs), self._reach(range(len(pairs)))) if generator.kv_cache else None
        self.cached_len = [0] * len(pairs)  # tokens of each row already in its cache

    def _reach(self, rows) -> int:
        """The cache slots ``rows``' running turns can fill: every token of a turn but its last
        (fed with the observation after it, when the next turn starts), within ``max_len``
        tokens (the last of which is never fed)."""
        return max(min(self.turn_start[r] + self.params.max_new_tokens - 1, self.max_len - 1) for r in rows)

    @torch.no_grad()
    def run(self, respond: Respond, max_turns: int) -> list[EpisodeTokens]:
        params = self.params
        stop_ids = set(params.stop_token_ids)
        rows = list(range(len(self.pairs)))
        num_turns = [1] * len(rows)
        turn = [[] for _ in rows]
        end_reason = [""] * len(rows)
        logits = self._first_logits()
        while rows:
            uniforms = torch.cat([torch.rand(1, generator=self.rngs[r], dtype=torch.float64) for r in rows])
            tokens, logprobs = sample_tokens(logits, params, uniforms.to(self.gen.device))
            running = []
            for r, token, logprob in zip(rows, tokens.tolist(), logprobs.tolist()):
                self.tokens[r].append(token)
                self.sampled[r].append(True)
                self.logprobs[r].append(logprob)
                turn[r].append(token)
                stopped = token in stop_ids
                if not stopped and len(turn[r]) < params.max_new_tokens and len(self.tokens[r]) < self.max_len:
                    running.append(r)
                    continue
                if not stopped:
                    end_reason[r] = "length"
                    continue
                p, s = self.pairs[r]
                observation = respond(p, s, turn[r])
                turn[r] = []
                if observation is None:
                    end_reason[r] = "done"
                elif num_turns[r] == max_turns:
                    end_reason[r] = "max_turns"
                elif len(self.tokens[r]) + len(observation) >= self.max_len:
                    end_reason[r] = "length"  # the observation and a next turn do not fit
                else:
                    self.tokens[r] += observation
                    self.sampled[r] += [False] * len(observation)
                    self.logprobs[r] += [0.0] * len(observation)
                    self.turn_start[r] = len(self.tokens[r])
                    num_turns[r] += 1
                    running.append(r)
            rows = running
            if rows:
                logits = self._next_logits(rows)
        return [
            EpisodeTokens(
                p,
                s,
                self.tokens[r],
                self.sampled[r],
                self.logprobs[r],
                num_turns[r],
                end_reason[r],
                self.gen.version,
            )
            for r, (p, s) in enumerate(self.pairs)
        ]

    def _first_logits(self) -> torch.Tensor:
        if self.cache is None:
            return self._recomputed_logits(list(range(len(self.pairs))))
        logits = self.gen.prefill(self.batch, self.cache)
        self.cached_len = [len(t) for t in self.tokens]
        return logits

    def _next_logits(self, rows: list[int]) -> torch.Tensor:
        """Logits after each of ``rows``' tokens so far (every row has tokens not yet fed)."""
        if self.cache is None:
            return self._recomputed_logits(rows)
        if (reach := self._reach(rows)) > self.cache.num_slots:
            self.cache = self.cache.resized([self.cache_row[r] for r in rows], reach)
            self.cache_row = {r: i for i, r in enumerate(rows)}
        new = [self.tokens[r][self.cached_len[r] :] for r in rows]
        attention = ExtendAttention.build(
            self.cache, [self.cache_row[r] for r in rows], [self.cached_len[r] for r in rows], [len(n) for n in new]
        )
        for r in rows:
            self.cached_len[r] = len(self.tokens[r])
        ids = torch.tensor([t for part in new for t in part], device=self.gen.device)
        last = torch.tensor([len(part) for part in new], device=self.gen.device).cumsum(0) - 1
        return self.gen.logits(ids, attention.positions, attention.rows, attention, last)

    def _recomputed_logits(self, rows: list[int]) -> torch.Tensor:
        ids, positions, seq_ids, last = pack_sequences(
            [torch.tensor(self.tokens[r], device=self.gen.device) for r in rows]
        )
        return self.gen.logits(ids, positions, seq_ids, rows=last)
