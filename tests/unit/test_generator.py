"""The rollout generator (``torchtitan_rl.rl.generator``), single process on CPU.

References are independent of the code under test: a hand-written greedy loop that reruns
``model(...)`` on the growing sequence, ``Engine.forward`` log-probs of prompt + completion,
the generator's no-cache mode, and softmax / top-k / top-p distributions written out in Python
against which sampled frequencies are checked with bounds computed from the sample count.
"""

import dataclasses
import hashlib
import math

import pytest
import torch

from torchtitan_rl.data.sample import Sample
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.engine import Engine, EngineOptions
from torchtitan_rl.models.qwen3.args import Qwen3ModelArgs
from torchtitan_rl.models.qwen3.model import Qwen3Model
from torchtitan_rl.recipes.base import build_model
from torchtitan_rl.rl.generator import SamplingParams, TorchGenerator
from torchtitan_rl.rl.sampling import rollout_seed, sample_tokens

CPU = torch.device("cpu")
ARGS = Qwen3ModelArgs(
    vocab_size=64,
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    hidden_dim=48,
    rope_theta=10_000.0,
    max_seq_len=64,
    attn_backend="sdpa_dense",
)
# Lengths 1, 5 and 17: rows of one batch sit at very different positions.
PROMPTS = [[7], [3, 14, 15, 9, 26], [(5 * i + 2) % 64 for i in range(17)]]


def noisy_model(args: Qwen3ModelArgs = ARGS, seed: int = 0, std: float = 0.3) -> Qwen3Model:
    """A single-process model whose next-token distributions are far from uniform."""
    dims = ParallelDims(1, 1, 1, 1, world_size=1)
    dims.build_meshes("cpu")
    model = build_model(args, parallel_dims=dims, device=CPU, seed=seed, param_dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * std)
    return model


def generator_for(model: Qwen3Model, args: Qwen3ModelArgs = ARGS, **kwargs) -> TorchGenerator:
    gen = TorchGenerator(args, CPU, **kwargs)
    gen.update_weights(model)
    return gen


def generate(gen, prompts=PROMPTS, indices=None, num_samples=2, seed=3, step=1, **params):
    indices = list(range(len(prompts))) if indices is None else indices
    params.setdefault("max_new_tokens", 8)
    return gen.generate(prompts, indices, num_samples, SamplingParams(**params), seed, step)


def by_key(rollouts) -> dict:
    return {(r.prompt_index, r.sample_index): r for r in rollouts}


def assert_same_rollouts(got, expected, atol=1e-5):
    """Same rollouts (tokens, stop reasons exactly; log-probs within atol), in any order."""
    got, expected = by_key(got), by_key(expected)
    assert got.keys() == expected.keys()
    for key, e in expected.items():
        g = got[key]
        assert (g.prompt_tokens, g.completion_tokens, g.stop_reason) == (
            e.prompt_tokens,
            e.completion_tokens,
            e.stop_reason,
        ), key
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(e.logprobs), rtol=0, atol=atol)


@torch.no_grad()
def last_logits(model: Qwen3Model, tokens: list[int]) -> torch.Tensor:
    """float32 next-token logits after ``tokens``, the sequence run through the model alone."""
    n = len(tokens)
    hidden = model(torch.tensor(tokens), torch.arange(n), torch.zeros(n, dtype=torch.long))
    return model.output(hidden[-1]).float()


# ---------------------------------------------------------------- greedy and the KV cache


def test_cached_greedy_matches_no_cache_and_a_hand_written_loop():
    model = noisy_model()
    cached = generate(generator_for(model), temperature=0.0, max_new_tokens=10)
    uncached = generate(generator_for(model, kv_cache=False), temperature=0.0, max_new_tokens=10)
    assert_same_rollouts(cached, uncached)
    assert [(r.prompt_index, r.sample_index) for r in cached] == [(p, s) for p in range(3) for s in range(2)]
    for rollout in cached:
        sequence, tokens, logprobs = list(rollout.prompt_tokens), [], []
        for _ in range(10):
            logits = last_logits(model, sequence)
            token = int(logits.argmax())
            tokens.append(token)
            logprobs.append(float(logits.log_softmax(-1)[token]))  # temperature 0 reports T = 1
            sequence.append(token)
        assert rollout.prompt_tokens == PROMPTS[rollout.prompt_index]
        assert rollout.completion_tokens == tokens
        assert rollout.stop_reason == "length"
        torch.testing.assert_close(torch.tensor(rollout.logprobs), torch.tensor(logprobs), rtol=0, atol=1e-5)
    # Not a degenerate model: greedy rows of different prompts differ and do not repeat one token.
    assert len({tuple(r.completion_tokens) for r in cached}) == 3
    assert all(len(set(r.completion_tokens)) > 2 for r in cached)


