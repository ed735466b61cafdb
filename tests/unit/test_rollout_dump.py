"""The rollout dump's records against what was generated and trained: a multi-turn episode's record
gives back its token stream, roles and trained turns; a single-turn record's numbers are the
brute-force means of its sample's tensors; the log writes each step's file whole, K table rows to
TensorBoard, removes the files of steps a resumed run makes again, and reports a failed write."""

import dataclasses
import logging
import math
import os
import types

import numpy as np
import pytest
import torch

from test_env_rollouts import MAX_LEN, TOKENIZER, Counter, run
from torchtitan_rl import rollout_files
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.rl.env_rollouts import decode_completion
from torchtitan_rl.rl.generator import Rollout
from torchtitan_rl.rl.rollout_dump import (
    ROLLOUT_TABLE_TAG,
    RolloutLog,
    batch_records,
    decode_rollout,
    read_routing,
    sample_batch,
    table_rows,
)
from torchtitan_rl.rl.rollouts import ScoredGroup, score_groups, to_samples
from torchtitan_rl.rl.tasks import Reward
from torchtitan_rl.tensorboard_io import read_texts


def test_an_episodes_record_gives_back_its_token_stream_roles_and_trained_turns():
    rollouts = run(Counter)
    assert max(r.num_turns for r in rollouts) == 3  # premise: observations inside episodes
    groups = score_groups(rollouts, [Reward(r.reward, r.correct, {}) for r in rollouts], 4, "grpo", 1e-6)
    samples = to_samples(groups, MAX_LEN, mask_truncated=True)
    for group in groups:
        for rollout, advantage in zip(group.rollouts, group.advantages):
            sample = samples.pop(0)
            record = decode_rollout(TOKENIZER, raw_record(sample, step=7))
            turns = record["turns"]
            assert [t for turn in turns for t in turn["token_ids"]] == rollout.completion_tokens
            assert record["prompt"] == TOKENIZER.decode(rollout.prompt_tokens)
            assert record["num_prompt_tokens"] == len(rollout.prompt_tokens)
            # Turns alternate: the policy's (its sampled tokens), then the tool's answer.
            start = 0
            for i, turn in enumerate(turns):
                mask = rollout.loss_mask[start : start + len(turn["token_ids"])]
                assert turn["role"] == ("assistant" if i % 2 == 0 else "tool")
                assert set(mask) == {i % 2 == 0}
                trained = i % 2 == 0 and rollout.stop_reason != "length"  # truncated episodes are masked
                assert turn["trained"] == trained
                assert turn["text"] == decode_completion(TOKENIZER, turn["token_ids"])
                start += len(mask)
            assert sum(1 for t in turns if t["role"] == "assistant") == rollout.num_turns
            assert record["num_loss_tokens"] == sum(len(t["token_ids"]) for t in turns if t["trained"])
            assert (record["end_reason"], record["reward"], record["advantage"]) == (
                rollout.end_reason,
                rollout.reward,
                advantage,
            )


def raw_record(sample, step: int) -> dict:
    """The record of one sample before decoding, as rank 0 makes it from the rank's batch."""
    [record] = batch_records([sample_batch([sample], step)])
    return record


def single_turn_group() -> ScoredGroup:
    rollouts = [
        Rollout(3, s, [10, 11, 12], completion, logprobs, stop, version=1)
        for s, (completion, logprobs, stop) in enumerate(
            [([65, 66, 0], [-0.5, -1.5, -0.25], "stop"), ([67, 68], [-2.0, -3.0], "length")]
        )
    ]
    rewards = [Reward(1.0, True, {"correct": 1.0}), Reward(0.25, False, {"correct": 0.0, "partial": 0.5})]
    return ScoredGroup(5, rollouts, rewards, [0.75, -0.75])


