"""Multi-turn episodes (``rl/episodes.py``): the KV-cache path equals recomputing each row's whole
episode at every token (tokens exactly, log-probs to float rounding), with observations of
different lengths arriving at different times and episodes ending for every reason; the
result's masks and log-probs line up with what was sampled and what the caller appended; a
single-turn episode is the single-turn rollout; an episode does not depend on the batch
it is generated in; and the cache's memory, measured (CPU profiler) on a wider model, follows
what the episodes reach, and feeding an observation reads it without copying it."""

import contextlib
import dataclasses

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from test_generator import ARGS, PROMPTS, brute_force_rows, generate, generator_for, noisy_model, recording_forwards
from torchtitan_rl.profiling import cpu_memory_timeline
from torchtitan_rl.rl.episodes import generate_episodes
from torchtitan_rl.rl.generator import SamplingParams

STOPS = tuple(range(8))  # a noisy model draws one of them every few tokens
MAX_LEN = 48


def scripted_respond(log: list | None = None):
    """An environment of tokens: after a turn that stopped with token 1 or 3 the episode ends;
    else it answers with 1 + (turn length mod 4) tokens 40, 41, ... (observations of different
    lengths)."""

    def respond(p: int, s: int, turn: list[int]) -> list[int] | None:
        if log is not None:
            log.append((p, s, list(turn)))
        assert turn[-1] in STOPS
        if turn[-1] in (1, 3):
            return None
        return [40 + i for i in range(1 + len(turn) % 4)]

    return respond


def episodes(gen, prompts=PROMPTS, num_samples=4, max_turns=3, seed=5, max_len=MAX_LEN, respond=None, **params):
    params.setdefault("max_new_tokens", 8)
    params.setdefault("stop_token_ids", STOPS)
    return generate_episodes(
        gen,
        prompts,
        list(range(len(prompts))),
        num_samples,
        SamplingParams(**params),
        seed,
        2,
        respond or scripted_respond(),
        max_turns,
        max_len,
    )


@pytest.fixture(scope="module")
def model():
    return noisy_model(std=0.6)


def test_the_cache_equals_recomputing_every_episode(model):
    cached = episodes(generator_for(model, max_prompts_per_batch=3))
    recomputed = episodes(generator_for(model, max_prompts_per_batch=3, kv_cache=False))
    assert [(e.prompt_index, e.sample_index) for e in cached] == [(p, s) for p in range(3) for s in range(4)]
    for c, r in zip(cached, recomputed):
        assert (c.tokens, c.sampled, c.num_turns, c.end_reason) == (r.tokens, r.sampled, r.num_turns, r.end_reason)
        assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(r.logprobs), atol=1e-5)
    # Premises: several turns happened, and episodes ended for every reason.
    assert max(e.num_turns for e in cached) >= 3
    assert {e.end_reason for e in cached} == {"done", "max_turns", "length"}


@pytest.mark.parametrize("kv_cache", [True, False])
def test_episodes_through_a_small_cache_equal_each_episode_run_alone(model, kv_cache):
    """3 prompts x 4 samples through a cache of one prompt's rows: finished episodes leave, the
    next prompt's samples take their rows, and every episode equals the brute-force one (the
    whole episode rerun for every token, the row alone)."""
    gen = generator_for(model, max_prompts_per_batch=1, kv_cache=kv_cache)
    events = recording_forwards(gen)
    result = episodes(gen)
    params = SamplingParams(max_new_tokens=8, stop_token_ids=STOPS)
    for p, prompt in enumerate(PROMPTS):
        expected = brute_force_rows(model, prompt, p, 4, params, 5, 2, scripted_respond(), 3, MAX_LEN)
        for s, (tokens, sampled, logprobs, turns, reason) in enumerate(expected):
            episode = result[4 * p + s]
            assert (episode.prompt_index, episode.sample_index) == (p, s)
            assert episode.tokens == prompt + tokens
            assert episode.sampled == [False] * len(prompt) + sampled
            assert (episode.num_turns, episode.end_reason) == (turns, reason)
            assert episode.logprobs[len(prompt) :] == pytest.approx(logprobs, abs=1e-5)
    assert max(e.num_turns for e in result) == 3  # premise: several turns
    if kv_cache:
        assert [kind for kind, _ in events].count("prefill") == 3
        assert max(rows for kind, rows in events if kind == "decode") <= 4


def test_masks_and_logprobs_line_up_with_what_was_sampled_and_appended(model):
    log: list = []
    result = episodes(generator_for(model), respond=scripted_respond(log))
    turns = {}
    for p, s, turn in log:
        turns.setdefault((p, s), []).append(turn)
    for episode in result:
        prompt = PROMPTS[episode.prompt_index]
        assert episode.tokens[: len(prompt)] == prompt and not any(episode.sampled[: len(prompt)])
        assert len(episode.tokens) == len(episode.sampled) == len(episode.logprobs) <= MAX_LEN
        # Rebuild the episode by hand: each turn's tokens sampled, each observation not.
        expected_tokens, expected_mask = list(prompt), [False] * len(prompt)
        answered = turns.get((episode.prompt_index, episode.sample_index), [])
        for i, turn in enumerate(answered):
            expected_tokens += turn
            expected_mask += [True] * len(turn)
            observation = scripted_respond()(0, 0, turn)
            if observation is not None and i + 1 < episode.num_turns:
                expected_tokens += observation
                expected_mask += [False] * len(observation)
        tail = episode.tokens[len(expected_tokens) :]  # a last turn cut before its stop token
        assert episode.tokens[: len(expected_tokens)] == expected_tokens
        assert episode.sampled == expected_mask + [True] * len(tail)
        assert all((lp < 0) == sampled for lp, sampled in zip(episode.logprobs, episode.sampled))
        assert (episode.end_reason == "length") == (not answered or len(tail) > 0 or episode.num_turns > len(answered))


