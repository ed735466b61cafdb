"""GRPO of a MoE policy with routing replay, end to end through ``train.py`` (gloo ranks on CPU).

- With a float32 sampler the sampler routes every token as the trainer does: the logged
  ``moe/routing_agreement`` is 1 in every layer, and replaying the recorded experts changes no
  logged number (loss, entropy, grad norm, rollout-correction KL) against the colocated run that
  only records. The replaying run's records come from a rollout rank (prompt routing recorded
  too) with the rollouts: an agreement of 1 there also shows that no record was lost or shifted
  by a position.
- With a bf16 sampler the first step's rollouts are the same with and without replay (same
  weights, same random numbers), some of their routing disagrees with the trainer's, and
  replaying it brings the trainer's proximal log-probs closer to the sampler's: a lower
  ``rl/rollout_corr/kl_k3``.
"""

import pytest

from test_grpo import launch
from torchtitan_rl.tensorboard_io import read_scalars

STEPS = 2
# A random MoE policy (no warm-up): every reward is 0, so the entropy term carries the gradient.
# No KL term: the reference replays the records too, and after the first update the policy's
# routing is no longer the reference's own, so replay would change the KL.
OPTIONS = (
    *("--model.flavor", "debugmodel_moe", "--rl.sft_warmup_steps", "0", "--rl.eval_interval", "0"),
    *("--loss.entropy_coef", "0.01", "--rl.prompts_per_step", "4", "--rl.group_size", "4"),
    # One update per step: the trainer's weights are the sampler's in it (a second mini-batch
    # would meet rollouts of weights one update older, whose routing it need not share).
    *("--rl.num_minibatches", "1", "--generation.max_prompts_per_batch", "2"),
    *("--rl.rollout_correction", "tis"),
)
FP32 = ("--generation.dtype", "float32")
BF16 = ("--generation.dtype", "bfloat16")
# "record": the trainer keeps its own routing (the run without replay) and logs the agreement.
RECORD = ("--moe.router_replay", "record")
REPLAY = ("--moe.router_replay", "rollout")
RUNS = {
    "fp32_record": (1, (*FP32, *RECORD, "--training.steps", str(STEPS))),
    "fp32_replay_rollout_rank": (
        2,
        (*FP32, *REPLAY, "--moe.router_replay_prompt", "true", "--parallelism.rollout_ranks", "1")
        + ("--training.steps", str(STEPS)),
    ),
    "bf16_record": (1, (*BF16, *RECORD, "--training.steps", "1")),
    "bf16_replay": (1, (*BF16, *REPLAY, "--training.steps", "1")),
}
SAME_TAGS = (
    "loss_metrics/global_avg_loss",
    "grad_norm",
    "rl/entropy",
    "rl/rollout_corr/kl_k3",
    "rl/response_length_mean",
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("moe_grpo")
    scalars = {}
    for name, (num_ranks, options) in RUNS.items():
        launch(out / name, num_ranks, *OPTIONS, *options)
        scalars[name] = read_scalars(str(out / name / "tb"))
    return scalars


def test_a_float32_sampler_agrees_everywhere_and_replay_changes_nothing(runs):
    record, replay = runs["fp32_record"], runs["fp32_replay_rollout_rank"]
    layers = [tag for tag in replay if tag.startswith("moe/routing_agreement/layer_")]
    assert len(layers) == 3  # debugmodel_moe: layers 1-3 are MoE
    for run in (record, replay):
        for tag in ("moe/routing_agreement", *layers):
            assert run[tag] == {step: 1.0 for step in range(1, STEPS + 1)}, tag
    # The rollout rank's replayed run logs the colocated run's numbers (staleness 0).
    for tag in SAME_TAGS:
        for step in range(1, STEPS + 1):
            assert replay[tag][step] == pytest.approx(record[tag][step], rel=1e-5, abs=1e-7), (tag, step)


def test_replaying_a_bf16_samplers_routing_lowers_the_mismatch(runs):
    record, replay = runs["bf16_record"], runs["bf16_replay"]
    # The same rollouts: generated before any update, with the same random numbers.
    assert record["rl/response_length_mean"][1] == replay["rl/response_length_mean"][1]
    assert record["rl/sampler_logprob_diff_mean"][1] != replay["rl/sampler_logprob_diff_mean"][1]
    # The first MoE layer's input does not depend on any routing: the same agreement either
    # way. A later layer's own choice is made on the replayed layers' output under replay.
    assert record["moe/routing_agreement/layer_1"][1] == replay["moe/routing_agreement/layer_1"][1]
    assert 0.5 < record["moe/routing_agreement"][1] < 1.0
    assert replay["rl/rollout_corr/kl_k3"][1] < record["rl/rollout_corr/kl_k3"][1]
