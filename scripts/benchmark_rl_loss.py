"""Cost of the RL loss (ppo + KL + entropy) against cross-entropy, per training step.

    .venv/bin/python scripts/benchmark_rl_loss.py            # rewrites its page in docs/benchmarks/
    .venv/bin/python scripts/benchmark_rl_loss.py --no-write # print only

One process, the ``debugmodel`` Qwen3 with its vocabulary set to ``--vocab``; a mini-batch of
``--samples`` sequences of ``--seq-len`` tokens with RL inputs, packed into micro-batches of
``--budget`` tokens. Each round times ``Engine.forward_backward`` (+ zeroing the gradients) once
per loss, alternating the order, and the medians are compared as a ratio measured in the same
run. Peak memory is that of one profiled step per loss: the bytes allocated during the step and
still alive (``torchtitan_rl.profiling.cpu_memory_timeline``) on CPU, or the allocator's peak
above the step's start on CUDA.
"""

import argparse
import dataclasses

import torch

from bench_common import add_publish_args, markdown_table, peak_bytes, publish, ratio, time_alternating
from torchtitan_rl.data.sample import Sample
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.engine import Engine, EngineOptions
from torchtitan_rl.models.qwen3.args import qwen3_flavors
from torchtitan_rl.recipes.base import build_model

LOSSES = {
    "cross_entropy": ("cross_entropy", {}),
    # RL losses always compute the entropy (for rl/entropy); without a bonus it gets no gradient.
    "ppo": ("ppo", {"dual_clip_c": 3.0}),
    "ppo+kl+entropy": (
        "ppo",
        {"dual_clip_c": 3.0, "kl_coef": 0.05, "kl_estimator": "low_var_kl", "entropy_coef": 0.01},
    ),
}


def make_samples(num: int, seq_len: int, vocab: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(num):
        ids = torch.randint(0, vocab, (seq_len + 1,), generator=gen)
        base = -torch.log(torch.tensor(float(vocab)))
        samples.append(
            Sample(
                input_ids=ids[:-1],
                labels=ids[1:],
                loss_mask=torch.arange(seq_len) >= seq_len // 4,
                advantages=torch.randn(seq_len, generator=gen),
                sampler_logprobs=base + 0.1 * torch.randn(seq_len, generator=gen),
                ref_logprobs=base + 0.1 * torch.randn(seq_len, generator=gen),
                group_id=i // 4,
            )
        )
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=10)
    add_publish_args(parser, "rl_loss")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dims = ParallelDims(1, 1, 1, 1, world_size=1)
    dims.build_meshes(device.type)
    model_args = dataclasses.replace(qwen3_flavors["debugmodel"], vocab_size=args.vocab, attn_backend="sdpa_loop")
    model = build_model(model_args, parallel_dims=dims, device=device, seed=0, param_dtype=torch.float32)
    options = EngineOptions(
        reduction="sequence_mean",
        horizon=args.seq_len,
        max_tokens_per_microbatch=args.budget,
        logits_chunk_size=1024,
        max_norm=0.0,
    )
    engine = Engine(model, optimizer=None, lr_scheduler=None, parallel_dims=dims, device=device, options=options)
    samples = make_samples(args.samples, args.seq_len, args.vocab)

    def step_of(name):
        loss_fn, config = LOSSES[name]

        def step():
            engine.forward_backward(samples, loss_fn, config)
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        return step

    median = time_alternating({name: step_of(name) for name in LOSSES}, args.rounds)
    peaks = {name: peak_bytes(step_of(name), device) for name in LOSSES}
    base = "cross_entropy"
    body = [
        (
            f"One process, `debugmodel` Qwen3 with vocab {args.vocab}, {args.samples} × {args.seq_len}-token sequences "
            f"packed into {args.budget}-token micro-batches, `sequence_mean`; `Engine.forward_backward` + zero_grad, "
            f"median of {args.rounds} alternating rounds; peak = bytes allocated during one step and still alive "
            "(memory from before the step not counted)."
        ),
        "",
        *markdown_table(
            ["loss", "step time", "peak memory"],
            [[f"`{name}`", f"{median[name] * 1e3:.0f} ms", f"{peaks[name] / 2**20:.0f} MiB"] for name in LOSSES],
        ),
        "",
        *[
            f"- `{name}` / `{base}`: time {ratio(median[name], median[base])}, peak memory "
            f"{ratio(peaks[name], peaks[base])}."
            for name in LOSSES
            if name != base
        ],
    ]
    publish(
        args,
        "RL loss overhead per step",
        "Step time and peak memory of the RL losses (PPO, with KL and entropy bonus) against cross-entropy.",
        body,
    )


if __name__ == "__main__":
    main()
