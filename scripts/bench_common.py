"""What the benchmark scripts share: the machine line, alternating timings, launching ``train.py``
(or a script's own ranks), markdown tables, and the page each benchmark rewrites.

A benchmark publishes one page, ``docs/benchmarks/<name>.md``: a title, a one-line summary,
the command, the machine and date, and its tables. Rerunning it rewrites the page; a
``## Notes`` section written by hand at the end of the page is kept. ``docs/benchmarks/README.md``
is the index of the pages, remade from their titles and summaries on every publish.

Ratios between variants are only meaningful when the variants ran in the same process on
the same machine at the same time (the machines are often shared), so the timing helpers
alternate the variants round by round, reversing the order every other round, and report
medians.
"""

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # a python without the editable install still finds this checkout
    sys.path.insert(0, ROOT)

DOCS = os.path.join(ROOT, "docs", "benchmarks")
INDEX = "README.md"
NOTES_HEADING = "## Notes"
RESULT_PREFIX = "RESULT "
# torchrun's variables of an enclosing job would make a launched run join that job.
_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# ------------------------------------------------------------------------- the machine


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line() -> str:
    """CPU model and cores, torch version, and the GPUs (or "no GPU"), in one line."""
    import torch

    if torch.cuda.is_available():
        gpu = f"{torch.cuda.device_count()} × {torch.cuda.get_device_name()}"
    else:
        gpu = "no GPU"
    return f"{cpu_model()} ({platform.machine()}, {os.cpu_count()} cores), torch {torch.__version__}, {gpu}"


# ------------------------------------------------------------------------- timing


def alternating_order(names: list[str], rounds: int) -> list[list[str]]:
    """The order of the variants in each round: as given, then reversed, and so on, so that a
    change of the machine's load during a round does not always hit the same variant first."""
    return [list(names) if r % 2 == 0 else list(reversed(names)) for r in range(rounds)]


def collect_alternating(variants: dict[str, Callable], rounds: int) -> dict[str, list]:
    """``{name: [what the call returned, one per round]}``, the calls alternating (for runs
    that measure themselves, e.g. launches)."""
    results = {name: [] for name in variants}
    for order in alternating_order(list(variants), rounds):
        for name in order:
            results[name].append(variants[name]())
    return results


def time_alternating(
    variants: dict[str, Callable[[], object]],
    rounds: int,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Median seconds of one call of each variant over ``rounds`` alternating rounds, after
    ``warmup`` rounds that are not counted (compilation, caches, first allocations)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    seconds = {name: [] for name in variants}
    for index, order in enumerate(alternating_order(list(variants), warmup + rounds)):
        for name in order:
            start = clock()
            variants[name]()
            if index >= warmup:
                seconds[name].append(clock() - start)
    return {name: statistics.median(values) for name, values in seconds.items()}


def peak_bytes(run: Callable[[], object], device) -> int:
    """Peak bytes allocated during ``run()`` above what was allocated before it: CUDA's
    allocator statistics on a GPU, the profiler's memory events on the CPU."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    from torchtitan_rl.profiling import cpu_memory_timeline

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    return cpu_memory_timeline(prof)["peak_allocated_bytes"]


def ratio(value: float, reference: float, digits: int = 2) -> str:
    """``value / reference`` as ``"1.23x"``; ``"—"`` when the reference is zero."""
    return f"{value / reference:.{digits}f}x" if reference else "—"


# ------------------------------------------------------------------------- launching


def launch_env(extra: dict | None = None) -> dict:
    """This process's environment for a child launch: one intra-op thread per process (ranks
    share the cores), no torchrun variables of an enclosing job, then ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


def launcher(ranks: int | None) -> list[str]:
    """``torchrun --standalone --nproc_per_node=ranks``, or plain ``python`` for ``None``."""
    if ranks is None:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]


@dataclass
class TrainRun:
    """One ``train.py`` run: wall-clock seconds including start-up, and its TensorBoard scalars."""

    wall_s: float
    scalars: dict[str, dict[int, float]]
    command: list[str]

    def series(self, tag: str) -> dict[int, float]:
        if tag not in self.scalars:
            raise KeyError(f"the run logged no {tag!r}; it has: {', '.join(sorted(self.scalars))}")
        return self.scalars[tag]

    def first_last(self, tag: str) -> tuple[float, float]:
        values = self.series(tag)
        return values[min(values)], values[max(values)]


