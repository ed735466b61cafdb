"""Multi-turn episodes, token in and token out: the policy samples a turn, the caller answers with
the tokens of an observation (or ends the episode), and the policy goes on from there.

An episode is one token stream owned by the generator: sampled tokens are never re-tokenized,
observations are tokenized once by the caller (``respond``) and appended. The result marks
which tokens were sampled (the loss tokens, the turn's stop token included) and their
behaviour log-probs; observation and template tokens carry neither.

With the KV cache (the default) each row's cache holds its episode so far: turn 0 prefills the
prompts (each prompt once for its samples), and every later call feeds only what is new, one
sampled token per running row, or, for a row starting a new turn, the last turn's stop token
followed by the observation's tokens, all rows packed into one forward. Finished episodes drop
out of the forward. ``kv_cache=False`` recomputes every running row's whole episode at every
token: the reference the cache is tested against.

Randomness: row (prompt index p, sample s) draws one uniform per sampled token, in order, from
its own generator seeded like a single-turn rollout's (``rollout_seed``), so an episode depends
only on (weights, prompt, the environment's answers, params, seed, step, p, s).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from torchtitan_rl.rl.generator import (
    SamplingParams,
    TorchGenerator,
    _Batch,
    _KVCache,
    _pack,
    rollout_seed,
    sample_tokens,
)

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


@dataclass(frozen=True)
class _ExtendAttention:
    """Attention state feeding several new tokens per row: token i (of row ``rows[i]``, at
    ``positions[i]``) is written to its row's cache slot, then attends to that row's slots
    ``0..positions[i]`` (the row's earlier tokens and the new ones before it)."""

    cache: _KVCache
    rows: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    span: int

    def for_layer(self, layer_id: int):
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.cache.k[layer_id].index_put_((self.rows, self.positions), k)
            self.cache.v[layer_id].index_put_((self.rows, self.positions), v)
            keys, values = (c[layer_id][self.rows, : self.span].transpose(1, 2) for c in (self.cache.k, self.cache.v))
            slots = torch.arange(self.span, device=q.device)
            visible = (slots[None, :] <= self.positions[:, None])[:, None, None, :]
            out = F.scaled_dot_product_attention(
                q[:, :, None, :],
                keys,
                values,
                attn_mask=visible,
                scale=q.shape[-1] ** -0.5,
                enable_gqa=q.shape[1] != k.shape[1],
            )
            return out.squeeze(2)

        return attend


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
    generator._check_inputs(prompts, prompt_indices, num_samples, params)
    for index, prompt in zip(prompt_indices, prompts):
        if len(prompt) >= max_len:
            raise ValueError(f"prompt {index}: {len(prompt)} tokens leave no room in an episode of {max_len} tokens")
    if max_len > generator.args.max_seq_len:
        raise ValueError(f"episodes of {max_len} tokens exceed the model's max_seq_len {generator.args.max_seq_len}")
    episodes = []
    size = generator.max_prompts_per_batch
    for start in range(0, len(prompts), size):
        end = start + size
        batch = _Batch(prompts[start:end], num_samples, generator.device)
        pairs = [(p, s) for p in prompt_indices[start:end] for s in range(num_samples)]
        episodes += _EpisodeBatch(generator, batch, pairs, params, seed, step, max_len).run(respond, max_turns)
    return episodes


class _EpisodeBatch:
    def __init__(self, generator, batch: _Batch, pairs, params, seed: int, step: int, max_len: int):
        self.gen, self.batch, self.pairs, self.params, self.max_len = generator, batch, pairs, params, max_len
        self.rngs = [torch.Generator().manual_seed(rollout_seed(seed, step, p, s)) for p, s in pairs]
        self.tokens = [list(batch.prompts[r // batch.num_samples]) for r in range(len(pairs))]
        self.sampled = [[False] * len(t) for t in self.tokens]
        self.logprobs = [[0.0] * len(t) for t in self.tokens]
        self.cache = None
        if generator.kv_cache:
            shape = (generator.args.n_layers, len(pairs), max_len, generator.args.n_kv_heads, generator.args.head_dim)
            dtype = generator.model.output.weight.dtype
            # Zeros, not empty: masked slots get zero weight, and 0 * NaN garbage would still be NaN.
            device = generator.device
            self.cache = _KVCache(
                torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
            )
        self.cached_len = [0] * len(pairs)  # tokens of each row already in its cache

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
        logits = self.gen._prefill(self.batch, self.cache)
        self.cached_len = [len(t) for t in self.tokens]
        return logits

    def _next_logits(self, rows: list[int]) -> torch.Tensor:
        """Logits after each of ``rows``' tokens so far (every row has tokens not yet fed)."""
        if self.cache is None:
            return self._recomputed_logits(rows)
        new = [self.tokens[r][self.cached_len[r] :] for r in rows]
        device = self.gen.device
        ids = torch.tensor([t for part in new for t in part], device=device)
        row_ids = torch.tensor([r for r, part in zip(rows, new) for _ in part], device=device)
        positions = torch.tensor(
            [self.cached_len[r] + i for r, part in zip(rows, new) for i in range(len(part))], device=device
        )
        last = torch.tensor([len(part) for part in new], device=device).cumsum(0) - 1
        span = max(len(self.tokens[r]) for r in rows)
        attention = _ExtendAttention(self.cache, row_ids, positions, span)
        for r in rows:
            self.cached_len[r] = len(self.tokens[r])
        return self.gen._logits(ids, positions, row_ids, attention, last)

    def _recomputed_logits(self, rows: list[int]) -> torch.Tensor:
        ids, positions, seq_ids, last = _pack([torch.tensor(self.tokens[r], device=self.gen.device) for r in rows])
        return self.gen._logits(ids, positions, seq_ids, rows=last)