def test_a_single_turn_records_numbers_are_its_samples_means():
    group = single_turn_group()
    samples = to_samples([group], 16)
    torch.manual_seed(0)
    for sample in samples:
        sample.prox_logprobs = torch.where(sample.loss_mask, -torch.rand(len(sample)), 0.0)
        sample.rollout_weights = torch.where(sample.loss_mask, torch.rand(len(sample)) * 2, 0.0)
    for sample, rollout, reward, advantage in zip(samples, group.rollouts, group.rewards, group.advantages):
        record = decode_rollout(TOKENIZER, raw_record(sample, step=3))
        mask = sample.loss_mask.tolist()
        loss_prox = [p for p, m in zip(sample.prox_logprobs.tolist(), mask) if m]
        loss_weights = [w for w, m in zip(sample.rollout_weights.tolist(), mask) if m]
        assert record["behaviour_logprob_mean"] == pytest.approx(sum(rollout.logprobs) / len(rollout.logprobs))
        assert record["proximal_logprob_mean"] == pytest.approx(sum(loss_prox) / len(loss_prox))
        assert record["correction_weight_mean"] == pytest.approx(sum(loss_weights) / len(loss_weights))
        assert record["completion"] == decode_completion(TOKENIZER, rollout.completion_tokens)
        assert (record["group"], record["sample"], record["version"], record["staleness"]) == (
            5,
            rollout.sample_index,
            1,
            3 - 1 - 1,
        )
        assert (record["reward"], record["correct"], record["reward_components"]) == (
            reward.total,
            reward.correct,
            reward.components,
        )
        assert record["advantage"] == advantage and record["stop_reason"] == rollout.stop_reason
        assert record["num_completion_tokens"] == len(rollout.completion_tokens) == record["num_loss_tokens"]
        assert record["turns"] is None and record["images"] == []


def test_a_record_without_loss_tokens_has_no_loss_token_means():
    group = single_turn_group()
    sample = to_samples([group], 16, mask_truncated=True)[1]  # the truncated one: no loss token
    sample.prox_logprobs = torch.zeros(len(sample))
    record = raw_record(sample, step=2)
    assert record["num_loss_tokens"] == 0 and record["proximal_logprob_mean"] is None
    assert not math.isnan(record["behaviour_logprob_mean"])  # its sampled tokens still have log-probs


@pytest.mark.parametrize("num_records,num_rows", [(10, 4), (3, 4), (8, 8), (5, 0)])
def test_table_rows_take_one_record_from_each_equal_part(num_records, num_rows):
    records = list(range(num_records))
    rows = table_rows(records, num_rows)
    if num_rows >= num_records:
        assert rows == records
        return
    assert len(rows) == num_rows and rows == sorted(set(rows))
    for i, record in enumerate(rows):  # row i lies in the i-th part of the records
        assert num_records * i / num_rows <= record < num_records * (i + 1) / num_rows


def rollout_log(tmp_path, *, dump=True, log_samples=2, writer=None, dump_routing=True) -> RolloutLog:
    config = types.SimpleNamespace(
        rl=types.SimpleNamespace(
            dump_rollouts=dump, log_samples=log_samples, print_samples=True, dump_routing=dump_routing
        ),
        metrics=types.SimpleNamespace(log_freq=1),
        job=types.SimpleNamespace(dump_folder=str(tmp_path)),
    )
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, world_size=1)
    dims.build_meshes("cpu")
    return RolloutLog(config, TOKENIZER, dims, rank=0, tb_writer=writer)


def test_the_log_writes_every_step_whole_and_k_rows_to_tensorboard(tmp_path, caplog):
    from torch.utils.tensorboard import SummaryWriter

    caplog.set_level(logging.INFO)
    writer = SummaryWriter(str(tmp_path / "tb"))
    log = rollout_log(tmp_path, writer=writer)
    group = single_turn_group()
    bigger = dataclasses.replace(group, slot=1)
    for step in (1, 2):
        samples = to_samples([bigger, group], 16)
        log.log_step(step, samples[::-1])  # any order on the rank: sorted by (group, sample)
    log.close()
    writer.close()
    assert rollout_files.dumped_steps(str(tmp_path / "rollouts")) == [1, 2]
    records = rollout_files.read_step(str(tmp_path / "rollouts"), 2)
    assert [(r["group"], r["sample"]) for r in records] == [(1, 0), (1, 1), (5, 0), (5, 1)]
    texts = read_texts(str(tmp_path / "tb"))[f"{ROLLOUT_TABLE_TAG}/text_summary"]
    assert sorted(texts) == [1, 2]
    table = texts[2].splitlines()
    # A header, its rule, then the rows of records 0 and 2 (one from each half).
    assert len(table) == 2 + 2 and table[2].startswith("| 1 | 0 |") and table[3].startswith("| 5 | 0 |")
    assert "rollouts/samples at step 2" in caplog.text  # rl.print_samples, every step at log_freq 1