def run_train(
    overrides: list[str],
    ranks: int | None = 2,
    dump_folder: str | None = None,
    env: dict | None = None,
    timeout: float | None = None,
    root: str = ROOT,
) -> TrainRun:
    """Run ``train.py OVERRIDES`` (under torchrun with ``ranks`` processes, or plain python for
    ``None``) and read back what it logged to TensorBoard. ``root``: the source tree whose
    ``train.py`` runs, from that folder (another tree's package needs it on ``PYTHONPATH`` too).

    TensorBoard is switched on and the run writes into ``dump_folder`` (a temporary folder,
    removed afterwards, when ``None``); the forced keys come last so they win. A failed run
    raises RuntimeError with the tail of its output.
    """
    from torchtitan_rl.tensorboard_io import read_scalars

    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        dump = dump_folder or tmp
        cmd = [
            *launcher(ranks),
            os.path.join(root, "train.py"),
            *overrides,
            "--metrics.enable_tensorboard",
            "true",
            "--metrics.save_tb_folder",
            "tb",
            "--job.dump_folder",
            dump,
        ]
        start = time.perf_counter()
        proc = subprocess.run(
            cmd, check=False, cwd=root, env=launch_env(env), capture_output=True, text=True, timeout=timeout
        )
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(
                f"train.py failed (exit status {proc.returncode}): {shlex.join(cmd)}\n"
                + "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
            )
        scalars = read_scalars(os.path.join(dump, "tb"))
    return TrainRun(wall, scalars, cmd)


