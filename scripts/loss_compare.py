#!/usr/bin/env python
"""Compare the loss curves of two training runs step by step.

The project promises that, for a fixed mini-batch and reduction mode, the gradient -- and so
the whole loss curve -- does not depend on how the mini-batch is split into micro-batches or
over data-parallel ranks. This tool checks that promise end to end, from TensorBoard logs.

Run mode (the default): launch ``train.py`` twice with the same recipe, seed and data --
once with the baseline options, once with the test options -- each into its own dump folder
``{output-folder}/baseline`` and ``{output-folder}/test`` (a folder left there by an earlier
comparison is replaced), then compare them::

    python scripts/loss_compare.py --config train_configs/debug_model.toml \\
        --baseline-ngpu 1 --test-ngpu 2 \\
        --baseline-options "--parallelism.data_parallel_shard_degree 1" \\
        --test-options "--training.max_tokens_per_microbatch 128" \\
        --steps 10 --rtol 1e-4 --output-folder outputs/loss_compare

Each run is ``python -m torch.distributed.run --standalone --nproc_per_node=N train.py
--job.config_file CONFIG [--options] [--X-options] --training.steps STEPS
--metrics.log_freq 1 --metrics.enable_tensorboard true --job.dump_folder DIR`` (the forced
keys come last, so they win), with ``OMP_NUM_THREADS=1`` unless it is already set. Its
stdout and stderr go to ``DIR/train.log``; ``--stream`` echoes them too.

Folder mode: ``--baseline-folder A --test-folder B`` compares two existing dump folders (or
TensorBoard folders) without running anything. The TensorBoard folder of a dump folder is
``metrics.save_tb_folder`` of its ``config.toml`` (``tb`` when there is none).

The table shows, for every step, loss (``loss_metrics/global_avg_loss``) and ``grad_norm``
(change with ``--tags``) of both runs and their relative difference
``|test - baseline| / |baseline|``. A step fails when ``|test - baseline| > atol + rtol *
|baseline|`` or a value is NaN.

Exit status (as diff(1)): 0 -- every step of every tag agrees; 1 -- some step differs by more
than the tolerance, or the runs logged different steps; 2 -- trouble: bad arguments, a
missing or empty folder, a missing tag, or a training run that failed (its log tail is
printed).

Option strings are split like a shell command line (``shlex``). An option string that is a
single flag with no space must be attached with ``=``: ``--test-options=--debug.deterministic``.
"""

import argparse
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:
    from torchtitan_rl.tensorboard_io import event_files, read_scalars
except ModuleNotFoundError:  # a python without the editable install: use this checkout
    sys.path.insert(0, REPO_ROOT)
    from torchtitan_rl.tensorboard_io import event_files, read_scalars

DEFAULT_TAGS = ("loss_metrics/global_avg_loss", "grad_norm")
SHORT_NAMES = {"loss_metrics/global_avg_loss": "loss"}
LOG_NAME = "train.log"
# Files a dump folder of an earlier comparison may hold; anything else in it means the folder
# is not ours to delete.
_OWN_ENTRIES = {"config.toml", "tb", LOG_NAME}

EXIT_OK, EXIT_DIFFERENT, EXIT_TROUBLE = 0, 1, 2