def test_cached_sampling_matches_no_cache():
    model = noisy_model()
    params = dict(temperature=0.9, top_k=20, top_p=0.95, max_new_tokens=12)
    cached = generate(generator_for(model), num_samples=3, **params)
    assert_same_rollouts(cached, generate(generator_for(model, kv_cache=False), num_samples=3, **params))
    # Samples of one prompt differ: every row has its own random stream.
    assert len({tuple(r.completion_tokens) for r in cached}) == len(cached)


def test_low_temperature_equals_greedy():
    model = noisy_model()
    gen = generator_for(model)
    greedy = generate(gen, temperature=0.0)
    cold = generate(gen, temperature=1e-6)
    assert [r.completion_tokens for r in cold] == [r.completion_tokens for r in greedy]


# ---------------------------------------------------------------- the trainer's log-probs


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.7, 8, 0.9)])
def test_sampler_logprobs_equal_engine_forward(temperature, top_k, top_p):
    """The trainer evaluates softmax(logits / T) of the full vocabulary (truncation only limits
    which tokens are drawn), on prompt + completion packed in its own micro-batches."""
    model = noisy_model()
    rollouts = generate(
        generator_for(model), num_samples=3, max_new_tokens=10, temperature=temperature, top_k=top_k, top_p=top_p
    )
    dims = ParallelDims(1, 1, 1, 1, world_size=1)
    dims.build_meshes("cpu")
    engine = Engine(
        model,
        optimizer=None,
        lr_scheduler=None,
        parallel_dims=dims,
        device=CPU,
        options=EngineOptions(
            reduction="token_mean",
            horizon=20,
            max_tokens_per_microbatch=40,
            logits_chunk_size=7,
            max_norm=0.0,
            temperature=temperature,
        ),
    )
    samples = []
    for r in rollouts:
        tokens = r.prompt_tokens + r.completion_tokens
        mask = [False] * len(r.prompt_tokens) + [True] * len(r.completion_tokens)
        samples.append(Sample.from_tokens(tokens, mask))
    for r, sample, logprobs in zip(rollouts, samples, engine.forward(samples).logprobs):
        completion = logprobs[sample.loss_mask]
        assert completion.numel() == len(r.completion_tokens)
        torch.testing.assert_close(torch.tensor(r.logprobs), completion, rtol=0, atol=1e-5)


def test_a_bfloat16_replica_on_cpu_samples_with_its_own_numerics():
    """generation.dtype = "bfloat16" on the CPU: the replica's weights and cache are bf16, its
    log-probs are those of the bf16 model (the hand-written loop in bf16) and differ from the
    float32 trainer's by a small, real mismatch that the rollout correction has to handle (a
    float32 replica matches the trainer to 1e-5, see above)."""
    model = noisy_model()
    gen = generator_for(model, dtype=torch.bfloat16)
    assert {p.dtype for p in gen.model.parameters()} == {torch.bfloat16}
    rollouts = generate(gen, num_samples=1, max_new_tokens=6, temperature=0.0)
    bf16_model = noisy_model().to(torch.bfloat16)
    gaps = []
    for r in rollouts:
        tokens = list(r.prompt_tokens)
        for token, logprob in zip(r.completion_tokens, r.logprobs):
            expected = last_logits(bf16_model, tokens).log_softmax(-1)
            # bf16 rounds differently with and without the KV cache: close, not equal.
            assert logprob == pytest.approx(float(expected[token]), abs=0.1)
            gaps.append(abs(logprob - float(last_logits(model, tokens).log_softmax(-1)[token])))
            tokens.append(token)
    assert 1e-4 < max(gaps) < 0.5


# ---------------------------------------------------------------- batch independence


def test_rows_do_not_depend_on_their_batch():
    model = noisy_model()
    params = dict(temperature=1.0, max_new_tokens=12)
    together = generate(generator_for(model), num_samples=3, **params)
    alone = [r for i, p in enumerate(PROMPTS) for r in generate(generator_for(model), [p], [i], 3, **params)]
    assert_same_rollouts(together, alone)
    one_per_batch = generate(generator_for(model, max_prompts_per_batch=1), num_samples=3, **params)
    assert_same_rollouts(together, one_per_batch)
    reordered = generate(generator_for(model, max_prompts_per_batch=2), PROMPTS[::-1], [2, 1, 0], 3, **params)
    assert [(r.prompt_index, r.sample_index) for r in reordered] == [(p, s) for p in (2, 1, 0) for s in range(3)]
    assert_same_rollouts(together, reordered)


