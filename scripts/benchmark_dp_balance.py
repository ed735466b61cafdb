"""Compute-balanced data parallelism and FSDP resharding, measured through ``train.py`` on 2 CPU
ranks, plus the host work of one training step.

    .venv/bin/python scripts/benchmark_dp_balance.py                   # everything; rewrites its page
    .venv/bin/python scripts/benchmark_dp_balance.py --no-write        # print the page only
    .venv/bin/python scripts/benchmark_dp_balance.py --rounds 1 --steps 3 --models debug --data varied \\
        --variants off-always,on-always --host-steps 0 --no-write     # a smoke run
    git worktree add --detach /tmp/before <commit>                     # host work before/after:
    .venv/bin/python scripts/benchmark_dp_balance.py --host-before /tmp/before

Models: the debug model (``model.flavor = "debugmodel"``) and the same 2 layers 4x wider (dim
512, 8 heads of 64, MLP 1536), given as ``model.flavor = "hf"`` with a ``config.json`` and a
byte-level ``tokenizer.json`` (the built-in byte tokenizer's ids) written to a temporary folder.
Data, written to the same folder as SFT chat rows (``messages``): ``uniform``, every row 256
tokens; ``varied``, row lengths drawn from a seeded lognormal (median 200 tokens, sigma 1,
clipped to 32..1024). Every run packs to micro-batches of 1024 tokens (``training.seq_len`` and
``training.max_tokens_per_microbatch``) and logs every step.

Variants, ``BALANCE-RESHARD``: ``training.balance_dp_compute`` off / on times
``parallelism.fsdp_reshard_after_forward`` always / default / never; the baseline is
``off-always``. For each model and data, the variants run alternately (the order reversed
every other round) for ``--rounds`` rounds. Per run, over the steps after the first
``--warmup``:

- tokens/s per rank: the steps' tokens (TensorBoard ``tokens/total``) over the steps'
  seconds (each step's window, recovered from its ``throughput(tps)``), per rank;
- CPU-seconds per token: user + system CPU time of every process of the launch (torchrun and
  the ranks, read from /proc when rank 0 logs step ``--warmup`` and the last step), over those
  tokens. ``getrusage(RUSAGE_CHILDREN)`` around the whole launch would also count the
  start-up (imports, model build, data preparation), which dominates runs this short;
- busy cores: that CPU time over the wall-clock time between the same two log lines;
- ``data/dp_cost_imbalance``: the slowest rank's estimated cost over the mean, averaged.

Every figure is the median over the rounds; every ratio is the median over the rounds of the
ratio to the baseline's run of the same round (paired ratios), for every row alike.

Host work per step (one rank, debug model, both data): ``--host-steps`` steps of
``engine.forward_backward`` + ``engine.optim_step`` of an ``SFTRecipe`` built from the same
settings, timed end to end, minus the time spent inside model compute, which is: the
model's forward (module hooks) except any attention planning inside it, ``token_loss``
(output head, loss and its gradient), ``Tensor.backward``, ``clip_grad_norm_`` and
``optimizer.step``. The rest is host work: whatever of checking, planning, packing and
counting the micro-batches and planning their attention the step still does itself, the plan
and count collectives, copying to the device, loss weights, metrics, releasing autograd
graphs, ``zero_grad`` and the LR schedule. Fetching the next batch is not in the step: the
loader prepares it on its prefetch thread, which runs during the step as it does in training
(so its contention for the interpreter is in the figure).
"""

import argparse
import collections
import dataclasses
import json
import math
import os
import random
import re
import shlex
import statistics
import string
import subprocess
import sys
import tempfile
import time

from bench_common import (
    ROOT,
    add_publish_args,
    collect_alternating,
    launch_env,
    launch_workers,
    launcher,
    markdown_table,
    print_result,
    publish,
)