class Trouble(Exception):
    """Anything that keeps the comparison from happening (exit status 2)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loss_compare.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run = parser.add_argument_group("run mode (the default)")
    run.add_argument(
        "--config",
        default=os.path.join("train_configs", "debug_model.toml"),
        help="TOML recipe for both runs (default: %(default)s)",
    )
    run.add_argument(
        "--baseline-ngpu",
        type=int,
        default=1,
        help="ranks (torchrun --nproc_per_node) of the baseline run (default: %(default)s)",
    )
    run.add_argument("--test-ngpu", type=int, default=1, help="ranks of the test run (default: %(default)s)")
    run.add_argument("--baseline-options", default="", help="train.py overrides of the baseline run, one string")
    run.add_argument("--test-options", default="", help="train.py overrides of the test run, one string")
    run.add_argument("--options", default="", help="overrides given to both runs (before the per-run ones)")
    run.add_argument("--steps", type=int, default=10, help="training.steps of both runs (default: %(default)s)")
    run.add_argument(
        "--seed", type=int, default=None, help="debug.seed of both runs (default: the recipe's, the same for both)"
    )
    run.add_argument(
        "--output-folder",
        default=os.path.join("outputs", "loss_compare"),
        help="runs go to OUTPUT/baseline and OUTPUT/test (default: %(default)s)",
    )
    run.add_argument(
        "--train-script",
        default=os.path.join(REPO_ROOT, "train.py"),
        help="training entry point (default: this repository's train.py)",
    )
    run.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds one training run may take (default: %(default)s)"
    )
    run.add_argument("--stream", action="store_true", help="echo the runs' output while they run")
    folders = parser.add_argument_group("folder mode")
    folders.add_argument("--baseline-folder", help="existing dump folder (or TensorBoard folder) of the baseline")
    folders.add_argument("--test-folder", help="existing dump folder (or TensorBoard folder) of the test run")
    check = parser.add_argument_group("comparison")
    check.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance (default: %(default)s)")
    check.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default: %(default)s)")
    check.add_argument(
        "--tags",
        default=",".join(DEFAULT_TAGS),
        help="comma-separated TensorBoard tags to compare (default: %(default)s)",
    )
    return parser


# ------------------------------------------------------------------------- running


def train_command(args, ngpu: int, run_options: str, dump_folder: str) -> list[str]:
    forced = [
        "--training.steps",
        str(args.steps),
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "true",
        "--job.dump_folder",
        dump_folder,
    ]
    if args.seed is not None:
        forced += ["--debug.seed", str(args.seed)]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ngpu}",
        args.train_script,
        "--job.config_file",
        args.config,
        *shlex.split(args.options),
        *shlex.split(run_options),
        *forced,
    ]


def _prepare_dump_folder(folder: str) -> None:
    """Empty ``folder`` if it holds an earlier comparison's run; refuse anything else."""
    if os.path.isdir(folder) and os.listdir(folder):
        foreign = sorted(set(os.listdir(folder)) - _OWN_ENTRIES)
        if foreign and not os.path.isfile(os.path.join(folder, LOG_NAME)):
            raise Trouble(
                f"{folder} already exists and holds files this tool did not write ({', '.join(foreign[:5])}); "
                "choose another --output-folder"
            )
        shutil.rmtree(folder)
    elif os.path.exists(folder) and not os.path.isdir(folder):
        raise Trouble(f"{folder} exists and is not a folder; choose another --output-folder")
    os.makedirs(folder, exist_ok=True)


def run_training(name: str, cmd: list[str], dump_folder: str, timeout: float, stream: bool) -> None:
    _prepare_dump_folder(dump_folder)
    log_path = os.path.join(dump_folder, LOG_NAME)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    print(f"[{name}] {shlex.join(cmd)}", flush=True)
    print(f"[{name}] log: {log_path}", flush=True)
    start = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        copier = threading.Thread(target=_copy_output, args=(proc.stdout, log, name if stream else None), daemon=True)
        copier.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            copier.join(timeout=10)
            raise Trouble(
                f"{name} run did not finish within {timeout:.0f} s; last lines of {log_path}:\n" + _tail(log_path)
            ) from None
        except KeyboardInterrupt:
            _kill(proc)
            raise
        copier.join(timeout=30)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise Trouble(
            f"{name} run failed (exit status {proc.returncode}) after {elapsed:.1f} s; last lines of {log_path}:\n"
            + _tail(log_path)
        )
    print(f"[{name}] finished in {elapsed:.1f} s", flush=True)


def _copy_output(pipe, log, echo_prefix: str | None) -> None:
    for line in pipe:
        log.write(line)
        log.flush()
        if echo_prefix is not None:
            sys.stdout.write(f"[{echo_prefix}] {line}")
            sys.stdout.flush()


