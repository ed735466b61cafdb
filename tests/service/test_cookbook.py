"""The tinker-cookbook's own ``sl_loop`` and ``rl_loop`` recipes (0.5.8, in a client environment
of their own) run unmodified against the service: the SL loss falls, and rl_loop, resumed from an
SL warm-up on its own prompts through its resume path, samples, rewards and trains with
``importance_sampling``."""

import sys
from pathlib import Path

import pytest

from cookbook_client import last_checkpoint, rl_rows, rl_warmup_rows, run_cookbook, sl_rows

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # the launch helper lives there
from service_launch import API_KEY, start_service  # noqa: E402


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    svc = start_service(tmp_path_factory.mktemp("cookbook-service"), 1)
    yield svc
    svc.stop()


def test_sl_loop_lowers_the_loss(service, tmp_path):
    # One distinct row: every step sees the same batch, so the losses compare step to step.
    metrics = run_cookbook(
        "sl", service.url, tmp_path, rows=sl_rows(12), env={"TINKER_API_KEY": API_KEY},
        max_steps=6, learning_rate=1e-2,
    )  # fmt: skip
    losses = [m["train_mean_nll"] for m in metrics if "train_mean_nll" in m]
    assert len(losses) == 6, metrics
    assert sum(losses[-2:]) < 0.8 * sum(losses[:2]), losses
    assert last_checkpoint(tmp_path, "sl")["state_path"].startswith("tinker://")


def test_rl_loop_trains_after_a_warm_up(service, tmp_path):
    questions = rl_rows(2)
    env = {"TINKER_API_KEY": API_KEY}
    run_cookbook("sl", service.url, tmp_path, rows=rl_warmup_rows(questions, 400), env=env,
                 max_steps=200, learning_rate=5e-3, lora_rank=16)  # fmt: skip
    warm = last_checkpoint(tmp_path, "sl")["state_path"]
    metrics = run_cookbook("rl", service.url, tmp_path, rows=questions, env=env, resume_from=warm,
                           batch_size=1, group_size=8, max_tokens=40, max_steps=2, lora_rank=16)  # fmt: skip
    rewards = [m["reward/total"] for m in metrics if "reward/total" in m]
    assert len(rewards) == 2 and all(0 <= r <= 1 for r in rewards), metrics
    assert any(r > 0 for r in rewards), metrics  # the warm-up taught the answer format
    # A step with mixed rewards calls forward_backward and optim_step, whose metrics it logs.
    assert any("grad_norm:mean" in m for m in metrics), metrics


def test_the_service_writes_the_tokenizer_clients_load(service, tmp_path):
    """The folder a user links as ./Qwen/Qwen3-8B holds exactly the files the cookbook tests load."""
    from tokenizer_assets import tokenizer_dir

    served = service.dump / "tokenizer"
    expected = tokenizer_dir(tmp_path)
    names = sorted(p.name for p in expected.iterdir())
    assert names and sorted(p.name for p in served.iterdir()) == names
    for name in names:
        assert (served / name).read_bytes() == (expected / name).read_bytes(), name
