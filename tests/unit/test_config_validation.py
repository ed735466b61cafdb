"""The project's rules on a JobConfig, through the parser train.py uses: the config's own
(torchtitan_rl/config/validation.py) and those its parts state (recipes/config_checks.py)."""

import json
import os

import pytest

from test_config import assert_error, parse, write
from torchtitan_rl.hf_checkpoint import read_hf_model_args
from torchtitan_rl.models.config_checks import check_model_settings
from torchtitan_rl.models.qwen3.args import qwen3_flavors
from torchtitan_rl.models.vlm.args import vlm_flavors

# --- cross-key checks ----------------------------------------------------------------------


def test_max_tokens_per_microbatch_vs_seq_len():
    assert_error(
        ["--training.seq_len", "128", "--training.max_tokens_per_microbatch", "127"],
        "training.max_tokens_per_microbatch",
        "training.seq_len",
    )
    ok = parse("--training.seq_len", "128", "--training.max_tokens_per_microbatch", "128")
    assert ok.training.max_tokens_per_microbatch == 128
    assert parse("--training.seq_len", "4096").training.max_tokens_per_microbatch == 0


def test_horizon_only_with_the_mode_that_uses_it():
    assert_error(["--loss.horizon", "64"], "loss.horizon", "seq_mean_token_sum_norm", "'token_mean'")
    cfg = parse("--loss.reduction", "seq_mean_token_sum_norm", "--loss.horizon", "1")
    assert cfg.loss.horizon == 1  # the smallest valid horizon
    assert_error(["--loss.reduction", "seq_mean_token_sum_norm", "--loss.horizon", "0"], "loss.horizon", "> 0")


def test_legacy_mode_allowed_with_context_parallel():
    # Its micro-batch is the one before the CP split, so the mode is well defined under CP.
    cfg = parse("--loss.reduction", "token_mean_legacy", "--parallelism.context_parallel_degree", "2")
    assert (cfg.loss.reduction, cfg.parallelism.context_parallel_degree) == ("token_mean_legacy", 2)


@pytest.mark.parametrize("flavor", ["debugmodel", "0.6B", "1.7B", "4B", "8B", "14B", "32B"])
def test_known_flavors(flavor):
    assert parse("--model.flavor", flavor).model.flavor == flavor


def test_hf_flavor_needs_a_directory_with_config_json():
    assert parse("--model.flavor", "hf", "--model.hf_assets_path", "assets/x").model.flavor == "hf"
    assert (
        parse(
            "--model.flavor", "hf", "--checkpoint.initial_load_path", "hf/x", "--checkpoint.initial_load_in_hf", "true"
        ).model.flavor
        == "hf"
    )
    assert_error(["--model.flavor", "hf"], "model.flavor: 'hf' takes the architecture from the config.json")


def test_unknown_flavor():
    assert_error(["--model.flavor", "70B"], "model.flavor", "'70B'", "'debugmodel'", "'8B'")


def test_vlm_flavors_and_settings():
    cfg = parse(
        "--model.name",
        "vlm",
        "--model.flavor",
        "0.6B",
        "--training.max_patches_per_microbatch",
        "1024",
        "--model.freeze_vision",
        "true",
    )
    assert (cfg.model.name, cfg.model.flavor, cfg.model.freeze_vision) == ("vlm", "0.6B", True)
    assert_error(
        ["--model.name", "vlm", "--model.flavor", "8B"], "model.flavor", "'8B'", "'vlm'", "'debugmodel'", "'0.6B'"
    )


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--model.freeze_vision", "true"], ["model.freeze_vision", "only used by a vision-language model"]),
        (["--training.max_image_tokens", "64"], ["training.max_image_tokens", "model.name = 'vlm'"]),
        (["--model.image_token", "<img>"], ["model.image_token", "only used by a vision-language model"]),
        (
            ["--model.name", "vlm", "--training.max_patches_per_microbatch", "100"],
            ["training.max_patches_per_microbatch", "must be 0 or >= 1024", "max_image_tokens=256"],
        ),
        (["--model.name", "vlm", "--model.image_break_token", "[IMG]"], ["three different non-empty strings"]),
    ],
)
def test_vision_settings_fail_closed(argv, fragments):
    assert_error(argv, *fragments)


