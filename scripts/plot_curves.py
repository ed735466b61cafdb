#!/usr/bin/env python
"""Plot TensorBoard scalars of one or more runs as an SVG line chart (no plotting library).

    python scripts/plot_curves.py --runs outputs/debug_grpo --tag rl/reward_mean --out reward.svg
    python scripts/plot_curves.py --runs a,b --labels "seed 1,seed 2" --tag rl/reward_mean \\
        --x-tag time/step_s --out reward_vs_time.svg

The x axis is the step, or with ``--x-tag`` the running sum of that tag (``time/step_s``
gives seconds of training). A run is a dump folder (its ``tb`` subfolder is read) or a
TensorBoard folder.
"""

import argparse
import os
import sys
from xml.sax.saxutils import escape

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from torchtitan_rl.tensorboard_io import read_scalars  # noqa: E402

WIDTH, HEIGHT, MARGIN = 640, 400, 56
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def series(run: str, tag: str, x_tag: str | None) -> list[tuple[float, float]]:
    folder = os.path.join(run, "tb") if os.path.isdir(os.path.join(run, "tb")) else run
    scalars = read_scalars(folder)
    if tag not in scalars:
        raise SystemExit(f"{run}: no tag {tag!r} (has: {', '.join(sorted(scalars))})")
    values = scalars[tag]
    if x_tag is None:
        return sorted((float(step), value) for step, value in values.items())
    elapsed, points = 0.0, []
    for step in sorted(scalars[x_tag]):
        elapsed += scalars[x_tag][step]
        if step in values:
            points.append((elapsed, values[step]))
    return points


def ticks(low: float, high: float, count: int = 5) -> list[float]:
    return [low + (high - low) * i / (count - 1) for i in range(count)]


def svg_chart(curves: dict[str, list[tuple[float, float]]], title: str, x_label: str, y_label: str) -> str:
    xs = [x for points in curves.values() for x, _ in points]
    ys = [y for points in curves.values() for _, y in points]
    x_low, x_high = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y_low, y_high = min(0.0, min(ys)), max(ys) if max(ys) > min(0.0, min(ys)) else 1.0
    plot_w, plot_h = WIDTH - 2 * MARGIN, HEIGHT - 2 * MARGIN

    def px(x):
        return MARGIN + (x - x_low) / (x_high - x_low) * plot_w

    def py(y):
        return HEIGHT - MARGIN - (y - y_low) / (y_high - y_low) * plot_h

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" '
             'font-size="12">', f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
             f'<text x="{WIDTH / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>']
    for y in ticks(y_low, y_high):
        parts.append(f'<line x1="{MARGIN}" x2="{WIDTH - MARGIN}" y1="{py(y):.1f}" y2="{py(y):.1f}" stroke="#ddd"/>')
        parts.append(f'<text x="{MARGIN - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:.2f}</text>')
    for x in ticks(x_low, x_high):
        parts.append(f'<text x="{px(x):.1f}" y="{HEIGHT - MARGIN + 16}" text-anchor="middle">{x:.0f}</text>')
    parts.append(f'<rect x="{MARGIN}" y="{MARGIN}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#333"/>')
    parts.append(f'<text x="{WIDTH / 2}" y="{HEIGHT - 14}" text-anchor="middle">{escape(x_label)}</text>')
    parts.append(f'<text x="16" y="{HEIGHT / 2}" text-anchor="middle" transform="rotate(-90 16 {HEIGHT / 2})">'
                 f'{escape(y_label)}</text>')
    for i, (label, points) in enumerate(curves.items()):
        color = COLORS[i % len(COLORS)]
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.8"/>')
        parts.append(f'<text x="{MARGIN + 10}" y="{MARGIN + 16 + 16 * i}" fill="{color}">{escape(label)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", required=True, help="comma-separated dump (or TensorBoard) folders")
    parser.add_argument("--labels", help="comma-separated legend labels (default: the folders)")
    parser.add_argument("--tag", required=True, help="the scalar to plot")
    parser.add_argument("--x-tag", help="plot against the running sum of this tag instead of the step")
    parser.add_argument("--title", default="")
    parser.add_argument("--out", required=True, help="the .svg file to write")
    args = parser.parse_args()
    runs = args.runs.split(",")
    labels = args.labels.split(",") if args.labels else runs
    if len(labels) != len(runs):
        raise SystemExit("--labels needs one label per run")
    curves = {label: series(run, args.tag, args.x_tag) for label, run in zip(labels, runs)}
    x_label = f"cumulative {args.x_tag}" if args.x_tag else "step"
    with open(args.out, "w") as f:
        f.write(svg_chart(curves, args.title or args.tag, x_label, args.tag))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
