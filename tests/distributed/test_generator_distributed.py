"""The rollout generator under FSDP, FSDP + TP, HSDP and TP (gloo, real processes).

The shared launch (conftest.py) runs ``generator_cases.run_generator_checks`` on each layout
of ``generator_cases.GENERATOR_LAYOUTS``: one training step, ``update_weights`` from the
sharded model, rollouts of each rank's share of the prompts, and ``Engine.forward`` log-probs
of prompt + completion. References: the trained model's full tensors, the engine's log-probs,
and a single-process generator loaded with the same weights.
"""

import math

import pytest
import torch

import generator_cases as gc
import layout_cases as lc
from torchtitan_rl.models.qwen3.model import Qwen3Model
from torchtitan_rl.rl.generator import TorchGenerator

LAYOUTS = pytest.mark.parametrize("layout", gc.GENERATOR_LAYOUTS, ids=lambda layout: gc.layout_key(*layout))


@pytest.fixture(scope="module")
def results(layout_results) -> dict[int, dict]:
    return layout_results


def recorded(results: dict, layout: tuple) -> dict:
    return results[math.prod(layout)][gc.layout_key(*layout)]


def rollouts_by_key(entry: dict) -> dict:
    """(prompt index, sample index) -> rollout; ranks holding the same rollout agree exactly."""
    by_key = {}
    for rollout in entry["rollouts"]:
        key = (rollout.prompt_index, rollout.sample_index)
        assert by_key.setdefault(key, rollout) == rollout, key
    return by_key


def single_process_rollouts(weights: dict) -> list:
    """All prompts generated in this process by a generator loaded with ``weights``."""
    model = Qwen3Model(lc.model_args(False))
    model.load_state_dict(weights)
    generator = TorchGenerator(
        lc.model_args(False), torch.device("cpu"), max_prompts_per_batch=gc.MAX_PROMPTS_PER_BATCH
    )
    generator.update_weights(model)
    with lc.one_thread():
        indices = list(range(len(gc.PROMPT_LENS)))
        return generator.generate(gc.prompts(), indices, gc.NUM_SAMPLES, gc.PARAMS, gc.SEED, gc.STEP)


def assert_equal_weights(replica: dict, trained: dict) -> None:
    assert replica.keys() == trained.keys()
    for name, value in trained.items():
        assert torch.equal(replica[name], value), name


@LAYOUTS
def test_update_weights_copies_the_full_trained_weights(results, layout):
    entry = recorded(results, layout)
    assert_equal_weights(entry["replica"], entry["trained"])
    # One gather per sharded parameter, no more.
    assert entry["gathers"]["dtensor_params"] == len(entry["trained"]) and entry["gathers"]["calls"] == len(
        entry["trained"]
    )
    # The step really moved the weights away from the init.
    init = Qwen3Model(lc.model_args(False))
    init.init_weights(lc.SEED)
    assert all(not torch.equal(p, entry["trained"][name]) for name, p in init.named_parameters())


@LAYOUTS
def test_update_weights_keeps_tied_embeddings_tied(results, layout):
    tied = recorded(results, layout)["tied"]
    assert tied["still_tied"]
    assert "output.weight" not in tied["trained"]  # one parameter for both layers
    assert_equal_weights(tied["replica"], tied["trained"])
    assert tied["gathers"]["calls"] == tied["gathers"]["dtensor_params"] == len(tied["trained"])


@LAYOUTS
def test_sampler_logprobs_equal_engine_forward(results, layout):
    entry = recorded(results, layout)
    assert len(entry["rollouts"]) == len(entry["engine_logprobs"])
    for rollout, engine_logprobs in zip(entry["rollouts"], entry["engine_logprobs"]):
        assert engine_logprobs.numel() == len(rollout.completion_tokens)
        torch.testing.assert_close(torch.tensor(rollout.logprobs), engine_logprobs, rtol=0, atol=1e-5)


@LAYOUTS
def test_rollouts_equal_a_single_process_generator_with_the_same_weights(results, layout):
    entry = recorded(results, layout)
    got = rollouts_by_key(entry)
    expected = single_process_rollouts(entry["trained"])
    assert set(got) == {(r.prompt_index, r.sample_index) for r in expected}
    for rollout in expected:
        assert got[(rollout.prompt_index, rollout.sample_index)] == rollout  # bitwise, log-probs too


def test_rollouts_are_the_same_on_every_layout(results):
    """The trained weights differ by float rounding between layouts (the gradient is summed in
    another order); the sampled tokens must not."""
    first, *others = [rollouts_by_key(recorded(results, layout)) for layout in gc.GENERATOR_LAYOUTS]
    assert len(first) == len(gc.PROMPT_LENS) * gc.NUM_SAMPLES
    for other in others:
        assert other.keys() == first.keys()
        for key, rollout in first.items():
            assert (other[key].completion_tokens, other[key].stop_reason) == (
                rollout.completion_tokens,
                rollout.stop_reason,
            )
            torch.testing.assert_close(
                torch.tensor(other[key].logprobs), torch.tensor(rollout.logprobs), rtol=0, atol=1e-5
            )
    # Not degenerate: samples of one prompt differ, and the prompts' very different lengths were used.
    assert len({tuple(r.completion_tokens) for r in first.values()}) == len(first)