def test_moe_settings():
    cfg = parse(
        "--model.flavor",
        "debugmodel_moe",
        "--moe.aux_loss_coef",
        "0.01",
        "--moe.aux_loss_scope",
        "sequence",
        "--moe.z_loss_coef",
        "1e-3",
        "--moe.experts_impl",
        "loop",
    )
    assert (cfg.moe.aux_loss_coef, cfg.moe.aux_loss_scope, cfg.moe.experts_impl) == (0.01, "sequence", "loop")
    for flavor in ("30B-A3B", "235B-A22B"):
        assert parse("--model.flavor", flavor).model.flavor == flavor


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--moe.aux_loss_coef", "0.01"], ["moe.aux_loss_coef", "model.flavor='debugmodel' has no experts"]),
        (
            [
                "--job.recipe",
                "grpo",
                "--loss.loss_fn",
                "ppo",
                "--rl.advantage",
                "gae",
                "--model.flavor",
                "debugmodel_moe",
            ],
            ["rl.advantage = 'gae' (its critic): a score model with mixture-of-experts layers is not supported"],
        ),
        (["--model.flavor", "8B", "--moe.z_loss_coef", "0.001"], ["moe.z_loss_coef", "has no experts"]),
        (
            ["--model.flavor", "debugmodel", "--parallelism.expert_parallel_degree", "2"],
            ["parallelism.expert_parallel_degree=2", "model.flavor='debugmodel' is dense", "needs a MoE model"],
        ),
        (
            ["--model.flavor", "debugmodel_moe", "--parallelism.expert_parallel_degree", "3"],
            ["parallelism.expert_parallel_degree=3 does not divide num_experts=8", "debugmodel_moe"],
        ),
        (["--model.flavor", "debugmodel_moe", "--moe.aux_loss_scope", "batch"], ["moe.aux_loss_scope", "'global'"]),
        (["--model.flavor", "debugmodel_moe", "--moe.aux_loss_coef", "-1"], ["moe.aux_loss_coef"]),
        (
            ["--model.flavor", "debugmodel_moe", "--moe.router_replay", "rollout"],
            ["moe.router_replay = 'rollout'", "job.recipe = 'sft' samples nothing"],
        ),
        (
            ["--job.recipe", "grpo", "--loss.loss_fn", "ppo", "--model.flavor", "debugmodel_moe"]
            + ["--moe.router_replay_prompt", "true"],
            ["moe.router_replay_prompt", "'off'"],
        ),
        (
            ["--job.recipe", "grpo", "--loss.loss_fn", "ppo", "--moe.router_replay", "rollout"],
            ["moe.router_replay", "has no experts"],
        ),
        (["--model.flavor", "debugmodel_moe", "--moe.router_replay", "on"], ["moe.router_replay", "'rollout'"]),
    ],
)
def test_moe_settings_fail_closed(argv, fragments):
    assert_error(argv, *fragments)


