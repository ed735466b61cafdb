"""The GPU path checked and measured in one run, written to one page: the `cuda` tests, SFT of a
Qwen3-0.6B-shaped model, the embedded GRPO recipe and the rollout generator.

    bash scripts/gpu_check.sh                                # on a GPU: rewrites docs/benchmarks/gpu.md
    bash scripts/gpu_check.sh --log-dir "$OUT/logs"; cp docs/benchmarks/gpu.md "$OUT/"   # a lent machine
    bash scripts/gpu_check.sh --cpu --out /tmp/gpu.md        # the same steps at tiny sizes on CPU

Run it through ``scripts/gpu_check.sh`` (which puts carried wheels on the path). The steps run
one after the other, each even when an earlier one failed; the page lists the failed steps with
their error and the exit status is then 1. Each step's whole output is kept in ``--log-dir``.

1. tests: ``pytest -m cuda tests/``. On CPU every selected test skips: what is checked there is
   that the command runs and that no `cuda` test fails without a GPU.
2. SFT: ``train.py`` under ``torchrun --nproc_per_node=1`` on synthetic text rows of varied
   lengths (the byte tokenizer: one token per character), the ``0.6B`` flavor from random
   initialization with bf16 parameters (FSDP mixed precision, as training runs on CUDA), once
   per attention backend, flex and sdpa_varlen (CPU: the ``debugmodel``, sdpa_varlen only).
   Tokens/s, MFU and peak memory are train.py's own metrics read back from TensorBoard: medians
   of the steps after the first few, which compile, and the peak over the run.
3. GRPO: ``train_configs/debug_grpo.toml`` as shipped (its SFT warm-up included) for a few RL
   steps (CPU: a 10-step warm-up): RL step time and generation tokens/s (medians of the steps
   after the first), mean reward of the first and the last step.
4. generator: ``scripts/benchmark_generator.py`` at 64 and 256 rows (CPU: 4 and 8, fewer
   tokens), eager and compiled, on that benchmark's length-skewed workload.

``--budget-s`` bounds the whole run: each step gets at most its own limit and what is left of
the budget, and a step left without time is reported failed.
"""

import argparse
import json
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from bench_common import ROOT, launch_env, launcher, markdown_table, publish, ratio
from gpu_wheels import OPTIONAL_MODULES, REQUIRED_MODULES, module_versions

DEFAULT_PAGE = os.path.join(ROOT, "docs", "benchmarks", "gpu.md")
GRPO_RECIPE = "train_configs/debug_grpo.toml"
SFT_RECIPE = "train_configs/debug_model.toml"  # its byte tokenizer and optimizer; the rest is overridden
MIN_STEP_SECONDS = 15  # a step with less of the budget left is not started
ERROR_CHARS = 300
STOP_GRACE_SECONDS = 35  # torchrun gives its workers 30 s after a SIGTERM


@dataclass(frozen=True)
class Plan:
    """The sizes of one mode (GPU or CPU)."""

    device: str
    flavor: str
    backends: tuple[str, ...]
    seq_len: int
    min_sample_len: int
    global_batch_size: int
    max_tokens_per_microbatch: int
    sft_steps: int
    sft_uncounted_steps: int  # the first steps compile: not in the medians
    grpo_steps: int
    grpo_overrides: tuple[str, ...]
    generator_rows: tuple[int, ...]
    generator_args: tuple[str, ...]  # benchmark_generator.py's sizes, when not its defaults
    budget_s: float
    step_limits_s: dict[str, float] = field(default_factory=dict)


