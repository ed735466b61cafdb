"""PPO with a learned critic in the GRPO recipe (``rl.advantage = "gae"``), on whole recipe steps
of one process: the critic starts from the policy's body with a fresh head; a step's advantages
and value targets are a brute-force GAE of the critic's values and the rollouts' rewards (KL in
the reward on), and its logged value loss that of those targets; the critic's warm-up moves the
critic alone; a resumed run logs and exports exactly what the uninterrupted one does; the
exported critic is a ``Qwen3ForTokenClassification`` whose outputs are the critic's values.
Multi-rank layouts of whole steps are in ``tests/integration/test_grpo.py``."""

import shutil
from pathlib import Path

import pytest
import torch

from torchtitan_rl.config import ConfigManager
from torchtitan_rl.data.sample import Sample
from torchtitan_rl.recipes.critic import CRITIC_FOLDER
from torchtitan_rl.recipes.grpo import GRPORecipe
from torchtitan_rl.tensorboard_io import read_scalars

CONFIG = Path(__file__).resolve().parents[2] / "train_configs" / "debug_ppo.toml"
GAMMA, LAM, KL_IN_REWARD = 0.9, 0.8, 0.1


def recipe(folder, *overrides: str) -> GRPORecipe:
    args = [
        "--job.config_file",
        str(CONFIG),
        "--job.dump_folder",
        str(folder),
        "--rl.sft_warmup_steps",
        "0",
        "--rl.prompts_per_step",
        "4",
        "--rl.group_size",
        "2",
        "--rl.eval_interval",
        "0",
        "--critic.warmup_steps",
        "0",
        *overrides,
    ]
    built = GRPORecipe(ConfigManager().parse_args(args))
    built.setup()
    return built


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_the_critic_starts_from_the_policys_body_with_a_fresh_head(tmp_path):
    built = recipe(tmp_path)
    try:
        policy, critic = params(built.engine.model), params(built.critic.engine.model)
    finally:
        built.close()
    body = set(policy) & set(critic)
    assert body == set(critic) - {"score.weight", "score.bias"}
    assert "output.weight" in policy and "output.weight" not in critic
    for name in body:
        torch.testing.assert_close(critic[name], policy[name], rtol=0, atol=0)
    assert critic["score.bias"].item() == 0.0 and critic["score.weight"].abs().sum() > 0


def brute_force_targets(samples, values) -> tuple[list[list[float]], list[list[float]]]:
    """Per sample and token: advantages (whitened over every loss token) and returns, by plain
    loops over each sample's loss tokens."""
    advantages, returns = [], []
    for sample, value in zip(samples, values):
        loss_tokens = [t for t in range(len(sample)) if sample.loss_mask[t]]
        kl = (sample.sampler_logprobs.double() - sample.ref_logprobs.double()).tolist()
        reward = {t: -KL_IN_REWARD * kl[t] for t in loss_tokens}
        reward[loss_tokens[-1]] += sample.rollout_info["reward"]
        a, r = [0.0] * len(sample), [0.0] * len(sample)
        for k, t in enumerate(loss_tokens):
            for j, u in enumerate(loss_tokens[k:]):
                next_value = float(value[loss_tokens[k + j + 1]]) if k + j + 1 < len(loss_tokens) else 0.0
                delta = reward[u] + GAMMA * next_value - float(value[u])
                a[t] += (GAMMA * LAM) ** j * delta
            r[t] = a[t] + float(value[t])
        advantages.append(a)
        returns.append(r)
    every = [a[t] for a, s in zip(advantages, samples) for t in range(len(s)) if s.loss_mask[t]]
    mean = sum(every) / len(every)
    std = (sum((x - mean) ** 2 for x in every) / (len(every) - 1) + 1e-8) ** 0.5
    whitened = [
        [(x - mean) / std if s.loss_mask[t] else 0.0 for t, x in enumerate(a)] for a, s in zip(advantages, samples)
    ]
    return whitened, returns


