"""The service's overhead: one SL step (forward_backward + optim_step) of the debug model through
the tinker SDK against the same step run by the service's worker directly (no HTTP, no SDK, no
dispatch), and sampling tokens/s through the SDK against the worker's sampler directly; both on
the same number of CPU ranks and the same config (train_configs/service_debug.toml).

    .venv/bin/python scripts/benchmark_service.py            # 2 ranks, writes docs/benchmarks/service.md

The SDK side launches the service and drives it from this process; the direct side is a torchrun
launch of this script (``--worker``) where every rank builds the same service and runs the same
operations in lockstep. Each side: a LoRA client of rank ``--lora-rank``, ``--warmup`` untimed
steps, then ``--steps`` timed steps (median), and ``--samples`` sequences of ``--max-tokens``
tokens from one prompt (stop tokens off, so every sequence has that length).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_common import add_publish_args, launch_workers, markdown_table, print_result, publish, ratio
from service_launch import BASE_MODEL, REPO, sdk_env, start_service

CONFIG = str(REPO / "train_configs" / "service_debug.toml")


def sl_rows(num_datums: int, length: int, seed: int) -> list[tuple[list[int], list[int], list[float]]]:
    """(tokens, targets, weights) of random datums; weights sum to 1 per datum, on its second half."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_datums):
        ids = torch.randint(3, 250, (length + 1,), generator=g).tolist()
        weights = [0.0] * (length // 2) + [1.0 / (length - length // 2)] * (length - length // 2)
        rows.append((ids[:-1], ids[1:], weights))
    return rows


def timed(run, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_sdk(args, num_datums: int) -> dict:
    import tinker
    from tinker import types

    os.environ.update(sdk_env())
    with tempfile.TemporaryDirectory(prefix="bench_service_") as dump:
        service = start_service(Path(dump), args.ranks)
        try:
            client = tinker.ServiceClient(base_url=service.url)
            trainer = client.create_lora_training_client(base_model=BASE_MODEL, rank=args.lora_rank, seed=0).result()
            data = [
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens),
                    loss_fn_inputs={"target_tokens": targets, "weights": weights},
                )
                for tokens, targets, weights in sl_rows(num_datums, args.length, 0)
            ]
            adam = types.AdamParams(learning_rate=1e-4)

            def step():
                fb = trainer.forward_backward(data, "cross_entropy")
                optim = trainer.optim_step(adam)
                fb.result(), optim.result()

            step_s = timed(step, args.warmup, args.steps)
            sampler = trainer.save_weights_and_get_sampling_client().result()
            params = types.SamplingParams(max_tokens=args.max_tokens, seed=1, stop=[])
            prompt = types.ModelInput.from_ints(list(range(10, 30)))

            def sample():
                sampler.sample(prompt, num_samples=args.samples, sampling_params=params).result()

            sample_s = timed(sample, 1, args.sample_rounds)
        finally:
            service.stop()
    return {"step_s": step_s, "tokens_per_s": args.samples * args.max_tokens / sample_s}


def worker(args) -> None:
    """Every rank: build the service, run the same operations in lockstep, rank 0 reports."""
    from torchtitan_rl.recipes.config_checks import parse_job_config
    from torchtitan_rl.recipes.service import ServiceRecipe
    from torchtitan_rl.service.operations import Operation, TinkerDatum

    with tempfile.TemporaryDirectory(prefix="bench_service_direct_") as dump:
        recipe = ServiceRecipe(parse_job_config(["--job.config_file", CONFIG, "--job.dump_folder", dump]))
        recipe.setup()
        w = recipe.worker

        def run(kind, model_id=None, seq=None, **op_args):
            return w.execute(w.check(Operation("bench", kind, model_id, seq, op_args)))

        model = "bench:train:0"
        run("create_model", model, base_model=BASE_MODEL, lora_rank=args.lora_rank, seed=0,
            train_attn=True, train_mlp=True, train_unembed=True)  # fmt: skip
        data = [
            TinkerDatum(tokens, {"target_tokens": torch.tensor(targets), "weights": torch.tensor(weights)})
            for tokens, targets, weights in sl_rows(args.datums[0], args.length, 0)
        ]
        adam = dict(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0)

        def step():
            run("forward_backward", model, None, data=data, loss_fn="cross_entropy", loss_fn_config=None,
                forward_only=False)  # fmt: skip
            run("optim_step", model, None, **adam)

        step_s = timed(step, args.warmup, args.steps)
        run("save_weights_for_sampler", model, None, name=None, sampling_session_id="bench:sample:0")
        sample_args = dict(sampling_session_id="bench:sample:0", prompt=list(range(10, 30)),
                           num_samples=args.samples, max_tokens=args.max_tokens, seed=1, stop=[],
                           temperature=1.0, top_k=-1, top_p=1.0, prompt_logprobs=False)  # fmt: skip
        sample_s = timed(lambda: run("sample", **sample_args), 1, args.sample_rounds)
        if os.environ.get("RANK", "0") == "0":
            print_result({"step_s": step_s, "tokens_per_s": args.samples * args.max_tokens / sample_s})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--datums", type=int, nargs="+", default=[16, 64], help="SL batch sizes, one row each")
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--sample-rounds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="paired rounds of (direct, SDK), alternating")
    add_publish_args(parser, "service")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    rows, summary_parts = [], []
    for num_datums in args.datums:
        worker_args = [a for a in sys.argv[1:] if a != "--no-write"]
        if "--datums" in worker_args:  # the worker runs one size
            at = worker_args.index("--datums")
            worker_args = worker_args[:at] + worker_args[at + 1 + len(args.datums) :]
        worker_args += ["--datums", str(num_datums)]
        direct, sdk = [], []
        for round_index in range(args.rounds):
            order = ("direct", "sdk") if round_index % 2 == 0 else ("sdk", "direct")
            for side in order:
                if side == "direct":
                    result = launch_workers(__file__, args.ranks, worker_args)
                    if "error" in result:
                        raise SystemExit(f"direct run failed: {result['error']}")
                    direct.append(result)
                else:
                    sdk.append(measure_sdk(args, num_datums))
        step_direct = statistics.median(r["step_s"] for r in direct)
        step_sdk = statistics.median(r["step_s"] for r in sdk)
        tps_direct = statistics.median(r["tokens_per_s"] for r in direct)
        tps_sdk = statistics.median(r["tokens_per_s"] for r in sdk)
        rows.append(
            [f"SL step, {num_datums} datums", f"{step_direct:.3f} s", f"{step_sdk:.3f} s", ratio(step_sdk, step_direct)]
        )
        rows.append(["sampling tokens/s", f"{tps_direct:.0f}", f"{tps_sdk:.0f}", ratio(tps_sdk, tps_direct)])
        summary_parts.append(f"{ratio(step_sdk, step_direct)} ({num_datums} datums)")
    body = [
        f"One SL step: datums of {args.length} tokens (cross_entropy, weights on each second half), a LoRA "
        f"client of rank {args.lora_rank}, AdamW; sampling (measured beside each size): {args.samples} "
        f"sequences of {args.max_tokens} tokens from a 20-token prompt. {args.ranks} ranks; medians over "
        f"{args.steps} steps (after {args.warmup}) and {args.sample_rounds} sampling calls, then over "
        f"{args.rounds} paired rounds.",
        "",
        *markdown_table(["", "direct (worker)", "through the SDK", "SDK / direct"], rows),
    ]
    summary = f"SL step through the SDK / direct: {', '.join(summary_parts)} on {args.ranks} CPU ranks"
    publish(args, "Tinker-compatible service: overhead", summary, body)


if __name__ == "__main__":
    main()