GPU_PLAN = Plan(
    device="cuda",
    flavor="0.6B",
    backends=("flex", "sdpa_varlen"),
    seq_len=2048,
    min_sample_len=256,
    global_batch_size=32,
    max_tokens_per_microbatch=8192,
    sft_steps=8,
    sft_uncounted_steps=3,
    grpo_steps=4,
    grpo_overrides=(),
    generator_rows=(64, 256),
    generator_args=(),
    # Measured on H100s: tests 123-141 s, SFT 108-144 s under flex (its first step compiles
    # for 84-114 s) and 61-68 s under sdpa_varlen, GRPO 78-96 s, generator 125-134 s: up to
    # 583 s in all. The budget fits one 600 s device command, with the wheels' install.
    budget_s=585,
    step_limits_s={"tests": 170, "sft": 170, "grpo": 120, "generator": 170},
)
CPU_PLAN = Plan(
    device="cpu",
    flavor="debugmodel",
    backends=("sdpa_varlen",),
    seq_len=128,
    min_sample_len=16,
    global_batch_size=8,
    max_tokens_per_microbatch=512,
    sft_steps=3,
    sft_uncounted_steps=1,
    grpo_steps=2,
    grpo_overrides=("--rl.sft_warmup_steps", "10"),
    generator_rows=(4, 8),
    generator_args=("--samples", "4", "--max-new-tokens", "32", "--batches", "1", "--rounds", "1"),
    budget_s=600,
    step_limits_s={"tests": 180, "sft": 120, "grpo": 150, "generator": 240},
)


@dataclass
class StepResult:
    name: str
    ok: bool
    seconds: float
    error: str = ""
    figures: dict = field(default_factory=dict)


@dataclass
class Context:
    plan: Plan
    work_dir: str
    log_dir: str
    deadline: float

    def limit(self, step: str) -> float:
        """Seconds the next command of ``step`` may run; TimeoutError when the budget is spent."""
        left = self.deadline - time.monotonic()
        if left < MIN_STEP_SECONDS:
            raise TimeoutError(f"not started: {left:.0f} s of --budget-s left")
        return min(self.plan.step_limits_s[step], left)


# ------------------------------------------------------------------------- running commands


def run_command(ctx: Context, step: str, log_name: str, cmd: list[str], env: dict | None = None) -> str:
    """Run ``cmd`` in its own process group, its output saved to ``log_dir/log_name.log``;
    returns the output, raises RuntimeError with the telling line when it fails or runs out of
    time. At the time limit the group gets SIGTERM first: torchrun starts its workers in sessions
    of their own, so only torchrun itself can end them (a SIGKILL of its group alone left a
    worker training on, holding the GPU during the next step)."""
    timeout = ctx.limit(step)
    log_path = os.path.join(ctx.log_dir, f"{log_name}.log")
    print(f"[gpu_check] {step}: {shlex.join(cmd)} (limit {timeout:.0f} s, log {log_path})", flush=True)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        timed_out = True
    with open(log_path, "w", encoding="utf-8") as f:
        f.write(f"$ {shlex.join(cmd)}\n{output}")
    if timed_out:
        raise RuntimeError(f"ran past its limit of {timeout:.0f} s (log: {log_path})")
    if proc.returncode != 0 and not (step == "tests" and proc.returncode in accepted_pytest_codes(ctx.plan)):
        print("\n".join(output.splitlines()[-40:]), flush=True)
        raise RuntimeError(f"exit status {proc.returncode}: {telling_line(output)}")
    return output


def accepted_pytest_codes(plan: Plan) -> tuple[int, ...]:
    # pytest exits 1 when a test failed (reported as a failed step after the counts are read),
    # 5 when it collected nothing, accepted on CPU only.
    return (1, 5) if plan.device == "cpu" else (1,)