def test_a_steps_targets_and_value_loss_are_brute_force_gae_of_the_critics_values(tmp_path):
    built = recipe(
        tmp_path,
        "--rl.gamma",
        str(GAMMA),
        "--rl.lam",
        str(LAM),
        "--rl.use_reference",
        "true",
        "--rl.kl_in_reward_coef",
        str(KL_IN_REWARD),
        "--rl.reward_fn",
        "rl_plugins:byte_sum_parity",
    )
    seen = {}
    critic_values, set_targets = built.critic.engine.values, built.critic.set_targets

    def values(samples):
        seen["values"] = critic_values(samples)
        return seen["values"]

    def targets(samples):
        seen["samples"] = samples
        return set_targets(samples)

    built.critic.engine.values, built.critic.set_targets = values, targets
    try:
        logged = built.train_step(1)
    finally:
        built.close()
    samples, values = seen["samples"], seen["values"]
    assert len(samples) == 8 and len({s.rollout_info["reward"] for s in samples}) > 1  # premise: rewards differ
    # Premise: the KL term is not 0 (the bf16 sampler differs from the float32 reference).
    assert max(float((s.sampler_logprobs - s.ref_logprobs)[s.loss_mask].abs().max()) for s in samples) > 1e-4
    advantages, returns = brute_force_targets(samples, values)
    for sample, a, r, v in zip(samples, advantages, returns, values):
        torch.testing.assert_close(
            sample.advantages.double(), torch.tensor(a, dtype=torch.float64), rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(sample.returns.double(), torch.tensor(r, dtype=torch.float64), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(sample.old_values, v, rtol=0, atol=0)
    # One mini-batch, one epoch, token_mean: the update's values are the old ones (nothing clipped).
    mask = torch.cat([s.loss_mask for s in samples])
    v = torch.cat(values).double()[mask]
    r = torch.tensor([x for rs in returns for x in rs], dtype=torch.float64)[mask]
    assert logged["critic/vf_loss"] == pytest.approx(float((0.5 * (v - r) ** 2).mean()), rel=1e-5)
    assert logged["critic/vf_clipfrac"] == 0.0
    assert logged["critic/values_mean"] == pytest.approx(float(v.mean()), rel=1e-5, abs=1e-7)
    assert logged["critic/returns_mean"] == pytest.approx(float(r.mean()), rel=1e-5, abs=1e-7)
    explained = 1 - float((r - v).var(correction=0)) / float(r.var(correction=0))
    assert logged["critic/vf_explained_var"] == pytest.approx(explained, rel=1e-5, abs=1e-6)
    assert logged["critic/grad_norm"] > 0


def rollout_sample(tokens: list[int], num_prompt: int, trained: bool, reward: float) -> Sample:
    ids = torch.tensor(tokens)
    mask = torch.tensor([False] * num_prompt + [trained] * (len(tokens) - 1 - num_prompt))
    sample = Sample(input_ids=ids[:-1], labels=ids[1:], loss_mask=mask)
    sample.rollout_info = {"reward": reward, "advantage": None}
    return sample


def test_a_rollout_without_loss_tokens_gets_no_targets_and_stays_out_of_the_whitening(tmp_path):
    """rl.mask_truncated leaves a cut completion without loss tokens, so without a token to carry
    its reward: its targets are 0, and the others' are what they are without it."""
    built = recipe(tmp_path)
    try:
        masked = rollout_sample(list(range(40, 52)), 4, trained=False, reward=1.0)
        others = [rollout_sample(list(range(60, 70)), 3, True, 1.0), rollout_sample(list(range(80, 95)), 5, True, 0.0)]
        built.critic.set_targets([others[0], masked, others[1]])
        alone = [rollout_sample(list(range(60, 70)), 3, True, 1.0), rollout_sample(list(range(80, 95)), 5, True, 0.0)]
        built.critic.set_targets(alone)
    finally:
        built.close()
    assert not masked.advantages.any() and not masked.returns.any() and masked.rollout_info["advantage"] == 0.0
    for with_masked, without in zip(others, alone):
        # Packed with other neighbours: the values agree up to float rounding.
        torch.testing.assert_close(with_masked.advantages, without.advantages, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(with_masked.returns, without.returns, rtol=1e-5, atol=1e-6)
        assert with_masked.advantages[with_masked.loss_mask].abs().min() > 0


def test_the_critics_warmup_steps_move_the_critic_alone(tmp_path):
    built = recipe(tmp_path, "--critic.warmup_steps", "1", "--training.steps", "2")
    try:
        policy, critic = params(built.engine.model), params(built.critic.engine.model)
        first = built.train_step(1)
        policy_1, critic_1 = params(built.engine.model), params(built.critic.engine.model)
        built.train_step(2)
        policy_2, critic_2 = params(built.engine.model), params(built.critic.engine.model)
    finally:
        built.close()
    assert first["grad_norm"] == 0.0 and first["critic/grad_norm"] > 0
    assert all(torch.equal(policy[name], policy_1[name]) for name in policy)
    assert not all(torch.equal(critic[name], critic_1[name]) for name in critic)
    assert not all(torch.equal(policy_1[name], policy_2[name]) for name in policy)
    assert not all(torch.equal(critic_1[name], critic_2[name]) for name in critic)


SAVE = ("--checkpoint.enable", "true", "--checkpoint.interval", "2", "--training.steps", "3")
EXPORT = ("--checkpoint.last_save_model_only", "true", "--checkpoint.last_save_in_hf", "true")


LORA = ("--lora.enable", "true", "--critic.lora", "true")


def test_a_lora_critic_trains_its_adapters_and_value_head_alone(tmp_path):
    built = recipe(tmp_path, *LORA)
    try:
        before = params(built.critic.engine.model)
        built.train_step(1)
        after = params(built.critic.engine.model)
    finally:
        built.close()
    moved = {name for name in before if not torch.equal(before[name], after[name])}
    trained = {name for name in before if "lora_" in name} | {"score.weight", "score.bias"}
    assert moved and moved <= trained and {"score.weight", "score.bias"} <= moved


@pytest.mark.parametrize("lora", [(), LORA], ids=["full", "lora"])
def test_resume_is_exact_and_the_critic_exports_as_token_classification(tmp_path, lora):
    """A LoRA critic is exported merged: a plain token classifier giving its values."""
    transformers = pytest.importorskip("transformers")
    for name in ("whole", "resumed"):
        folder = tmp_path / name
        if name == "resumed":  # the uninterrupted run's state after step 2, then steps 3.. again
            shutil.copytree(tmp_path / "whole" / "checkpoint" / "step-2", folder / "checkpoint" / "step-2")
        built = recipe(folder, *SAVE, *EXPORT, "--critic.warmup_steps", "1", *lora)
        try:
            built.train()
            if name == "resumed":
                tokens = torch.tensor([list(range(40, 60)), list(range(70, 90))])
                ours = built.critic.engine.values([whole_sample(row) for row in tokens])
        finally:
            built.close()
    whole, resumed = (read_scalars(tmp_path / n / "tb") for n in ("whole", "resumed"))
    for tag in ("critic/vf_loss", "critic/values_mean", "critic/vf_explained_var", "critic/grad_norm", "grad_norm"):
        assert resumed[tag][3] == pytest.approx(whole[tag][3], rel=1e-6, abs=1e-9), tag
    for side in ("whole", "resumed"):
        assert (tmp_path / side / "checkpoint" / "step-3" / CRITIC_FOLDER / "config.json").is_file()
    exported = tmp_path / "resumed" / "checkpoint" / "step-3" / CRITIC_FOLDER
    model = transformers.AutoModelForTokenClassification.from_pretrained(exported, torch_dtype=torch.float32)
    assert type(model).__name__ == "Qwen3ForTokenClassification" and model.config.num_labels == 1
    with torch.no_grad():
        theirs = model(input_ids=tokens).logits[..., 0]
    for row, values in zip(theirs, ours):
        torch.testing.assert_close(values, row, rtol=1e-4, atol=1e-5)
    uninterrupted = transformers.AutoModelForTokenClassification.from_pretrained(
        tmp_path / "whole" / "checkpoint" / "step-3" / CRITIC_FOLDER, torch_dtype=torch.float32
    )
    for (name, a), b in zip(model.state_dict().items(), uninterrupted.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def whole_sample(tokens: torch.Tensor) -> Sample:
    return Sample(input_ids=tokens, labels=tokens, loss_mask=torch.ones(len(tokens), dtype=torch.bool))
