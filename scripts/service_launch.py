"""Start the service (``train.py`` with ``job.recipe = "service"``) as a torchrun launch on a free
loopback port, for the tests and the benchmark that drive it with the SDK; and a tiny Hugging Face
Qwen3 for it to serve."""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from bench_common import launch_env
from torchtitan_rl.models.qwen3.args import qwen3_flavors

REPO = Path(__file__).resolve().parents[1]
BASE_MODEL = "Qwen/Qwen3-8B"
API_KEY = "tml-service-tests"
START_TIMEOUT_S = 240


def make_hf_model(folder: Path, seed: int = 0) -> Path:
    """A random debugmodel-shaped Qwen3 (its head untied, so the head can take adapters)."""
    torch.manual_seed(seed)
    config = Qwen3Config(**qwen3_flavors["debugmodel"].to_hf_config("float32"))
    Qwen3ForCausalLM(config).save_pretrained(folder)
    return folder


@dataclass
class Service:
    url: str
    dump: Path
    proc: subprocess.Popen
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def output(self) -> str:
        return self.log.read_text()[-8000:]


def start_service(dump: Path, nproc: int, *options: str, hf_dir: Path | None = None) -> Service:
    dump.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        str(REPO / "train.py"), "--job.config_file", str(REPO / "train_configs" / "service_debug.toml"),
        "--job.dump_folder", str(dump), "--service.port", "0", "--service.api_key", API_KEY,
        "--service.keepalive_seconds", "1",
        *(["--checkpoint.initial_load_path", str(hf_dir), "--checkpoint.initial_load_in_hf", "true"] if hf_dir else []),
        *options,
    ]  # fmt: skip
    log = dump / "service.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=launch_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    service_file = dump / "service.json"
    deadline = time.monotonic() + START_TIMEOUT_S
    while not service_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            Service("", dump, proc, log).stop()
            raise RuntimeError(f"the service did not start:\n{log.read_text()[-6000:]}")
        time.sleep(0.2)
    info = json.loads(service_file.read_text())
    return Service(f"http://127.0.0.1:{info['port']}", dump, proc, log)


def sdk_env() -> dict:
    return {"TINKER_API_KEY": API_KEY, "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1"}
