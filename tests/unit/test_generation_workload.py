"""The benchmark's length-skewed workload (``scripts/generation_workload.py``) on the real
generator: the completion lengths it realizes against the schedule written out here from each
row's own tokens, with and without the KV cache."""

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

from test_generator import ARGS as GENERATOR_TEST_ARGS
from torchtitan_rl.models.qwen3.model import Qwen3Model
from torchtitan_rl.rl.generator import SamplingParams, TorchGenerator

TOOL = Path(__file__).resolve().parents[2] / "scripts" / "generation_workload.py"
ARGS = dataclasses.replace(GENERATOR_TEST_ARGS, max_seq_len=128)
PROMPT_LEN, MAX_NEW_TOKENS, STOP = 5, 34, 63


def _load_tool():
    spec = importlib.util.spec_from_file_location("generation_workload", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


workload = _load_tool()


def expected_length(first_token: int) -> int | None:
    """The default schedule written out: residue 0 of 8 never stops; residues 1..7 stop after
    8, 12, ..., 32 tokens (stop token included). None: runs to max_new_tokens."""
    residue = first_token % 8
    return None if residue == 0 else 8 + 4 * (residue - 1)


@pytest.fixture(scope="module")
def model():
    model = Qwen3Model(ARGS)
    model.init_weights(seed=0)
    return model


def test_lengths_follow_the_stop_schedule(model):
    schedule = workload.StopSchedule(prompt_len=PROMPT_LEN, stop_token=STOP)
    gen = workload.with_stop_schedule(TorchGenerator, schedule)(ARGS, torch.device("cpu"), max_prompts_per_batch=2)
    gen.update_weights(model)
    prompts = workload.skewed_prompts(3, PROMPT_LEN, ARGS.vocab_size, seed=0)
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, stop_token_ids=(STOP,))
    rollouts = gen.generate(prompts, [0, 1, 2], 16, params, seed=1, step=0)

    num_long = 0
    for r in rollouts:
        tokens = r.completion_tokens
        length = expected_length(tokens[0])
        num_long += length is None
        assert len(tokens) == (MAX_NEW_TOKENS if length is None else length), (r.prompt_index, r.sample_index)
        assert r.stop_reason == ("length" if length is None else "stop")
        body = tokens if length is None else tokens[:-1]
        assert STOP not in body and len({t % 8 for t in body}) == 1  # the class persists
        assert workload.schedule_mismatches([r], schedule, MAX_NEW_TOKENS) == 0
    # 48 rows, each long with probability 1/8: 6 expected; P(outside 1..15) < 0.3 %.
    assert 1 <= num_long <= 15, num_long
    assert num_long < len(rollouts)


def test_both_generator_modes_sample_the_same_tokens_under_the_schedule(model):
    schedule = workload.StopSchedule(prompt_len=PROMPT_LEN, stop_token=STOP, min_short=3, max_short=9)
    prompts = workload.skewed_prompts(3, PROMPT_LEN, ARGS.vocab_size, seed=1)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, stop_token_ids=(STOP,))
    tokens = {}
    for kv_cache in (True, False):
        gen = workload.with_stop_schedule(TorchGenerator(ARGS, torch.device("cpu"), kv_cache=kv_cache), schedule)
        gen.update_weights(model)
        tokens[kv_cache] = [r.completion_tokens for r in gen.generate(prompts, [0, 1, 2], 4, params, seed=2, step=0)]
    assert tokens[True] == tokens[False]
    assert {len(t) for t in tokens[True]} - {12} <= {3, 4, 5, 6, 7, 8, 9}
