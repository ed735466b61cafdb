"""The README's sizing table, from the memory estimator: which layouts of 8 x 80 GiB fit Qwen3
0.6B, 8B, 32B and 30B-A3B for SFT, LoRA SFT and GRPO, at two sequence lengths.

    python scripts/sizing_table.py            # rewrite the table in README.md
    python scripts/sizing_table.py --check    # exit 1 when README.md's table is not this output

Each row is ``train.py --estimate --estimate.search`` on a shipped recipe (``qwen_sft.toml``,
the same with ``lora.enable``, ``qwen_grpo.toml``) with the row's flavor, ``training.seq_len``
and ``training.max_tokens_per_microbatch``.
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from torchtitan_rl.config import ConfigManager  # noqa: E402
from torchtitan_rl.estimate.memory import GIB  # noqa: E402
from torchtitan_rl.estimate.search import search_layouts  # noqa: E402
from torchtitan_rl.recipes.base import lora_settings  # noqa: E402
from torchtitan_rl.recipes.estimate import estimate_model_args  # noqa: E402

START, END = "<!-- sizing table: scripts/sizing_table.py -->", "<!-- end of sizing table -->"
FLAVORS = ("0.6B", "8B", "32B", "30B-A3B")
RECIPES = {
    "SFT": ("qwen_sft.toml", []),
    "LoRA SFT": ("qwen_sft.toml", ["--lora.enable", "true"]),
    "GRPO": ("qwen_grpo.toml", []),
}
# (training.seq_len, training.max_tokens_per_microbatch)
LENGTHS = ((4096, 16384), (32768, 32768))
WORLD_SIZE, DEVICE_GIB = 8, 80


def row(flavor: str, recipe: str, seq_len: int, budget: int) -> str:
    config_file, extra = RECIPES[recipe]
    argv = ["--job.config_file", os.path.join(ROOT, "train_configs", config_file), "--model.flavor", flavor]
    argv += ["--training.seq_len", str(seq_len), "--training.max_tokens_per_microbatch", str(budget), *extra]
    if recipe == "GRPO":
        # Prompts up to half the length, completions the other half.
        argv += ["--generation.max_new_tokens", str(seq_len // 2)]
    config = ConfigManager().parse_args(argv)
    found = search_layouts(config, estimate_model_args(config), WORLD_SIZE, DEVICE_GIB * GIB, lora_settings(config))
    if not found:
        return f"| {flavor} | {recipe} | {seq_len} | {budget} | none fits | | 0 |"
    best, least = found[0], min(found, key=lambda c: c.peak)
    return (
        f"| {flavor} | {recipe} | {seq_len} | {budget} | `{best.describe()}` ({best.peak / GIB:.0f} GiB) "
        f"| `{least.describe()}` ({least.peak / GIB:.0f} GiB) | {len(found)} |"
    )


def table() -> str:
    lines = [
        START,
        "| model | recipe | seq_len | tokens / micro-batch | fastest layout that fits (peak) "
        "| least memory (peak) | layouts that fit |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [row(f, r, s, b) for f in FLAVORS for r in RECIPES for s, b in LENGTHS]
    return "\n".join([*lines, END])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md's table differs")
    args = parser.parse_args()
    path = os.path.join(ROOT, "README.md")
    with open(path, encoding="utf-8") as f:
        readme = f.read()
    if START not in readme or END not in readme:
        print(f"{path} has no sizing table markers", file=sys.stderr)
        return 1
    before, rest = readme.split(START, 1)
    after = rest.split(END, 1)[1]
    new = before + table() + after
    if args.check:
        if new != readme:
            print("README.md's sizing table is out of date: run python scripts/sizing_table.py", file=sys.stderr)
            return 1
        return 0
    with open(path, "w", encoding="utf-8") as f:
        f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
