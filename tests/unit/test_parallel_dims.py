"""ParallelDims validation (errors name the config key, docs/design.md 'Conventions') and the DP degree."""

import pytest

from torchtitan_rl.config import ConfigManager
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.recipes.base import build_parallel_dims, check_divisible_by_data_parallel

KEYS = {
    "dp_replicate": "parallelism.data_parallel_replicate_degree",
    "dp_shard": "parallelism.data_parallel_shard_degree",
    "cp": "parallelism.context_parallel_degree",
    "tp": "parallelism.tensor_parallel_degree",
}


def error_of(*args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        ParallelDims(*args, **kwargs)
    return str(info.value)


# ---------------------------------------------------------------- valid layouts


@pytest.mark.parametrize(
    "dp_replicate, dp_shard, world_size, expected_shard",
    [(1, -1, 1, 1), (1, -1, 4, 4), (2, -1, 8, 4), (4, -1, 4, 1), (3, -1, 6, 2), (2, 3, 6, 3), (1, 5, 5, 5)],
)
def test_valid_layouts_and_batch_degree(dp_replicate, dp_shard, world_size, expected_shard):
    dims = ParallelDims(dp_replicate, dp_shard, 1, 1, world_size=world_size)
    assert dims.dp_shard == expected_shard
    assert dims.dp_replicate == dp_replicate
    assert dims.batch_degree == dp_replicate * expected_shard
    assert dims.batch_degree * dims.cp * dims.tp == world_size


def test_single_rank_meshes_are_none():
    dims = ParallelDims(1, -1, 1, 1, world_size=1)
    dims.build_meshes("cpu")
    for name in ("batch", "fsdp", "loss", "cp", "tp", "dp_shard", "dp_replicate"):
        assert dims.mesh(name) is None
    assert dims.fsdp_mesh() is None
    assert dims.batch_rank() == 0
    assert dims.batch_degree == 1


# ---------------------------------------------------------------- invalid layouts


@pytest.mark.parametrize("dim", ["dp_replicate", "cp", "tp"])
@pytest.mark.parametrize("value", [0, -1, -3])
def test_degree_below_one(dim, value):
    degrees = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, dim: value}
    message = error_of(**degrees, world_size=1)
    assert KEYS[dim] in message
    assert str(value) in message


@pytest.mark.parametrize("value", [0, -2, -5])
def test_dp_shard_zero_or_below_minus_one(value):
    message = error_of(1, value, 1, 1, world_size=4)
    assert KEYS["dp_shard"] in message
    assert str(value) in message


@pytest.mark.parametrize(
    "dp_replicate, dp_shard, cp, tp, world_size, inferred_shard",
    [(1, -1, 2, 1, 4, 2), (1, -1, 4, 1, 4, 1), (1, -1, 2, 2, 8, 2), (2, -1, 2, 1, 8, 2), (2, 1, 2, 2, 8, 1)],
)
def test_context_parallel_layouts(dp_replicate, dp_shard, cp, tp, world_size, inferred_shard):
    dims = ParallelDims(dp_replicate, dp_shard, cp, tp, world_size=world_size)
    assert dims.dp_shard == inferred_shard
    assert dims.batch_degree == dp_replicate * inferred_shard  # CP ranks share their samples
    assert dims.fsdp_degree == inferred_shard * cp  # ... but shard parameters like DP ranks


def test_context_parallel_not_dividing_world():
    message = error_of(1, -1, 3, 1, world_size=4)
    assert KEYS["cp"] in message and "(3)" in message and "world size 4" in message


@pytest.mark.parametrize(
    "dp_replicate, dp_shard, tp, world_size", [(1, 2, 2, 4), (1, -1, 4, 4), (2, 2, 2, 8), (1, 1, 2, 2)]
)
def test_tensor_parallel_layouts(dp_replicate, dp_shard, tp, world_size):
    dims = ParallelDims(dp_replicate, dp_shard, 1, tp, world_size=world_size)
    assert dims.tp == tp
    assert dims.batch_degree == world_size // tp  # TP ranks share their samples


@pytest.mark.parametrize("dp_replicate, world_size", [(3, 4), (2, 5), (4, 6)])
def test_dp_shard_inference_needs_divisible_world_size(dp_replicate, world_size):
    message = error_of(dp_replicate, -1, 1, 1, world_size=world_size)
    assert KEYS["dp_shard"] in message
    assert str(world_size) in message


def test_product_must_equal_world_size():
    for dp_replicate, dp_shard, world_size in [(1, 3, 4), (2, 2, 8), (2, 1, 1), (1, 2, 1), (3, 2, 4)]:
        message = error_of(dp_replicate, dp_shard, 1, 1, world_size=world_size)
        assert str(world_size) in message
        # The message names the config key of every degree that takes part
        # (is not 1), so the user knows which setting to change.
        for dim, value in (("dp_replicate", dp_replicate), ("dp_shard", dp_shard)):
            if value != 1:
                assert KEYS[dim] in message, message


# ---------------------------------------------------------------- trainer.build_parallel_dims


def config(*argv: str):
    return ConfigManager().parse_args(list(argv))