def test_rollouts_are_seeded_by_seed_step_prompt_and_sample():
    gen = generator_for(noisy_model())
    base = generate(gen, num_samples=2)
    assert_same_rollouts(generate(gen, num_samples=2), base, atol=0)  # reproducible
    for changed in (dict(seed=4), dict(step=2), dict(indices=[10, 11, 12])):
        other = generate(gen, num_samples=2, **changed)
        assert all(a.completion_tokens != b.completion_tokens for a, b in zip(base, other)), changed
    # The documented hash, and distinct streams for neighbouring rollouts.
    assert rollout_seed(3, 1, 0, 1) == int.from_bytes(hashlib.sha256(b"3:1:0:1").digest()[:8], "little") & (2**63 - 1)
    assert len({rollout_seed(0, 0, p, s) for p in range(50) for s in range(50)}) == 2500


# ---------------------------------------------------------------- continuous batching


def brute_force_rows(
    model,
    prompt,
    prompt_index,
    num_samples,
    params: SamplingParams,
    seed,
    step,
    respond=None,
    max_turns=1,
    max_len=None,
):
    """Each sample of ``prompt`` alone, as the generator defines it: the whole sequence so far run
    through ``model`` for every token, one uniform per token from the row's own stream; after a
    stop token, ``respond`` (None: the row is done) may append an observation and start a turn.
    Per row: (tokens after the prompt, their sampled flags, log-probs, turns, end reason)."""
    max_len = len(prompt) + params.max_new_tokens if max_len is None else max_len
    rows = []
    for s in range(num_samples):
        rng = torch.Generator().manual_seed(rollout_seed(seed, step, prompt_index, s))
        tokens, sampled, logprobs, turn, turns = list(prompt), [], [], [], 1
        while True:
            uniform = torch.rand(1, generator=rng, dtype=torch.float64)
            token, logprob = sample_tokens(last_logits(model, tokens)[None], params, uniform)
            tokens.append(int(token))
            sampled.append(True)
            logprobs.append(float(logprob))
            turn.append(int(token))
            if int(token) not in params.stop_token_ids:
                if len(turn) < params.max_new_tokens and len(tokens) < max_len:
                    continue
                reason = "length"
                break
            observation = None if respond is None else respond(prompt_index, s, turn)
            turn = []
            if observation is None:
                reason = "done"
            elif turns == max_turns:
                reason = "max_turns"
            elif len(tokens) + len(observation) >= max_len:
                reason = "length"
            else:
                tokens += observation
                sampled += [False] * len(observation)
                logprobs += [0.0] * len(observation)
                turns += 1
                continue
            break
        rows.append((tokens[len(prompt) :], sampled, logprobs, turns, reason))
    return rows


def recording_forwards(gen: TorchGenerator) -> list[tuple[str, int]]:
    """(kind, rows) of every prefill and decode step ``gen`` runs from now on, in order."""
    events = []
    prefill, decode = gen.prefill, gen.decode

    def recorded_prefill(batch, cache, prompts, first_row):
        events.append(("prefill", len(prompts) * batch.num_samples))
        return prefill(batch, cache, prompts, first_row)

    def recorded_decode(tokens, positions, cache):
        events.append(("decode", len(tokens)))
        return decode(tokens, positions, cache)

    gen.prefill, gen.decode = recorded_prefill, recorded_decode
    return events


# Prompts of many lengths; with four stop tokens rows stop after 1 to 10 tokens or run to 10.
MANY_PROMPTS = [[(3 * i + 5 * p + 1) % 64 for i in range(1 + 4 * p % 13)] for p in range(7)]
CB_PARAMS = SamplingParams(max_new_tokens=10, temperature=1.0, stop_token_ids=(0, 1, 2, 3, 4, 5))


