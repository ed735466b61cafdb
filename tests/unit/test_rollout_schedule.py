"""The rollout ranks' schedule and bookkeeping, without processes: which weights generate each
step (against the definition, by brute force over the versions: the oldest weights whose lag,
counted by hand, is within max_staleness, so generation runs as far ahead as allowed), which
versions the trainers send (against the set the schedule uses, by brute force),
how the weights are cut into broadcasts and described in their header, which saved rollouts a resumed run keeps
(each trainer its share of them), and the config rules of rollout ranks."""

import dataclasses
from types import SimpleNamespace

import pytest

from test_config import assert_error, parse
from test_generator import ARGS
from torchtitan_rl.models.lora import LoRASettings
from torchtitan_rl.recipes.base import build_parallel_dims
from torchtitan_rl.rl import rollout_ranks
from torchtitan_rl.rl.generator import sync_names, trained_parameters
from torchtitan_rl.rl.rollout_ranks import (
    RolloutClient,
    StepBatch,
    check_weights_header,
    generation_version,
    is_version_sent,
    receive_finished,
    staleness,
    usable_in_flight,
    weight_buckets,
    weights_header,
)
from torchtitan_rl.rl.rollouts import ScoredGroup

GRPO = ("--job.recipe", "grpo", "--loss.loss_fn", "ppo")


def oldest_allowed_version(step: int, start: int, max_staleness: int) -> int:
    """By brute force: of the weights that exist when ``step`` trains (after steps start ..
    step - 1), the oldest within the bound, the lag of weights ``v`` at ``step`` being the
    updates between them, (step - 1) - v. The oldest one is the furthest ahead generation may run."""
    return min(v for v in range(start, step) if (step - 1) - v <= max_staleness)


def test_the_lag_counts_the_updates_between_the_weights_and_the_trained_policy():
    # Step 5 trains the policy after 4 updates: weights after step 1 are 3 behind, after step 4 none.
    assert [staleness(5, version) for version in (1, 2, 3, 4)] == [3, 2, 1, 0]


@pytest.mark.parametrize("max_staleness", [0, 1, 2, 5])
@pytest.mark.parametrize("start", [0, 3])
def test_each_step_runs_as_far_ahead_as_the_staleness_bound_allows(max_staleness, start):
    num_steps = 12
    versions = [generation_version(step, start, max_staleness) for step in range(start + 1, num_steps + 1)]
    assert versions == [oldest_allowed_version(step, start, max_staleness) for step in range(start + 1, num_steps + 1)]
    if max_staleness == 0:
        assert versions == list(range(start, num_steps))  # the colocated run's schedule


@pytest.mark.parametrize("max_staleness", [0, 1, 2, 20])
@pytest.mark.parametrize("start", [0, 4])
def test_the_trainers_send_exactly_the_versions_a_later_step_is_generated_with(max_staleness, start):
    num_steps = 10
    used = {oldest_allowed_version(step, start, max_staleness) for step in range(start + 1, num_steps + 1)}
    # The start version goes out with the start message; after that, one send per step whose weights are used.
    sent = {
        version for version in range(start + 1, num_steps + 1) if is_version_sent(version, num_steps, max_staleness)
    }
    assert sent == used - {start}


def test_weight_buckets_fill_in_order_up_to_the_limit():
    numels = [3, 5, 2, 9, 1, 1, 4, 30, 2]
    itemsize, limit = 2, 16
    buckets = weight_buckets(numels, itemsize, limit)
    assert [i for bucket in buckets for i in bucket] == list(range(len(numels)))
    for bucket, following in zip(buckets, buckets[1:] + [None]):
        size = sum(numels[i] for i in bucket) * itemsize
        assert size <= limit or len(bucket) == 1  # a parameter above the limit goes alone
        if following is not None:
            assert size + numels[following[0]] * itemsize > limit  # full: the next one did not fit
    assert weight_buckets(numels, itemsize, 10**9) == [list(range(len(numels)))]


