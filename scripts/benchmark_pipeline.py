"""Pipeline parallel on 4 gloo CPU ranks, measured: each schedule's bubble and step time against
the number of micro-batches, and the per-rank peak memory of pp2 x dp2 against dp4.

    .venv/bin/python scripts/benchmark_pipeline.py            # rewrites its page in docs/benchmarks/ (~6 min)
    .venv/bin/python scripts/benchmark_pipeline.py --quick    # smoke run, under 2 min
    .venv/bin/python scripts/benchmark_pipeline.py --no-write # print only

Bubbles (``--parts bubble``): one launch of ``--ranks`` ranks, all of them pipeline ranks
(pp = 4, no data parallel), holding one model per schedule (``--layers`` layers of width
``--dim``; one stage per rank for GPipe and 1F1B, two for the others). Every (schedule,
micro-batch count) pair runs ``PipelineEngine.forward_backward`` once per round, the pairs
alternating, the order reversed every other round, after ``--warmup`` uncounted rounds; each
micro-batch is one sequence of ``--tokens`` tokens. Reported per pair:

- the schedule's own bubble: every rank's order of passes, replayed with fixed costs and free
  communication, each pass starting when its rank is free and its input is there (the previous
  stage's forward, the next stage's input gradient). The order is the ``pipeline_order`` of the
  schedule object the step ran for the multi-stage schedules (their runtime executes that
  table); for GPipe and 1F1B it is built here from their code (torch 2.13's ``pipeline_order``
  of 1F1B is off by one micro-batch on the last rank). Two cost models: F = B (the
  zero-bubble schedules' split backward I = W = 1/2) and F = 1, B = 2 (I = W = 1). Idle
  fraction = 1 - busy / makespan, averaged over the ranks; for the non-zero-bubble schedules
  the textbook (p - 1) / (v m + p - 1) is printed next to it as a check;
- measured: per rank, the wall time spent inside the stages' forward, backward and weight-gradient
  calls and the loss (``PipelineStage.forward_one_chunk``, ``backward_one_chunk``,
  ``backward_weight_one_chunk``, the schedule's ``_compute_loss``), against the step's wall time
  between two barriers: bubble = 1 - busy / wall; and the step time relative to GPipe's at the
  same micro-batch count.

Memory (``--parts memory``): a ``--deep-layers`` model under dp4 (FSDP over the 4 ranks) and
pp2 x dp2 (FSDP over 2 ranks inside each of 2 stages; 1F1B and GPipe), the same global batch of
``--global-batch`` sequences and the same micro-batch budget (one sequence). Each layout runs in
fresh processes: a warm-up step (``forward_backward`` + ``optim_step``), a measured one (peak
RSS), then a profiled one whose tensor allocations give the peak of live bytes.
"""

import argparse
import statistics
import time

from bench_common import (
    add_publish_args,
    alternating_order,
    launch_workers,
    markdown_table,
    print_result,
    publish,
    ratio,
)

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
# name: (pp, schedule or None for plain FSDP); every layout uses all --ranks ranks.
MEMORY_LAYOUTS = {
    "dp4 (FSDP over 4)": (1, None),
    "pp2 x dp2, 1F1B": (2, "1F1B"),
    "pp2 x dp2, GPipe": (2, "GPipe"),
}
VOCAB = 512
# Cost models of the replayed schedule: (forward, full backward, input-gradient, weight-gradient).
COST_MODELS = {"F = B": (1.0, 1.0, 0.5, 0.5), "F = 1, B = 2": (1.0, 2.0, 1.0, 1.0)}


# ------------------------------------------------------------------------- the schedule's own bubble


def torch_table(order: dict) -> dict[int, list[tuple[str, int, int]]]:
    """torch's action table (``{rank: [_Action or None]}``) as ``{rank: [(kind, stage, micro-batch)]}``,
    compute actions only (F, B, I, W), in order."""
    return {
        rank: [
            (a.computation_type.value, a.stage_index, a.microbatch_index)
            for a in actions
            if a is not None and a.computation_type.value in "FBIW"
        ]
        for rank, actions in order.items()
    }


