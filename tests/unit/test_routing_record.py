"""Routing recorded by the generator (``TorchGenerator(record_routing=...)``): each rollout's
recorded experts equal, exactly, those one plain packed forward of its whole sequence computes
(the model's own ``record_routing``), with and without the KV cache, through continuous
batching (rows finish, the cache compacts, queued prompts are admitted), the compiled decode
step and multi-turn episodes; recording changes no token or log-prob; the dtype follows the
number of experts; and the settings that cannot record are refused.

The routers are redrawn with std 1 so that every top-k choice has a clear margin: with the
usual init (std 0.02) near-ties flip on the rounding that different batch shapes bring.
"""

import dataclasses

import numpy as np
import pytest
import torch

from test_env_rollouts import PROMPTS as ENV_PROMPTS
from test_env_rollouts import TOKENIZER, Counter, problems
from test_generator import ARGS, CPU, generator_for, noisy_model, recording_forwards
from torchtitan_rl.rl.env_rollouts import EpisodeRunner
from torchtitan_rl.rl.generator import SamplingParams, TorchGenerator

# Layer 1 is dense, so the MoE layers are 0 and 2: the routing's layer axis is not the layer index.
MOE_ARGS = dataclasses.replace(
    ARGS, n_layers=3, num_experts=8, num_experts_per_tok=2, moe_hidden_dim=16, norm_topk_prob=True, mlp_only_layers=(1,)
)
# Four prompts of lengths 1 to 13, three samples each, through a cache of two prompts' rows; stop
# tokens end rows after 1 to 10 tokens, so rows finish at different steps and prompts queue.
PROMPTS = [[7], [3, 14, 15, 9], [(5 * i + 2) % 64 for i in range(9)], [(3 * i + 1) % 64 for i in range(13)]]
PARAMS = SamplingParams(max_new_tokens=10, temperature=1.0, stop_token_ids=(0, 1, 2, 3, 4, 5))


def moe_model(args=MOE_ARGS, seed=0):
    model = noisy_model(args, seed=seed)
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for layer in args.moe_layers:
            model.get_submodule(f"layers.{layer}.moe.router").weight.normal_(0, 1, generator=gen)
    return model


@pytest.fixture(scope="module")
def model():
    return moe_model()


@torch.no_grad()
def plain_routing(model, tokens: list[int]) -> np.ndarray:
    """``[len(tokens) - 1, L, k]``: the experts of every input position of ``tokens`` (all but the
    last), from one plain packed forward of the sequence alone."""
    n = len(tokens) - 1
    _, stats = model(torch.tensor(tokens[:-1]), torch.arange(n), torch.zeros(n, dtype=torch.long), record_routing=True)
    return stats.experts.transpose(0, 1).numpy()


def assert_routing_is_the_plain_forwards(model, sequences, routings, num_recorded) -> None:
    """Each ``routings[i]`` is the plain forward's routing of the last ``num_recorded[i]`` inputs
    of ``sequences[i]``, one byte per expert; and the routing is not degenerate."""
    k = model.args.num_experts_per_tok
    for tokens, routing, m in zip(sequences, routings, num_recorded):
        assert routing.dtype == np.uint8 and routing.shape == (m, len(model.args.moe_layers), k)
        np.testing.assert_array_equal(routing, plain_routing(model, tokens)[-m:])
    every = np.concatenate(routings)
    assert all(len(np.unique(every[:, layer])) == model.args.num_experts for layer in range(every.shape[1]))


def generate(gen, prompts=PROMPTS, num_samples=3, params=PARAMS):
    return gen.generate(prompts, list(range(len(prompts))), num_samples, params, seed=3, step=1)


def check_rollouts(model, rollouts, mode: str) -> None:
    sequences = [r.prompt_tokens + r.completion_tokens for r in rollouts]
    # "completion": from the last prompt position (it samples the first token); "all": every input.
    counts = [len(r.completion_tokens) if mode == "completion" else len(t) - 1 for r, t in zip(rollouts, sequences)]
    assert_routing_is_the_plain_forwards(model, sequences, [r.routing for r in rollouts], counts)