def test_a_single_turn_episode_is_the_single_turn_rollout(model):
    gen = generator_for(model)
    rollouts = generate(gen, num_samples=4, seed=5, step=2, max_new_tokens=8, stop_token_ids=STOPS)
    single = episodes(gen, respond=lambda p, s, turn: None)
    for rollout, episode in zip(rollouts, single):
        assert episode.tokens == rollout.prompt_tokens + rollout.completion_tokens
        assert episode.logprobs[len(rollout.prompt_tokens) :] == pytest.approx(rollout.logprobs, abs=1e-5)
        assert episode.num_turns == 1


def test_an_episode_does_not_depend_on_its_batch(model):
    together = episodes(generator_for(model, max_prompts_per_batch=3))
    alone = episodes(generator_for(model, max_prompts_per_batch=1))
    for a, b in zip(together, alone):
        assert a.tokens == b.tokens and a.num_turns == b.num_turns
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_prompts_that_leave_no_room_are_refused(model):
    with pytest.raises(ValueError, match="prompt 2: 17 tokens leave no room in an episode of 17 tokens"):
        episodes(generator_for(model), max_len=17)
    with pytest.raises(ValueError, match="exceed the model's max_seq_len"):
        episodes(generator_for(model), max_len=ARGS.max_seq_len + 1)


# Heads wide enough that the KV cache, not the activations, is what a forward could copy.
WIDE = dataclasses.replace(
    ARGS,
    dim=128,
    n_heads=4,
    n_kv_heads=2,
    head_dim=32,
    hidden_dim=256,
    max_seq_len=2048,
    attn_backend="sdpa_varlen",
)


def cache_bytes(args, num_rows: int, num_slots: int) -> int:
    """Keys and values of every layer for ``num_slots`` tokens of ``num_rows`` rows, float32."""
    return 2 * args.n_layers * num_rows * num_slots * args.n_kv_heads * args.head_dim * 4


@contextlib.contextmanager
def peak_bytes_per_forward(model: torch.nn.Module):
    """Collects (tokens fed, peak bytes allocated during it and still alive) of each forward of
    ``model``; memory from before the forward, the KV cache included, is not counted."""
    peaks, running = [], []

    def start(module, args, kwargs):
        running.append(profile(activities=[ProfilerActivity.CPU], profile_memory=True))
        running[-1].start()

    def stop(module, args, kwargs, output):
        prof = running.pop()
        prof.stop()
        peaks.append((args[0].numel(), cpu_memory_timeline(prof)["peak_allocated_bytes"]))

    handles = [
        model.register_forward_pre_hook(start, with_kwargs=True),
        model.register_forward_hook(stop, with_kwargs=True),
    ]
    try:
        yield peaks
    finally:
        for handle in handles:
            handle.remove()


@pytest.fixture(scope="module")
def wide_generator():
    return generator_for(noisy_model(WIDE, std=0.6), WIDE)


def test_feeding_long_observations_allocates_less_than_the_cache(wide_generator):
    """Rows of ~1000 tokens get 120-token observations: every forward after the prefill
    allocates less than the cache the episodes fill. Gathering each new token's cache rows
    would copy a row's span per token and layer: about 40 such caches here."""
    prompts = [[(7 * i + p) % 64 for i in range(900)] for p in range(2)]
    observation = [40 + i % 20 for i in range(120)]
    params = SamplingParams(max_new_tokens=8, stop_token_ids=tuple(range(32)))
    with peak_bytes_per_forward(wide_generator.model) as peaks:
        result = generate_episodes(
            wide_generator, prompts, [0, 1], 2, params, 5, 2, lambda p, s, t: observation, 4, 1400
        )
    cache = cache_bytes(WIDE, len(result), max(len(e.tokens) for e in result))
    # Premises: forwards fed several observations at once, and single tokens, over ~1000 slots.
    assert max(n for n, _ in peaks[1:]) > 2 * len(observation) and min(n for n, _ in peaks) == 1
    assert min(len(e.tokens) for e in result) > 1000
    assert max(peak for _, peak in peaks[1:]) < cache, [round(peak / cache, 3) for _, peak in peaks]


def test_the_cache_follows_what_the_episodes_reach(wide_generator):
    """With a length budget far above what the episodes reach, the whole generation's peak
    memory stays within a few caches of (longest episode + max_new_tokens) slots per row, not
    one of max_len slots (~45 of them here)."""
    params = SamplingParams(max_new_tokens=8, stop_token_ids=STOPS)
    max_len = WIDE.max_seq_len - 48
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = generate_episodes(wide_generator, PROMPTS, [0, 1, 2], 4, params, 5, 2, scripted_respond(), 3, max_len)
    reach = max(len(e.tokens) for e in result) + params.max_new_tokens
    assert max(e.num_turns for e in result) == 3 and reach * 40 < max_len  # premises
    peak = cpu_memory_timeline(prof)["peak_allocated_bytes"]
    assert peak < 3 * cache_bytes(WIDE, len(result), reach), peak / cache_bytes(WIDE, len(result), reach)
