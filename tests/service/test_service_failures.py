"""A rank of the service that dies ends the launch (torchrun stops the others), rather than
leaving rank 0 serving requests no rank can run."""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # the launch helper lives there
from service_launch import start_service  # noqa: E402


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return sorted(found)


def test_a_rank_that_dies_ends_the_launch(tmp_path):
    service = start_service(tmp_path, 2)
    try:
        workers = children_of(service.proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[-1], signal.SIGKILL)
        start = time.monotonic()
        service.proc.wait(timeout=120)
        assert service.proc.returncode != 0
        assert time.monotonic() - start < 120
        assert not [pid for pid in workers if os.path.exists(f"/proc/{pid}") and _alive(pid)]
    finally:
        service.stop()


def _alive(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"
