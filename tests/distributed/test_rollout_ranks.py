"""Rollout ranks on gloo (``rollout_rank_cases``, in the shared 4-rank launch): the weights a
rollout rank loads are exactly the trainers' full weights of each version, whether FSDP or TP
shards them and however many buckets carry them, and a send holds at most two buckets on
training rank 0 and one gathered parameter on the others; two rollout ranks split a step's
generation and both end with the rollouts one process generates; each trainer receives the
groups of its own slots and no more bytes than they take, and a checkpoint gathers the whole
step. With LoRA the
second broadcast carries the adapters alone and the rollout ranks' replica is the merged
model. Trainers under expert parallel send every expert."""

import pickle

import pytest
import torch

import layout_cases as lc
import moe_cases as mc
import rollout_rank_cases as cases
import rollout_timeout_cases as timeouts
from generator_cases import prompts
from rl_cases import NUM_MINIBATCHES, NUM_SAMPLES, PARAMS, STEP, reward, summary
from test_rollout_exchange import single_process_rollouts
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.models.lora import is_adapter_key
from torchtitan_rl.models.qwen3.model import Qwen3Model
from torchtitan_rl.recipes.base import build_model
from torchtitan_rl.rl.generator import Rollout
from torchtitan_rl.rl.rollout_ranks import weight_buckets
from torchtitan_rl.rl.rollouts import ScoredGroup, rank_prompt_slots, score_groups


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
def test_two_rollout_ranks_generate_what_one_process_does(layout_results, layout):
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


def reference_groups() -> list[ScoredGroup]:
    """The step's scored groups as one process makes them from its rollouts (each with its own
    list of prompt tokens, as the generator returns them: pickled once per rollout)."""
    step_prompts = prompts()
    reference = single_process_rollouts()
    rollouts = [
        Rollout(
            p, s, list(step_prompts[p]), tokens, logprobs, "stop" if tokens[-1] in PARAMS.stop_token_ids else "length"
        )
        for (p, s), (tokens, logprobs) in sorted(reference.items())
    ]
    return score_groups(rollouts, [reward(r) for r in rollouts], NUM_SAMPLES, "grpo", 1e-6)


def described(groups: list[ScoredGroup]) -> list[tuple]:
    return [(g.slot, summary(g.rollouts), g.advantages) for g in groups]


@pytest.mark.parametrize("layout", cases.ROLLOUT_LAYOUTS)
def test_each_trainer_receives_the_groups_of_its_slots_alone(layout_results, layout):
    ranks = layout_results[4][cases.layout_key(layout)]
    groups = reference_groups()
    dp, peers = layout[0] * layout[1], layout[2] * layout[3]
    batch_fields = len(pickle.dumps(cases.step_batch([])))  # the step batch but for its groups
    for rank, trainer in enumerate(ranks[:2]):
        batch_rank = rank // peers  # the training ranks in (data-parallel, CP, TP) order
        assert trainer["batch_rank"] == (batch_rank, batch_rank)  # the mesh's, and the one derived elsewhere
        slots = {s for mb in rank_prompt_slots(len(prompts()), NUM_MINIBATCHES, batch_rank, dp) for s in mb}
        own = [g for g in groups if g.slot in slots]
        assert trainer["groups"] == described(own)
        # The bytes it received: its own groups and the batch's other fields, pickled apart (the
        # groups that travelled may share fewer objects than these: a few bytes more).
        bound = len(pickle.dumps(own)) + batch_fields + 32
        assert len(trainer["payload"]) <= bound, (len(trainer["payload"]), bound)
        if dp > 1:
            assert len(pickle.dumps(groups)) > bound  # the whole step's groups would not fit
    if peers > 1:
        assert ranks[0]["payload"] == ranks[1]["payload"]  # TP peers: the same share, the same bytes
    # A checkpoint holds the whole step, the same bytes on every trainer.
    assert ranks[0]["checkpoint"] == ranks[1]["checkpoint"]
    saved = pickle.loads(ranks[0]["checkpoint"])
    assert [b.step for b in saved] == [STEP] and described(saved[0].kept) == described(groups)


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


def test_a_weight_send_holds_two_buckets_on_rank_0_and_one_parameter_on_the_others(layout_results):
    """FSDP trainers, a model of several buckets: what each holds at most during a send (the
    tensors it created and still references), against the model's bytes; a rollout rank holds
    the one bucket arriving."""
    ranks = layout_results[4]["rollout_ranks/weight_memory"]
    model = Qwen3Model(cases.MEMORY_ARGS)
    model.init_weights(lc.SEED)
    reference = {name: p.detach() for name, p in model.named_parameters()}
    numels = [p.numel() for _, p in sorted(reference.items())]
    model_bytes, largest = 4 * sum(numels), 4 * max(numels)
    assert len(weight_buckets(numels, 4, cases.MEMORY_BUCKET_BYTES)) >= 5
    # Rank 0: the two buckets in flight and the parameter being gathered (with its shard's copy).
    sender_bound = 2 * cases.MEMORY_BUCKET_BYTES + 2 * largest
    assert ranks[0]["peak_bytes"] <= sender_bound, ranks[0]["peak_bytes"]
    assert sender_bound < model_bytes / 2  # far from a copy of the model
    # The other trainer: the parameter being gathered, dropped at once.
    assert ranks[1]["peak_bytes"] <= 2 * largest, ranks[1]["peak_bytes"]
    assert 2 * largest < cases.MEMORY_BUCKET_BYTES / 2  # far from a bucket of gathered parameters
    for rank in ranks[2:]:
        assert rank["weights"].keys() == reference.keys()
        for name, value in reference.items():
            assert torch.equal(rank["weights"][name], 2 * value), name
        # A rollout rank: the bucket arriving, taken into the replica before the next one.
        assert rank["peak_bytes"] <= cases.MEMORY_BUCKET_BYTES, rank["peak_bytes"]


def test_waits_outlast_a_warm_up_and_a_save_longer_than_the_silent_peer_timeout(layout_results):
    """The rollout ranks wait out the trainers' warm-up before the start message and their
    checkpoint save before the next weights, each longer than the timeout, and the run goes on."""
    ranks = layout_results[4]["rollout_timeouts"]
    assert [r["role"] for r in ranks] == ["trainer", "trainer", "rollout", "rollout"]
    assert [r["steps"] for r in ranks[:2]] == [[1, 2], [1, 2]]
    for rank in ranks[2:]:
        # Less than the sleep by the rollout rank's set-up before it waits, still past the timeout.
        assert rank["waited"]["start"] > timeouts.SILENT_SECONDS + 1, rank["waited"]
        assert rank["waited"]["weights"] > timeouts.SILENT_SECONDS + 1, rank["waited"]


def test_a_stopped_rollout_rank_that_is_not_the_leader_is_the_one_named(layout_results):
    """The trainers wait for the leader's rollouts; the leader, alive, waits for the stopped rank
    in their rollout mesh's collective: the trainers name the stopped rank, after the timeout."""
    for trainer in layout_results[4]["rollout_timeouts"][:2]:
        assert trainer["silent"] is not None, "no error while a rollout rank was stopped"
        message, seconds = trainer["silent"]
        assert message.startswith(
            "waiting for rollout rank 2's rollouts of step 2: rollout rank 3 sent no heartbeat for "
        ), message
        assert "comm.silent_peer_timeout_seconds=2" in message, message
        assert timeouts.SILENT_SECONDS - 0.5 < seconds < timeouts.SILENT_SECONDS + 3, seconds
