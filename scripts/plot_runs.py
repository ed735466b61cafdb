#!/usr/bin/env python
"""Plot TensorBoard scalars of several runs side by side: an SVG (no plotting library) or a PNG
(matplotlib).

    python scripts/plot_runs.py outputs/run_a outputs/run_b
    python scripts/plot_runs.py A B --tags loss_metrics/global_avg_loss grad_norm lr --out runs.png
    python scripts/plot_runs.py A B --labels "dp=2" "dp=1" --out dp.svg
    python scripts/plot_runs.py A B --tags rl/reward_mean --x-tag time/step_s --title "reward vs time" --out r.svg

One panel per tag, one line per run; x is the training step, or with ``--x-tag`` the running
sum of that tag over the steps (``time/step_s`` gives seconds of training). A run is a dump
folder (its ``tb`` sub-folder, ``metrics.save_tb_folder``'s default, is read) or a TensorBoard
folder. The legend shows each run's folder name, or ``--labels``. Without ``--tags`` the panels
are ``loss_metrics/global_avg_loss`` and ``grad_norm``, plus ``rl/reward_mean`` when any run
logged it (an RL run; runs without it are left out of that panel). A tag given with ``--tags``
that some run did not log stops with exit code 2, naming the run and the tags it has.

``--format`` (default: the extension of ``--out``, else png): ``svg`` is written by hand and
needs nothing beyond this repository; ``png`` needs matplotlib (``pip install -e .[plot]``) and
uses no display (no pyplot), so it runs headless.
"""

import argparse
import os
import sys
from xml.sax.saxutils import escape, quoteattr

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from torchtitan_rl.tensorboard_io import event_files, read_scalars  # noqa: E402

LOSS_TAG, GRAD_NORM_TAG, REWARD_TAG = "loss_metrics/global_avg_loss", "grad_norm", "rl/reward_mean"
TB_SUBFOLDER = "tb"  # metrics.save_tb_folder's default
PANEL_SIZE = (4.6, 3.2)  # inches per panel: legible at dpi 100 and a PNG of a few tens of KB
DPI = 100  # the SVG uses the same pixels per panel as the PNG
MAX_COLUMNS = 3  # beyond this, panels wrap into rows so each stays readable
FORMATS = ("png", "svg")
# matplotlib's default cycle (C0, C1, ...), so a run has the same colour in both formats.
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
# SVG layout, pixels: the legend (and title) band above the panels; inside a panel, the space
# around its plot area for the tag (top), the tick labels (left, bottom) and the x label.
LEGEND_PX, TITLE_PX = 28, 24
PAD_LEFT, PAD_RIGHT, PAD_TOP, PAD_BOTTOM = 64, 16, 28, 44
TICKS = 5

Scalars = dict[str, dict[int, float]]


def tb_folder(run: str) -> str:
    """The TensorBoard folder of ``run``: ``run/tb`` for a dump folder, else ``run`` itself."""
    if not os.path.isdir(run):
        raise ValueError(f"run folder {run!r} does not exist (or is not a folder)")
    nested = os.path.join(run, TB_SUBFOLDER)
    folder = nested if os.path.isdir(nested) else run
    # read_scalars merges every event file below the folder. A run writes all of its files into
    # one folder, so files in several folders mean a parent of several runs was given (e.g.
    # outputs/), whose curves would be silently mixed into one line.
    folders = sorted({os.path.relpath(os.path.dirname(f), folder) for f in event_files(folder)})
    if len(folders) > 1:
        shown = ", ".join(folders[:5]) + (", ..." if len(folders) > 5 else "")
        raise ValueError(
            f"{run!r} holds the event files of several runs (in {shown} under {folder!r}); pass each run's own folder"
        )
    return folder


def run_label(run: str) -> str:
    """The legend name of a run: its dump folder's name, also when the tb folder was given."""
    path = os.path.normpath(os.path.abspath(run))
    if os.path.basename(path) == TB_SUBFOLDER:
        path = os.path.dirname(path)
    return os.path.basename(path)


