"""DAPO sampling and length shaping of the GRPO recipe: the overlong penalty against its formula,
masking of truncated completions, the selection of groups with signal over rounds (pure, and
through the recipe's rollout step with a scripted generator), where each kept group travels
(to the rank that trains it alone), the metrics and the config rules."""

import dataclasses
import logging
import random
from types import SimpleNamespace

import pytest

from test_config import assert_error, parse
from torchtitan_rl.config import JobConfig
from torchtitan_rl.recipes.grpo import GRPORecipe
from torchtitan_rl.rl.dynamic_sampling import round_offset, route_selected, select_groups_with_signal
from torchtitan_rl.rl.generator import Rollout, SamplingParams
from torchtitan_rl.rl.length_shaping import overlong_penalty, shape_overlong
from torchtitan_rl.rl.rollouts import (
    PromptStream,
    ScoredGroup,
    generate_share,
    is_zero_variance,
    rank_prompt_slots,
    rollout_metrics,
    rollout_sums,
    score_groups,
    to_samples,
)
from torchtitan_rl.rl.sampling import rollout_seed
from torchtitan_rl.rl.step_sampler import StepSampler
from torchtitan_rl.rl.tasks import Reward

# ------------------------------------------------------------------ overlong penalty


@pytest.mark.parametrize(
    "length, expected",
    # L = 16, B = 4, penalty 0.5: free up to 12 tokens, then -0.5 * (n - 12) / 4.
    [(1, 0.0), (11, 0.0), (12, 0.0), (13, -0.125), (14, -0.25), (15, -0.375), (16, -0.5)],
)
def test_overlong_penalty_is_linear_over_the_last_buffer_tokens(length, expected):
    assert overlong_penalty(length, max_new_tokens=16, buffer=4, penalty=0.5) == pytest.approx(expected)


def test_overlong_penalty_off_and_whole_range_buffers():
    assert [overlong_penalty(n, 8, 0, 1.0) for n in range(1, 9)] == [0.0] * 8
    # B = L - 1: every token after the first costs 1/B of the penalty.
    assert [overlong_penalty(n, 8, 7, 2.0) for n in (1, 2, 8)] == pytest.approx([0.0, -2.0 / 7, -2.0])


def test_shaped_reward_enters_the_advantages_and_keeps_the_penalty_as_a_component():
    base = Reward(1.0, True, {"correct": 1.0})
    shaped = shape_overlong(base, length=8, max_new_tokens=8, buffer=2, penalty=1.0)
    assert shaped.total == 0.0 and shaped.correct and shaped.components == {"correct": 1.0, "overlong": -1.0}
    assert base.total == 1.0  # not changed in place
    # Two correct answers, one at full length: dr_grpo advantages of totals (1, 0).
    rollouts = [Rollout(0, 0, [1], [2, 3], [0.0, 0.0], "stop"), Rollout(0, 1, [1], [2] * 8, [0.0] * 8, "length")]
    rewards = [shape_overlong(base, len(r.completion_tokens), 8, 2, 1.0) for r in rollouts]
    (group,) = score_groups(rollouts, rewards, 2, "dr_grpo", 1e-6)
    assert group.advantages == pytest.approx([0.5, -0.5])
    metrics = rollout_metrics(*rollout_sums([group], filtered=0), batch_mesh=None)
    assert metrics["rl/overlong/penalized"] == 0.5 and metrics["rl/reward_overlong"] == -0.5


# ------------------------------------------------------------------ masking truncated completions


def rollout(slot, sample, completion, truncated):
    logprobs = [-0.1 * (j + 1) for j in range(len(completion))]
    return Rollout(slot, sample, [1, 2], completion, logprobs, "length" if truncated else "stop")