@pytest.mark.parametrize(
    "argv, world_size",
    [
        (["--training.global_batch_size", "3", "--parallelism.data_parallel_shard_degree", "2"], 2),
        (["--training.global_batch_size", "6"], 4),  # dp_shard -1 -> 4
        (
            [
                "--training.global_batch_size",
                "6",
                "--parallelism.data_parallel_replicate_degree",
                "2",
                "--parallelism.data_parallel_shard_degree",
                "2",
            ],
            4,
        ),
    ],
)
def test_build_parallel_dims_batch_not_divisible(argv, world_size):
    cfg = config(*argv)
    dims = build_parallel_dims(cfg, world_size)
    with pytest.raises(ValueError, match=r"training\.global_batch_size") as info:
        check_divisible_by_data_parallel("training.global_batch_size", cfg.training.global_batch_size, dims)
    assert str(cfg.training.global_batch_size) in str(info.value) and str(dims.batch_degree) in str(info.value)


@pytest.mark.parametrize(
    "argv, world_size, batch_degree",
    [
        (["--training.global_batch_size", "4", "--parallelism.data_parallel_shard_degree", "2"], 2, 2),
        (["--training.global_batch_size", "8"], 4, 4),
        (["--training.global_batch_size", "3"], 1, 1),
        (
            [
                "--training.global_batch_size",
                "12",
                "--parallelism.data_parallel_replicate_degree",
                "2",
                "--parallelism.data_parallel_shard_degree",
                "3",
            ],
            6,
            6,
        ),
    ],
)
def test_build_parallel_dims_ok(argv, world_size, batch_degree):
    cfg = config(*argv)
    dims = build_parallel_dims(cfg, world_size)
    check_divisible_by_data_parallel("training.global_batch_size", cfg.training.global_batch_size, dims)
    assert dims.batch_degree == batch_degree
    assert dims.world_size == world_size


def test_build_parallel_dims_passes_on_layout_errors():
    cfg = config("--parallelism.tensor_parallel_degree", "3")
    with pytest.raises(ValueError) as info:
        build_parallel_dims(cfg, 2)
    assert KEYS["tp"] in str(info.value)
    cfg = config("--parallelism.data_parallel_replicate_degree", "3")
    with pytest.raises(ValueError) as info:
        build_parallel_dims(cfg, 4)
    assert KEYS["dp_shard"] in str(info.value)  # cannot infer dp_shard from 4 / 3


@pytest.mark.parametrize("tp, culprit", [(4, "n_kv_heads=2"), (3, "n_heads=4"), (8, "n_heads=4")])
def test_tensor_parallel_degree_must_divide_sharded_model_dims(tp, culprit):
    from torchtitan_rl.models.qwen3.args import qwen3_flavors
    from torchtitan_rl.models.qwen3.parallelize import check_tp_divisibility

    with pytest.raises(ValueError) as info:
        check_tp_divisibility(qwen3_flavors["debugmodel"], tp)
    assert KEYS["tp"] in str(info.value) and culprit in str(info.value)
    check_tp_divisibility(qwen3_flavors["debugmodel"], 2)  # heads 4, kv 2, hidden 384, vocab 512
    check_tp_divisibility(qwen3_flavors["8B"], 8)


# ---------------------------------------------------------------- expert parallel


@pytest.mark.parametrize(
    "dp_replicate, dp_shard, cp, tp, world_size, ep, expert_fsdp",
    [(1, 4, 1, 1, 4, 2, 2), (1, 4, 1, 1, 4, 4, 1), (2, 2, 1, 1, 4, 2, 1), (1, 2, 2, 2, 8, 4, 2), (1, 1, 1, 2, 2, 2, 1)],
)
def test_expert_parallel_degree_divides_a_replica(dp_replicate, dp_shard, cp, tp, world_size, ep, expert_fsdp):
    dims = ParallelDims(dp_replicate, dp_shard, cp, tp, world_size=world_size, ep=ep)
    assert dims.expert_fsdp_degree == expert_fsdp
    assert dims.expert_fsdp_degree * dims.ep == dims.dp_shard * dims.cp * dims.tp


def test_expert_parallel_degree_not_dividing_a_replica():
    # 4 ranks in 2 replicas of 2: ep 4 would span replicas, which hold other samples' copies.
    message = error_of(2, 2, 1, 1, world_size=4, ep=4)
    assert "parallelism.expert_parallel_degree (4)" in message and "= 2" in message
    assert KEYS["dp_shard"] in message
    message = error_of(1, 3, 1, 1, world_size=3, ep=2)
    assert "parallelism.expert_parallel_degree (2)" in message and "= 3" in message


def test_expert_parallel_degree_below_one():
    assert "parallelism.expert_parallel_degree must be >= 1, got 0" in error_of(1, 1, 1, 1, world_size=1, ep=0)


def test_pipeline_degree_takes_its_share_of_the_world():
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=2, world_size=8, pp=2)
    assert (dims.dp_shard, dims.batch_degree, dims.stage_size) == (2, 2, 4)
    # Ranks are ordered (pp, dp_replicate, dp_shard, cp, tp): a stage's ranks are consecutive.
    assert [dims.batch_rank_of(rank) for rank in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    with pytest.raises(ValueError, match=r"pipeline_parallel_degree \(3\) \* .* cannot infer"):
        ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, world_size=8, pp=3)
    with pytest.raises(ValueError, match=r"pipeline_parallel_degree \(2\) \* .* = 8 does not equal the world size 4"):
        ParallelDims(dp_replicate=1, dp_shard=4, cp=1, tp=1, world_size=4, pp=2)
    with pytest.raises(ValueError, match="pipeline_parallel_degree must be >= 1"):
        ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, world_size=1, pp=0)
