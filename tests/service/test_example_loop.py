"""``examples/tinker_rl_loop.py``, an RL loop written against the tinker SDK alone, raises the
reward of the built-in arithmetic task on a warmed-up debug model served on 2 CPU ranks, as its
docstring runs it: the GRPO recipe's SFT warm-up saved as step-0, the service serving it, the loop."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))  # the launch helper lives there
sys.path.insert(0, str(REPO / "examples"))
import tinker_rl_loop  # noqa: E402

from bench_common import launch_env  # noqa: E402
from service_launch import sdk_env, start_service  # noqa: E402


def test_the_example_loop_raises_the_reward(tmp_path, monkeypatch):
    warmup = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(REPO / "train.py"),
        "--job.config_file", str(REPO / "train_configs" / "debug_grpo.toml"), "--rl.sft_warmup_only", "true",
        "--rl.eval_interval", "0", "--checkpoint.enable", "true", "--job.dump_folder", str(tmp_path / "warmup"),
    ]  # fmt: skip
    proc = subprocess.run(warmup, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    step0 = tmp_path / "warmup" / "checkpoint" / "step-0"
    service = start_service(tmp_path / "service", 2, "--checkpoint.initial_load_path", str(step0))
    try:
        for key, value in sdk_env().items():
            monkeypatch.setenv(key, value)
        history = tinker_rl_loop.main(["--base-url", service.url, "--steps", "30"])
    finally:
        service.stop()
    rewards = [record["reward_mean"] for record in history]
    assert any(record["num_datums"] for record in history), history  # it trained
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.1, rewards