def telling_line(output: str) -> str:
    """The line of a failed run's output that says most: its last error line, else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip().strip("=")]
    # torchrun's own summary ("ChildFailedError") names no cause; prefer the worker's error.
    errors = [line for line in lines if ("Error" in line or "error:" in line) and "ChildFailedError" not in line]
    return (errors or lines or ["no output"])[-1][-ERROR_CHARS:]


def train(ctx: Context, step: str, log_name: str, overrides: list[str]) -> tuple[dict[str, dict[int, float]], float]:
    """``train.py OVERRIDES`` on one process under torchrun, TensorBoard on; its scalars and wall seconds."""
    from torchtitan_rl.tensorboard_io import read_scalars

    dump = os.path.join(ctx.work_dir, log_name)
    cmd = [*launcher(1), "train.py", *overrides, "--metrics.enable_tensorboard", "true"]
    cmd += ["--metrics.save_tb_folder", "tb", "--metrics.log_freq", "1", "--job.dump_folder", dump]
    start = time.perf_counter()
    run_command(ctx, step, log_name, cmd, env=launch_env())
    return read_scalars(os.path.join(dump, "tb")), time.perf_counter() - start


def series(scalars: dict[str, dict[int, float]], tag: str, after_step: int = 0) -> list[float]:
    """The values of ``tag`` at the steps after ``after_step``, in step order."""
    if tag not in scalars:
        raise RuntimeError(f"the run logged no {tag!r}")
    values = [value for step, value in sorted(scalars[tag].items()) if step > after_step]
    if not values:
        raise RuntimeError(f"the run logged no {tag!r} after step {after_step}")
    return values


# ------------------------------------------------------------------------- the steps


def step_tests(ctx: Context) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "tests/", "-q", "-rfE", "-p", "no:cacheprovider"]
    output = run_command(ctx, "tests", "tests", cmd)
    summary = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|deselected)", line)]
    if not summary:
        raise RuntimeError(f"no pytest summary line: {telling_line(output)}")
    counts = dict.fromkeys(("passed", "failed", "errors", "skipped", "deselected"), 0)
    for count, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)", summary[-1]):
        counts["errors" if word.startswith("error") else word] = int(count)
    # -rfE lists them as "FAILED tests/x.py::test_y - message" (ERROR for errors).
    failing = [line for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    counts["failing"] = [line.split(" - ")[0].split(" ", 1)[1] for line in failing]
    if counts["failed"] or counts["errors"]:
        raise StepFailed(
            f"{counts['failed']} failed, {counts['errors']} errors: {', '.join(counts['failing'])}", counts
        )
    if ctx.plan.device == "cuda" and not counts["passed"]:
        raise StepFailed("no `cuda` test passed", counts)
    return counts


def write_sft_rows(ctx: Context, num_rows: int) -> str:
    """Text rows of lengths uniform in [min_sample_len, seq_len) characters (seeded)."""
    plan = ctx.plan
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 .,+-="
    path = os.path.join(ctx.work_dir, "sft_rows.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(num_rows):
            length = rng.randrange(plan.min_sample_len, plan.seq_len)
            f.write(json.dumps({"text": "".join(rng.choices(alphabet, k=length))}) + "\n")
    return path


def sft_overrides(plan: Plan, backend: str, rows_path: str) -> list[str]:
    """train.py's command line for the SFT step."""
    return [
        *("--job.config_file", SFT_RECIPE),
        *("--model.flavor", plan.flavor, "--model.attn_backend", backend),
        *("--training.dataset_path", rows_path, "--training.steps", str(plan.sft_steps)),
        *("--training.seq_len", str(plan.seq_len), "--training.global_batch_size", str(plan.global_batch_size)),
        *("--training.max_tokens_per_microbatch", str(plan.max_tokens_per_microbatch)),
        *("--training.mixed_precision_param", "bfloat16", "--lr_scheduler.warmup_steps", "0"),
    ]


def grpo_overrides(plan: Plan) -> list[str]:
    """train.py's command line for the GRPO step."""
    return ["--job.config_file", GRPO_RECIPE, "--training.steps", str(plan.grpo_steps), *plan.grpo_overrides]


def estimated_peak_gib(overrides: list[str], device: str) -> float:
    """``train.py --estimate``'s peak for one rank of this run (the compute dtype of ``device``)."""
    from torchtitan_rl.distributed.parallel_dims import ParallelDims
    from torchtitan_rl.estimate.memory import GIB, estimate_memory
    from torchtitan_rl.recipes.base import lora_settings
    from torchtitan_rl.recipes.config_checks import parse_job_config
    from torchtitan_rl.recipes.estimate import estimate_model_args

    config = parse_job_config(overrides)
    dtype = config.training.mixed_precision_param if device == "cuda" else "float32"
    dims = ParallelDims.from_config(config.parallelism, 1)
    (estimate,) = estimate_memory(config, estimate_model_args(config), dims, lora_settings(config), dtype)
    return estimate.peak / GIB