def test_mask_truncated_masks_exactly_the_truncated_completions_and_keeps_their_baseline():
    truncated = [False, True, False, True]
    rollouts = [rollout(3, s, [5] * (s + 1), t) for s, t in enumerate(truncated)]
    totals = [1.0, 0.0, 0.0, 1.0]
    (group,) = score_groups(rollouts, [Reward(t, t > 0, {}) for t in totals], 4, "dr_grpo", 1e-6)
    # The truncated ones count in the baseline: the mean of all four rewards, 0.5.
    assert group.advantages == pytest.approx([0.5, -0.5, -0.5, 0.5])
    plain = to_samples([group], max_len=16)
    masked = to_samples([group], max_len=16, mask_truncated=True)
    for rollout_, before, after in zip(rollouts, plain, masked):
        assert before.loss_mask.sum() == len(rollout_.completion_tokens)
        if rollout_.stop_reason == "length":
            assert not after.loss_mask.any() and not after.advantages.any()
        else:
            assert after.loss_mask.equal(before.loss_mask) and after.advantages.equal(before.advantages)
        assert after.input_ids.equal(before.input_ids) and after.sampler_logprobs.equal(before.sampler_logprobs)
    metrics = rollout_metrics(*rollout_sums([group], filtered=0, masked_truncated=2), batch_mesh=None)
    assert metrics["rl/masked_truncated"] == 2.0
    assert "rl/masked_truncated" not in rollout_metrics(*rollout_sums([group], filtered=0), batch_mesh=None)


# ------------------------------------------------------------------ selection of groups with signal


def group(slot: int, totals: list[float]) -> ScoredGroup:
    rewards = [Reward(t, False, {}) for t in totals]
    return ScoredGroup(slot, [rollout(slot, s, [4], False) for s in range(len(totals))], rewards, [0.0] * len(totals))


SIGNAL, FLAT = [1.0, 0.0], [1.0, 1.0]


class ScriptedRounds:
    """Round r of 4 slots (candidates 4r..4r+3), each with or without signal; the candidates with
    signal returned shuffled (a gather returns them in any order), and every call recorded."""

    def __init__(self, signal_by_round: list[list[bool]]):
        self.signal_by_round = signal_by_round
        self.calls: list[int] = []

    def __call__(self, round_index: int) -> list[int]:
        self.calls.append(round_index)
        offset = round_offset(round_index, 4)
        candidates = [offset + s for s, x in enumerate(self.signal_by_round[round_index]) if x]
        random.Random(round_index).shuffle(candidates)
        return candidates


def reference_selection(signal_by_round, num_prompts, max_rounds):
    """Brute force: walk the (round, slot) grid in order, stop after the round that fills P."""
    kept, num_rounds = [], 0
    for r, flags in enumerate(signal_by_round[:max_rounds]):
        num_rounds = r + 1
        kept += [4 * r + s for s, has_signal in enumerate(flags) if has_signal]
        if len(kept) >= num_prompts:
            break
    return kept, num_rounds


@pytest.mark.parametrize(
    "signal_by_round, max_rounds",
    [
        ([[True, False, True, True], [False] * 4, [True] * 4], 3),  # enough in round 0... plus 1 later
        ([[True, True, True, True], [True] * 4, [True] * 4], 3),  # round 0 suffices
        ([[False, True, False, False], [True, False, False, True], [False, True, True, True]], 3),
        ([[False, True, False, False], [False, False, True, False], [True] * 4], 2),  # bound reached
    ],
)
def test_selection_keeps_the_first_groups_with_signal_in_round_then_slot_order(caplog, signal_by_round, max_rounds):
    rounds = ScriptedRounds(signal_by_round)
    with caplog.at_level(logging.WARNING):
        selection = select_groups_with_signal(rounds, num_prompts=4, max_rounds=max_rounds, warn=True)
    candidates, num_rounds = reference_selection(signal_by_round, 4, max_rounds)
    assert rounds.calls == list(range(num_rounds))  # stops early, never past the bound
    assert selection.num_rounds == num_rounds and selection.num_with_signal == len(candidates)
    assert selection.candidates == candidates[:4]
    short = len(candidates) < 4
    assert short == any("dynamic sampling" in r.message for r in caplog.records if r.levelno == logging.WARNING)


