"""Clean exits, checked: consecutive short 2-rank ``train.py`` runs must all exit 0.

    .venv/bin/python scripts/check_clean_exits.py --runs 30            # rewrites docs/benchmarks/clean_exits.md
    .venv/bin/python scripts/check_clean_exits.py --runs 30 --stress
    .venv/bin/python scripts/check_clean_exits.py --runs 4 --no-write  # print only

Each run is ``torchrun --standalone --nproc_per_node=2 train.py`` with the debug recipe shrunk
to ``--steps`` steps of 8 short sequences, checkpoints at step 2 and at the last step,
alternately with ``checkpoint.async_mode = "async"`` and ``"disabled"`` (``OMP_NUM_THREADS=1``).
Every run's exit status is reported with the lines of its output that tell of an abort
(``terminate called``, SIGABRT or SIGSEGV, heap corruption, or the warning that gloo threads
outlived the teardown); a run that failed otherwise shows the tail of its output. Exit
status 0 when every run exited 0 without such lines.

``--stress`` makes the teardown race the rule instead of a rare event: each rank pins itself
to one core and runs its gloo worker threads at ``SCHED_IDLE``, so a worker that completes a
collective is preempted by the rank's main thread at once and keeps holding the collective's
tensors, as on a machine busy with other jobs. A teardown that leaves the groups to interpreter
shutdown then aborts with "terminate called without an active exception" (see
``shutdown_distributed`` in ``torchtitan_rl/distributed/utils.py``). ``--repo`` runs the
``train.py`` of another checkout (e.g. an older commit, to compare).
"""

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time

# Also found when a test loads this file by its path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import ROOT, add_publish_args, launch_env, launcher, markdown_table, publish  # noqa: E402

# Output lines that mean a rank aborted or did not tear down cleanly (torchrun's SIGTERM to the
# surviving rank of a failed run is not one: that run counts among the other failures).
ABORT_MARKERS = (
    "terminate called",
    "SIGABRT",
    "SIGSEGV",
    "Fatal Python error",
    "malloc(",
    "outlive destroy_process_group",
)
_RANK_ENTRY = "--rank-entry"


def train_args(dump_folder: str, steps: int, async_mode: str) -> list[str]:
    return [
        "--job.config_file",
        os.path.join(ROOT, "train_configs", "debug_model.toml"),
        "--job.dump_folder",
        dump_folder,
        "--training.steps",
        str(steps),
        "--training.global_batch_size",
        "8",
        "--training.seq_len",
        "64",
        "--training.max_tokens_per_microbatch",
        "128",
        "--metrics.log_freq",
        "1",
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "2",
        "--checkpoint.async_mode",
        async_mode,
    ]


def launch(repo: str, args: list[str], stress: bool, timeout_s: float) -> subprocess.CompletedProcess:
    """One 2-rank torchrun of ``repo``'s train.py (through this file's rank entry under stress)."""
    entry = [os.path.abspath(__file__), _RANK_ENTRY, repo] if stress else [os.path.join(repo, "train.py")]
    cmd = [*launcher(2), *entry, *args]
    return subprocess.run(
        cmd, check=False, cwd=repo, env=launch_env(), capture_output=True, text=True, timeout=timeout_s
    )


def abort_lines(output: str) -> list[str]:
    return [line.strip() for line in output.splitlines() if any(marker in line for marker in ABORT_MARKERS)]


def rank_entry(repo: str, argv: list[str]) -> int:
    """A stressed rank: pinned to one core, gloo workers at SCHED_IDLE, then ``train.main``."""
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[int(os.environ.get("LOCAL_RANK", "0")) % len(cpus)]})
    threading.Thread(target=_demote_gloo_workers, daemon=True).start()
    sys.path.insert(0, repo)
    import train

    return train.main(argv)


def _demote_gloo_workers() -> None:
    """Put every gloo worker thread of this process at SCHED_IDLE as soon as it appears."""
    demoted = set()
    while True:
        for tid in os.listdir("/proc/self/task"):
            if tid in demoted:
                continue
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if f.read().strip() == "pt_gloo_runloop":
                        os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
                        demoted.add(tid)
            except OSError:  # the thread ended meanwhile
                pass
        time.sleep(0.05)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--steps", type=int, default=3, help="training steps per run (checkpoints at 2 and the last)")
    parser.add_argument("--stress", action="store_true", help="pinned ranks, gloo workers at SCHED_IDLE (see above)")
    parser.add_argument("--repo", default=ROOT, help="checkout whose train.py runs (default: this one)")
    parser.add_argument("--label", default="this checkout", help="how the published section names --repo")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    add_publish_args(parser, "clean_exits")
    args = parser.parse_args()

    results = []  # (async_mode, returncode, seconds, abort lines)
    with tempfile.TemporaryDirectory(prefix="clean_exits_") as tmp:
        for run in range(1, args.runs + 1):
            async_mode = "async" if run % 2 else "disabled"
            start = time.perf_counter()
            proc = launch(
                args.repo, train_args(os.path.join(tmp, f"run{run}"), args.steps, async_mode), args.stress, args.timeout
            )
            seconds = time.perf_counter() - start
            found = abort_lines(proc.stdout + proc.stderr)
            results.append((async_mode, proc.returncode, seconds, found))
            print(f"run {run:3d}  async_mode={async_mode:8s}  exit {proc.returncode}  {seconds:5.1f} s", flush=True)
            for line in found[:6]:
                print(f"          {line}", flush=True)
            if proc.returncode != 0 and not found:
                print("          " + "\n          ".join((proc.stdout + proc.stderr).splitlines()[-25:]), flush=True)

    rows = []
    for mode in ("async", "disabled"):
        runs = [r for r in results if r[0] == mode]
        if runs:
            aborted = sum(1 for r in runs if r[3])
            other = sum(1 for r in runs if r[1] != 0 and not r[3])
            rows.append(
                [
                    mode,
                    len(runs),
                    sum(r[1] == 0 for r in runs),
                    aborted,
                    other,
                    f"{sum(r[2] for r in runs) / len(runs):.1f} s",
                ]
            )
    body = [
        (
            f"train.py of {args.label}; {args.runs} consecutive 2-rank runs of {args.steps} steps with checkpoints at "
            "step 2 and the last step"
            + (", stressed (ranks pinned to one core each, gloo workers at SCHED_IDLE)" if args.stress else "")
            + "."
        ),
        "",
        *markdown_table(
            [
                "checkpoint.async_mode",
                "runs",
                "exit 0",
                "aborted (terminate / signal)",
                "other failures",
                "mean run time",
            ],
            rows,
        ),
    ]
    publish(
        args,
        "Clean exits",
        "Consecutive short 2-rank `train.py` runs with checkpoints, with and without async "
        "saves (optionally stressed): how many exit 0.",
        body,
    )
    return 0 if all(r[1] == 0 and not r[3] for r in results) else 1


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == _RANK_ENTRY:
        sys.exit(rank_entry(sys.argv[2], sys.argv[3:]))
    sys.exit(main())