def _kill(proc: subprocess.Popen) -> None:
    """Stop the launcher and its ranks: SIGTERM first, since torchrun starts its ranks in sessions
    of their own and only it can end them; SIGKILL of the launcher's group after its grace."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=35)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _tail(path: str, lines: int = 40) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read().splitlines()[-lines:]
    return "\n".join("    | " + line for line in text)


# ----------------------------------------------------------------------- comparing


def tensorboard_folder(folder: str) -> str:
    """The TensorBoard folder of a dump folder, or ``folder`` itself when it holds event files."""
    if not os.path.isdir(folder):
        raise Trouble(f"folder {folder!r} does not exist")
    config_path = os.path.join(folder, "config.toml")
    sub = "tb"
    if os.path.isfile(config_path):
        try:
            with open(config_path, "rb") as f:
                sub = tomllib.load(f).get("metrics", {}).get("save_tb_folder", sub)
        except tomllib.TOMLDecodeError as err:
            raise Trouble(f"{config_path} is not valid TOML: {err}") from None
    candidate = os.path.join(folder, sub)
    if os.path.isdir(candidate) and event_files(candidate):
        return candidate
    if any(os.path.dirname(f) == folder for f in event_files(folder)):
        return folder
    raise Trouble(
        f"no TensorBoard event files in {candidate!r} or {folder!r}: is {folder!r} the dump folder of a run "
        "that logged with --metrics.enable_tensorboard true?"
    )


def load(folder: str, tags: list[str], name: str) -> dict[str, dict[int, float]]:
    tb = tensorboard_folder(folder)
    try:
        scalars = read_scalars(tb)
    except ValueError as err:
        raise Trouble(f"{name}: {err}") from None
    missing = [t for t in tags if not scalars.get(t)]
    if missing:
        raise Trouble(f"{name} run ({tb}) logged no {', '.join(missing)}; it has: {', '.join(sorted(scalars))}")
    return {t: scalars[t] for t in tags}


def rel_diff(baseline: float, test: float) -> float:
    if math.isnan(baseline) or math.isnan(test):
        return math.nan
    if baseline == test:
        return 0.0
    return abs(test - baseline) / abs(baseline) if baseline != 0 else math.inf


def within(baseline: float, test: float, rtol: float, atol: float) -> bool:
    if math.isnan(baseline) or math.isnan(test):
        return False
    return abs(test - baseline) <= atol + rtol * abs(baseline)


def compare(baseline: dict, test: dict, tags: list[str], rtol: float, atol: float) -> int:
    """Print the table and verdict; return the exit status (0 or 1)."""
    ok = True
    for tag in tags:
        only_base = sorted(set(baseline[tag]) - set(test[tag]))
        only_test = sorted(set(test[tag]) - set(baseline[tag]))
        if only_base or only_test:
            ok = False
            print(
                f"FAIL: {tag}: the runs logged different steps: only baseline {_steps(only_base)}, "
                f"only test {_steps(only_test)}"
            )
    steps = sorted(set().union(*(set(baseline[t]) & set(test[t]) for t in tags)))
    header = ["step"]
    for tag in tags:
        short = SHORT_NAMES.get(tag, tag)
        header += [f"{short} base", f"{short} test", f"{short} rel"]
    rows, worst = [], {t: 0.0 for t in tags}
    failed_steps = []
    for step in steps:
        row, step_ok = [str(step)], True
        for tag in tags:
            if step not in baseline[tag] or step not in test[tag]:
                row += ["-", "-", "-"]
                continue
            b, t = baseline[tag][step], test[tag][step]
            r = rel_diff(b, t)
            worst[tag] = r if math.isnan(r) or math.isnan(worst[tag]) else max(worst[tag], r)
            good = within(b, t, rtol, atol)
            step_ok &= good
            row += [f"{b:.8g}", f"{t:.8g}", f"{r:.2e}" + ("" if good else " !")]
        if not step_ok:
            failed_steps.append(step)
        rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
    for tag in tags:
        print(f"max relative difference of {tag}: {worst[tag]:.3e}")
    if failed_steps:
        ok = False
        print(
            f"FAIL: {len(failed_steps)} step(s) differ by more than rtol={rtol:g}, atol={atol:g}: "
            f"{_steps(failed_steps)} (marked !)"
        )
    if not steps:
        ok = False
        print("FAIL: the runs have no step in common")
    if ok:
        print(f"PASS: {len(steps)} steps agree within rtol={rtol:g}, atol={atol:g}")
    return EXIT_OK if ok else EXIT_DIFFERENT


def _steps(steps: list[int]) -> str:
    return "[" + ", ".join(map(str, steps[:20])) + (", ...]" if len(steps) > 20 else "]")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    tags = [t.strip() for t in args.tags.split(",") if t.strip()]
    if not tags:
        parser.error("--tags names no tag")
    if args.rtol < 0 or args.atol < 0:
        parser.error("--rtol and --atol must be >= 0")
    try:
        if args.baseline_folder or args.test_folder:
            if not (args.baseline_folder and args.test_folder):
                parser.error("folder mode needs both --baseline-folder and --test-folder")
            baseline_dir, test_dir = args.baseline_folder, args.test_folder
        else:
            if args.steps < 1 or args.baseline_ngpu < 1 or args.test_ngpu < 1:
                parser.error("--steps, --baseline-ngpu and --test-ngpu must be >= 1")
            if not os.path.isfile(args.config):
                raise Trouble(f"--config {args.config!r}: file not found")
            for opt in ("options", "baseline_options", "test_options"):
                try:
                    shlex.split(getattr(args, opt))
                except ValueError as err:
                    parser.error(f"--{opt.replace('_', '-')}: {err}")
            baseline_dir = os.path.join(args.output_folder, "baseline")
            test_dir = os.path.join(args.output_folder, "test")
            for name, ngpu, options, folder in (
                ("baseline", args.baseline_ngpu, args.baseline_options, baseline_dir),
                ("test", args.test_ngpu, args.test_options, test_dir),
            ):
                run_training(name, train_command(args, ngpu, options, folder), folder, args.timeout, args.stream)
        baseline = load(baseline_dir, tags, "baseline")
        test = load(test_dir, tags, "test")
    except Trouble as err:
        print(f"loss_compare: error: {err}", file=sys.stderr)
        return EXIT_TROUBLE
    print(f"baseline: {baseline_dir}\ntest:     {test_dir}")
    return compare(baseline, test, tags, args.rtol, args.atol)


if __name__ == "__main__":
    sys.exit(main())
