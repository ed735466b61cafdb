"""Would caching the RoPE cos/sin tables help? Measured on CPU before deciding.

    .venv/bin/python scripts/benchmark_rope_cache.py            # rewrites its page in docs/benchmarks/
    .venv/bin/python scripts/benchmark_rope_cache.py --no-write # print only

The Qwen3 model computes its rotary tables from the per-token positions once per forward
(``rotary_cos_sin``), shared by every layer. The alternative is a table over positions
``0 .. max_seq_len - 1`` computed once and gathered by position each forward. For each model
(the debug model, and one layer of Qwen3-0.6B's width) on one packed micro-batch of
``--docs`` documents: the time of the table computation alone and of the gather alone, and
forward + backward of the model with either, alternating for ``--repeats`` rounds (medians).
Also checks that both give the same tables bit for bit.
"""

import argparse
import dataclasses

import torch

import torchtitan_rl.models.qwen3.model as qwen3_model
from bench_common import add_publish_args, markdown_table, publish, ratio, time_alternating
from torchtitan_rl.models.qwen3.args import qwen3_flavors

RECOMPUTE = qwen3_model.rotary_cos_sin


def cached_rotary(max_seq_len: int):
    """``rotary_cos_sin`` by lookup in tables of every position, made on first use."""
    tables = {}

    def rotary(positions, head_dim, theta, dtype):
        key = (head_dim, theta, dtype, positions.device)
        if key not in tables:
            tables[key] = RECOMPUTE(torch.arange(max_seq_len, device=positions.device), head_dim, theta, dtype)
        cos, sin = tables[key]
        return cos.index_select(0, positions), sin.index_select(0, positions)

    return rotary


def measure(name: str, model_args, num_tokens: int, docs: int, repeats: int) -> dict:
    torch.manual_seed(0)
    model = qwen3_model.Qwen3Model(model_args)
    model.init_weights(0)
    lens = [num_tokens // docs] * docs
    positions = torch.cat([torch.arange(n) for n in lens])
    seq_ids = torch.repeat_interleave(torch.arange(docs), torch.tensor(lens))
    tokens = torch.randint(0, model_args.vocab_size, (num_tokens,))
    variants = {"recompute": RECOMPUTE, "cached": cached_rotary(model_args.max_seq_len)}
    args = (positions, model_args.head_dim, model_args.rope_theta, torch.float32)
    expected = RECOMPUTE(*args)
    got = variants["cached"](*args)
    exact = all(torch.equal(a, b) for a, b in zip(got, expected))
    table_time = time_alternating({v: (lambda fn=fn: fn(*args)) for v, fn in variants.items()}, 20 * repeats)

    def step():
        model.zero_grad(set_to_none=True)
        model(tokens, positions, seq_ids).square().mean().backward()

    def step_with(rotary):
        def run():
            qwen3_model.rotary_cos_sin = rotary
            step()

        return run

    # The first (warm-up) round also fills the cache.
    step_time = time_alternating({v: step_with(fn) for v, fn in variants.items()}, repeats)
    qwen3_model.rotary_cos_sin = RECOMPUTE
    return {
        "name": name,
        "tokens": num_tokens,
        "exact": exact,
        "table": table_time,
        "step": step_time,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    add_publish_args(parser, "rope_cache")
    args = parser.parse_args()
    debug = dataclasses.replace(qwen3_flavors["debugmodel"], attn_backend="sdpa_loop")
    layer = dataclasses.replace(qwen3_flavors["0.6B"], n_layers=1, vocab_size=4096, attn_backend="sdpa_loop")
    results = [
        measure("debugmodel", debug, 2048, args.docs, args.repeats),
        measure("one layer of 0.6B's width (vocab 4096)", layer, 4096, args.docs, args.repeats),
    ]
    rows = [
        [
            r["name"],
            r["tokens"],
            f"{r['table']['recompute'] * 1e3:.2f} ms",
            f"{r['table']['cached'] * 1e3:.2f} ms",
            f"{r['step']['recompute'] * 1e3:.0f} ms",
            f"{r['step']['cached'] * 1e3:.0f} ms ({ratio(r['step']['cached'], r['step']['recompute'], digits=3)})",
            "yes" if r["exact"] else "no",
        ]
        for r in results
    ]
    body = [
        (
            f"One process, float32, one packed micro-batch of {args.docs} equal documents; the tables alone (computed "
            "from the positions, or gathered from a table of every position) and a forward + backward of the model, "
            f"medians of {args.repeats} alternating rounds:"
        ),
        "",
        *markdown_table(
            [
                "model",
                "tokens",
                "tables: recompute",
                "tables: cached",
                "fwd+bwd: recompute",
                "fwd+bwd: cached",
                "equal bit for bit",
            ],
            rows,
        ),
    ]
    publish(
        args,
        "RoPE tables: recomputed vs cached",
        "Whether caching the rotary cos/sin tables would speed up a "
        "step: the tables alone and a model's forward + backward, both ways.",
        body,
    )


if __name__ == "__main__":
    main()
