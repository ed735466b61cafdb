"""Rollout ranks on gloo (``rollout_rank_cases``, in the shared 4-rank launch): the weights a
rollout rank loads are exactly the trainers' full weights of each version, whether FSDP or TP
shards them and however many buckets carry them; two rollout ranks split a step's generation
and both end with the rollouts one process generates; both trainers receive them. With LoRA the
second broadcast carries the adapters alone and the rollout ranks' replica is the merged
model. Trainers under expert parallel send every expert."""

import pytest
import torch

import layout_cases as lc
import moe_cases as mc
import rollout_rank_cases as cases
from test_rollout_exchange import single_process_rollouts
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.models.lora import is_adapter_key
from torchtitan_rl.models.qwen3.model import Qwen3Model
from torchtitan_rl.recipes.base import build_model
from torchtitan_rl.rl.rollout_ranks import weight_buckets


def reference_weights() -> dict[str, torch.Tensor]:
    model = Qwen3Model(lc.model_args(False))
    model.init_weights(lc.SEED)  # what build_model gives every layout (test_layout_invariance checks)
    return {name: p.detach() for name, p in model.named_parameters()}


def test_the_weights_need_several_buckets():
    numels = [p.numel() for _, p in sorted(reference_weights().items())]
    assert len(weight_buckets(numels, 4, cases.BUCKET_BYTES)) > 2


@pytest.mark.parametrize("layout", cases.ROLLOUT_LAYOUTS)
def test_rollout_ranks_load_each_version_of_the_full_weights(layout_results, layout):
    ranks = layout_results[4][cases.layout_key(layout)]
    assert [r["role"] for r in ranks] == ["trainer", "trainer", "rollout", "rollout"]
    reference = reference_weights()
    num_bytes = 4 * sum(p.numel() for p in reference.values())
    assert [r["bytes"] for r in ranks[:2]] == [[num_bytes, num_bytes], [0, 0]]  # rank 0 sends, each tensor once
    for rank in ranks[2:]:
        first, second = rank["weights"]
        assert first.keys() == reference.keys()
        for name, value in reference.items():
            assert torch.equal(first[name], value), name
            assert torch.equal(second[name], 2 * value), name
        assert rank["version"] == 1


@pytest.mark.parametrize("layout", cases.ROLLOUT_LAYOUTS)
def test_two_rollout_ranks_generate_what_one_process_does_and_every_trainer_gets_it(layout_results, layout):
    ranks = layout_results[4][cases.layout_key(layout)]
    reference = single_process_rollouts()
    rollout = ranks[2:]
    # Each generated a part (split by prompt), and both hold the whole step.
    assert rollout[0]["local"] and rollout[1]["local"]
    assert len(rollout[0]["local"]) + len(rollout[1]["local"]) == len(reference)
    for rank in rollout:
        assert rank["rollouts"] == rollout[0]["rollouts"]
        assert rank["versions"] == [0]
    assert {(p, s): (tokens, logprobs) for p, s, tokens, logprobs in rollout[0]["rollouts"]} == reference
    for trainer in ranks[:2]:
        assert trainer["rollouts"] == rollout[0]["rollouts"]


def test_rollout_ranks_merge_the_adapters_the_second_broadcast_carries_alone(layout_results):
    ranks = layout_results[4]["rollout_ranks/lora"]
    assert [r["role"] for r in ranks] == ["trainer", "trainer", "rollout", "rollout"]
    # The reference: one process's adapted model (the layouts build the same one), the step applied.
    dims = ParallelDims(1, 1, 1, 1, world_size=1)
    dims.build_meshes("cpu")
    model = build_model(
        lc.model_args(False),
        parallel_dims=dims,
        device=torch.device("cpu"),
        seed=lc.SEED,
        param_dtype=torch.float32,
        lora=cases.LORA,
    )
    params = {
        name: p.detach() + (cases.ADAPTER_STEP if p.requires_grad else 0.0) for name, p in model.named_parameters()
    }
    everything = 4 * sum(p.numel() for p in params.values())
    adapters = 4 * sum(p.numel() for name, p in params.items() if is_adapter_key(name))
    assert adapters < everything / 10
    assert [r["bytes"] for r in ranks] == [
        [everything, adapters],
        [0, 0],
        [everything, adapters],
        [everything, adapters],
    ]
    expected = {name: p for name, p in params.items() if not is_adapter_key(name)}
    for name in params:
        if name.endswith(".lora_a.weight"):
            module = name.removesuffix(".lora_a.weight")
            delta = params[f"{module}.lora_b.weight"] @ params[name] * cases.LORA.scale
            expected[f"{module}.weight"] = params[f"{module}.weight"] + delta
    assert any(name.endswith(".lora_a.weight") for name in params)
    for rank in ranks[2:]:
        assert rank["weights"].keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(rank["weights"][name], value), name
        assert rank["version"] == 1


def test_rollout_ranks_get_every_expert_from_expert_parallel_trainers(layout_results):
    """Each trainer holds 2 of the 4 experts of a layer (FSDP over a single rank, so whole);
    the rollout ranks' replicas hold every expert as the one-process model does."""
    ranks = layout_results[4]["rollout_ranks/expert_parallel"]
    assert [r["role"] for r in ranks] == ["trainer", "trainer", "rollout", "rollout"]
    assert [(r["ep_size"], r["local_experts"]) for r in ranks[:2]] == [(2, mc.EP_NUM_EXPERTS // 2)] * 2
    reference = expert_parallel_reference_weights()
    for rank in ranks[2:]:
        assert rank["weights"].keys() == reference.keys()
        for name, value in reference.items():
            assert torch.equal(rank["weights"][name], value), name


def expert_parallel_reference_weights() -> dict:
    model = Qwen3Model(mc.ep_model_args())
    model.init_weights(lc.SEED)
    return {name: p.detach() for name, p in model.named_parameters()}