def launch_workers(script: str, ranks: int, args: list[str], env: dict | None = None, retries: int = 1) -> dict:
    """Run ``script --worker ARGS`` in ``ranks`` fresh torchrun processes; the dict its rank 0
    printed with ``print_result``, or ``{"error": the most telling line of output}``.

    A failed launch is retried ``retries`` times (a rendezvous port taken by another job, a
    transient gloo error), with a warning and the output's tail on stderr.
    """
    cmd = [*launcher(ranks), os.path.abspath(script), "--worker", *args]
    error = ""
    for attempt in range(retries + 1):
        proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, env=launch_env(env))
        results = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
        if proc.returncode == 0 and results:
            return json.loads(results[0][len(RESULT_PREFIX) :])
        output = [line.strip() for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
        # torchrun's own summary ("ChildFailedError") names no cause; prefer the worker's error.
        errors = [line for line in output if ("Error" in line or "error:" in line) and "ChildFailedError" not in line]
        output = [line for line in output if line.strip("=")]
        error = (errors or output or [f"exit status {proc.returncode}"])[-1][-300:]
        if attempt < retries:
            tail = "\n".join(output[-40:])
            print(
                f"warning: {shlex.join(cmd[3:])} failed ({error}); retrying. Output's tail:\n{tail}",
                file=sys.stderr,
                flush=True,
            )
    return {"error": error}


def print_result(result: dict) -> None:
    """A worker's answer to ``launch_workers`` (print it on one rank only)."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# ------------------------------------------------------------------------- publishing


def markdown_table(header: list[str], rows: list[list]) -> list[str]:
    """The lines of a markdown table; cells are ``str()``-ed, ``|`` inside a cell escaped."""
    if any(len(row) != len(header) for row in rows):
        raise ValueError(f"every row needs {len(header)} cells: {[len(row) for row in rows]}")

    def line(cells):
        return "| " + " | ".join(str(cell).replace("|", "\\|") for cell in cells) + " |"

    return [line(header), "|" + "---|" * len(header), *(line(row) for row in rows)]


def notes_of(text: str) -> str | None:
    """The hand-written ``## Notes`` section of a page (heading to the end), or None."""
    lines = text.splitlines()
    for index, line in enumerate(lines):
        if line.rstrip() == NOTES_HEADING:
            return "\n".join(lines[index:]).rstrip() + "\n"
    return None


def render_page(
    title: str, summary: str, command: str, machine: str, date: str, body: list[str], notes: str | None = None
) -> str:
    """A benchmark's page: title, summary, command, machine and date, body, then ``notes``."""
    for line in body:
        if line.rstrip() == NOTES_HEADING:
            raise ValueError(
                f"the body of {title!r} may not hold a {NOTES_HEADING!r} heading: that section is kept "
                "from the page written before"
            )
    text = (
        "\n".join(
            [f"# {title}", "", summary, "", f"Command: `{command}`", "", f"Measured {date} on {machine}.", "", *body]
        ).rstrip()
        + "\n"
    )
    return text + ("\n" + notes if notes else "")


def summary_of(text: str) -> tuple[str, str]:
    """(title, one-line summary) of a page: its ``# `` heading and the paragraph after it."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith("# "):
        raise ValueError("a benchmark page starts with a '# title' line")
    paragraph = []
    for line in lines[1:]:
        if line.strip():
            paragraph.append(line.strip())
        elif paragraph:
            break
    return lines[0][2:].strip(), " ".join(paragraph)


def script_of(text: str) -> str:
    """The script named by a page's ``Command:`` line (``"—"`` when there is none)."""
    for line in text.splitlines():
        if line.startswith("Command: `"):
            for word in line[len("Command: `") :].replace("`", " ").split():
                if word.startswith("scripts/") and word.endswith((".py", ".sh")):
                    return f"`{word}`"
    return "—"


def render_index(pages: dict[str, str]) -> str:
    """The index of ``{file name: page text}``: one table row per page, by file name."""
    rows = []
    for name in sorted(pages):
        title, summary = summary_of(pages[name])
        rows.append([f"[{title}]({name})", script_of(pages[name]), summary])
    return (
        "\n".join(
            [
                "# Benchmarks",
                "",
                "One page per benchmark script; the script rewrites its page when it runs (a hand-written",
                f"`{NOTES_HEADING}` section at the end of a page is kept). Ratios compare variants measured in",
                "the same run, alternating between them, because the machines are shared. This index is",
                "remade from the pages by every publish, or by `python scripts/bench_common.py`.",
                "",
                *markdown_table(["page", "script", "what it measures"], rows),
            ]
        )
        + "\n"
    )


def write_index(folder: str = DOCS) -> None:
    pages = {}
    for name in os.listdir(folder):
        if name.endswith(".md") and name != INDEX:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                pages[name] = f.read()
    with open(os.path.join(folder, INDEX), "w", encoding="utf-8") as f:
        f.write(render_index(pages))


def add_publish_args(parser: argparse.ArgumentParser, name: str) -> None:
    """``--no-write`` and ``--page`` (default ``docs/benchmarks/<name>.md``)."""
    parser.add_argument("--no-write", action="store_true", help="print the page only; write nothing")
    parser.add_argument(
        "--page", default=os.path.join(DOCS, f"{name}.md"), help="page to rewrite (default: %(default)s)"
    )


def command_line(argv: list[str] | None = None) -> str:
    """How the running script was called, without the publishing options (they do not change
    what is measured)."""
    argv = sys.argv if argv is None else argv
    shown, skip = [], False
    for arg in argv[1:]:
        if skip:
            skip = False
        elif arg == "--no-write":
            continue
        elif arg == "--page":
            skip = True
        elif not arg.startswith("--page="):
            shown.append(arg)
    script = os.path.relpath(os.path.abspath(argv[0]), ROOT)
    return shlex.join(["python", script, *shown])


def publish(args: argparse.Namespace, title: str, summary: str, body: list[str], command: str | None = None) -> str:
    """Print the page; unless ``--no-write``, rewrite ``--page`` keeping its ``## Notes`` (and the
    index, when the page is one of docs/benchmarks/). ``command`` is the page's command line
    (default: how this script was called). Returns the page's text."""
    page = args.page
    notes = None
    if os.path.exists(page):
        with open(page, encoding="utf-8") as f:
            notes = notes_of(f.read())
    command = command_line() if command is None else command
    text = render_page(title, summary, command, machine_line(), datetime.date.today().isoformat(), body, notes)
    print(text)
    if not args.no_write:
        os.makedirs(os.path.dirname(os.path.abspath(page)), exist_ok=True)
        with open(page, "w", encoding="utf-8") as f:
            f.write(text)
        if os.path.isdir(DOCS) and os.path.samefile(os.path.dirname(os.path.abspath(page)), DOCS):
            write_index(DOCS)
        print(f"wrote {page}", file=sys.stderr)
    return text


if __name__ == "__main__":
    write_index()  # after a page was edited by hand