def header_of(sources: dict, version: int, full: bool) -> list[int]:
    names = sync_names({name: trains for name, (_, trains) in sources.items()}, full)
    return weights_header(version, full, names, [sources[name][0] for name in names])


def test_a_weights_header_describes_what_is_sent_and_a_mismatch_is_a_clear_error():
    lora, plain = trained_parameters(ARGS, LoRASettings(rank=4, alpha=8.0)), trained_parameters(ARGS, None)
    full, adapters = header_of(lora, 3, True), header_of(lora, 3, False)
    check_weights_header(adapters, header_of(lora, 3, False))
    adapter_sizes = [shape.numel() for name, (shape, _) in lora.items() if ".lora_" in name]
    assert adapters[1:4] == [0, len(adapter_sizes), sum(adapter_sizes)]
    assert full[1:4] == [1, len(lora), sum(shape.numel() for shape, _ in lora.values())]
    with pytest.raises(RuntimeError, match="out of order: expected version 3, got version 2"):
        check_weights_header(header_of(lora, 2, False), adapters)
    # A LoRA trainer's adapters, to a rollout rank without LoRA that trains everything.
    with pytest.raises(
        RuntimeError,
        match=rf"sent the trainable parameters: {len(adapter_sizes)} tensors.*expects the trainable parameters: "
        rf"{len(plain)} tensors.*\[lora\] settings",
    ):
        check_weights_header(adapters, header_of(plain, 3, False))
    with pytest.raises(RuntimeError, match="sent every parameter.*expects the trainable parameters"):
        check_weights_header(full, adapters)
    # The same counts cut into other shapes differ in their fingerprint alone.
    swapped = weights_header(0, True, ["a", "b"], [(2, 3), (3, 2)])
    with pytest.raises(RuntimeError, match="2 tensors, 12 elements, names and shapes"):
        check_weights_header(swapped, weights_header(0, True, ["a", "b"], [(3, 2), (2, 3)]))


def batch(step: int, version: int) -> StepBatch:
    return StepBatch(step, version, [], {}, {"epoch": 0, "position": step}, 0, 0.0)


def test_a_resumed_run_keeps_the_saved_rollouts_its_staleness_allows_up_to_the_first_it_does_not():
    # Saved after step 4 of a run with max_staleness 3: steps 5, 6, 7 from the weights after steps 1, 2, 3.
    saved = {5: batch(5, 1), 6: batch(6, 2), 7: batch(7, 3)}
    assert usable_in_flight(saved, 4, 3) == saved
    assert usable_in_flight(saved, 4, 0) == {}  # every one lags
    # max_staleness 3 -> 2: step 5 lags 3 (dropped), so 6 and 7 are generated again after it.
    assert usable_in_flight(saved, 4, 2) == {}
    later = {5: batch(5, 4), 6: batch(6, 4), 7: batch(7, 4)}  # lags 0, 1, 2
    assert usable_in_flight(later, 4, 1) == {5: later[5], 6: later[6]}
    assert usable_in_flight({6: batch(6, 4)}, 4, 2) == {}  # step 5 missing: nothing after it is kept


def test_a_checkpoint_of_whole_batches_resumes_on_another_layout_each_rank_with_its_share():
    """A checkpoint holds every slot's groups (``prepare_checkpoint``, here on one data-parallel
    rank); a resumed trainer keeps those of its own slots, whatever layout saved them."""
    groups = [ScoredGroup(slot, [], [], []) for slot in range(6)]
    saving = RolloutClient(SimpleNamespace(), None, num_steps=9, max_staleness=2, slots=list(range(6)), batch_mesh=None)
    saving.in_flight = {7: dataclasses.replace(batch(7, 5), kept=groups), 6: batch(6, 4)}
    saving.prepare_checkpoint()
    for slots in ([0, 1, 2], [3, 4, 5], [1, 4]):  # dp 2, or a share of another cut
        resumed = RolloutClient(SimpleNamespace(), None, num_steps=9, max_staleness=2, slots=slots, batch_mesh=None)
        resumed.load_state_dict(saving.state_dict())
        assert sorted(resumed.in_flight) == [6, 7]
        assert [g.slot for g in resumed.in_flight[7].kept] == slots
        assert resumed.in_flight[7].stream_state == batch(7, 5).stream_state and resumed.in_flight[6].kept == []