@pytest.mark.parametrize("kv_cache", [True, False])
def test_finished_rows_leave_and_queued_prompts_refill_with_the_same_rollouts(kv_cache):
    """7 prompts x 3 samples through a cache of 2 prompts' rows: each rollout equals its row
    generated alone (the brute-force reference); each decode step runs on the rows still running
    (its rows add up to every completion's tokens but the last), never more than the cache holds;
    prompts are admitted while others' rows are still decoding."""
    model = noisy_model()
    gen = generator_for(model, max_prompts_per_batch=2, kv_cache=kv_cache)
    events = recording_forwards(gen)
    rollouts = gen.generate(MANY_PROMPTS, list(range(7)), 3, CB_PARAMS, 3, 1)
    lengths = []
    for p, prompt in enumerate(MANY_PROMPTS):
        for s, (tokens, _, logprobs, _, reason) in enumerate(brute_force_rows(model, prompt, p, 3, CB_PARAMS, 3, 1)):
            rollout = rollouts[3 * p + s]
            assert (rollout.prompt_index, rollout.sample_index, rollout.prompt_tokens) == (p, s, prompt)
            assert rollout.completion_tokens == tokens
            assert rollout.stop_reason == {"done": "stop", "length": "length"}[reason]
            torch.testing.assert_close(torch.tensor(rollout.logprobs), torch.tensor(logprobs), rtol=0, atol=1e-5)
            lengths.append(len(tokens))
    assert len(set(lengths)) >= 4 and max(lengths) == 10 and min(lengths) < 5  # premise: skewed lengths
    if not kv_cache:
        return
    decodes = [rows for kind, rows in events if kind == "decode"]
    assert sum(decodes) == sum(n - 1 for n in lengths)
    assert max(decodes) <= 6 and min(decodes) < 6
    prefills = [i for i, (kind, _) in enumerate(events) if kind == "prefill"]
    assert sum(events[i][1] for i in prefills) == 21
    assert any(events[i - 1][0] == "decode" and i < len(events) - 1 for i in prefills)  # a refill mid-way


# ---------------------------------------------------------------- stopping


def test_stop_tokens_and_max_new_tokens():
    """With stop tokens every row is its no-stop rollout cut after the first stop token."""
    model = noisy_model()
    params = dict(temperature=1.0, max_new_tokens=12)
    free = generate(generator_for(model), num_samples=4, **params)
    assert all(r.stop_reason == "length" and len(r.completion_tokens) == 12 for r in free)
    # Stop tokens that the free rows reach at different steps, and some rows never reach.
    first_seen = {}
    for r in free:
        for t, token in enumerate(r.completion_tokens[:-1]):
            first_seen.setdefault(token, set()).add(t)
    stops = tuple(sorted(first_seen, key=lambda tok: -len(first_seen[tok]))[:2])
    for kv_cache in (True, False):
        stopped = generate(generator_for(model, kv_cache=kv_cache), num_samples=4, stop_token_ids=stops, **params)
        lengths = set()
        for r, f in zip(stopped, free):
            cut = next((t + 1 for t, token in enumerate(f.completion_tokens) if token in stops), 12)
            assert r.completion_tokens == f.completion_tokens[:cut]
            torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(f.logprobs[:cut]), rtol=0, atol=1e-5)
            hit = f.completion_tokens[cut - 1] in stops
            assert r.stop_reason == ("stop" if hit else "length")
            lengths.add((len(r.completion_tokens), r.stop_reason))
        assert len({n for n, reason in lengths if reason == "stop"}) >= 2, lengths  # rows stop at different steps
        assert (12, "length") in lengths


def test_all_rows_stopping_ends_generation_early():
    model = noisy_model()
    greedy = generate(generator_for(model), temperature=0.0, num_samples=1)
    firsts = tuple({r.completion_tokens[0] for r in greedy})
    stopped = generate(generator_for(model), temperature=0.0, num_samples=1, stop_token_ids=firsts)
    assert all(
        r.completion_tokens == g.completion_tokens[:1] and r.stop_reason == "stop" for r, g in zip(stopped, greedy)
    )


# ---------------------------------------------------------------- sampling distribution

STAT_ARGS = dataclasses.replace(ARGS, vocab_size=8)
STAT_PROMPT = [1, 5, 2]
STAT_SAMPLES = 20000


