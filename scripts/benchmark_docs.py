"""Where the benchmark scripts publish their figures: printed, and appended to docs/benchmarks.md."""

import os

BENCHMARKS_MD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "benchmarks.md")
_HEADER = ("# Benchmarks\n\nFigures measured by the scripts in `scripts/` (each section names its command); newest "
           "last. Ratios are measured within one run, alternating the variants, because the machines are shared.\n")


def publish(lines: list[str], write: bool) -> None:
    """Print the section ``lines``; with ``write``, append it to docs/benchmarks.md (made if missing)."""
    text = "\n".join(lines)
    print(text)
    if not write:
        return
    if not os.path.exists(BENCHMARKS_MD):
        with open(BENCHMARKS_MD, "w") as f:
            f.write(_HEADER)
    with open(BENCHMARKS_MD, "a") as f:
        f.write("\n" + text)