RANKS = 2
SEQ_LEN = 1024
UNIFORM_LEN = 256
VARIED_MEDIAN, VARIED_SIGMA, VARIED_MIN = 200, 1.0, 32
DATA_SEED = 0
MODELS = ("debug", "wide")
DATA = ("uniform", "varied")
GLOBAL_BATCH = {"debug": 32, "wide": 16}
WIDE = {"dim": 512, "n_heads": 8, "n_kv_heads": 4, "head_dim": 64, "hidden_dim": 1536}
BALANCE = {"off": "false", "on": "true"}
RESHARD = ("always", "default", "never")
VARIANTS = tuple(f"{b}-{r}" for b in BALANCE for r in RESHARD)
BASELINE = "off-always"
TOKENS_TAG, TPS_TAG = "tokens/total", "throughput(tps)"
IMBALANCE_TAG, LOSS_TAG = "data/dp_cost_imbalance", "loss_metrics/global_avg_loss"
# Rank 0's step line (torchtitan_rl/metrics.py).
STEP_LINE = re.compile(r"\bstep: (\d+)  loss: ")
# ChatML tokens around a message's content: <|im_start|>, the role, "\n", <|im_end|>, "\n".
USER_OVERHEAD, ASSISTANT_OVERHEAD = len("user") + 4, len("assistant") + 4


# ------------------------------------------------------------------------- data and model files


def document_lengths(kind: str, count: int, seed: int = DATA_SEED) -> list[int]:
    """Tokens per row: all ``UNIFORM_LEN``, or lognormal draws clipped to ``VARIED_MIN..SEQ_LEN``."""
    if kind == "uniform":
        return [UNIFORM_LEN] * count
    if kind == "varied":
        rng = random.Random(seed)
        draws = (rng.lognormvariate(math.log(VARIED_MEDIAN), VARIED_SIGMA) for _ in range(count))
        return [min(SEQ_LEN, max(VARIED_MIN, round(x))) for x in draws]
    raise ValueError(f"unknown data kind {kind!r}; choose from {DATA}")