def test_protocol_violations_are_runtime_errors_that_say_what_broke(monkeypatch):
    """Checked under ``python -O`` too: a batch that lags more than the run's K, one that comes
    out of order, a last message that is not ``FINISHED``."""
    topology = SimpleNamespace(leader=2)
    client = RolloutClient(topology, None, num_steps=5, max_staleness=1, slots=[], batch_mesh=None)
    client.in_flight, client._next_received = {3: batch(3, 0)}, 4
    with pytest.raises(RuntimeError, match=r"step 3 come from the weights of version 0, 2 steps behind, more than rl"):
        client.batch(3)
    client._next_received = 4
    monkeypatch.setattr(rollout_ranks, "receive_object", lambda src, topology, what: batch(5, 3))
    with pytest.raises(RuntimeError, match="rollout rank 2 sent the rollouts of step 5 where those of step 4 were due"):
        client.receive_until(4)
    monkeypatch.setattr(rollout_ranks, "receive_object", lambda src, topology, what: {"version": 0})
    with pytest.raises(RuntimeError, match=r"sent a dict where its last message \('finished'\) was due"):
        receive_finished(topology)
    monkeypatch.setattr(rollout_ranks, "receive_object", lambda src, topology, what: rollout_ranks.FINISHED)
    receive_finished(topology)


def test_rollout_rank_config_rules_name_the_key():
    cfg = parse(*GRPO, "--parallelism.rollout_ranks", "1", "--rl.max_staleness", "2")
    assert (cfg.parallelism.rollout_ranks, cfg.rl.max_staleness) == (1, 2)
    assert_error(["--parallelism.rollout_ranks", "1"], "parallelism.rollout_ranks: only used with job.recipe = 'grpo'")
    assert_error([*GRPO, "--rl.max_staleness", "1"], "rl.max_staleness=1", "parallelism.rollout_ranks >= 1")
    assert_error([*GRPO, "--parallelism.rollout_ranks", "-1"], "parallelism.rollout_ranks")
    assert_error([*GRPO, "--comm.silent_peer_timeout_seconds", "0"], "comm.silent_peer_timeout_seconds")
    assert_error(
        [*GRPO, "--parallelism.rollout_ranks", "1", "--comm.silent_peer_timeout_seconds", "300"],
        "comm.silent_peer_timeout_seconds=300: must be below comm.collective_timeout_seconds=300",
    )
    # Without rollout ranks nothing waits on a silent peer.
    assert parse(*GRPO, "--comm.silent_peer_timeout_seconds", "300").comm.silent_peer_timeout_seconds == 300


def test_rollout_ranks_leave_the_rest_of_the_launch_to_the_training_degrees():
    cfg = parse(*GRPO, "--parallelism.rollout_ranks", "1")
    dims = build_parallel_dims(cfg, 3)
    assert (dims.world_size, dims.dp_shard, dims.num_rollout_ranks) == (2, 2, 1)
    with pytest.raises(ValueError, match=r"parallelism.rollout_ranks=1 leaves no training rank in a launch of 1"):
        build_parallel_dims(cfg, 1)
    tp = parse(*GRPO, "--parallelism.rollout_ranks", "2", "--parallelism.tensor_parallel_degree", "2")
    with pytest.raises(
        ValueError, match=r"the number of training ranks 3 \(the world size less parallelism.rollout_ranks=2\)"
    ):
        build_parallel_dims(tp, 5)