def step_sft(ctx: Context, backend: str) -> dict:
    plan = ctx.plan
    rows = write_sft_rows(ctx, num_rows=plan.sft_steps * plan.global_batch_size)
    overrides = sft_overrides(plan, backend, rows)
    scalars, wall = train(ctx, "sft", f"sft_{backend}", overrides)
    memory_tag = "memory/max_active(GiB)" if plan.device == "cuda" else "memory/peak_rss(GiB)"
    figures = {
        "tokens_per_s": statistics.median(series(scalars, "throughput(tps)", plan.sft_uncounted_steps)),
        "peak_memory_gib": max(series(scalars, memory_tag)),
        "estimated_peak_gib": estimated_peak_gib(overrides, plan.device),
        "wall_s": wall,
    }
    if "mfu(%)" in scalars:
        figures["mfu_percent"] = statistics.median(series(scalars, "mfu(%)", plan.sft_uncounted_steps))
    return figures


def step_grpo(ctx: Context) -> dict:
    scalars, wall = train(ctx, "grpo", "grpo", grpo_overrides(ctx.plan))
    rewards = series(scalars, "rl/reward_mean")
    return {
        "step_s": statistics.median(series(scalars, "time/step_s", after_step=1)),
        "generate_tokens_per_s": statistics.median(series(scalars, "throughput/generate_tps", after_step=1)),
        "reward_first": rewards[0],
        "reward_last": rewards[-1],
        "wall_s": wall,
    }


def step_generator(ctx: Context) -> dict:
    out = os.path.join(ctx.work_dir, "generator.json")
    rows = [str(n) for n in ctx.plan.generator_rows]
    cmd = [sys.executable, "scripts/benchmark_generator.py", "--device", ctx.plan.device, "--rows", *rows]
    cmd += ["--compile", "both", *ctx.plan.generator_args, "--json", out, "--no-write"]
    output = run_command(ctx, "generator", "generator", cmd)
    if not os.path.exists(out):
        raise RuntimeError(f"scripts/benchmark_generator.py wrote no {out}: {telling_line(output)}")
    with open(out, encoding="utf-8") as f:
        records = json.load(f)
    if not isinstance(records, list) or not records:
        raise RuntimeError(f"scripts/benchmark_generator.py wrote no records to {out}")
    for record in records:
        if not {"rows", "compile", "tokens_per_s"} <= set(record):
            raise RuntimeError(f"a generator record lacks rows / compile / tokens_per_s: {record}")
    return {"records": records}


class StepFailed(RuntimeError):
    """A step that ran to the end and measured, but whose result is a failure (failing tests)."""

    def __init__(self, message: str, figures: dict):
        super().__init__(message)
        self.figures = figures


def run_step(name: str, function: Callable[[], dict]) -> StepResult:
    start = time.perf_counter()
    try:
        figures = function()
        result = StepResult(name, True, time.perf_counter() - start, figures=figures)
    except StepFailed as err:
        result = StepResult(name, False, time.perf_counter() - start, str(err), err.figures)
    except (RuntimeError, TimeoutError, OSError, ValueError, KeyError) as err:
        result = StepResult(name, False, time.perf_counter() - start, f"{type(err).__name__}: {err}")
    status = "ok" if result.ok else f"FAILED ({result.error})"
    print(f"[gpu_check] {name}: {status} in {result.seconds:.0f} s", flush=True)
    return result


# ------------------------------------------------------------------------- the page


def number(value: float | None, digits: int = 0) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def failure_line(result: StepResult) -> str:
    return f"Failed: {result.error.replace(chr(10), ' ')}"


def environment_lines(plan: Plan, wall_s: float) -> list[str]:
    lines = [f"Device: {torch.cuda.get_device_name() if plan.device == 'cuda' else 'CPU'}, torch {torch.__version__}"]
    if plan.device == "cuda":
        from torchtitan_rl.metrics import _peak_flops

        versions = module_versions(("triton",))
        peak = _peak_flops(torch.device("cuda"))
        lines[0] += f", CUDA {torch.version.cuda}, triton {versions['triton'] or 'missing'}"
        lines.append(
            "MFU is train.py's `mfu(%)` against "
            + (f"{peak / 1e12:.0f} TFLOP/s dense bf16" if peak else "no known peak for this device (not reported)")
            + " (`torchtitan_rl/metrics.py`)."
        )
    missing = [m for m, v in module_versions(REQUIRED_MODULES + OPTIONAL_MODULES).items() if v is None]
    lines.append(f"Modules missing: {', '.join(missing) if missing else 'none'}.")
    site = os.environ.get("GPU_CHECK_SITE")
    if site and os.path.isdir(site):
        carried = sorted(n[: -len(".dist-info")] for n in os.listdir(site) if n.endswith(".dist-info"))
        lines.append(f"Installed from `.whl/`: {', '.join(carried)}.")
    lines.append(f"Wall time of the whole check: {wall_s:.0f} s.")
    return [f"- {line}" for line in lines]


