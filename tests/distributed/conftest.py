"""The multi-rank layout launch, shared by every test module of this folder.

One torchrun launch per world size (2, 4 and 8 gloo ranks) runs ``layout_worker.py``, which
records every case of every layout (and the generator and RL checks hooked into it); world 1
runs in this process. Test modules compare the recorded numbers with their references.
"""

import os
import subprocess
import sys
import warnings

import pytest
import torch

import layout_worker
from reference import launch_env

HERE = os.path.dirname(os.path.abspath(__file__))


def _launch_once(world_size: int, out_path: str) -> str | None:
    """Run the worker; None on success, else the failure's telling lines (full log beside OUT)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world_size}",
        os.path.join(HERE, "layout_worker.py"),
        out_path,
    ]
    proc = subprocess.run(cmd, cwd=HERE, env=launch_env(), capture_output=True, text=True, timeout=600)
    if proc.returncode == 0:
        return None
    log = out_path + ".log"
    with open(log, "w") as f:
        f.write(proc.stdout + proc.stderr)
    # The first failing rank's own message is usually far above the tail.
    causes = [
        line
        for line in (proc.stdout + proc.stderr).splitlines()
        if any(word in line for word in ("Error", "terminate", "abort", "what()", "exitcode", "malloc"))
    ]
    return f"{world_size}-rank launch failed (full log: {log}):\n" + "\n".join(causes[:40])


def launch(world_size: int, out_path: str) -> dict:
    failure = _launch_once(world_size, out_path)
    if failure is not None:
        # A gloo rank on this 2-core machine has been seen to abort now and then (SIGABRT after
        # "malloc(): unaligned tcache chunk detected", in unchanged SFT layouts too). The abort at
        # exit ("terminate called without an active exception": gloo groups left to interpreter
        # shutdown) is gone since the worker ends with shutdown_distributed; the heap corruption
        # was never reproduced, so the retry stays for it. A real bug fails twice; a rerun that
        # passes is still reported.
        warnings.warn(f"retrying after a failed launch: {failure}", stacklevel=2)
        failure = _launch_once(world_size, out_path)
        assert failure is None, failure
    return torch.load(out_path, weights_only=False)


@pytest.fixture(scope="session")
def layout_results(tmp_path_factory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("layouts")
    by_world = {w: launch(w, str(out / f"world{w}.pt")) for w in (2, 4, 8)}
    by_world[1] = layout_worker.run_all_layouts(1)
    return by_world
