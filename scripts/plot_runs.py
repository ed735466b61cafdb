#!/usr/bin/env python
"""Plot TensorBoard scalars of several runs side by side into one PNG (matplotlib).

    python scripts/plot_runs.py outputs/run_a outputs/run_b
    python scripts/plot_runs.py A B --tags loss_metrics/global_avg_loss grad_norm lr --out runs.png
    python scripts/plot_runs.py A B --labels "dp=2" "dp=1" --out dp.png

One panel per tag, one line per run, x = the training step. A run is a dump folder (its
``tb`` sub-folder, ``metrics.save_tb_folder``'s default, is read) or a TensorBoard folder.
The legend shows each run's folder name, or ``--labels``. Without ``--tags`` the panels are
``loss_metrics/global_avg_loss`` and ``grad_norm``, plus ``rl/reward_mean`` when any run logged
it (an RL run; runs without it are left out of that panel). A tag given with ``--tags`` that
some run did not log stops with exit code 2, naming the run and the tags it has.

Needs matplotlib: ``pip install -e .[plot]``. No display is used (Agg), so it runs headless.
"""

import argparse
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from torchtitan_rl.tensorboard_io import event_files, read_scalars  # noqa: E402

LOSS_TAG, GRAD_NORM_TAG, REWARD_TAG = "loss_metrics/global_avg_loss", "grad_norm", "rl/reward_mean"
TB_SUBFOLDER = "tb"  # metrics.save_tb_folder's default
PANEL_SIZE = (4.6, 3.2)  # inches per panel: legible at dpi 100 and a PNG of a few tens of KB
MAX_COLUMNS = 3  # beyond this, panels wrap into rows so each stays readable

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
        raise ValueError(f"{run!r} holds the event files of several runs (in {shown} under {folder!r}); "
                         "pass each run's own folder")
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
            raise ValueError(f"runs {seen[label]!r} and {path!r} would both be labelled {label!r}; "
                             "pass --labels with one distinct label per run")
        seen[label] = path
    # read_scalars names the folder when it is missing or holds no event files.
    return {label: read_scalars(tb_folder(path)) for label, path in zip(labels, paths)}


def default_tags(runs: dict[str, Scalars]) -> list[str]:
    """Loss and grad norm; the mean reward too when any run is an RL run."""
    tags = [LOSS_TAG, GRAD_NORM_TAG]
    if any(REWARD_TAG in scalars for scalars in runs.values()):
        tags.append(REWARD_TAG)
    return tags


def check_tags(runs: dict[str, Scalars], tags: list[str], allow_missing: bool = False) -> None:
    """Raise ValueError naming the first (tag, run) pair that cannot be plotted.

    With ``allow_missing`` a run may lack a tag (it is left out of that panel) as long as some
    run has it: the default tags mix SFT and RL runs, and the SFT ones have no reward.
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


def _matplotlib_figure_class():
    """matplotlib's Figure, imported only when plotting, so the rest works without it."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("plotting needs matplotlib, which is not installed: "
                          "pip install -e .[plot]  (or: pip install matplotlib)") from exc
    return Figure


def plot_runs(runs: dict[str, Scalars], tags: list[str], out: str | None = None, allow_missing: bool = False):
    """A matplotlib Figure with one panel per tag and one line per run; saved to ``out`` if given.

    ``runs`` maps a legend label to that run's ``{tag: {step: value}}`` (``read_scalars``).
    A run lacking a tag is a ValueError, unless ``allow_missing`` (see ``check_tags``).
    The Figure is built without pyplot, so no GUI backend or display is ever touched and
    nothing stays registered in pyplot's global figure list.
    """
    check_tags(runs, tags, allow_missing)
    Figure = _matplotlib_figure_class()
    columns = min(len(tags), MAX_COLUMNS)
    rows = -(-len(tags) // columns)
    fig = Figure(figsize=(PANEL_SIZE[0] * columns, PANEL_SIZE[1] * rows), dpi=100, layout="constrained")
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    colors = {label: f"C{i % 10}" for i, label in enumerate(runs)}  # a run keeps its colour in every panel
    for ax, tag in zip(axes, tags):
        for label, scalars in runs.items():
            if tag not in scalars:  # only with allow_missing
                continue
            steps = sorted(scalars[tag])
            # A single logged point draws no line segment; a marker keeps it visible.
            ax.plot(steps, [scalars[tag][s] for s in steps], label=label, color=colors[label], linewidth=1.4,
                    marker="o" if len(steps) == 1 else None)
        ax.set_title(tag, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
    for ax in axes[len(tags):]:  # unused cells of the last row
        fig.delaxes(ax)
    # One legend for the whole figure, since a run has the same colour in every panel; collected
    # over all panels because with allow_missing no single panel need hold every run.
    legend = {}
    for ax in axes[:len(tags)]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    labels = [label for label in runs if label in legend]
    handles = [legend[label] for label in labels]
    fig.legend(handles, labels, loc="outside upper center", ncols=min(len(labels), 4), frameon=False)
    if out is not None:
        parent = os.path.dirname(os.path.abspath(out))
        os.makedirs(parent, exist_ok=True)
        fig.savefig(out)
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="dump folders (their tb/ is read) or TensorBoard folders")
    parser.add_argument("--tags", nargs="+", help=f"scalars to plot, one panel each (default: {LOSS_TAG} "
                        f"{GRAD_NORM_TAG}, plus {REWARD_TAG} if any run has it)")
    parser.add_argument("--labels", nargs="+", help="legend labels, one per run (default: the folder names)")
    parser.add_argument("--out", default="runs.png",
                        help="image to write; format from the extension (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        runs = load_runs(args.runs, args.labels)
        tags = args.tags if args.tags else default_tags(runs)
        # Tags the user chose must exist in every run; the default reward panel only where it does.
        plot_runs(runs, tags, args.out, allow_missing=not args.tags)
    except (ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {len(tags)} panel(s) x {len(runs)} run(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