def test_selection_falls_short_quietly_off_the_logging_rank(caplog):
    rounds = ScriptedRounds([[False] * 4, [True, False, False, False]])
    with caplog.at_level(logging.WARNING):
        selection = select_groups_with_signal(rounds, num_prompts=4, max_rounds=2, warn=False)
    assert not caplog.records
    assert (selection.num_rounds, selection.num_with_signal, selection.candidates) == (2, 1, [4])
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        select_groups_with_signal(ScriptedRounds([[False] * 4] * 3), num_prompts=4, max_rounds=3, warn=True)
    assert len(caplog.records) == 1  # once per step, not once per round


def test_each_kept_group_travels_once_to_the_rank_that_trains_its_new_slot():
    """Three data-parallel ranks, 12 prompts per round in 2 mini-batches: each rank holds the
    groups with signal of its own slots of every round; the selection's groups, renumbered,
    reach the rank that trains their new slot from the rank that generated them, and a rank
    receives no group (no byte) it does not train."""
    num_prompts, num_ranks = 12, 3
    slots_by_rank = [
        [s for mb in rank_prompt_slots(num_prompts, 2, r, num_ranks) for s in mb] for r in range(num_ranks)
    ]
    signal = random.Random(0)
    groups = {c: group(c, SIGNAL if signal.random() < 0.6 else FLAT) for c in range(3 * num_prompts)}  # rounds 0..2
    held = [
        {c: g for c, g in groups.items() if c % num_prompts in slots and not is_zero_variance(g)}
        for slots in slots_by_rank
    ]
    with_signal = sorted(c for c, g in groups.items() if not is_zero_variance(g))
    candidates = with_signal[:num_prompts]
    assert max(candidates) >= num_prompts  # later rounds contribute
    outgoing = [route_selected(candidates, held[r], slots_by_rank) for r in range(num_ranks)]
    for r in range(num_ranks):
        received = [g for source in range(num_ranks) for g in outgoing[source][r]]
        expected = [
            dataclasses.replace(groups[c], slot=slot) for slot, c in enumerate(candidates) if slot in slots_by_rank[r]
        ]
        assert sorted(received, key=lambda g: g.slot) == expected
        from_others = [g for source in range(num_ranks) if source != r for g in outgoing[source][r]]
        moved = [g for g in expected if candidates[g.slot] not in held[r]]
        assert sorted(from_others, key=lambda g: g.slot) == moved
    assert any(outgoing[s][r] for s in range(num_ranks) for r in range(num_ranks) if s != r)  # groups did move


class RecordingGenerator:
    """Returns one rollout per (prompt, sample) and records the prompt indices it was given."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, prompt_indices, num_samples, params, seed, step, images=None):
        self.calls.append((prompts, prompt_indices))
        return [
            Rollout(p, s, prompt, [0], [0.0], "stop") for prompt, p in zip(prompts, prompt_indices) for s in range(2)
        ]


def test_later_rounds_key_their_rollouts_with_fresh_prompt_indices():
    generator = RecordingGenerator()
    step_prompts = [[10], [11], [12], [13]]
    params = SamplingParams(4, 1.0, stop_token_ids=(0,))
    generate_share(generator, step_prompts, [1, 3], 2, params, 0, 5, None, index_offset=round_offset(2, 4))
    assert generator.calls == [([[11], [13]], [9, 11])]  # the round's prompts, keyed as candidates 8 + slot
    # Candidates r * P + s of rounds 0..9 never repeat, and only round 0 uses 0..P-1.
    keys = [round_offset(r, 4) + s for r in range(10) for s in range(4)]
    assert len(set(keys)) == len(keys) and sorted(keys[:4]) == [0, 1, 2, 3] and min(keys[4:]) == 4


# ------------------------------------------------------------------ the recipe's rollout step

NUM_PROBLEMS, GROUP_SIZE, MAX_NEW = 12, 2, 4


def scripted_rollout(seed, step, prompt_index, sample_index, prompt) -> Rollout:
    """A completion that depends only on its randomness key, as the real generator's does."""
    rng = random.Random(rollout_seed(seed, step, prompt_index, sample_index))
    length = rng.randint(1, MAX_NEW)
    truncated = length == MAX_NEW and rng.random() < 0.5
    tokens = [rng.randrange(10) for _ in range(length)]
    return Rollout(prompt_index, sample_index, prompt, tokens, [-0.5] * length, "length" if truncated else "stop")


