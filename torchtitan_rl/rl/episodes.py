"""Multi-turn episodes, token in and token out: the policy samples a turn, the caller answers with
the tokens of an observation (or ends the episode), and the policy goes on from there.

An episode is one token stream owned by the generator: sampled tokens are never re-tokenized,
observations are tokenized once by the caller (``respond``) and appended. The result marks
which tokens were sampled (the loss tokens, the turn's stop token included) and their
behaviour log-probs; observation and template tokens carry neither.

Episodes run through the same continuous batching as single-turn rollouts
(``rl/continuous_batching.py``): with the KV cache (the default) each running row's cache row
holds its episode so far; every forward feeds only what is new, one sampled token per running
row, or, for a row starting a new turn, the last turn's stop token followed by the
observation's tokens (``ExtendAttention``, which reads the cache through views). Finished
episodes leave the batch and queued prompts take their rows. ``kv_cache=False`` recomputes
every running row's whole episode at every token: the reference the cache is tested against.

Randomness: row (prompt index p, sample s) draws one uniform per sampled token, in order, from
its own generator seeded like a single-turn rollout's (``rollout_seed``), so an episode depends
only on (weights, prompt, the environment's answers, params, seed, step, p, s).

A generator that records routing records an episode's like a rollout's (``Rollout.routing``):
observation tokens are fed positions too, so their experts are recorded with the sampled ones'.
"""

from dataclasses import dataclass

import numpy as np

from torchtitan_rl.rl.continuous_batching import ContinuousBatch, PromptBatch, Respond
from torchtitan_rl.rl.generator import SamplingParams, TorchGenerator


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
    routing: np.ndarray | None = None  # the experts of the last positions of tokens[:-1] (Rollout.routing)


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
    if not prompts:
        return []
    batch = PromptBatch(prompts, num_samples, generator.device)
    pairs = [(p, s) for p in prompt_indices for s in range(num_samples)]
    rows = ContinuousBatch(generator, batch, pairs, params, seed, step, respond, max_turns, max_len).run()
    return [
        EpisodeTokens(
            p, s, row.tokens, row.sampled, row.logprobs, row.num_turns, row.end_reason, generator.version, row.routing
        )
        for (p, s), row in zip(pairs, rows)
    ]
