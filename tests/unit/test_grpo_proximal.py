"""Where the GRPO recipe takes the proximal policy from (``rl.proximal``), on whole recipe steps:
a separate forward over the rollouts runs exactly when pi_prox is not the policy being
trained (more than one optimizer step per rollout batch, stale rollouts, or ``recompute``), as
counted on the policy model's forwards, and a step with the update's own log-probs as pi_prox
trains and logs what a step with the separate forward does (same rollouts, same weights)."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from torchtitan_rl.config import ConfigManager
from torchtitan_rl.recipes.grpo import GRPORecipe
from torchtitan_rl.rl.proximal import proximal_source
from torchtitan_rl.rl.rollout_correction import RolloutCorrection

CONFIGS = Path(__file__).resolve().parents[2] / "train_configs"


def recipe(tmp_path, *overrides: str) -> GRPORecipe:
    args = [
        "--job.config_file",
        str(CONFIGS / "debug_grpo.toml"),
        "--job.dump_folder",
        str(tmp_path),
        "--metrics.enable_tensorboard",
        "false",
        "--rl.sft_warmup_steps",
        "0",
        "--rl.prompts_per_step",
        "4",
        "--rl.group_size",
        "4",
        *overrides,
    ]
    built = GRPORecipe(ConfigManager().parse_args(args))
    built.setup()
    return built


def step_counting_forwards(built: GRPORecipe) -> tuple[dict[str, float], dict[str, int]]:
    """One recipe step; the policy model's forwards, by the engine call they ran in."""
    engine, phase, counts = built.engine, ["other"], {}
    built.engine.model.register_forward_pre_hook(lambda *_: counts.__setitem__(phase[0], counts.get(phase[0], 0) + 1))
    for name in ("forward", "forward_backward"):
        method = getattr(engine, name)

        def counted(*args, method=method, name=name, **kwargs):
            phase[0] = name
            try:
                return method(*args, **kwargs)
            finally:
                phase[0] = "other"

        setattr(engine, name, counted)
    values = built.train_step(1)
    return values, counts


@pytest.mark.parametrize(
    "overrides,separate",
    [
        ((), False),  # TIS, one update: pi_prox is the update's own forward
        (("--rl.proximal", "recompute"), True),
        (("--rl.ppo_epochs", "2"), True),
        (("--rl.num_minibatches", "2"), True),
        (("--rl.rollout_correction", "none"), False),  # the ratio is to the sampler: no pi_prox
    ],
    ids=["auto", "recompute", "two-epochs", "two-minibatches", "no-correction"],
)
def test_the_separate_proximal_pass_runs_exactly_when_pi_prox_is_another_policy(tmp_path, overrides, separate):
    built = recipe(tmp_path, *overrides)
    try:
        _, counts = step_counting_forwards(built)
    finally:
        built.close()
    assert counts.get("forward_backward", 0) > 0
    assert counts.get("other", 0) == 0  # no forward outside the engine's two entry points
    assert (counts.get("forward", 0) > 0) == separate, counts


def test_stale_rollouts_need_the_separate_pass():
    tis = RolloutCorrection("tis")
    one = SimpleNamespace(ppo_epochs=1, num_minibatches=1, max_staleness=0, proximal="auto")
    assert proximal_source(one, tis) == "current"
    assert proximal_source(SimpleNamespace(**{**vars(one), "max_staleness": 1}), tis) == "recomputed"
    assert proximal_source(SimpleNamespace(**{**vars(one), "max_staleness": 1}), RolloutCorrection()) == "recomputed"
    assert proximal_source(one, RolloutCorrection()) == "sampler"


def test_a_step_with_the_updates_own_logprobs_equals_one_with_the_separate_pass(tmp_path):
    """Same rollouts (same seed and weights), then the same update and the same metrics, from
    the bf16 sampler's TIS-corrected step of the embedded recipe."""
    steps = {}
    for proximal in ("auto", "recompute"):
        built = recipe(tmp_path / proximal, "--rl.proximal", proximal)
        try:
            values = built.train_step(1)
            params = [p.detach().clone() for p in built.engine.model.parameters()]
        finally:
            built.close()
        steps[proximal] = (values, params)
    (fused, fused_params), (separate, separate_params) = steps["auto"], steps["recompute"]
    assert "time/old_logprobs_s" in separate and "time/old_logprobs_s" not in fused
    tags = {tag for tag in separate if tag.startswith(("rl/", "loss_metrics/", "grad_norm", "tokens/"))}
    assert tags == {tag for tag in fused if tag.startswith(("rl/", "loss_metrics/", "grad_norm", "tokens/"))}
    assert {"rl/rollout_corr/weight_mean", "rl/sampler_logprob_diff_mean", "rl/reward_mean"} <= tags
    assert separate["rl/rollout_corr/kl_k3"] > 0  # premise: the bf16 sampler really differs
    for tag in sorted(tags):
        assert fused[tag] == pytest.approx(separate[tag], rel=1e-5, abs=1e-6), tag
    for a, b in zip(fused_params, separate_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