class ScriptedGenerator:
    def take_phase_seconds(self) -> dict[str, float]:
        return {}

    def generate(self, prompts, prompt_indices, num_samples, params, seed, step, images=None):
        return [
            scripted_rollout(seed, step, p, s, prompt)
            for prompt, p in zip(prompts, prompt_indices)
            for s in range(num_samples)
        ]


def scripted_reward(problem: int, text: str) -> float:
    """Correct when the digits (the text of the tokens) add up to the problem's parity."""
    return float(sum(map(int, text)) % 2 == problem % 2)


def completion_text(rollout: Rollout) -> str:
    """What the verifier reads: the digits, without the stop token of a completion that stopped."""
    tokens = rollout.completion_tokens[:-1] if rollout.stop_reason == "stop" else rollout.completion_tokens
    return "".join(map(str, tokens))


class ScriptedTask:
    train_problems = list(range(NUM_PROBLEMS))

    def reward(self, problem, text, stopped):
        return Reward(scripted_reward(problem, text), bool(scripted_reward(problem, text)), {})


class DigitTokenizer:
    vocab_size = 10

    def decode(self, tokens):
        return "".join(map(str, tokens))


def scripted_recipe(prompts_per_step: int, **rl) -> GRPORecipe:
    """The recipe's rollout step without a model: one rank, a scripted generator and task."""
    recipe = GRPORecipe.__new__(GRPORecipe)
    cfg = JobConfig()
    cfg.rl = dataclasses.replace(cfg.rl, group_size=GROUP_SIZE, prompts_per_step=prompts_per_step, **rl)
    cfg.generation = dataclasses.replace(cfg.generation, max_new_tokens=MAX_NEW, seed=7)
    recipe.job_config = cfg
    recipe.parallel_dims = SimpleNamespace(mesh=lambda name: None)
    recipe.rank = 0
    recipe.stream = PromptStream(NUM_PROBLEMS, prompts_per_step, seed=3)
    recipe.generator = ScriptedGenerator()
    recipe.train_prompts = [[100 + i] for i in range(NUM_PROBLEMS)]
    recipe.task = ScriptedTask()
    recipe.tokenizer = DigitTokenizer()
    recipe.sampling = SamplingParams(MAX_NEW, 1.0, stop_token_ids=(0,))
    recipe.vision = None  # a text model
    recipe.sampler = StepSampler(
        cfg, recipe.task, recipe.train_prompts, recipe.tokenizer, recipe.generator, recipe.sampling, recipe.stream
    )
    return recipe


def expected_dynamic_step(prompts_per_step: int, max_rounds: int, step: int) -> tuple[list[int], int, int]:
    """Brute force of one step: (problem ids kept in order, rounds drawn, groups with signal)."""
    stream = PromptStream(NUM_PROBLEMS, prompts_per_step, seed=3)
    kept, num_rounds = [], 0
    while num_rounds < max_rounds and len(kept) < prompts_per_step:
        for slot, problem in enumerate(stream.next_step()):
            key = num_rounds * prompts_per_step + slot
            texts = [completion_text(scripted_rollout(7, step, key, s, [])) for s in (0, 1)]
            if len({scripted_reward(problem, t) for t in texts}) > 1:
                kept.append(problem)
        num_rounds += 1
    return kept[:prompts_per_step], num_rounds, len(kept)


