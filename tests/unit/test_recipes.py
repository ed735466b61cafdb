"""The recipe layer: the registry ``train.py`` dispatches on, constructors that only build
(checkpoints and the GRPO warm-up happen in ``setup()``), and OS errors named by config key."""

import os
import typing
from pathlib import Path

import pytest
import torch

from torchtitan_rl.config import ConfigManager, JobConfig
from torchtitan_rl.data.tokenizer import build_tokenizer
from torchtitan_rl.recipes import RECIPES, get_recipe
from torchtitan_rl.recipes.base import REDUCE_DTYPES, describe_os_error, model_args_from_config
from torchtitan_rl.recipes.dpo import DPORecipe
from torchtitan_rl.recipes.grpo import GRPORecipe, build_grpo
from torchtitan_rl.recipes.grpo_data import generation_dtype
from torchtitan_rl.recipes.service import build_service
from torchtitan_rl.recipes.sft import SFTRecipe

CONFIGS = Path(__file__).resolve().parents[2] / "train_configs"
SMALL = ["--training.global_batch_size", "4", "--training.seq_len", "64", "--metrics.enable_tensorboard", "false"]


def parse(*args: str) -> JobConfig:
    return ConfigManager().parse_args(list(args))


def params_of(recipe) -> list[torch.Tensor]:
    return [p.detach().clone() for p in recipe.engine.model.parameters()]


def test_registry_matches_the_config_choices():
    (choices,) = [
        typing.get_args(f.type)
        for f in JobConfig.__dataclass_fields__["job"].type.__dataclass_fields__.values()
        if f.name == "recipe"
    ]
    assert set(RECIPES) == set(choices)
    assert get_recipe("grpo") is build_grpo and get_recipe("sft") is SFTRecipe
    assert get_recipe("service") is build_service and get_recipe("dpo") is DPORecipe
    with pytest.raises(
        ValueError, match=r"job.recipe: unknown recipe 'ppo'.*\['dpo', 'grpo', 'reward_model', 'service', 'sft'\]"
    ):
        get_recipe("ppo")


def test_os_error_names_the_config_key(tmp_path):
    not_a_dir = tmp_path / "cache"
    not_a_dir.write_text("a file, not a directory")
    cfg = parse("--job.dump_folder", str(tmp_path / "run"), "--training.dataset_cache_dir", str(not_a_dir))
    with pytest.raises(OSError) as caught:
        os.makedirs(not_a_dir / "json")
    message = describe_os_error(caught.value, cfg)
    assert message.startswith(str(caught.value))
    assert f"training.dataset_cache_dir = '{not_a_dir}'" in message
    assert "job.dump_folder" not in message
    elsewhere = OSError(2, "No such file or directory", str(tmp_path / "unrelated"))
    assert describe_os_error(elsewhere, cfg) == str(elsewhere)


def test_sft_constructor_builds_and_setup_resumes(tmp_path):
    dump = str(tmp_path / "sft")
    args = [
        "--job.config_file",
        str(CONFIGS / "debug_model.toml"),
        *SMALL,
        "--job.dump_folder",
        dump,
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "2",
    ]
    first = SFTRecipe(parse(*args, "--training.steps", "2"))
    initial = params_of(first)
    assert not first.setup()
    first.train()
    trained = params_of(first)
    assert any(not torch.equal(a, b) for a, b in zip(trained, initial))
    first.close()

    second = SFTRecipe(parse(*args, "--training.steps", "3"))
    # Built from the seed, nothing loaded yet.
    assert second.train_state.step == 0
    for got, expected in zip(params_of(second), initial):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert second.setup()
    assert second.train_state.step == 2
    for got, expected in zip(params_of(second), trained):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    second.close()


def test_grpo_warmup_runs_in_setup_and_seeds_the_reference(tmp_path):
    cfg = parse(
        "--job.config_file",
        str(CONFIGS / "debug_grpo.toml"),
        "--job.dump_folder",
        str(tmp_path / "grpo"),
        "--metrics.enable_tensorboard",
        "false",
        "--rl.sft_warmup_steps",
        "2",
        "--rl.sft_warmup_batch_size",
        "4",
        "--rl.use_reference",
        "true",
        "--loss.kl_coef",
        "0.01",
    )
    recipe = GRPORecipe(cfg)
    initial = params_of(recipe)  # the constructor ran no warm-up step
    recipe.setup()
    warmed = params_of(recipe)
    assert any(not torch.equal(a, b) for a, b in zip(warmed, initial))
    for ref, policy in zip(recipe.reference.copy.model.parameters(), warmed):
        torch.testing.assert_close(ref.detach(), policy, rtol=0, atol=0)
    recipe.close()


def test_grpo_dataset_warmup_needs_rows_outside_the_rl_pool(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"prompt": "{i}+1?", "answer": "{i + 1}"}}\n' for i in range(6)))
    args = [
        "--job.config_file",
        str(CONFIGS / "debug_grpo.toml"),
        "--job.dump_folder",
        str(tmp_path / "grpo"),
        "--rl.task",
        "dataset",
        "--rl.task_path",
        str(rows),
        "--rl.eval_interval",
        "5",
        "--rl.num_eval_prompts",
        "1",
        "--rl.num_train_prompts",
        "0",
        "--rl.sft_warmup_steps",
        "3",
        "--rl.sft_warmup_batch_size",
        "4",
    ]
    with pytest.raises(
        ValueError, match=r"rl.sft_warmup_steps=3: the warm-up of task 'dataset' .* none besides the 5 RL prompts"
    ):
        GRPORecipe(parse(*args))


@pytest.mark.parametrize("coef, expected", [(0.0, (0.001, False)), (0.05, (0.05, True))])
def test_moe_export_writes_the_router_loss_in_force(coef, expected):
    cfg = parse(
        "--job.config_file",
        str(CONFIGS / "debug_model.toml"),
        "--model.flavor",
        "debugmodel_moe",
        "--moe.aux_loss_coef",
        str(coef),
    )
    args = model_args_from_config(cfg, torch.device("cpu"), build_tokenizer(""))
    exported = args.to_hf_config("float32")
    assert (exported["router_aux_loss_coef"], exported["output_router_logits"]) == expected


def test_every_reduce_dtype_choice_maps_to_a_torch_dtype():
    field = JobConfig.__dataclass_fields__["training"].type.__dataclass_fields__["mixed_precision_reduce"]
    assert set(REDUCE_DTYPES) == set(typing.get_args(field.type))
    assert REDUCE_DTYPES[parse().training.mixed_precision_reduce] == torch.float32


@pytest.mark.parametrize(
    "options, device, expected",
    [
        ((), "cpu", torch.float32),  # auto: the CPU trains in float32
        ((), "cuda", torch.bfloat16),  # auto: the trainer's bfloat16 compute
        (("--training.mixed_precision_param", "float32"), "cuda", torch.float32),
        (("--generation.dtype", "bfloat16"), "cpu", torch.bfloat16),
        (("--generation.dtype", "float32"), "cuda", torch.float32),
    ],
)
def test_generation_dtype_auto_is_the_trainer_compute_dtype_and_a_choice_wins(options, device, expected):
    cfg = parse("--job.recipe", "grpo", *options)
    if "--generation.dtype" not in options:
        assert cfg.generation.dtype == "auto"  # the default
    assert generation_dtype(cfg, torch.device(device)) == expected