def expected_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> list[float]:
    """softmax(logits / T), cut to the top-k tokens, then to the smallest set of highest
    probability whose mass reaches top_p, renormalized; written out in float64 Python."""
    scaled = [x / temperature for x in logits.double().tolist()]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    kept = order[:top_k] if top_k else order
    z = sum(math.exp(scaled[i]) for i in kept)
    probs = {i: math.exp(scaled[i]) / z for i in kept}
    if top_p < 1:
        nucleus, mass = [], 0.0
        for i in kept:
            nucleus.append(i)
            mass += probs[i]
            if mass >= top_p:
                # Float rounding must not be able to move the boundary.
                assert mass - top_p > 1e-3 and top_p - (mass - probs[i]) > 1e-3
                break
        z = sum(probs[i] for i in nucleus)
        probs = {i: probs[i] / z for i in nucleus}
    return [probs.get(i, 0.0) for i in range(len(scaled))]


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [
        (1.0, 0, 1.0),
        (0.6, 0, 1.0),
        (1.3, 3, 1.0),
        (1.0, 0, 0.7),
        (1.0, 5, 0.8),
    ],
)
def test_first_token_frequencies_match_the_distribution(temperature, top_k, top_p):
    model = noisy_model(STAT_ARGS, seed=4, std=0.2)
    logits = last_logits(model, STAT_PROMPT)
    untempered = torch.softmax(logits.double(), -1)
    assert untempered.max() < 0.3 and (untempered > 0.03).sum() >= 7  # a distribution worth testing
    full = torch.softmax(logits.double() / temperature, -1)
    expected = torch.tensor(expected_distribution(logits, temperature, top_k, top_p), dtype=torch.float64)
    rollouts = generate(
        generator_for(model, STAT_ARGS),
        [STAT_PROMPT],
        [0],
        STAT_SAMPLES,
        seed=11,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        max_new_tokens=1,
    )
    first = torch.tensor([r.completion_tokens[0] for r in rollouts])
    freq = torch.bincount(first, minlength=STAT_ARGS.vocab_size).double() / STAT_SAMPLES
    # Five standard deviations of a frequency over STAT_SAMPLES draws (fixed seed: cannot flake).
    bound = 5 * (expected * (1 - expected) / STAT_SAMPLES).sqrt() + 1e-9
    assert ((freq - expected).abs() <= bound).all(), (freq, expected)
    assert (freq[expected == 0] == 0).all()  # cut tokens are never drawn
    # Reported log-probs are of the full tempered distribution, whatever was cut.
    reported = torch.tensor([r.logprobs[0] for r in rollouts], dtype=torch.float64)
    torch.testing.assert_close(reported, full.log()[first], rtol=0, atol=1e-5)


# ---------------------------------------------------------------- weights and bad input


def test_update_weights_copies_every_parameter_and_keeps_tying():
    args = dataclasses.replace(ARGS, tie_embeddings=True)
    model = noisy_model(args)
    gen = generator_for(model, args)
    assert gen.model.output.weight is gen.model.tok_embeddings.weight
    source = dict(model.named_parameters())
    assert dict(gen.model.named_parameters()).keys() == source.keys()
    for name, param in gen.model.named_parameters():
        assert torch.equal(param, source[name]) and not param.requires_grad
    with pytest.raises(ValueError, match="missing.*output.weight"):
        generator_for(model, ARGS)  # an untied generator cannot take tied weights


def test_no_prompts_give_no_rollouts():
    # A rank's share of a step can be empty (TP / CP peers split their prompts).
    assert generate(generator_for(noisy_model()), [], []) == []


def test_generate_needs_weights():
    with pytest.raises(RuntimeError, match="update_weights"):
        generate(TorchGenerator(ARGS, CPU))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompts=[], indices=[0]), "0 prompts but 1 prompt_indices"),
        (dict(indices=[0, 1]), "3 prompts but 2 prompt_indices"),
        (dict(indices=[0, 1, 1]), "distinct"),
        (dict(prompts=[[1], [], [2]]), "prompt 1 is empty"),
        (dict(prompts=[[1], [64]], indices=[0, 1]), "prompt 1 has a token id outside the vocabulary"),
        (dict(prompts=[[-1]], indices=[0]), "prompt 0 has a token id outside the vocabulary"),
        (dict(num_samples=0), "num_samples"),
        (dict(max_new_tokens=48), "prompt 2: 17 prompt tokens \\+ max_new_tokens 48 exceed the model's max_seq_len 64"),
        (dict(stop_token_ids=(64,)), "stop token 64"),
    ],
)
def test_bad_generate_inputs(kwargs, message):
    gen = generator_for(noisy_model())
    with pytest.raises(ValueError, match=message):
        generate(gen, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=4, temperature=-0.1), "temperature"),
        (dict(max_new_tokens=4, temperature=float("nan")), "temperature"),
        (dict(max_new_tokens=4, top_k=-1), "top_k"),
        (dict(max_new_tokens=4, top_p=0.0), "top_p"),
        (dict(max_new_tokens=4, top_p=1.5), "top_p"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