@pytest.mark.parametrize("max_rounds", [1, 2, 5])
def test_the_recipe_trains_the_first_groups_with_signal_of_its_rounds(max_rounds):
    prompts_per_step, step = 4, 3
    recipe = scripted_recipe(prompts_per_step, dynamic_sampling=True, max_sampling_rounds=max_rounds)
    kept, values, num_generated = recipe._rollout_groups(step, list(range(prompts_per_step)), {})
    problems, num_rounds, num_with_signal = expected_dynamic_step(prompts_per_step, max_rounds, step)
    assert [recipe.train_prompts.index(g.rollouts[0].prompt_tokens) for g in kept] == problems
    assert [g.slot for g in kept] == list(range(len(problems)))
    assert values["rl/dynamic_sampling/rounds"] == num_rounds
    assert values["rl/dynamic_sampling/groups_with_signal"] == num_with_signal
    # Rollout metrics cover every generated group, the zero-variance ones counted as filtered.
    assert values["rl/num_rollouts"] == num_rounds * prompts_per_step * GROUP_SIZE
    assert values["rl/filtered_groups"] == num_rounds * prompts_per_step - num_with_signal
    assert recipe.stream.state_dict()["position"] == num_rounds * prompts_per_step  # rounds consumed the stream
    assert num_generated > 0


def test_the_scripted_step_needs_several_rounds():
    # The parametrized case above would prove little if round 0 always had enough signal.
    assert expected_dynamic_step(4, 5, 3)[1] > 1


def test_the_recipe_shapes_rewards_and_masks_truncated_completions():
    recipe = scripted_recipe(4, overlong_buffer=2, overlong_penalty=0.5, mask_truncated=True)
    kept, values, _ = recipe._rollout_groups(2, [0, 1, 2, 3], {})
    rollouts = [r for g in kept for r in g.rollouts]
    for r, reward in zip(rollouts, [x for g in kept for x in g.rewards]):
        problem = recipe.train_prompts.index(r.prompt_tokens)
        shaped = scripted_reward(problem, completion_text(r))
        shaped -= 0.5 * max(len(r.completion_tokens) - 2, 0) / 2
        assert reward.total == pytest.approx(shaped)
    num_long = sum(len(r.completion_tokens) > 2 for r in rollouts)
    num_truncated = sum(r.stop_reason == "length" for r in rollouts)
    assert 0 < num_long < len(rollouts) and num_truncated > 0
    assert values["rl/overlong/penalized"] == pytest.approx(num_long / len(rollouts))
    assert values["rl/masked_truncated"] == num_truncated
    samples = recipe._minibatch_samples(kept, [[0, 1, 2, 3]])[0]
    assert [not s.loss_mask.any() for s in samples] == [r.stop_reason == "length" for r in rollouts]


# ------------------------------------------------------------------ config rules

GRPO = ("--job.recipe", "grpo", "--loss.loss_fn", "ppo")


def test_dapo_keys_parse_and_their_mistakes_name_the_key():
    cfg = parse(*GRPO, "--rl.dynamic_sampling", "true", "--rl.max_sampling_rounds", "5", "--rl.overlong_buffer", "4")
    assert (cfg.rl.dynamic_sampling, cfg.rl.max_sampling_rounds, cfg.rl.overlong_buffer) == (True, 5, 4)
    assert_error([*GRPO, "--rl.max_sampling_rounds", "5"], "rl.max_sampling_rounds: only used with rl.dynamic_sampling")
    assert_error([*GRPO, "--rl.dynamic_sampling", "true", "--rl.max_sampling_rounds", "0"], "rl.max_sampling_rounds")
    assert_error(
        [*GRPO, "--rl.dynamic_sampling", "true", "--rl.filter_zero_variance_groups", "true"],
        "rl.filter_zero_variance_groups: implied by rl.dynamic_sampling",
    )
    assert_error(
        [*GRPO, "--generation.max_new_tokens", "8", "--rl.overlong_buffer", "8"],
        "rl.overlong_buffer=8 must be below generation.max_new_tokens=8",
    )
    assert parse(*GRPO, "--generation.max_new_tokens", "8", "--rl.overlong_buffer", "7").rl.overlong_buffer == 7
    assert_error([*GRPO, "--rl.overlong_buffer", "-1"], "rl.overlong_buffer")
    assert_error([*GRPO, "--rl.overlong_penalty", "2"], "rl.overlong_penalty: only used with rl.overlong_buffer > 0")
    assert_error([*GRPO, "--rl.overlong_buffer", "2", "--rl.overlong_penalty", "-1"], "rl.overlong_penalty")
    assert_error(["--rl.mask_truncated", "true"], "rl.mask_truncated: only used with job.recipe = 'grpo'")