@pytest.mark.parametrize("num_experts, dtype", [(8, np.uint8), (300, np.int16)])
def test_the_dump_keeps_each_samples_recorded_experts(tmp_path, num_experts, dtype):
    """Routing replay: a record's rows of the step's routing file are its sample's
    ``routed_experts`` from the first recorded position on (-1 before it), one byte per id where
    they fit; a sample without routing has none; a resumed run drops later steps' files."""
    group = single_turn_group()
    rng = np.random.default_rng(num_experts)
    # The first rollout's completion positions (prompt's last on), the second's every input.
    for rollout, num_recorded in zip(group.rollouts, (3, 4)):
        rollout.routing = rng.integers(0, num_experts, (num_recorded, 3, 2)).astype(np.int16)
    unrecorded = dataclasses.replace(group, slot=1, rollouts=[dataclasses.replace(r) for r in group.rollouts])
    for rollout in unrecorded.rollouts:
        rollout.routing = None
    log = rollout_log(tmp_path)
    for step in (1, 2):
        samples = to_samples([group, unrecorded], 16)
        log.log_step(step, samples[::-1])
    log.close()
    folder = str(tmp_path / "rollouts")
    records = rollout_files.read_step(folder, 2)
    assert [(r["group"], r["sample"]) for r in records] == [(1, 0), (1, 1), (5, 0), (5, 1)]
    # Records in (group, sample) order: the unrecorded group (slot 1) first.
    for record, sample, rollout in zip(records, samples[2:] + samples[:2], unrecorded.rollouts + group.rollouts):
        got = read_routing(folder, 2, record)
        if rollout.routing is None:
            assert record["routed_experts"] is None and got is None and sample.routed_experts is None
            continue
        first = record["routed_experts"]["first"]
        assert first == len(sample) - len(rollout.routing) and record["routed_experts"]["num"] == len(rollout.routing)
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, rollout.routing)
        assert torch.equal(torch.from_numpy(got.astype(np.int16)), sample.routed_experts[first:])
        assert bool((sample.routed_experts[:first] == -1).all())
    assert np.load(tmp_path / "rollouts" / "step-2.routing.npy").shape == (7, 3, 2)  # the recorded rows only
    rollout_log(tmp_path).start(last_step=1)
    assert sorted(os.listdir(folder)) == ["step-1.jsonl.gz", "step-1.routing.npy"]
    # rl.dump_routing = false: the same records, no routing in them or beside them.
    log = rollout_log(tmp_path / "without", dump_routing=False)
    log.log_step(1, to_samples([group, unrecorded], 16))
    log.close()
    assert os.listdir(tmp_path / "without" / "rollouts") == ["step-1.jsonl.gz"]
    without = rollout_files.read_step(str(tmp_path / "without" / "rollouts"), 1)
    assert [r["routed_experts"] for r in without] == [None] * 4


def test_starting_removes_the_files_of_later_steps_and_partial_ones(tmp_path):
    for kind in rollout_files.KINDS:
        for step in (0, 1, 2, 3):
            rollout_files.write_step(str(tmp_path / kind), step, [{"step": step}])
    (tmp_path / "rollouts" / "step-4.jsonl.gz.partial").write_bytes(b"half")
    rollout_log(tmp_path).start(last_step=2)
    assert rollout_files.dumped_steps(str(tmp_path / "rollouts")) == [0, 1, 2]
    assert rollout_files.dumped_steps(str(tmp_path / "evals")) == [0, 1, 2]
    assert not (tmp_path / "rollouts" / "step-4.jsonl.gz.partial").exists()
    # A fresh run: every earlier file goes, its step-0 evaluation is made again.
    rollout_log(tmp_path).start(last_step=0)
    assert rollout_files.dumped_steps(str(tmp_path / "rollouts")) == []
    assert rollout_files.dumped_steps(str(tmp_path / "evals")) == []


def test_a_failed_write_stops_the_run_naming_the_folder(tmp_path):
    (tmp_path / "rollouts").write_text("a file where the folder goes")
    log = rollout_log(tmp_path)
    log.log_step(1, to_samples([single_turn_group()], 16))
    with pytest.raises(RuntimeError, match="rl.dump_rollouts: writing under .*rollouts"):
        log.close()
    assert os.path.isfile(tmp_path / "rollouts")


def test_nothing_is_gathered_or_written_when_both_are_off(tmp_path):
    log = rollout_log(tmp_path, dump=False, log_samples=0)
    log.log_step(1, to_samples([single_turn_group()], 16))
    log.close()
    assert not (tmp_path / "rollouts").exists()