def single_stage_table(schedule: str, pp: int, microbatches: int) -> dict[int, list[tuple[str, int, int]]]:
    """The order in which torch's single-stage schedules run their passes on each rank (built
    here from ``ScheduleGPipe._step_microbatches`` and ``Schedule1F1B._step_microbatches``; the
    ``pipeline_order`` torch 2.13 gives 1F1B starts its last rank at micro-batch 1 and runs one
    micro-batch too many, so it is not used). GPipe: every forward, then every backward. 1F1B:
    ``pp - rank`` forwards, then a backward and a forward alternately, then the backwards left."""
    table = {}
    for rank in range(pp):
        if schedule == "GPipe":
            table[rank] = [("F", rank, i) for i in range(microbatches)] + [("B", rank, i) for i in range(microbatches)]
            continue
        warmup = min(microbatches, pp - rank)
        actions = [("F", rank, i) for i in range(warmup)]
        forward, backward = warmup, 0
        while backward < microbatches:
            actions.append(("B", rank, backward))
            backward += 1
            if forward < microbatches:
                actions.append(("F", rank, forward))
                forward += 1
        table[rank] = actions
    return table


def replay(table: dict, costs: tuple[float, float, float, float]) -> dict[int, tuple[float, float]]:
    """``{rank: (busy, finish)}`` of the action table ``{rank: [(kind, stage, micro-batch)]}`` run
    with ``costs`` (F, B, I, W) and free communication: every rank runs its actions in order, each
    as soon as the rank is free and its input exists (F of stage s after F of s - 1; B or I of
    stage s after B or I of s + 1, or after its own F on the last stage; W after I)."""
    cost = dict(zip("FBIW", costs))
    last = max(stage for actions in table.values() for _, stage, _ in actions)
    done: dict[tuple[str, int, int], float] = {}
    clock = {rank: 0.0 for rank in table}
    busy = {rank: 0.0 for rank in table}
    cursor = {rank: 0 for rank in table}

    def ready_at(kind: str, stage: int, mb: int) -> float | None:
        if kind == "F":
            needs = [("F", stage - 1, mb)] if stage > 0 else []
        elif kind in "BI":
            grads = [] if stage == last else [(k, stage + 1, mb) for k in "BI" if (k, stage + 1, mb) in done]
            if stage != last and not grads:
                return None
            needs = [("F", stage, mb), *grads]
        else:
            needs = [("I", stage, mb)]
        if any(need not in done for need in needs):
            return None
        return max((done[need] for need in needs), default=0.0)

    remaining = sum(len(actions) for actions in table.values())
    while remaining:
        progressed = False
        for rank, actions in table.items():
            while cursor[rank] < len(actions):
                kind, stage, mb = actions[cursor[rank]]
                at = ready_at(kind, stage, mb)
                if at is None:
                    break
                clock[rank] = max(clock[rank], at) + cost[kind]
                busy[rank] += cost[kind]
                done[(kind, stage, mb)] = clock[rank]
                cursor[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("the action table cannot progress (a dependency is never met)")
    return {rank: (busy[rank], clock[rank]) for rank in table}


def table_bubble(table: dict, costs) -> float:
    """Idle fraction of the replayed table, averaged over the ranks (they share one makespan)."""
    result = replay(table, costs)
    makespan = max(finish for _, finish in result.values())
    return statistics.mean(1 - busy / makespan for busy, _ in result.values())


def textbook_bubble(schedule: str, pp: int, microbatches: int) -> float | None:
    """(p - 1) / (v m + p - 1), v stages per rank; None for the zero-bubble schedules."""
    if "ZeroBubble" in schedule:
        return None
    v = 1 if schedule in ("GPipe", "1F1B") else 2
    return (pp - 1) / (v * microbatches + pp - 1)


# ------------------------------------------------------------------------- workers


def _model_args(dim: int, layers: int):
    import dataclasses

    from torchtitan_rl.models.qwen3.args import qwen3_flavors

    return dataclasses.replace(
        qwen3_flavors["debugmodel"],
        vocab_size=VOCAB,
        dim=dim,
        n_layers=layers,
        n_heads=dim // 64,
        n_kv_heads=max(1, dim // 128),
        head_dim=64,
        hidden_dim=3 * dim,
        attn_backend="sdpa_varlen",
    )


def _samples(count: int, tokens: int, seed: int) -> list:
    import torch

    from torchtitan_rl.data.sample import Sample

    gen = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(count):
        ids = torch.randint(0, VOCAB, (tokens + 1,), generator=gen)
        samples.append(Sample(input_ids=ids[:-1], labels=ids[1:], loss_mask=torch.ones(tokens, dtype=torch.bool)))
    return samples


def _options(tokens: int, min_microbatches: int, max_norm: float = 0.0):
    from torchtitan_rl.engine import EngineOptions

    return EngineOptions(
        reduction="token_mean",
        horizon=tokens,
        max_tokens_per_microbatch=tokens,
        logits_chunk_size=1024,
        max_norm=max_norm,
        min_microbatches=min_microbatches,
    )


class Probe:
    """Wall and thread CPU seconds spent inside the pipeline stages' compute calls, the seconds
    inside ``run_schedule`` and in building its stages and schedule object, and the last
    schedule object built (its ``pipeline_order``)."""

    def __init__(self):
        import torch.distributed.pipelining.schedules as schedules
        import torch.distributed.pipelining.stage as stage

        import torchtitan_rl.distributed.pipeline as pipeline
        import torchtitan_rl.engine_pipeline as engine_pipeline

        self.reset()
        self.runner = None
        self._depth = 0
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(stage._PipelineStageBase, name, self._compute(getattr(stage._PipelineStageBase, name)))
        schedules._PipelineSchedule._compute_loss = self._compute(schedules._PipelineSchedule._compute_loss)
        probe = self

        def timed_build(cls):
            class Timed(cls):
                def __init__(self, *args, **kwargs):
                    start = time.perf_counter()
                    super().__init__(*args, **kwargs)
                    probe.setup_s += time.perf_counter() - start
                    probe.runner = self

            Timed.__name__ = cls.__name__
            return Timed

        pipeline.SCHEDULES = {
            name: (timed_build(cls), per_rank) for name, (cls, per_rank) in pipeline.SCHEDULES.items()
        }
        build_stage = pipeline.PipelineStage

        def timed_stage(*args, **kwargs):
            start = time.perf_counter()
            try:
                return build_stage(*args, **kwargs)
            finally:
                probe.setup_s += time.perf_counter() - start

        pipeline.PipelineStage = timed_stage
        run_schedule = engine_pipeline.run_schedule

        def timed_run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return run_schedule(*args, **kwargs)
            finally:
                probe.schedule_s += time.perf_counter() - start
                probe.microbatches = kwargs["num_microbatches"]

        engine_pipeline.run_schedule = timed_run

    def reset(self) -> None:
        self.busy_s = self.busy_cpu_s = self.schedule_s = self.setup_s = 0.0
        self.microbatches = 0

    def _compute(self, fn):
        def wrapped(*args, **kwargs):
            self._depth += 1
            if self._depth > 1:  # nested: counted by the outer call
                try:
                    return fn(*args, **kwargs)
                finally:
                    self._depth -= 1
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.busy_s += time.perf_counter() - wall
                self.busy_cpu_s += time.thread_time() - cpu
                self._depth -= 1

        return wrapped


def bubble_worker(args) -> None:
    import torch
    import torch.distributed as dist

    from torchtitan_rl.distributed.parallel_dims import ParallelDims
    from torchtitan_rl.distributed.pipeline import is_multi_stage, plan_pipeline
    from torchtitan_rl.distributed.utils import init_distributed
    from torchtitan_rl.engine_pipeline import PipelineEngine
    from torchtitan_rl.recipes.base import build_model

    rank, world, device = init_distributed(900)
    torch.set_num_threads(1)
    probe = Probe()
    dims = ParallelDims(1, 1, 1, 1, world_size=world, pp=world)
    dims.build_meshes("cpu")
    pp_rank = dims.mesh("pp").get_local_rank()
    model_args = _model_args(args.dim, args.layers)
    models = {}
    for schedule in SCHEDULES:
        plan = plan_pipeline(args.layers, world, pp_rank, schedule)
        model = build_model(
            model_args, parallel_dims=dims, device=device, seed=0, param_dtype=torch.float32, pipeline=plan
        )
        models[schedule] = (plan, model)
    samples = {m: _samples(m, args.tokens, seed=0) for m in args.microbatches}  # the same on every pipeline rank
    pairs = [(schedule, m) for m in args.microbatches for schedule in SCHEDULES]
    records = {pair: [] for pair in pairs}
    tables = {}
    for index, order in enumerate(alternating_order(pairs, args.warmup + args.rounds)):
        for schedule, m in order:
            plan, model = models[schedule]
            # Built anew per step: the engine built last feeds the stages their inputs.
            engine = PipelineEngine(
                model,
                pipeline=plan,
                optimizer=None,
                lr_scheduler=None,
                parallel_dims=dims,
                device=device,
                options=_options(args.tokens, m),
            )
            probe.reset()
            dist.barrier()
            start = time.perf_counter()
            engine.forward_backward(samples[m])
            dist.barrier()
            wall = time.perf_counter() - start
            model.zero_grad(set_to_none=True)
            if index >= args.warmup:
                records[(schedule, m)].append(
                    (wall, probe.busy_s, probe.busy_cpu_s, probe.schedule_s, probe.setup_s, probe.microbatches)
                )
            if (schedule, m) not in tables:
                if is_multi_stage(schedule):
                    table = torch_table(probe.runner.pipeline_order)
                else:
                    table = single_stage_table(schedule, world, probe.microbatches)
                tables[(schedule, m)] = {name: table_bubble(table, costs) for name, costs in COST_MODELS.items()}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, records)
    if rank == 0:
        result = {}
        for schedule, m in pairs:
            per_rank = [everyone[(schedule, m)] for everyone in gathered]
            rounds = len(per_rank[0])
            # A step's wall time is the same on every rank (barriers); the median over rounds.
            walls = [max(per_rank[r][k][0] for r in range(world)) for k in range(rounds)]
            result[f"{schedule}/{m}"] = {
                "wall_s": statistics.median(walls),
                "busy_frac": [statistics.median(rec[1] / rec[0] for rec in mine) for mine in per_rank],
                "cpu_frac": [statistics.median(rec[2] / rec[0] for rec in mine) for mine in per_rank],
                "cores": statistics.median(
                    sum(per_rank[r][k][2] for r in range(world)) / walls[k] for k in range(rounds)
                ),
                "schedule_frac": statistics.median(rec[3] / rec[0] for rec in per_rank[0]),
                "setup_ms": 1000 * statistics.median(rec[4] for mine in per_rank for rec in mine),
                "microbatches": per_rank[0][0][5],
                "table": tables[(schedule, m)],
            }
        print_result(result)
    dist.destroy_process_group()


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def memory_worker(args) -> None:
    import resource

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from torchtitan_rl.distributed.parallel_dims import ParallelDims
    from torchtitan_rl.distributed.pipeline import plan_pipeline
    from torchtitan_rl.distributed.utils import init_distributed
    from torchtitan_rl.engine import Engine
    from torchtitan_rl.engine_pipeline import PipelineEngine
    from torchtitan_rl.optim import build_lr_scheduler, build_optimizer
    from torchtitan_rl.profiling import cpu_memory_timeline
    from torchtitan_rl.recipes.base import build_model

    rank, world, device = init_distributed(900)
    torch.set_num_threads(1)
    pp, schedule = MEMORY_LAYOUTS[args.layout]
    dims = ParallelDims(1, -1, 1, 1, world_size=world, pp=pp)
    dims.build_meshes("cpu")
    model_args = _model_args(args.dim, args.deep_layers)
    plan = None
    if pp > 1:
        plan = plan_pipeline(args.deep_layers, pp, dims.mesh("pp").get_local_rank(), schedule)
    model = build_model(model_args, parallel_dims=dims, device=device, seed=0, param_dtype=torch.float32, pipeline=plan)
    optimizer = build_optimizer(model, 1e-5, 0.9, 0.95, 1e-8, 0.0)
    scheduler = build_lr_scheduler(optimizer, 10**6, 0, "linear", 0.0)
    kwargs = dict(optimizer=optimizer, lr_scheduler=scheduler, parallel_dims=dims, device=device)
    if plan is None:
        engine = Engine(model, options=_options(args.tokens, 1, max_norm=1.0), **kwargs)
    else:
        engine = PipelineEngine(model, pipeline=plan, options=_options(args.tokens, plan.num_stages, 1.0), **kwargs)
    everything = _samples(args.global_batch, args.tokens, seed=0)
    share = len(everything) // dims.batch_degree
    samples = everything[dims.batch_rank() * share : (dims.batch_rank() + 1) * share]

    def step():
        engine.forward_backward(samples)
        engine.optim_step()

    step()  # warm-up: optimizer state exists from here on
    dist.barrier()
    start = time.perf_counter()
    step()
    dist.barrier()
    wall = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    resident = {"params": _local_bytes(model.parameters()), "optimizer": _local_bytes(state)}
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    timeline = cpu_memory_timeline(prof)
    mine = {
        "rss": rss,
        **resident,
        "step_peak": timeline["peak_allocated_bytes"],
        "step_end": timeline["allocated_bytes_at_end"],
        "stage": -1 if plan is None else min(plan.local_stages),
    }
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        print_result({"wall_s": wall, "microbatches": share, "ranks": gathered})
    dist.destroy_process_group()


# ------------------------------------------------------------------------- the page


def bubble_body(args, result: dict) -> list[str]:
    pp = args.ranks
    theory_rows, measured_rows = [], []
    for m in args.microbatches:
        gpipe = result[f"GPipe/{m}"]["wall_s"]
        for schedule in SCHEDULES:
            r = result[f"{schedule}/{m}"]
            book = textbook_bubble(schedule, pp, m)
            theory_rows.append(
                [
                    schedule,
                    m,
                    *(f"{r['table'][name]:.2f}" for name in COST_MODELS),
                    "—" if book is None else f"{book:.2f}",
                ]
            )
            busy = r["busy_frac"]
            measured_rows.append(
                [
                    schedule,
                    m,
                    ratio(r["wall_s"], gpipe),
                    f"{1 - statistics.mean(busy):.2f}",
                    " / ".join(f"{b:.2f}" for b in busy),
                    f"{statistics.mean(r['cpu_frac']) / statistics.mean(busy):.2f}",
                    f"{r['cores']:.2f}",
                    f"{r['schedule_frac']:.2f}",
                    f"{r['setup_ms']:.0f}",
                    f"{r['wall_s']:.2f}",
                ]
            )
    return [
        "## Bubbles and step time against the number of micro-batches",
        "",
        f"pp = {pp} ranks, no data parallel; Qwen3-style model of {args.layers} layers, dim {args.dim} "
        f"(heads of 64, MLP {3 * args.dim}), vocab {VOCAB}, fp32; one sequence of {args.tokens} tokens per "
        "micro-batch; GPipe and 1F1B run one stage (of "
        f"{args.layers // pp} layers) per rank, the other schedules two (of {args.layers // (2 * pp)}; ZBV's "
        "two form a V). One `PipelineEngine.forward_backward` per (schedule, micro-batches) pair and round, "
        f"the pairs alternating; {args.rounds} rounds after {args.warmup} warm-up round(s), medians.",
        "",
        "**The schedule's own bubble**: every rank's order of passes (forwards F and backwards B; the "
        "zero-bubble schedules split B into an input-gradient I and a weight-gradient W pass) replayed by "
        "this script with fixed costs and free communication, each pass starting as soon as its rank is "
        "free and its input exists; idle fraction 1 - busy / makespan, averaged over the ranks. The orders "
        "of the multi-stage schedules are the action tables (`pipeline_order`) of the schedule objects the "
        "steps ran, which their runtime executes; those of GPipe and 1F1B are built by the script from "
        "torch's code (torch 2.13's `pipeline_order` for 1F1B starts its last rank at micro-batch 1 and "
        "runs one too many, so it is not used). Costs: F = B (I = W = 1/2), and F = 1, B = 2 (I = W = 1), "
        "closer to real passes. The last column is the textbook (p - 1) / (v m + p - 1) for v stages per "
        "rank, which the replay reproduces.",
        "",
        *markdown_table(
            ["schedule", "micro-batches", *(f"bubble, {n}" for n in COST_MODELS), "(p-1)/(vm+p-1)"], theory_rows
        ),
        "",
        "**Measured** (the same steps). Step time: relative to GPipe at the same micro-batch count in "
        "this run (absolute seconds in the last column, for scale only). Bubble: 1 - busy / wall, busy "
        "being the wall time a rank spends inside its stages' forward, backward and weight-gradient "
        "calls and the loss, wall the step between two barriers; averaged over the ranks, then per rank "
        "(rank 0 holds the first stage). CPU / busy: thread CPU seconds inside those calls per wall "
        "second inside them, averaged over the ranks (below 1: the rank was waiting for a core while "
        "computing). Cores computing: the ranks' CPU seconds inside those calls per step second, summed "
        "(at most 2 here). In run_schedule: the share of the step spent inside `run_schedule` (the rest "
        "is the engine's preparation, agreement collective, metrics and final broadcast). Setup: ms per "
        "step spent building the `PipelineStage` objects and the schedule object, which `run_schedule` "
        "does on every call.",
        "",
        *markdown_table(
            [
                "schedule",
                "micro-batches",
                "step time vs GPipe",
                "bubble (mean)",
                "busy / wall per rank",
                "CPU / busy",
                "cores computing",
                "in run_schedule",
                "setup ms",
                "step s",
            ],
            measured_rows,
        ),
        "",
        f"The measured bubbles are not the schedules' bubbles on a dedicated machine: {pp} ranks share "
        f"{args.cores} cores, so while a rank waits in a receive its core goes to another rank, whose "
        "compute then runs faster. A bubble costs step time here only while fewer ranks have work than "
        "there are cores; the step time of every schedule tends to the total compute divided by the "
        "cores, and the differences between schedules are compressed. The busy figures also count the "
        "time a computing rank waited for a core (CPU / busy below 1).",
    ]


def memory_body(args, results: dict) -> list[str]:
    mib = 2**20
    rows = []
    dp4 = None
    for name, r in results.items():
        ranks = r["ranks"]
        live = [x["params"] + x["optimizer"] + x["step_peak"] for x in ranks]
        rss = [x["rss"] for x in ranks]
        if dp4 is None:
            dp4 = (max(live), max(rss))
        per_rank = " / ".join(f"{v / mib:.0f}" for v in live)
        rows.append(
            [
                name,
                r["microbatches"],
                f"{max(live) / mib:.0f} MiB ({ratio(max(live), dp4[0])})",
                per_rank,
                f"{max(x['params'] for x in ranks) / mib:.1f} + {max(x['optimizer'] for x in ranks) / mib:.1f}",
                f"{max(x['step_peak'] for x in ranks) / mib:.0f}",
                f"{max(x['step_end'] for x in ranks) / mib:.1f}",
                f"{max(rss) / mib:.0f} MiB ({ratio(max(rss), dp4[1])})",
                f"{r['wall_s']:.2f}",
            ]
        )
    return [
        "## Peak memory per rank: pp2 x dp2 against dp4",
        "",
        f"{args.deep_layers} layers, dim {args.dim} (otherwise as above), AdamW; a global batch of "
        f"{args.global_batch} sequences of {args.tokens} tokens, one sequence per micro-batch; 4 ranks "
        "in every layout. dp4: `Engine` with FSDP over the 4 ranks (each rank runs its "
        f"{args.global_batch // 4} micro-batches one after the other). pp2 x dp2: 2 stages of "
        f"{args.deep_layers // 2} layers, each FSDP-sharded over 2 ranks, each pipeline running its "
        f"{args.global_batch // 2} micro-batches. Each layout in fresh processes; the step is "
        "`forward_backward` + `optim_step`, after one warm-up step.",
        "",
        "Peak live tensors = the rank's resident tensors before the step (its shards of the parameters and "
        "of AdamW's two moments; gradients are freed after every optimizer step) + the peak of the bytes "
        "allocated during the step and still alive, from the PyTorch profiler's allocation events "
        "(`profile_memory=True`, `torchtitan_rl.profiling.cpu_memory_timeline`). It counts tensor storage "
        "only: not the allocator's slack, gloo's buffers or Python objects. Peak RSS (`ru_maxrss`) is the "
        "whole process: about 0.35 GiB is the interpreter and its imports, whatever the layout; "
        "it is read before the profiled step. Live after step: bytes allocated during the step still alive "
        "at its end (a leak check; in a check at the `--quick` sizes this was the output buffers of FSDP's "
        "last reduce-scatters, which FSDP frees at the next step). Ranks in launch order: under pp2 x dp2 ranks 0, 1 "
        "hold stage 0 (embeddings) and ranks 2, 3 stage 1 (head and loss).",
        "",
        *markdown_table(
            [
                "layout",
                "micro-batches per pipeline / rank",
                "peak live tensors (max rank)",
                "per rank MiB",
                "params + AdamW MiB",
                "step peak MiB",
                "live after step MiB",
                "peak RSS (max rank)",
                "step s",
            ],
            rows,
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: smaller model and sizes, one round")
    parser.add_argument("--parts", nargs="+", choices=("bubble", "memory"), default=["bubble", "memory"])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8, help="layers of the bubble model")
    parser.add_argument("--deep-layers", type=int, default=16, help="layers of the memory model")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per sequence (= per micro-batch)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per step, memory part")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    add_publish_args(parser, "pipeline")
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--cores", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.microbatches, args.rounds, args.global_batch = 64, [4, 8], 1, 8
        args.deep_layers = 8
    if args.worker:
        (bubble_worker if args.part == "bubble" else memory_worker)(args)
        return
    import os

    args.cores = os.cpu_count()
    started = time.perf_counter()
    shared = [
        *("--layers", str(args.layers), "--deep-layers", str(args.deep_layers), "--dim", str(args.dim)),
        *("--tokens", str(args.tokens), "--global-batch", str(args.global_batch)),
        *("--rounds", str(args.rounds), "--warmup", str(args.warmup)),
        "--microbatches",
        *map(str, args.microbatches),
    ]
    body, headline = [], []
    if "bubble" in args.parts:
        result = launch_workers(__file__, args.ranks, [*shared, "--part", "bubble"])
        if "error" in result:
            raise SystemExit(f"bubble part: the ranks failed: {result['error']}")
        body += bubble_body(args, result)
        m = max(args.microbatches)
        steps = ", ".join(
            f"{s} {ratio(result[f'{s}/{m}']['wall_s'], result[f'GPipe/{m}']['wall_s'])}" for s in SCHEDULES[1:]
        )
        headline.append(f"step time vs GPipe at {m} micro-batches on {args.ranks} CPU ranks (pp = 4): {steps}")
    if "memory" in args.parts:
        results = {}
        for layout in MEMORY_LAYOUTS:
            result = launch_workers(__file__, args.ranks, [*shared, "--part", "memory", "--layout", layout])
            if "error" in result:
                raise SystemExit(f"memory part, {layout}: the ranks failed: {result['error']}")
            results[layout] = result
        body += ([""] if body else []) + memory_body(args, results)
        peaks = {
            name: max(x["params"] + x["optimizer"] + x["step_peak"] for x in r["ranks"]) for name, r in results.items()
        }
        dp4, *pipelined = MEMORY_LAYOUTS
        headline.append(
            "peak live tensors per rank vs dp4: " + ", ".join(f"{n} {ratio(peaks[n], peaks[dp4])}" for n in pipelined)
        )
    minutes = (time.perf_counter() - started) / 60
    body = [
        f"gloo, one thread per rank, {args.ranks} ranks on {args.cores} cores; {minutes:.1f} min in all.",
        "",
        *body,
    ]
    publish(
        args,
        "Pipeline parallel: bubbles and memory",
        "The 5 pipeline schedules' bubbles and step times against the number of micro-batches, and per-rank "
        "peak memory of pp2 x dp2 against dp4; " + "; ".join(headline) + ".",
        body,
    )


if __name__ == "__main__":
    main()
