"""A reward model in the RL loop, under every layout of the dynamic sampling checks: each
rollout's reward is the verifier's plus the weighted score of the reward model, standardized
over the step's rollouts of every rank, as one process computes it by brute force (every
sequence alone through the plain model). So the peers' split of the scoring, their exchange
and the normalization's reduction over the data-parallel ranks change nothing."""

import functools

import pytest
import torch

import layout_cases as lc
import rl_cases
from test_rollout_exchange import reference_generator
from torchtitan_rl.data.tokenizer import ByteTokenizer
from torchtitan_rl.rl.rollouts import PromptStream
from torchtitan_rl.rl.step_sampler import completion_text


@functools.cache
def single_process_rewards() -> dict[int, list[tuple]]:
    """Per prompt slot of the step: (completion tokens, reward, parity, weighted score) of each sample."""
    stream = PromptStream(rl_cases.POOL_SIZE, rl_cases.PROMPTS_PER_STEP, rl_cases.STREAM_SEED)
    pool = rl_cases.dynamic_pool()
    step_prompts = [pool[i] for i in stream.next_step()]
    with lc.one_thread():
        rollouts = reference_generator().generate(
            step_prompts,
            list(range(len(step_prompts))),
            rl_cases.NUM_SAMPLES,
            rl_cases.PARAMS,
            rl_cases.SEED,
            rl_cases.STEP,
        )
    model = rl_cases.reward_model()
    with torch.no_grad():
        scores = []
        for r in rollouts:
            tokens = torch.tensor(r.prompt_tokens + r.completion_tokens)
            hidden = model(tokens, torch.arange(len(tokens)), torch.zeros(len(tokens), dtype=torch.long))
            scores.append(float(model.score(hidden)[-1, 0]))
    scores = torch.tensor(scores, dtype=torch.float64)
    assert scores.std() > 1e-3  # not vacuous: the reward model tells the rollouts apart
    standardized = (scores - scores.mean()) / scores.std(unbiased=False)
    out: dict[int, list[tuple]] = {}
    for r, z in zip(rollouts, standardized.tolist()):
        parity = float(len(completion_text(ByteTokenizer(), r)[0]) % 2)
        weighted = rl_cases.REWARD_MODEL_WEIGHT * z
        out.setdefault(r.prompt_index, []).append((r.completion_tokens, parity + weighted, parity, weighted))
    return out


@pytest.mark.parametrize("layout", rl_cases.DYNAMIC_SAMPLING_LAYOUTS)
def test_rewards_with_a_reward_model_equal_one_process_brute_force(layout_results, layout):
    world = layout[0] * layout[1] * layout[2] * layout[3]
    ranks = layout_results[world][rl_cases.reward_model_key(*layout)]
    reference = single_process_rewards()
    seen = {}
    for rank in ranks:
        assert "reward_model" in rank["timed"]  # time/reward_model_s
        for slot, samples in rank["groups"]:
            assert seen.setdefault(slot, samples) == samples  # peers of a data-parallel rank agree
            want = reference[slot]
            assert [tokens for tokens, *_ in samples] == [tokens for tokens, *_ in want]
            for (_, total, correct, components), (_, want_total, parity, weighted) in zip(samples, want):
                assert components["parity"] == parity and correct == (parity == 1.0)
                assert components["model"] == pytest.approx(weighted, rel=1e-5, abs=1e-6)
                assert total == pytest.approx(want_total, rel=1e-5, abs=1e-6)
        # The logged mean of the component: 0, since the scores are standardized over the step.
        assert rank["metrics"]["rl/reward_model"] == pytest.approx(0.0, abs=1e-6)
    assert sorted(seen) == sorted(reference)  # every slot of the step, on some data-parallel rank