def load_runs(paths: list[str], labels: list[str] | None = None) -> dict[str, Scalars]:
    """``{label: read_scalars(tb folder)}`` for each run, in the order given."""
    if not paths:
        raise ValueError("no run folders given")
    if labels is not None and len(labels) != len(paths):
        raise ValueError(f"--labels needs one label per run: got {len(labels)} labels for {len(paths)} runs")
    labels = labels if labels is not None else [run_label(p) for p in paths]
    # The legend is the only way to tell lines apart, so two runs may not share a name (e.g.
    # a/seed1 and b/seed1) -- the dict would also silently keep only one of them.
    seen: dict[str, str] = {}
    for label, path in zip(labels, paths):
        if label in seen:
            raise ValueError(
                f"runs {seen[label]!r} and {path!r} would both be labelled {label!r}; "
                "pass --labels with one distinct label per run"
            )
        seen[label] = path
    # read_scalars names the folder when it is missing or holds no event files.
    return {label: read_scalars(tb_folder(path)) for label, path in zip(labels, paths)}


def default_tags(runs: dict[str, Scalars]) -> list[str]:
    """Loss and grad norm; the mean reward too when any run is an RL run."""
    tags = [LOSS_TAG, GRAD_NORM_TAG]
    if any(REWARD_TAG in scalars for scalars in runs.values()):
        tags.append(REWARD_TAG)
    return tags


def check_tags(
    runs: dict[str, Scalars], tags: list[str], allow_missing: bool = False, x_tag: str | None = None
) -> None:
    """Raise ValueError naming the first (tag, run) pair that cannot be plotted.

    With ``allow_missing`` a run may lack a tag (it is left out of that panel) as long as some
    run has it: the default tags mix SFT and RL runs, and the SFT ones have no reward. The
    ``x_tag`` is needed by every run.
    """
    if not tags:
        raise ValueError("no tags to plot")
    repeated = sorted({tag for tag in tags if tags.count(tag) > 1})
    if repeated:
        raise ValueError(f"tag(s) given more than once: {', '.join(repeated)}")
    for tag in tags:
        lacking = [label for label, scalars in runs.items() if tag not in scalars]
        if lacking and (not allow_missing or len(lacking) == len(runs)):
            label = lacking[0]
            raise ValueError(f"run {label!r} has no scalar {tag!r}; its tags: {', '.join(sorted(runs[label]))}")
    for label, scalars in runs.items():
        if x_tag is not None and x_tag not in scalars:
            raise ValueError(f"run {label!r} has no scalar {x_tag!r} (--x-tag); its tags: {', '.join(sorted(scalars))}")


def curve(scalars: Scalars, tag: str, x_tag: str | None = None) -> list[tuple[float, float]]:
    """The (x, value) points of ``tag``, by step: x is the step, or the running sum of ``x_tag``
    up to and including that step (steps where ``tag`` was not logged still add to the sum)."""
    values = scalars[tag]
    if x_tag is None:
        return [(float(step), values[step]) for step in sorted(values)]
    elapsed, points = 0.0, []
    for step in sorted(scalars[x_tag]):
        elapsed += scalars[x_tag][step]
        if step in values:
            points.append((elapsed, values[step]))
    return points


def x_label(x_tag: str | None) -> str:
    return "step" if x_tag is None else f"cumulative {x_tag}"