def hf_flavor_settings_error(tmp_path, config: dict, *argv) -> str:
    """The error of check_model_settings once model.flavor = "hf" reads ``config`` as its config.json."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = parse("--model.flavor", "hf", "--model.hf_assets_path", str(tmp_path), *argv)  # the architecture is unknown
    with pytest.raises(ValueError) as error:
        check_model_settings(cfg, read_hf_model_args(str(tmp_path)))
    return str(error.value)


def test_model_settings_of_the_hf_flavor_name_its_config_json(tmp_path):
    dense = qwen3_flavors["debugmodel"].to_hf_config("float32")
    assert hf_flavor_settings_error(tmp_path, dense, "--moe.aux_loss_coef", "0.01") == (
        f"moe.aux_loss_coef: {tmp_path / 'config.json'} describes a dense model (num_experts is 0 or absent); "
        "choose a MoE flavor such as 'debugmodel_moe' or remove the key"
    )
    vlm = {**vlm_flavors["debugmodel"].to_hf_config("float32"), "spatial_merge_size": 4}
    message = hf_flavor_settings_error(
        tmp_path,
        vlm,
        "--model.name",
        "vlm",
        "--training.max_image_tokens",
        "16",
        "--training.max_patches_per_microbatch",
        "100",
    )
    assert message == (
        "training.max_patches_per_microbatch: must be 0 or >= 256 so any image fits (training.max_image_tokens=16 "
        f"feature tokens of 4x4 patches, spatial_merge_size of {tmp_path / 'config.json'}), got 100"
    )


# --- checkpoint keys ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (
            ["--checkpoint.enable", "--checkpoint.last_save_in_hf"],
            ["checkpoint.last_save_in_hf", "last_save_model_only"],
        ),
        (["--checkpoint.initial_load_in_hf"], ["checkpoint.initial_load_in_hf", "initial_load_path"]),
        (
            [
                "--checkpoint.initial_load_path",
                "x",
                "--checkpoint.initial_load_in_hf",
                "--checkpoint.initial_load_model_only",
                "false",
            ],
            ["checkpoint.initial_load_model_only", "must be true"],
        ),
        (
            ["--checkpoint.enable", "--checkpoint.load_step", "11", "--training.steps", "10"],
            ["checkpoint.load_step", "step 11", "training.steps"],
        ),
        (["--checkpoint.keep_latest_k", "2"], ["checkpoint.keep_latest_k", "checkpoint.enable = true"]),
        (["--checkpoint.async_mode", "async"], ["checkpoint.async_mode", "checkpoint.enable = true"]),
        (["--checkpoint.async_mode", "background"], ["checkpoint.async_mode", "'disabled'", "'async'"]),
        (["--checkpoint.interval", "0"], ["checkpoint.interval"]),
    ],
)
def test_checkpoint_key_combinations(argv, fragments):
    assert_error(argv, *fragments)


def test_checkpoint_keys_accepted_together():
    cfg = parse(
        "--checkpoint.enable",
        "--checkpoint.last_save_model_only",
        "--checkpoint.last_save_in_hf",
        "--checkpoint.export_dtype",
        "bfloat16",
        "--checkpoint.initial_load_path",
        "hf",
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.keep_latest_k",
        "1",
    )
    assert (cfg.checkpoint.export_dtype, cfg.checkpoint.keep_latest_k) == ("bfloat16", 1)


# --- recipes --------------------------------------------------------------------------


GRPO = ("--job.recipe", "grpo", "--loss.loss_fn", "ppo")


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--rl.group_size", "4"], ["rl.group_size: only used with job.recipe = 'grpo'"]),
        (["--generation.temperature", "0.7"], ["generation.temperature: only used with job.recipe = 'grpo'"]),
        ([*GRPO, "--training.dataset_path", "x.jsonl"], ["training.dataset_path: not used by job.recipe = 'grpo'"]),
        ([*GRPO, "--training.global_batch_size", "16"], ["training.global_batch_size: not used by job.recipe"]),
        (
            ["--job.recipe", "grpo"],
            ["loss.loss_fn: job.recipe = 'grpo' trains on advantages", "ppo", "'cross_entropy'"],
        ),
        ([*GRPO, "--generation.top_p", "0.9"], ["generation.top_p: truncated sampling", "'ppo'"]),
        ([*GRPO, "--generation.top_k", "5"], ["generation.top_k: truncated sampling"]),
        (
            [*GRPO, "--loss.kl_coef", "0.1"],
            ["loss.kl_coef: the KL penalty needs the reference model", "rl.use_reference"],
        ),
        (
            [*GRPO, "--rl.use_reference", "true"],
            ["rl.use_reference: the reference model only serves", "loss.kl_coef > 0", "rl.kl_in_reward_coef > 0"],
        ),
        (
            [*GRPO, "--rl.proximal", "recompute"],
            ["rl.proximal: without rl.rollout_correction", "no proximal policy is computed"],
        ),
        ([*GRPO, "--rl.task", "dataset"], ["rl.task_path: set it to the .jsonl, .json or .parquet file"]),
        ([*GRPO, "--rl.task", "jsonl"], ["rl.task: unknown task 'jsonl'", "'dataset'", "'package.module:name'"]),
        ([*GRPO, "--rl.task_path", "x.jsonl"], ["rl.task_path: only used with rl.task = 'dataset' or a task factory"]),
        ([*GRPO, "--rl.answer_match", "numeric"], ["rl.answer_match: only used with rl.task = 'dataset'"]),
        (
            [*GRPO, "--rl.eval_task_path", "e.jsonl", "--rl.eval_interval", "5"],
            ["rl.eval_task_path: only used with rl.task = 'dataset', but rl.task = 'arithmetic'"],
        ),
        (
            [*GRPO, "--rl.task", "dataset", "--rl.task_path", "x.jsonl", "--rl.eval_task_path", "e.jsonl"],
            ["rl.eval_task_path: only used with evaluation; set rl.eval_interval > 0"],
        ),
        (
            [*GRPO, "--rl.eval_interval", "5", "--rl.num_eval_prompts", "0"],
            ["rl.num_eval_prompts = 0: rl.eval_interval=5 evaluates on held-out prompts", "rl.eval_task_path"],
        ),
        (
            [*GRPO, "--rl.reward_fn", "pkg.mod:fn", "--rl.partial_credit", "0.5"],
            ["rl.partial_credit: sets the task's verifier, which rl.reward_fn = 'pkg.mod:fn' replaces"],
        ),
        (
            [*GRPO, "--rl.reward_fn", "pkg.mod:fn", "--rl.env", "calculator", "--rl.task", "calculator"],
            ["rl.reward_fn: with rl.env the environment rewards each episode"],
        ),
        ([*GRPO, "--rl.sft_warmup_only", "true"], ["rl.sft_warmup_only: set rl.sft_warmup_steps >= 1"]),
        (
            [*GRPO, "--rl.sft_warmup_only", "true", "--rl.sft_warmup_steps", "5"],
            ["rl.sft_warmup_only: the run saves the warmed-up model and exits; set checkpoint.enable = true"],
        ),
        (
            [
                *GRPO,
                "--rl.sft_warmup_only",
                "true",
                "--rl.sft_warmup_steps",
                "5",
                "--checkpoint.enable",
                "true",
                "--parallelism.rollout_ranks",
                "1",
            ],
            ["parallelism.rollout_ranks: rl.sft_warmup_only runs no RL step"],
        ),
        (
            [*GRPO, "--rl.prompts_per_step", "6", "--rl.num_minibatches", "4"],
            ["rl.prompts_per_step=6", "rl.num_minibatches=4"],
        ),
        ([*GRPO, "--rl.group_size", "1"], ["rl.group_size = 1: rl.advantage = 'grpo'", "at least 2", "'gae'"]),
        ([*GRPO, "--rl.gamma", "0.9"], ["rl.gamma: only used with rl.advantage = 'gae'"]),
        ([*GRPO, "--critic.lr", "1e-4"], ["critic.lr: only used with job.recipe = 'grpo' and rl.advantage = 'gae'"]),
        (["--loss.value_clip", "0.5"], ["loss.value_clip: only used with job.recipe = 'grpo' and rl.advantage"]),
        (
            [*GRPO, "--rl.advantage", "gae", "--rl.kl_in_reward_coef", "0.1"],
            ["rl.kl_in_reward_coef: the KL penalty needs the reference model", "rl.use_reference = true"],
        ),
        (
            [*GRPO, "--rl.advantage", "gae", "--rl.dynamic_sampling", "true"],
            ["rl.dynamic_sampling: drops groups whose rewards are all equal", "set it to false"],
        ),
        (
            [*GRPO, "--rl.advantage", "gae", "--critic.warmup_steps", "10", "--training.steps", "10"],
            ["critic.warmup_steps=10: the policy would never train in training.steps=10"],
        ),
        (
            [*GRPO, "--rl.advantage", "gae", "--model.name", "vlm", "--model.flavor", "debugmodel"],
            ["rl.advantage = 'gae': the critic is a qwen3 text model; model.name = 'vlm'"],
        ),
        ([*GRPO, "--rl.advantage", "gae", "--rl.gamma", "1.5"], ["rl.gamma: must be <= 1"]),
        ([*GRPO, "--generation.temperature", "0"], ["generation.temperature: must be > 0"]),
        (
            [*GRPO, "--checkpoint.initial_load_path", "x", "--checkpoint.initial_load_model_only", "false"],
            ["checkpoint.initial_load_model_only: job.recipe = 'grpo' starts from another run's model weights"],
        ),
    ],
)
def test_recipe_key_combinations(argv, fragments):
    assert_error(argv, *fragments)


def test_geo_mask_takes_the_sequence_level_it_works_at():
    geo_mask = (*GRPO, "--rl.rollout_correction", "geo_mask")
    cfg = parse(*geo_mask, "--rl.rollout_correction_level", "sequence")
    assert (cfg.rl.rollout_correction, cfg.rl.rollout_correction_level) == ("geo_mask", "sequence")
    for level in ([], ["--rl.rollout_correction_level", "token"]):  # the default level is 'token'
        assert_error(
            [*geo_mask, *level], "rl.rollout_correction_level = 'token'", "set rl.rollout_correction_level = 'sequence'"
        )


def test_service_takes_rollout_ranks_with_a_silent_peer_timeout_below_the_collective_one():
    recipes = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "train_configs")
    service = os.path.join(recipes, "service_debug.toml")
    with_rollout_ranks = ("--job.config_file", service, "--parallelism.rollout_ranks", "1")
    assert parse(*with_rollout_ranks).parallelism.rollout_ranks == 1
    assert_error(
        [*with_rollout_ranks, "--comm.silent_peer_timeout_seconds", "300", "--comm.collective_timeout_seconds", "300"],
        "comm.silent_peer_timeout_seconds=300: must be below comm.collective_timeout_seconds=300",
    )


def test_grpo_recipes_parse():
    recipes = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "train_configs")
    cfg = parse("--job.config_file", os.path.join(recipes, "debug_grpo.toml"))
    assert cfg.job.recipe == "grpo" and cfg.rl.group_size == 16
    cfg = parse("--job.config_file", os.path.join(recipes, "debug_ppo.toml"))
    assert (cfg.rl.advantage, cfg.rl.group_size, cfg.critic.warmup_steps) == ("gae", 4, 5)
    cfg = parse(
        *GRPO,
        "--rl.advantage",
        "gae",
        "--rl.group_size",
        "1",
        "--rl.use_reference",
        "true",
        "--rl.kl_in_reward_coef",
        "0.05",
    )
    assert (cfg.rl.group_size, cfg.rl.kl_in_reward_coef, cfg.loss.kl_coef) == (1, 0.05, 0.0)
    cfg = parse("--job.config_file", os.path.join(recipes, "qwen_grpo.toml"))
    assert cfg.rl.use_reference and cfg.loss.kl_coef > 0 and cfg.generation.dtype == "bfloat16"
    cfg = parse(
        *GRPO,
        "--loss.kl_coef",
        "0.1",
        "--rl.use_reference",
        "true",
        "--rl.task",
        "dataset",
        "--rl.task_path",
        "x.jsonl",
        "--rl.answer_match",
        "numeric",
    )
    assert cfg.rl.use_reference and cfg.rl.answer_match == "numeric"
    # A task factory may read rl.task_path; the warm-up alone may save in HF format without
    # last_save_model_only (its save is model only anyway).
    cfg = parse(*GRPO, "--rl.task", "pkg.mod:make_task", "--rl.task_path", "rows/", "--rl.reward_fn", "pkg.mod:fn")
    assert cfg.rl.task == "pkg.mod:make_task" and cfg.rl.reward_fn == "pkg.mod:fn"
    cfg = parse(
        *GRPO,
        *("--rl.sft_warmup_only", "true", "--rl.sft_warmup_steps", "5", "--checkpoint.enable", "true"),
        *("--checkpoint.last_save_in_hf", "true"),
    )
    assert cfg.rl.sft_warmup_only and cfg.checkpoint.last_save_in_hf
    # Both recipes balance DP compute by default; GRPO reads the switch, so turning it off is no error.
    assert cfg.training.balance_dp_compute and parse().training.balance_dp_compute
    assert not parse(*GRPO, "--training.balance_dp_compute", "false").training.balance_dp_compute


SERVICE = (
    "--job.config_file",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "train_configs", "service_debug.toml"),
)


@pytest.mark.parametrize(
    "argv,fragments",
    [
        (["--loss.reduction", "token_mean"], ["loss.reduction", "plain sums", "'sum'"]),
        (["--lora.dropout", "0.1"], ["lora.dropout"]),
        (["--lora.train_embeddings", "true"], ["lora.train_embeddings"]),
        (["--checkpoint.enable", "true"], ["checkpoint.enable", "save_state"]),
        (["--rl.group_size", "4"], ["rl.group_size: not used by job.recipe = 'service'"]),
        (["--generation.temperature", "0.5"], ["generation.temperature: not used by job.recipe = 'service'"]),
        (["--service.base_models", "[]"], ["service.base_models"]),
    ],
)
def test_service_key_rules(argv, fragments):
    assert_error([*SERVICE, *argv], *fragments)


def test_service_needs_lora(tmp_path):
    recipe = write(tmp_path, '[job]\nrecipe = "service"\n[loss]\nreduction = "sum"\n')
    assert_error(["--job.config_file", recipe], "lora.enable: job.recipe = 'service' trains LoRA clients")


def test_service_keys_belong_to_the_service_and_its_generator_keys_apply():
    assert_error(["--service.port", "9000"], "service.port: only used with job.recipe = 'service'")
    cfg = parse(*SERVICE, "--generation.max_prompts_per_batch", "4", "--service.port", "0")
    assert cfg.generation.max_prompts_per_batch == 4 and cfg.service.port == 0


def test_service_without_its_packages_names_the_extra(monkeypatch):
    import importlib.util

    import torchtitan_rl.recipes.config_checks as checks

    real = importlib.util.find_spec
    monkeypatch.setattr(checks.importlib.util, "find_spec", lambda name: None if name == "fastapi" else real(name))
    assert_error(list(SERVICE), "job.recipe = 'service' needs fastapi", "pip install -e '.[service]'")


DPO = ("--job.recipe", "dpo", "--loss.loss_fn", "dpo", "--loss.reduction", "sum")


@pytest.mark.parametrize(
    "argv,fragments",
    [
        (["--job.recipe", "dpo", "--loss.reduction", "sum"], ["loss.loss_fn", "dpo, ipo, simpo", "'cross_entropy'"]),
        (["--job.recipe", "dpo", "--loss.loss_fn", "dpo"], ["loss.reduction", "'sum'", "'token_mean'"]),
        ([*DPO, "--loss.kl_coef", "0.1"], ["loss.kl_coef: not used by job.recipe = 'dpo'"]),
        ([*DPO, "--loss.simpo_gamma", "1.0"], ["loss.simpo_gamma: only used with loss.loss_fn = 'simpo'"]),
        ([*DPO, "--loss.beta", "0"], ["loss.beta must be > 0"]),
        ([*DPO, "--loss.label_smoothing", "0.5"], ["loss.label_smoothing must be in [0, 0.5)"]),
        ([*DPO, "--rl.group_size", "4"], ["rl.group_size: only used with job.recipe = 'grpo'"]),
        ([*DPO, "--generation.max_new_tokens", "8"], ["generation.max_new_tokens", "preference.eval_interval > 0"]),
        ([*DPO, "--preference.eval_interval", "2", "--generation.temperature", "0.5"], ["generation.temperature"]),
        ([*DPO, "--preference.num_eval_pairs", "8"], ["preference.num_eval_pairs: only used with"]),
        (["--loss.beta", "0.2"], ["loss.beta: only used with job.recipe = 'dpo'"]),
        (["--preference.eval_interval", "2"], ["preference.eval_interval: only used with job.recipe = 'dpo'"]),
        (["--loss.loss_fn", "ipo"], ["loss.loss_fn: 'ipo' is a preference loss", "job.recipe = 'dpo'"]),
    ],
)
def test_preference_key_rules(argv, fragments):
    assert_error(argv, *fragments)


def test_preference_recipes_parse():
    cfg = parse("--job.config_file", "train_configs/debug_dpo.toml")
    assert (cfg.job.recipe, cfg.loss.loss_fn, cfg.loss.reduction) == ("dpo", "dpo", "sum")
    cfg = parse(*DPO, "--loss.loss_fn", "simpo", "--loss.simpo_gamma", "1.0", "--preference.eval_interval", "5")
    assert (cfg.loss.simpo_gamma, cfg.preference.eval_interval) == (1.0, 5)


REWARD_MODEL = ("--job.recipe", "reward_model")


@pytest.mark.parametrize(
    "argv,fragments",
    [
        (["--loss.center_rewards_coefficient", "0.1"], ["loss.center_rewards_coefficient: only used with"]),
        ([*REWARD_MODEL, "--rl.group_size", "4"], ["rl.group_size: not used by job.recipe = 'reward_model'"]),
        ([*REWARD_MODEL, "--loss.beta", "0.2"], ["loss.beta: only used with job.recipe = 'dpo'"]),
        ([*REWARD_MODEL, "--lora.enable", "true"], ["lora.enable", "no LoRA reward models"]),
        ([*REWARD_MODEL, "--loss.center_rewards_coefficient", "-1"], ["loss.center_rewards_coefficient", ">= 0"]),
        ([*REWARD_MODEL, "--model.name", "vlm"], ["model.name", "qwen3 reward model"]),
    ],
)
def test_reward_model_key_rules(argv, fragments):
    assert_error(argv, *fragments)


def test_reward_model_recipe_parses():
    cfg = parse("--job.config_file", "train_configs/debug_rm.toml")
    assert cfg.job.recipe == "reward_model" and cfg.loss.center_rewards_coefficient > 0
