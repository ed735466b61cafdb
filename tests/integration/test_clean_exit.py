"""A 2-rank ``train.py`` run that trained correctly exits 0, even when its teardown races.

One launch of ``scripts/check_clean_exits.py``'s stressed run (ranks pinned to a core each,
gloo worker threads at SCHED_IDLE, so a worker keeps holding the collective it just completed
for as long as the main thread runs), with a blocking checkpoint save as the last collective:
left to interpreter shutdown, that worker aborts the process ("terminate called without an
active exception", SIGABRT, as it did before ``shutdown_distributed``). The run must exit 0
with no abort in its output, and with no gloo thread left after the teardown (checked by the
trainer itself on every clean exit, so a process group that something still references
fails this test whether or not the race strikes). ``--runs 30`` of the script is the long
version (docs/benchmarks/clean_exits.md).
"""

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "scripts" / "check_clean_exits.py"


def _load_tool():
    spec = importlib.util.spec_from_file_location("check_clean_exits", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(
    not Path("/proc/self/task").is_dir(), reason="the stressed run and the thread check need Linux /proc"
)
def test_stressed_two_rank_run_exits_cleanly(tmp_path):
    tool = _load_tool()
    # Two steps: the checkpoint of the last step is the last collective before the teardown.
    proc = tool.launch(
        str(REPO), tool.train_args(str(tmp_path / "dump"), steps=2, async_mode="disabled"), stress=True, timeout_s=300
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert tool.abort_lines(output) == [], output[-4000:]
    assert (tmp_path / "dump" / "checkpoint" / "step-2").is_dir(), "the run did not save its last checkpoint"