@pytest.mark.parametrize("mode", ["completion", "all"])
@pytest.mark.parametrize("kv_cache", [True, False])
def test_recorded_routing_is_a_plain_forwards_and_changes_no_rollout(model, kv_cache, mode):
    gen = generator_for(model, MOE_ARGS, max_prompts_per_batch=2, kv_cache=kv_cache, record_routing=mode)
    events = recording_forwards(gen)
    rollouts = generate(gen)
    check_rollouts(model, rollouts, mode)
    unrecorded = generate(generator_for(model, MOE_ARGS, max_prompts_per_batch=2, kv_cache=kv_cache))
    # Evaluation pauses the recording of a recording generator (``not_recording``).
    with gen.not_recording():
        paused = generate(gen)
    assert gen.record_routing == mode
    for other in (unrecorded, paused):
        assert all(r.routing is None for r in other)
        assert [(r.completion_tokens, r.logprobs) for r in rollouts] == [
            (r.completion_tokens, r.logprobs) for r in other
        ]
    # Premises: rows finished at different lengths; with the cache, a prompt was admitted after
    # decode steps had run (into rows freed and compacted) and steps ran on fewer rows than it holds.
    assert len({len(r.completion_tokens) for r in rollouts}) >= 4
    if kv_cache:
        kinds = [kind for kind, _ in events]
        assert kinds.count("prefill") >= 2 and "decode" in kinds[: kinds.index("prefill", 1)]
        assert min(rows for kind, rows in events if kind == "decode") < 6


def test_the_compiled_decode_step_records_the_same_routing(model, monkeypatch):
    """generation.compile: the experts leave the compiled decode step with its logits, the
    padding rows of its bucket dropped. Dynamo traces the step as it would for inductor; the
    eager backend spares a cold inductor compile of this model (inductor's numbers are
    test_compile.py's)."""
    compile_ = torch.compile
    monkeypatch.setattr(
        torch, "compile", lambda fn, mode=None, dynamic=None: compile_(fn, backend="eager", dynamic=dynamic)
    )
    torch._dynamo.reset()
    try:
        gen = generator_for(model, MOE_ARGS, max_prompts_per_batch=2, compile=True, record_routing="completion")
        rollouts = generate(gen)
    finally:
        torch._dynamo.reset()
    check_rollouts(model, rollouts, "completion")
    eager = generate(generator_for(model, MOE_ARGS, max_prompts_per_batch=2, record_routing="completion"))
    assert [r.completion_tokens for r in rollouts] == [r.completion_tokens for r in eager]


@pytest.mark.parametrize("kv_cache, mode", [(True, "completion"), (False, "all")])
def test_an_episodes_routing_covers_its_observations(kv_cache, mode):
    """Multi-turn episodes (``EpisodeRunner``): the stop token and observation fed together
    (with the cache, one extend forward) are recorded like sampled tokens."""
    args = dataclasses.replace(MOE_ARGS, vocab_size=TOKENIZER.vocab_size, max_seq_len=96)
    model = moe_model(args)
    gen = generator_for(model, args, max_prompts_per_batch=1, kv_cache=kv_cache, record_routing=mode)
    runner = EpisodeRunner(gen, Counter, "test_env", problems(), TOKENIZER, max_turns=3, max_len=96)
    stops = tuple(range(0, TOKENIZER.vocab_size, 3))
    rollouts = runner.generate(ENV_PROMPTS, [0, 1], 3, SamplingParams(max_new_tokens=6, stop_token_ids=stops), 3, 1)
    assert max(r.num_turns for r in rollouts) == 3  # premise: observations inside episodes
    check_rollouts(model, rollouts, mode)


def test_more_than_256_experts_are_recorded_as_int16():
    args = dataclasses.replace(MOE_ARGS, num_experts=300, moe_hidden_dim=4)
    model = moe_model(args)
    gen = generator_for(model, args, record_routing="all")
    assert gen.routing_dtype == torch.int16
    rollouts = generate(gen, PROMPTS[:2], num_samples=2)
    for rollout in rollouts:
        tokens = rollout.prompt_tokens + rollout.completion_tokens
        assert rollout.routing.dtype == np.int16 and rollout.routing.shape == (len(tokens) - 1, 2, 2)
        np.testing.assert_array_equal(rollout.routing, plain_routing(model, tokens))
    assert max(int(r.routing.max()) for r in rollouts) > 255  # premise: ids a byte cannot hold


def test_settings_that_cannot_record_are_refused():
    with pytest.raises(ValueError, match="record_routing must be 'off', 'completion' or 'all', got 'prompt'"):
        TorchGenerator(MOE_ARGS, CPU, record_routing="prompt")
    with pytest.raises(ValueError, match="record_routing='completion' needs a MoE model"):
        TorchGenerator(ARGS, CPU, record_routing="completion")