def tests_section(result: StepResult) -> list[str]:
    lines = ["## `cuda` tests", "", "`pytest -m cuda tests/`.", ""]
    figures = result.figures
    if figures:
        keys = ("passed", "failed", "errors", "skipped", "deselected")
        lines += markdown_table([*keys, "time"], [[*(figures[k] for k in keys), f"{result.seconds:.0f} s"]])
        if figures["failing"]:
            lines += ["", *(f"- failing: `{name}`" for name in figures["failing"])]
    if not result.ok:
        lines += ["", failure_line(result)]
    return lines


def sft_section(plan: Plan, results: list[StepResult]) -> list[str]:
    precision = (
        "bf16 parameters, fp32 master weights and reductions (FSDP mixed precision)"
        if plan.device == "cuda"
        else "fp32 (the CPU trains in fp32)"
    )
    lines = [
        "## SFT",
        "",
        f"`train.py` on 1 process, flavor `{plan.flavor}` from random initialization, {precision}, synthetic text rows of "
        f"{plan.min_sample_len}-{plan.seq_len} tokens, `training.seq_len = {plan.seq_len}`, "
        f"`training.global_batch_size = {plan.global_batch_size}`, "
        f"`training.max_tokens_per_microbatch = {plan.max_tokens_per_microbatch}`, {plan.sft_steps} steps; tokens/s "
        f"and MFU are medians of the steps after the first {plan.sft_uncounted_steps}, peak memory the run's "
        f"{'`memory/max_active(GiB)`' if plan.device == 'cuda' else '`memory/peak_rss(GiB)`'} (its largest value), "
        "beside `train.py --estimate`'s peak for the same arguments (docs/memory.md; samples shorter than "
        "`training.seq_len` fill a micro-batch less than the estimate assumes).",
        "",
    ]
    rows = []
    for result in results:
        f = result.figures
        if result.ok:
            mfu = number(f.get("mfu_percent"), 1)
            rows.append([f"`{result.name[4:]}`", number(f["tokens_per_s"]), mfu, number(f["peak_memory_gib"], 2)])
            rows[-1] += [number(f["estimated_peak_gib"], 2), f"{f['wall_s']:.0f} s"]
    header = ["attention backend", "tokens/s", "MFU (%)", "peak memory (GiB)", "estimated peak (GiB)", "wall time"]
    lines += markdown_table(header, rows) if rows else []
    for result in results:
        if not result.ok:
            lines += ["", f"`{result.name[4:]}`: {failure_line(result)}"]
    return lines


def grpo_section(plan: Plan, result: StepResult) -> list[str]:
    warmup = "its SFT warm-up as shipped" if not plan.grpo_overrides else f"`{shlex.join(plan.grpo_overrides)}`"
    lines = [
        "## GRPO",
        "",
        f"`{GRPO_RECIPE}` on 1 process, {warmup}, {plan.grpo_steps} RL steps; step time and generation tokens/s "
        "are medians of the RL steps after the first; reward is `rl/reward_mean` of the first and the last.",
        "",
    ]
    if result.ok:
        f = result.figures
        header = ["RL step time", "generation tokens/s", "reward first → last", "wall time (warm-up included)"]
        row = [f"{f['step_s']:.2f} s", number(f["generate_tokens_per_s"])]
        row += [f"{f['reward_first']:.3f} → {f['reward_last']:.3f}", f"{f['wall_s']:.0f} s"]
        lines += markdown_table(header, [row])
    else:
        lines.append(failure_line(result))
    return lines