def _matplotlib_figure_class():
    """matplotlib's Figure, imported only when plotting, so the rest works without it."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(
            "plotting needs matplotlib, which is not installed: pip install -e .[plot]  (or: pip install matplotlib)"
        ) from exc
    return Figure


def plot_runs(
    runs: dict[str, Scalars],
    tags: list[str],
    out: str | None = None,
    allow_missing: bool = False,
    x_tag: str | None = None,
    title: str | None = None,
):
    """A matplotlib Figure with one panel per tag and one line per run; saved to ``out`` if given.

    ``runs`` maps a legend label to that run's ``{tag: {step: value}}`` (``read_scalars``).
    A run lacking a tag is a ValueError, unless ``allow_missing`` (see ``check_tags``); x is
    as ``curve`` says. The Figure is built without pyplot, so no GUI backend or display is ever
    touched and nothing stays registered in pyplot's global figure list.
    """
    check_tags(runs, tags, allow_missing, x_tag)
    Figure = _matplotlib_figure_class()
    columns = min(len(tags), MAX_COLUMNS)
    rows = -(-len(tags) // columns)
    fig = Figure(figsize=(PANEL_SIZE[0] * columns, PANEL_SIZE[1] * rows), dpi=DPI, layout="constrained")
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    colors = {label: f"C{i % 10}" for i, label in enumerate(runs)}  # a run keeps its colour in every panel
    for ax, tag in zip(axes, tags):
        for label, scalars in runs.items():
            if tag not in scalars:  # only with allow_missing
                continue
            points = curve(scalars, tag, x_tag)
            # A single logged point draws no line segment; a marker keeps it visible.
            ax.plot(
                [x for x, _ in points],
                [y for _, y in points],
                label=label,
                color=colors[label],
                linewidth=1.4,
                marker="o" if len(points) == 1 else None,
            )
        ax.set_title(tag, fontsize=10)
        ax.set_xlabel(x_label(x_tag))
        ax.grid(True, alpha=0.3)
    for ax in axes[len(tags) :]:  # unused cells of the last row
        fig.delaxes(ax)
    # One legend for the whole figure, since a run has the same colour in every panel; collected
    # over all panels because with allow_missing no single panel need hold every run.
    legend = {}
    for ax in axes[: len(tags)]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    labels = [label for label in runs if label in legend]
    handles = [legend[label] for label in labels]
    # The title heads the legend: a suptitle would overlap the legend placed outside the panels.
    fig.legend(handles, labels, loc="outside upper center", ncols=min(len(labels), 4), frameon=False, title=title)
    if out is not None:
        parent = os.path.dirname(os.path.abspath(out))
        os.makedirs(parent, exist_ok=True)
        fig.savefig(out)
    return fig


def _data_range(values: list[float]) -> tuple[float, float]:
    """The range of the values; one unit around a single value."""
    low, high = min(values), max(values)
    return (low - 1.0, high + 1.0) if high == low else (low, high)


def svg_figure(
    runs: dict[str, Scalars],
    tags: list[str],
    allow_missing: bool = False,
    x_tag: str | None = None,
    title: str | None = None,
) -> str:
    """The same figure as ``plot_runs`` as SVG text, drawn by hand (no plotting library).

    Each panel is a ``<g class="panel" data-tag=TAG>`` whose ``<rect class="plot-area">`` holds
    one ``<polyline class="curve" data-run=LABEL>`` per run (a ``<circle>`` too for a single
    point); y grows downwards, so a larger value is drawn higher.
    """
    check_tags(runs, tags, allow_missing, x_tag)
    columns = min(len(tags), MAX_COLUMNS)
    rows = -(-len(tags) // columns)
    panel_w, panel_h = PANEL_SIZE[0] * DPI, PANEL_SIZE[1] * DPI
    top = LEGEND_PX + (TITLE_PX if title else 0)
    width, height = columns * panel_w, top + rows * panel_h
    colors = {label: COLORS[i % len(COLORS)] for i, label in enumerate(runs)}
    parts = [
        (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="sans-serif" font-size="11">'
        ),
        '<rect width="100%" height="100%" fill="white"/>',
    ]
    if title:
        parts.append(
            f'<text class="title" x="{width / 2:.1f}" y="17" text-anchor="middle" font-size="14">{escape(title)}</text>'
        )
    drawn = [label for label in runs if any(tag in runs[label] for tag in tags)]
    for i, label in enumerate(drawn):  # the legend: one colour per run, the same in every panel
        x, y = 12 + i * (width - 24) / len(drawn), top - LEGEND_PX / 2
        parts.append(
            f'<line x1="{x:.1f}" x2="{x + 22:.1f}" y1="{y:.1f}" y2="{y:.1f}" stroke="{colors[label]}" '
            'stroke-width="2"/>'
        )
        parts.append(f'<text class="legend" x="{x + 28:.1f}" y="{y + 4:.1f}">{escape(label)}</text>')
    for index, tag in enumerate(tags):
        left, upper = (index % columns) * panel_w, top + (index // columns) * panel_h
        curves = {label: curve(scalars, tag, x_tag) for label, scalars in runs.items() if tag in scalars}
        parts += _svg_panel(tag, curves, colors, left, upper, panel_w, panel_h, x_label(x_tag))
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _svg_panel(
    tag: str,
    curves: dict[str, list[tuple[float, float]]],
    colors: dict[str, str],
    left: float,
    upper: float,
    panel_w: float,
    panel_h: float,
    xlabel: str,
) -> list[str]:
    x_low, x_high = _data_range([x for points in curves.values() for x, _ in points])
    y_min, y_max = _data_range([y for points in curves.values() for _, y in points])
    # 5 % of air above and below the curves; the ticks mark the data's own range.
    y_low, y_high = y_min - 0.05 * (y_max - y_min), y_max + 0.05 * (y_max - y_min)
    area_x, area_y = left + PAD_LEFT, upper + PAD_TOP
    area_w, area_h = panel_w - PAD_LEFT - PAD_RIGHT, panel_h - PAD_TOP - PAD_BOTTOM

    def px(x: float) -> float:
        return area_x + (x - x_low) / (x_high - x_low) * area_w

    def py(y: float) -> float:
        return area_y + area_h - (y - y_low) / (y_high - y_low) * area_h

    parts = [
        f'<g class="panel" data-tag={quoteattr(tag)}>',
        (
            f'<text class="panel-title" x="{area_x + area_w / 2:.1f}" y="{upper + 18:.1f}" '
            f'text-anchor="middle">{escape(tag)}</text>'
        ),
    ]
    for i in range(TICKS):
        y = y_min + (y_max - y_min) * i / (TICKS - 1)
        parts.append(
            f'<line x1="{area_x:.1f}" x2="{area_x + area_w:.1f}" y1="{py(y):.2f}" y2="{py(y):.2f}" stroke="#e4e4e4"/>'
        )
        parts.append(f'<text class="y-tick" x="{area_x - 5:.1f}" y="{py(y) + 4:.2f}" text-anchor="end">{y:.4g}</text>')
        x = x_low + (x_high - x_low) * i / (TICKS - 1)
        parts.append(
            f'<text class="x-tick" x="{px(x):.2f}" y="{area_y + area_h + 15:.1f}" text-anchor="middle">{x:.4g}</text>'
        )
    parts.append(
        f'<rect class="plot-area" x="{area_x:.1f}" y="{area_y:.1f}" width="{area_w:.1f}" '
        f'height="{area_h:.1f}" fill="none" stroke="#444"/>'
    )
    parts.append(
        f'<text class="x-label" x="{area_x + area_w / 2:.1f}" y="{upper + panel_h - 8:.1f}" '
        f'text-anchor="middle">{escape(xlabel)}</text>'
    )
    for label, points in curves.items():
        path = " ".join(f"{px(x):.2f},{py(y):.2f}" for x, y in points)
        parts.append(
            f'<polyline class="curve" data-run={quoteattr(label)} points="{path}" fill="none" '
            f'stroke="{colors[label]}" stroke-width="1.6"/>'
        )
        if len(points) == 1:  # a single point draws no segment
            ((x, y),) = points
            parts.append(f'<circle cx="{px(x):.2f}" cy="{py(y):.2f}" r="3" fill="{colors[label]}"/>')
    parts.append("</g>")
    return parts


def output_format(out: str, fmt: str | None) -> str:
    """``fmt``, else the extension of ``out``; an extension that contradicts ``fmt`` is an error."""
    extension = os.path.splitext(out)[1].lower().lstrip(".")
    if fmt is None:
        if extension not in FORMATS:
            raise ValueError(
                f"--out {out!r}: cannot tell the format from the extension; use .png or .svg, or give --format"
            )
        return extension
    if extension != fmt:
        raise ValueError(f"--out {out!r} does not end in .{fmt} (--format {fmt})")
    return fmt


def write_figure(
    runs: dict[str, Scalars],
    tags: list[str],
    out: str,
    fmt: str,
    allow_missing: bool = False,
    x_tag: str | None = None,
    title: str | None = None,
) -> None:
    """Write the figure to ``out`` as ``fmt`` (``png`` or ``svg``), making its folder if needed."""
    if fmt == "png":
        plot_runs(runs, tags, out, allow_missing, x_tag, title)
        return
    text = svg_figure(runs, tags, allow_missing, x_tag, title)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="dump folders (their tb/ is read) or TensorBoard folders")
    parser.add_argument(
        "--tags",
        nargs="+",
        help=f"scalars to plot, one panel each (default: {LOSS_TAG} "
        f"{GRAD_NORM_TAG}, plus {REWARD_TAG} if any run has it)",
    )
    parser.add_argument("--labels", nargs="+", help="legend labels, one per run (default: the folder names)")
    parser.add_argument("--x-tag", help="x = the running sum of this scalar (e.g. time/step_s) instead of the step")
    parser.add_argument("--title", help="a title above the panels")
    parser.add_argument(
        "--format",
        choices=FORMATS,
        help="svg (no dependency) or png (matplotlib); default: the extension of --out, else png",
    )
    parser.add_argument("--out", help="image to write (default: runs.png, or runs.svg with --format svg)")
    args = parser.parse_args(argv)
    out = args.out or f"runs.{args.format or 'png'}"
    try:
        fmt = output_format(out, args.format)
        runs = load_runs(args.runs, args.labels)
        tags = args.tags if args.tags else default_tags(runs)
        # Tags the user chose must exist in every run; the default reward panel only where it does.
        write_figure(runs, tags, out, fmt, allow_missing=not args.tags, x_tag=args.x_tag, title=args.title)
    except (ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}: {len(tags)} panel(s) x {len(runs)} run(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
