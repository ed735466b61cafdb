"""How pipeline parallel splits a model and a rank's samples: the stages' layers, which rank
holds which stage, the minimum micro-batch count, the padding that gives micro-batches one
shape, and the config rules that refuse what it does not support (named errors)."""

import pytest
import torch

from test_config import assert_error, parse
from torchtitan_rl.data.balance import spread_microbatches
from torchtitan_rl.data.packing import pack, pad_microbatch
from torchtitan_rl.data.sample import Sample
from torchtitan_rl.distributed.pipeline import (
    SCHEDULES,
    is_multi_stage,
    layer_ranges,
    num_microbatches_for,
    num_stages_of,
    plan_pipeline,
    stage_ids,
)
from torchtitan_rl.losses.reduction import local_counts


@pytest.mark.parametrize("num_layers,num_stages", [(8, 2), (7, 2), (28, 8), (5, 4), (4, 4)])
def test_balanced_split_is_contiguous_and_even(num_layers, num_stages):
    ranges = layer_ranges(num_layers, num_stages)
    assert [i for r in ranges for i in r] == list(range(num_layers))
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)  # earlier stages take the extra


def test_fixed_layers_per_stage_leave_the_rest_to_the_last():
    assert [list(r) for r in layer_ranges(7, 2, 4)] == [[0, 1, 2, 3], [4, 5, 6]]


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("pp", [2, 4])
def test_every_stage_is_held_by_exactly_one_rank_in_schedule_order(schedule, pp):
    num_stages = num_stages_of(8, pp, schedule, 0)
    held = [stage_ids(schedule, rank, pp, num_stages) for rank in range(pp)]
    assert sorted(s for stages in held for s in stages) == list(range(num_stages))
    if schedule == "ZBVZeroBubble":  # a V: rank 0 holds the first and the last stage
        assert held[0] == [0, num_stages - 1]
    else:  # looped: stage s on rank s mod pp
        assert all(s % pp == rank for rank, stages in enumerate(held) for s in stages)
    assert len(held[0]) == (2 if schedule in ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble") else 1)


def test_plan_of_a_rank():
    assert num_stages_of(2, 2, "1F1B", 1) == 2
    plan = plan_pipeline(8, 2, 1, "Interleaved1F1B")
    assert (plan.num_stages, plan.local_stages) == (4, (1, 3))
    assert [list(plan.layers[s]) for s in plan.local_stages] == [[2, 3], [6, 7]]


@pytest.mark.parametrize(
    "args,fragments",
    [
        ((8, 2, "1F1B", 2), ["splits the 8 layers into 4 stage(s)", "one stage per rank"]),
        ((8, 2, "Interleaved1F1B", 3), ["splits the 8 layers into 3 stage(s)", "several stages per rank"]),
        ((8, 2, "ZBVZeroBubble", 1), ["runs exactly 2 stages per rank (4 stages)", "gives 8"]),
        ((3, 4, "1F1B", 0), ["3 layers cannot fill 4 pipeline stages"]),
        ((8, 2, "Chimera", 0), ["pipeline_schedule = 'Chimera' is not one of", "1F1B"]),
    ],
)
def test_splits_that_cannot_serve_the_schedule_are_named(args, fragments):
    num_layers, pp, schedule, per_stage = args
    with pytest.raises(ValueError) as error:
        num_stages_of(num_layers, pp, schedule, per_stage)
    for fragment in fragments:
        assert fragment in str(error.value)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("pp", [2, 4])
def test_microbatch_count_is_the_fewest_the_schedule_accepts(schedule, pp):
    for count in range(1, 20):
        got = num_microbatches_for(schedule, count, pp)
        # Brute force: the first count from here on that torch's rule accepts.
        accepted = [n for n in range(max(count, pp), 40) if not is_multi_stage(schedule) or n % max(1, n // pp) == 0]
        assert got == accepted[0], (count, got)


def test_spread_splits_the_largest_micro_batch_in_order_until_the_count():
    lens = [5, 3, 8, 2, 2, 6]
    plan = spread_microbatches([[0, 1, 2], [3, 4, 5]], lens, 4)
    assert len(plan) == 4 and [i for group in plan for i in group] == list(range(6))  # order kept
    # Brute force: the first split takes the 16-token micro-batch at its token midpoint.
    assert plan[:2] == [[0, 1], [2]]
    assert spread_microbatches([[0], [1, 2]], [1, 1, 1], 10) == [[0], [1], [2]]  # one sample each at most
    assert spread_microbatches([[0, 1]], [1, 1], 1) == [[0, 1]]


def _sample(n: int, loss_from: int, seed: int) -> Sample:
    gen = torch.Generator().manual_seed(seed)
    return Sample(
        input_ids=torch.randint(0, 50, (n,), generator=gen),
        labels=torch.randint(0, 50, (n,), generator=gen),
        loss_mask=torch.arange(n) >= loss_from,
    )


@pytest.mark.parametrize("pad_multiple", [1, 4])
def test_padding_to_a_length_adds_zero_weight_tokens_of_the_padding_sequence(pad_multiple):
    mb = pack([_sample(5, 2, 0), _sample(6, 1, 1)], pad_multiple)
    padded = pad_microbatch(mb, 20)
    assert padded.num_tokens == 20 and padded.seq_lens == mb.seq_lens
    assert torch.equal(padded.input_ids[: mb.num_tokens], mb.input_ids)
    assert not padded.loss_mask[11:].any() and not padded.real_token_mask()[11:].any()
    assert (padded.seq_ids[11:] == 2).all()  # the real sequences are 0 and 1
    # The padding sequence's positions run on from its start (after the real tokens).
    assert torch.equal(padded.positions[11:], torch.arange(9))
    assert torch.equal(local_counts([padded]), local_counts([mb]))  # counted nowhere
    assert pad_microbatch(mb, mb.num_tokens) is mb


GRPO = ["--parallelism.pipeline_parallel_degree", "2", "--job.recipe", "grpo", "--loss.loss_fn", "ppo"]


@pytest.mark.parametrize(
    "argv,fragments",
    [
        (
            ["--parallelism.pipeline_schedule", "GPipe"],
            ["parallelism.pipeline_schedule", "pipeline_parallel_degree > 1"],
        ),
        (["--training.pipeline_microbatches", "4"], ["training.pipeline_microbatches", "pipeline_parallel_degree > 1"]),
        (
            ["--parallelism.pipeline_parallel_degree", "2", "--job.recipe", "reward_model"],
            ["pipeline_parallel_degree = 2", "job.recipe = 'sft', 'grpo' or 'dpo', not 'reward_model'"],
        ),
        (
            [*GRPO, "--rl.advantage", "gae", "--rl.group_size", "1"],
            ["pipeline_parallel_degree = 2", "rl.advantage = 'gae' (the critic)"],
        ),
        ([*GRPO, "--rl.reward_model", "some/folder"], ["pipeline_parallel_degree = 2", "rl.reward_model"]),
        (["--parallelism.pipeline_parallel_degree", "2", "--model.flavor", "0.6B"], ["ties the output head"]),
        (
            ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_schedule", "Interleaved1F1B"],
            ["the model's 2 layers cannot fill 4 pipeline stages"],
        ),
        (["--parallelism.pipeline_parallel_degree", "0"], ["parallelism.pipeline_parallel_degree"]),
    ],
)
def test_pipeline_config_fails_closed(argv, fragments):
    assert_error(argv, *fragments)


def test_pipeline_config_accepted_for_a_moe_model_with_expert_parallel():
    cfg = parse(
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--model.flavor",
        "debugmodel_moe",
        "--parallelism.expert_parallel_degree",
        "2",
    )
    assert (cfg.parallelism.pipeline_parallel_degree, cfg.parallelism.expert_parallel_degree) == (2, 2)


def test_pipeline_config_accepted_for_grpo():
    assert parse(*GRPO).parallelism.pipeline_parallel_degree == 2


def test_pipeline_config_accepted():
    cfg = parse(
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--model.flavor",
        "8B",
        "--parallelism.pipeline_schedule",
        "ZBVZeroBubble",
    )
    assert (cfg.parallelism.pipeline_parallel_degree, cfg.parallelism.pipeline_schedule) == (2, "ZBVZeroBubble")


def test_the_pipeline_recipe_parses():
    cfg = parse("--job.config_file", "train_configs/debug_pp.toml")
    p = cfg.parallelism
    assert (p.pipeline_parallel_degree, p.pipeline_schedule, cfg.training.pipeline_microbatches) == (2, "1F1B", 4)