def generator_section(plan: Plan, result: StepResult) -> list[str]:
    args = ["--device", plan.device, "--rows", *map(str, plan.generator_rows), "--compile", "both"]
    lines = [
        "## Generator",
        "",
        f"`{shlex.join(['python', 'scripts/benchmark_generator.py', *args, *plan.generator_args])}` "
        "(its length-skewed workload; see that script).",
        "",
    ]
    if not result.ok:
        return lines + [failure_line(result)]
    table = []
    for record in result.figures["records"]:
        memory = record.get("peak_memory_bytes")
        table.append(
            [
                record["rows"],
                f"`{record['compile']}`",
                number(record["tokens_per_s"]),
                number(memory and memory / 2**20, 1),
            ]
        )
    lines += markdown_table(["rows", "compile", "tokens/s", "peak memory (MiB)"], table)
    speed = {(r["rows"], r["compile"]): r["tokens_per_s"] for r in result.figures["records"]}
    ratios = [
        f"{rows} rows {ratio(speed[rows, 'compiled'], speed[rows, 'eager'])}"
        for rows in plan.generator_rows
        if (rows, "compiled") in speed and (rows, "eager") in speed
    ]
    return lines + (["", f"Compiled / eager tokens/s: {', '.join(ratios)}."] if ratios else [])


def page_command(argv: list[str]) -> str:
    """The wrapper's command line, without the options that only say where output goes."""
    shown, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--out", "--log-dir"):
            skip = True
        elif not arg.startswith(("--out=", "--log-dir=")):
            shown.append(arg)
    return shlex.join(["bash", "scripts/gpu_check.sh", *shown])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="tiny sizes on the CPU (what CI runs)")
    parser.add_argument(
        "--out", help=f"page to write (default: {os.path.relpath(DEFAULT_PAGE, ROOT)}; with --cpu a temporary file)"
    )
    parser.add_argument("--log-dir", help="folder for each step's whole output (default: a temporary folder)")
    parser.add_argument("--budget-s", type=float, help="seconds for the whole check (default: 585 on GPU, 600 on CPU)")
    args = parser.parse_args()
    plan = CPU_PLAN if args.cpu else GPU_PLAN
    if plan.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run the GPU check on a GPU machine, or pass --cpu")
    page = args.out or (os.path.join(tempfile.mkdtemp(prefix="gpu_check_"), "gpu.md") if args.cpu else DEFAULT_PAGE)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="gpu_check_logs_")
    os.makedirs(log_dir, exist_ok=True)
    start = time.monotonic()

    with tempfile.TemporaryDirectory(prefix="gpu_check_work_") as work_dir:
        ctx = Context(plan, work_dir, log_dir, start + (args.budget_s or plan.budget_s))
        tests = run_step("tests", lambda: step_tests(ctx))
        sft = [run_step(f"sft/{b}", lambda b=b: step_sft(ctx, b)) for b in plan.backends]
        grpo = run_step("grpo", lambda: step_grpo(ctx))
        generator = run_step("generator", lambda: step_generator(ctx))
    results = [tests, *sft, grpo, generator]
    failed = [r for r in results if not r.ok]

    body = [
        *environment_lines(plan, time.monotonic() - start),
        "",
        "## Failed steps",
        "",
        *([f"- {r.name}: {r.error}" for r in failed] or ["none"]),
        "",
        *tests_section(tests),
        "",
        *sft_section(plan, sft),
        "",
        *grpo_section(plan, grpo),
        "",
        *generator_section(plan, generator),
    ]
    summary = (
        "The GPU path in one run (`scripts/gpu_check.sh`): the `cuda` tests, SFT tokens/s, MFU and memory of a "
        "Qwen3-0.6B-shaped model under flex and sdpa_varlen, the embedded GRPO recipe, and generator tokens/s "
        "eager vs compiled."
    )
    if args.cpu:
        summary += " This page is the script's CPU mode (tiny sizes): its figures say only that every step runs."
    publish(argparse.Namespace(page=page, no_write=False), "GPU check", summary, body, page_command(sys.argv[1:]))
    print(f"[gpu_check] {len(failed)} of {len(results)} steps failed; page: {page}; logs: {log_dir}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