def chat_row(length: int, rng: random.Random) -> dict:
    """An SFT chat row of exactly ``length`` tokens under a byte tokenizer (one token per ASCII
    character): a user question of about a quarter of the content, the answer the rest."""
    content = length - USER_OVERHEAD - ASSISTANT_OVERHEAD
    if content < 2:
        raise ValueError(f"a chat row needs at least {USER_OVERHEAD + ASSISTANT_OVERHEAD + 2} tokens, got {length}")
    question = max(1, content // 4)

    def text(n):
        return "".join(rng.choices(string.ascii_lowercase + " ", k=n))

    return {
        "messages": [
            {"role": "user", "content": text(question)},
            {"role": "assistant", "content": text(content - question)},
        ]
    }


def write_rows(path: str, lengths: list[int], seed: int = DATA_SEED) -> None:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for length in lengths:
            f.write(json.dumps(chat_row(length, rng)) + "\n")


def bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet (GPT-2's): every byte as a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer_json():
    """A ``tokenizers`` tokenizer with the built-in byte tokenizer's ids: byte b is id b, then
    <|endoftext|>, <|im_start|>, <|im_end|> (so an ``hf`` flavor trains on the same tokens)."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    from torchtitan_rl.data.tokenizer import ByteTokenizer

    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(ByteTokenizer.SPECIAL_TOKENS[:3]))
    return tokenizer


def wide_model_args():
    from torchtitan_rl.models.qwen3.args import qwen3_flavors

    return dataclasses.replace(qwen3_flavors["debugmodel"], **WIDE)


def write_wide_assets(folder: str) -> None:
    """``config.json`` (the wide model) and ``tokenizer.json`` for ``model.flavor = "hf"``."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(wide_model_args().to_hf_config("float32"), f, indent=2)
    byte_tokenizer_json().save(os.path.join(folder, "tokenizer.json"))


# ------------------------------------------------------------------------- CPU time of a launch


def parse_stat(text: str) -> tuple[int, int]:
    """(parent pid, CPU ticks) of a ``/proc/PID/stat`` line: user + system time of the process
    and of its children it has waited for. The command name may hold spaces and parentheses."""
    fields = text[text.rindex(")") + 2 :].split()
    # After the name: state, ppid, ... utime, stime, cutime, cstime are fields 14..17 of stat(5).
    return int(fields[1]), sum(int(x) for x in fields[11:15])


def descendants(parents: dict[int, int], root: int) -> set[int]:
    """``root`` and every process below it, from ``{pid: parent pid}``."""
    children = collections.defaultdict(list)
    for pid, parent in parents.items():
        children[parent].append(pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children[pid])
    return found


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of ``root`` and its descendants so far (Linux /proc)."""
    parents, ticks = {}, {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parents[int(name)], ticks[int(name)] = parse_stat(f.read())
            except OSError:  # exited meanwhile
                continue
    return sum(ticks[pid] for pid in descendants(parents, root) if pid in ticks) / os.sysconf("SC_CLK_TCK")


@dataclasses.dataclass
class SampledRun:
    """A ``train.py`` launch: its TensorBoard scalars, and (wall-clock, CPU seconds) of the
    launch's processes when rank 0 logged each sampled step."""

    scalars: dict[str, dict[int, float]]
    samples: dict[int, tuple[float, float]]


def run_sampled(overrides: list[str], sample_steps: set[int], ranks: int = RANKS) -> SampledRun:
    """``train.py OVERRIDES`` under torchrun, logging every step to TensorBoard, sampling the
    CPU time of its processes as the step lines of ``sample_steps`` appear."""
    from torchtitan_rl.tensorboard_io import read_scalars

    with tempfile.TemporaryDirectory(prefix="bench_dp_balance_run_") as dump:
        cmd = [
            *launcher(ranks),
            os.path.join(ROOT, "train.py"),
            *overrides,
            *("--metrics.log_freq", "1", "--metrics.enable_tensorboard", "true"),
            *("--metrics.save_tb_folder", "tb", "--job.dump_folder", dump),
        ]
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        samples, tail = {}, collections.deque(maxlen=40)
        for line in proc.stdout:
            tail.append(line.rstrip())
            match = STEP_LINE.search(line)
            if match and int(match.group(1)) in sample_steps:
                samples[int(match.group(1))] = (time.perf_counter(), tree_cpu_seconds(proc.pid))
        if proc.wait() != 0:
            raise RuntimeError(
                f"train.py failed (exit status {proc.returncode}): {shlex.join(cmd)}\n" + "\n".join(tail)
            )
        missing = sample_steps - set(samples)
        if missing:
            raise RuntimeError(f"no step line for steps {sorted(missing)} in the output of {shlex.join(cmd)}")
        return SampledRun(read_scalars(os.path.join(dump, "tb")), samples)


# ------------------------------------------------------------------------- figures


def run_figures(run: SampledRun, warmup: int, steps: int, world_size: int = RANKS) -> dict[str, float]:
    """The figures of one run over steps ``warmup + 1 .. steps`` (see the module docstring)."""
    tokens, tps = run.scalars[TOKENS_TAG], run.scalars[TPS_TAG]
    measured = range(warmup + 1, steps + 1)
    missing = [s for s in measured if s not in tokens or s not in tps]
    if missing:
        raise ValueError(f"steps {missing} were not logged; every step must be (metrics.log_freq = 1)")
    num_tokens = sum(tokens[s] for s in measured)
    # throughput(tps) = the step's tokens / its seconds / world size.
    seconds = sum(tokens[s] / (tps[s] * world_size) for s in measured)
    (wall_0, cpu_0), (wall_1, cpu_1) = run.samples[warmup], run.samples[steps]
    imbalance = run.scalars.get(IMBALANCE_TAG, {})
    return {
        "tps": num_tokens / seconds / world_size,
        "cpu_per_token": (cpu_1 - cpu_0) / num_tokens,
        "busy_cores": (cpu_1 - cpu_0) / (wall_1 - wall_0),
        "imbalance": statistics.mean(imbalance[s] for s in measured) if imbalance else float("nan"),
        "loss": run.scalars[LOSS_TAG][steps],
    }


def medians_and_paired_ratios(
    runs: dict[str, list[dict[str, float]]], baseline: str
) -> dict[str, dict[str, tuple[float, float]]]:
    """``{variant: {figure: (median over rounds, median over rounds of the ratio to the
    baseline's run of the same round)}}``; ``runs[variant][r]`` is round r's figures."""
    base = runs[baseline]
    out = {}
    for name, rounds in runs.items():
        if len(rounds) != len(base):
            raise ValueError(f"variant {name!r} has {len(rounds)} rounds, the baseline {len(base)}")
        out[name] = {
            key: (
                statistics.median(r[key] for r in rounds),
                statistics.median(r[key] / b[key] if b[key] else float("nan") for r, b in zip(rounds, base)),
            )
            for key in rounds[0]
        }
    return out


def variant_overrides(variant: str) -> list[str]:
    balance, _, reshard = variant.partition("-")
    if balance not in BALANCE or reshard not in RESHARD:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    return ["--training.balance_dp_compute", BALANCE[balance], "--parallelism.fsdp_reshard_after_forward", reshard]


def case_overrides(model: str, data_path: str, steps: int, assets: str) -> list[str]:
    """The ``train.py`` settings of a model on a dataset, whatever the variant."""
    model_keys = ["--model.flavor", "hf", "--model.hf_assets_path", assets] if model == "wide" else []
    return [
        *("--job.config_file", os.path.join(ROOT, "train_configs", "debug_model.toml")),
        *model_keys,
        *("--training.steps", str(steps), "--training.seq_len", str(SEQ_LEN)),
        *("--training.max_tokens_per_microbatch", str(SEQ_LEN)),
        *("--training.global_batch_size", str(GLOBAL_BATCH[model]), "--training.dataset_path", data_path),
        *("--training.dataset_cache_dir", os.path.join(os.path.dirname(data_path), "cache")),
    ]


def case_table(stats: dict[str, dict[str, tuple[float, float]]]) -> list[str]:
    def cell(value, paired, fmt):
        return f"{value:{fmt}} ({paired:.2f}x)"

    rows = [
        [
            f"`{name}`",
            cell(*s["tps"], ".0f"),
            cell(s["cpu_per_token"][0] * 1e6, s["cpu_per_token"][1], ".1f"),
            cell(*s["busy_cores"], ".2f"),
            f"{s['imbalance'][0]:.3f}",
            f"{s['loss'][0]:.4f}",
        ]
        for name, s in stats.items()
    ]
    header = ["variant", "tokens/s per rank", "CPU-µs per token", "busy cores", "dp_cost_imbalance", "last loss"]
    return markdown_table(header, rows)


# ------------------------------------------------------------------------- host work per step


class ComputeTimer:
    """Seconds spent inside the model-compute regions; a region inside another counts once,
    and the time of an ``exclude``d function called inside one does not count."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.seconds, self._depth, self._start = 0.0, 0, 0.0

    def exclude(self, fn):
        def host_work(*args, **kwargs):
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                if self._depth:
                    self.seconds -= self.clock() - start

        return host_work

    def enter(self, *_):
        if self._depth == 0:
            self._start = self.clock()
        self._depth += 1

    def exit(self, *_):
        self._depth -= 1
        if self._depth == 0:
            self.seconds += self.clock() - self._start

    def wrap(self, fn):
        def timed(*args, **kwargs):
            self.enter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.exit()

        return timed


def install_compute_timer(engine, engine_module, model_module, torch) -> ComputeTimer:
    """Time the engine's compute regions (see the module docstring) from now on; attention
    planning inside the model's forward is host work."""
    timer = ComputeTimer()
    model_module.build_attention_context = timer.exclude(model_module.build_attention_context)
    for name in ("token_loss", "clip_grad_norm_"):
        if not hasattr(engine_module, name):
            raise RuntimeError(f"torchtitan_rl.engine no longer calls {name}; update this benchmark's compute regions")
        setattr(engine_module, name, timer.wrap(getattr(engine_module, name)))
    torch.Tensor.backward = timer.wrap(torch.Tensor.backward)
    engine.model.register_forward_pre_hook(timer.enter)
    engine.model.register_forward_hook(timer.exit)
    engine.optimizer.register_step_pre_hook(timer.enter)
    engine.optimizer.register_step_post_hook(timer.exit)
    return timer


def host_worker(args) -> None:
    """One rank: build the SFT recipe, time ``--host-steps`` steps; rank 0 prints the per-step
    (step, compute) seconds after the warm-up."""
    if args.tree:
        sys.path.insert(0, os.path.abspath(args.tree))
    import torch

    import torchtitan_rl.engine as engine_module
    import torchtitan_rl.models.qwen3.model as model_module
    from torchtitan_rl.config import ConfigManager
    from torchtitan_rl.distributed.utils import shutdown_distributed
    from torchtitan_rl.recipes.sft import SFTRecipe

    if args.tree and not engine_module.__file__.startswith(os.path.abspath(args.tree)):
        raise RuntimeError(f"imported {engine_module.__file__}, not the tree {args.tree}")
    job_config = ConfigManager().parse_args(
        [*shlex.split(args.overrides), "--job.dump_folder", args.dump, "--metrics.enable_tensorboard", "false"]
    )
    recipe = SFTRecipe(job_config)
    recipe.setup()
    engine, loss_fn = recipe.engine, recipe.loss_fn
    timer = install_compute_timer(engine, engine_module, model_module, torch)
    batches, measured = iter(recipe.dataloader), []
    for step in range(1, args.host_steps + 1):
        batch = next(batches)  # samples, or the prepared batch where the loader prepares
        timer.seconds, start = 0.0, time.perf_counter()
        engine.forward_backward(batch, loss_fn.name, loss_fn.options)
        engine.optim_step()
        if step > args.warmup:
            measured.append((time.perf_counter() - start, timer.seconds))
    if recipe.rank == 0:
        print_result({"steps": measured})
    recipe.close()
    del recipe, engine
    shutdown_distributed(clean=True)


def host_work(tree: str, data_path: str, args, workdir: str) -> dict[str, float]:
    """Median per-step (step, compute, host) milliseconds of one launch, 1 rank."""
    overrides = case_overrides("debug", data_path, args.host_steps, "")
    worker_args = ["--overrides", shlex.join(overrides), "--dump", tempfile.mkdtemp(dir=workdir)]
    worker_args += ["--host-steps", str(args.host_steps), "--warmup", str(args.warmup), "--tree", tree]
    result = launch_workers(__file__, 1, worker_args)
    if "error" in result:
        raise RuntimeError(f"host-work worker failed: {result['error']}")
    step = statistics.median(s for s, _ in result["steps"])
    host = statistics.median(s - c for s, c in result["steps"])
    return {"step_ms": 1e3 * step, "compute_ms": 1e3 * (step - host), "host_ms": 1e3 * host}


# ------------------------------------------------------------------------- main


def measure_case(model, data, data_path, args, assets) -> list[str]:
    base = case_overrides(model, data_path, args.steps, assets)
    sample_steps = {args.warmup, args.steps}

    def launch(name):
        run = run_sampled([*base, *variant_overrides(name)], sample_steps)
        return run_figures(run, args.warmup, args.steps)

    launches = {name: (lambda name=name: launch(name)) for name in args.variants}
    stats = medians_and_paired_ratios(collect_alternating(launches, args.rounds), args.variants[0])
    return [f"### {model} model, {data} data", "", *case_table(stats), ""]


def csv_choice(choices):
    def parse(text):
        values = [v for v in text.split(",") if v]
        unknown = [v for v in values if v not in choices]
        if unknown or not values:
            raise argparse.ArgumentTypeError(f"{text!r}: choose a comma-separated subset of {','.join(choices)}")
        return values

    return parse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="runs per variant, alternating")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of a run left out of the figures")
    parser.add_argument("--models", type=csv_choice(MODELS), default=list(MODELS))
    parser.add_argument("--data", type=csv_choice(DATA), default=list(DATA))
    parser.add_argument(
        "--variants",
        type=csv_choice(VARIANTS),
        default=list(VARIANTS),
        help=f"the first is the baseline (by default {BASELINE})",
    )
    parser.add_argument("--host-steps", type=int, default=12, help="steps of the host-work measure; 0 skips it")
    parser.add_argument("--host-before", default="", help="another checkout whose host work is measured too")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--overrides", default="", help=argparse.SUPPRESS)
    parser.add_argument("--dump", default="", help=argparse.SUPPRESS)
    parser.add_argument("--tree", default="", help=argparse.SUPPRESS)
    add_publish_args(parser, "dp_balance")
    args = parser.parse_args()
    if args.worker:
        host_worker(args)
        return
    if not 1 <= args.warmup < args.steps:
        parser.error("need 1 <= --warmup < --steps (the step line of --warmup starts the measured window)")
    if args.host_steps and args.host_steps <= args.warmup:
        parser.error("--host-steps must exceed --warmup (or be 0 to skip the host-work measure)")

    body = [
        (
            f"{RANKS} CPU ranks (torchrun), FSDP over both; steps {args.warmup + 1}..{args.steps} of each run, "
            f"median of {args.rounds} alternating round(s); in parentheses the median over rounds of the ratio "
            f"to `{args.variants[0]}` of the same round. Global batch: {GLOBAL_BATCH['debug']} rows (debug), "
            f"{GLOBAL_BATCH['wide']} (wide: dim {WIDE['dim']}, MLP {WIDE['hidden_dim']}, 2 layers); micro-batches "
            f"of {SEQ_LEN} tokens. Data: uniform = {UNIFORM_LEN}-token rows; varied = lognormal lengths (median "
            f"{VARIED_MEDIAN}, sigma {VARIED_SIGMA}, {VARIED_MIN}..{SEQ_LEN}). Variant `B-R`: "
            "`training.balance_dp_compute` off/on, `parallelism.fsdp_reshard_after_forward` R. CPU time and busy "
            "cores count every process of the launch between the two log lines."
        ),
        "",
    ]
    with tempfile.TemporaryDirectory(prefix="bench_dp_balance_") as workdir:
        assets = os.path.join(workdir, "wide")
        write_wide_assets(assets)
        paths = {}
        for data in DATA:
            os.makedirs(os.path.join(workdir, data))
            paths[data] = os.path.join(workdir, data, "rows.jsonl")
            rows = max(GLOBAL_BATCH.values()) * (max(args.steps, args.host_steps) + 1)
            write_rows(paths[data], document_lengths(data, rows))
        for model in args.models:
            for data in args.data:
                body += measure_case(model, data, paths[data], args, assets)
        if args.host_steps:
            trees = {"this tree": ROOT, **({"before": args.host_before} if args.host_before else {})}
            rows = []
            for data in args.data:
                launches = {
                    name: (lambda tree=tree, data=data: host_work(tree, paths[data], args, workdir))
                    for name, tree in trees.items()
                }
                for name, results in collect_alternating(launches, args.rounds).items():
                    m = {key: statistics.median(r[key] for r in results) for key in results[0]}
                    rows.append([data, name, *(f"{m[k]:.1f}" for k in ("step_ms", "compute_ms", "host_ms"))])
            body += [
                "### Host work per step",
                "",
                (
                    f"1 rank, debug model, steps {args.warmup + 1}..{args.host_steps} of `forward_backward` + "
                    f"`optim_step`, median over steps then over {args.rounds} round(s). Compute: time inside the "
                    "model's forward (less any attention planning in it), `token_loss`, `Tensor.backward`, "
                    "`clip_grad_norm_` and `optimizer.step`; host work: the rest of the step (what planning and "
                    "packing the step still does itself, collectives, copies, loss weights, metrics, releasing "
                    "autograd graphs, `zero_grad`, LR schedule), the median of each step's difference; compute ms "
                    "is step ms minus it. The script's docstring has the details."
                ),
                "",
                *markdown_table(["data", "tree", "step ms", "compute ms", "host work ms"], rows),
            ]
    publish(
        args,
        "Compute-balanced data parallelism and FSDP resharding",
        "Tokens/s per rank, CPU time per token, busy cores and the ranks' cost imbalance with "
        "`training.balance_dp_compute` off/on and each `parallelism.fsdp_reshard_after_forward`, "
        "on 2 CPU ranks; and the host work of one step.",
        body,
    )


if __name__ == "__main__":
    main()
