#!/usr/bin/env python
"""Show the rollouts and evaluations an RL run dumped (rl.dump_rollouts): a table in the terminal,
or a self-contained HTML page.

    python scripts/show_rollouts.py outputs/debug_grpo
    python scripts/show_rollouts.py outputs/debug_grpo --step all --sort reward --ascending --limit 10
    python scripts/show_rollouts.py outputs/debug_grpo --filter "correct=false" --filter "length>=8"
    python scripts/show_rollouts.py outputs/debug_grpo --kind evals --filter "pass@k=1"
    python scripts/show_rollouts.py outputs/debug_grpo --html rollouts.html
"""

import argparse
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from rich.console import Console  # noqa: E402

from torchtitan_rl.rollout_files import EVALS, KINDS, ROLLOUTS  # noqa: E402
from torchtitan_rl.rollout_viewer import dump, selection, terminal  # noqa: E402
from torchtitan_rl.rollout_viewer.html_page import render_page  # noqa: E402

EPILOG = """\
steps (--step): N, a range A-B (the dumped steps in it), latest, all, or a comma-separated list
  (3,5,10-12). Default: the latest step in the terminal, every step in the page.

filters (--filter, repeatable; every one must hold):
  FIELD OP VALUE   OP: = or !=, < <= > >= (numbers), ~ (case-insensitive regular expression)
                   VALUE: true, false, null, a number, or text
  TEXT             anything else: records whose text contains TEXT (case-insensitive)
  FIELD is a record's field (reward, correct, advantage, stop_reason, staleness, version,
  num_turns, pass@1, pass@k, ...), a nested one with a dot (reward_components.format,
  greedy.correct), or length (completion tokens), text (prompt and completion text; text~REGEX).
  Evaluations also have reward and correct (the greedy completion's).
  e.g. --filter correct=false --filter "reward>0.5" --filter "text~^\\s*\\d+$" --filter "stop_reason=length"

sort (--sort): reward, advantage, length, or any numeric field; largest first unless --ascending;
  records without a value last. Default: file order (step, group, sample).

--html FILE writes one page holding every record of the selected steps of both kinds: steps with
  their means, a histogram per step, a searchable table sorted by a clicked header, and a record's
  prompt, completion and episode turns on click. It loads nothing (opens offline); its size is
  about the records' text, so pick the steps of a long run (--step 900-1000). --filter,
  --sort, --ascending, --limit and --kind shape the terminal table only (the page has its own
  search and sort) and are refused with --html.

DUMP is the run's job.dump_folder, or its rollouts/ or evals/ folder. Errors (no such folder, no
dump, a step without a file, an unreadable record) exit with code 2.
"""

LIMIT_DEFAULT = 20


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="show_rollouts.py",
        description="Show the rollouts and evaluations an RL run dumped (rl.dump_rollouts).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dump", metavar="DUMP", help="the run's dump folder (job.dump_folder), or its rollouts/ or evals/")
    p.add_argument("--step", help="steps to show (see below; default: latest, or all with --html)")
    p.add_argument(
        "--kind",
        choices=KINDS,
        help=f"{ROLLOUTS} (default) or {EVALS}; implied by DUMP when it is one of these folders",
    )
    p.add_argument("--filter", action="append", default=[], metavar="EXPR", help="keep matching records (see below)")
    p.add_argument("--sort", metavar="FIELD", help="reward, advantage, length or any numeric field (largest first)")
    p.add_argument("--ascending", action="store_true", help="sort smallest first")
    p.add_argument(
        "--limit", type=int, default=None, help=f"rows of the terminal table (default {LIMIT_DEFAULT}; 0: all)"
    )
    p.add_argument("--html", metavar="FILE", help="write a self-contained HTML page instead of the terminal table")
    return p


def write_page(args: argparse.Namespace, dump_folder: str, console: Console) -> None:
    terminal_only = [
        name
        for name, given in (
            ("--filter", args.filter),
            ("--sort", args.sort),
            ("--ascending", args.ascending),
            ("--limit", args.limit is not None),
            ("--kind", args.kind),
        )
        if given
    ]
    if terminal_only:
        raise ValueError(
            f"{', '.join(terminal_only)} shape the terminal table only; the page (--html) holds every record "
            "of the selected steps and has its own search and sort"
        )
    steps = dump.load_kinds(dump_folder, args.step or "all")
    title = os.path.basename(os.path.normpath(os.path.abspath(dump_folder)))
    page = render_page(title, steps).encode()
    with open(args.html, "wb") as out:
        out.write(page)
    counts = ", ".join(f"{sum(len(r) for r in s.values())} {kind} in {len(s)} steps" for kind, s in steps.items())
    console.print(f"wrote {args.html} ({counts}; {len(page) / 2**20:.1f} MiB)", highlight=False)


def show_table(args: argparse.Namespace, dump_folder: str, kind: str, console: Console) -> None:
    filters = [selection.parse_filter(f) for f in args.filter]
    records = [r for rs in dump.load(dump_folder, kind, args.step or "latest").values() for r in rs]
    chosen = selection.select(records, kind, filters, args.sort, args.ascending)
    limit = LIMIT_DEFAULT if args.limit is None else args.limit
    if limit < 0:
        raise ValueError(f"--limit {limit}: a number of rows, 0 for all")
    terminal.show(console, kind, chosen, limit)


def main(argv: list[str] | None = None, console: Console | None = None) -> int:
    """The exit status: 0, or 2 after a one-line error (argparse's usage errors exit 2 too)."""
    args = parser().parse_args(argv)
    console = console or Console()
    try:
        dump_folder, named_kind = dump.locate(args.dump)
        if args.html:
            write_page(args, dump_folder, console)
            return 0
        if named_kind and args.kind and named_kind != args.kind:
            raise ValueError(f"{args.dump} is the {named_kind} folder, --kind says {args.kind}")
        show_table(args, dump_folder, args.kind or named_kind or ROLLOUTS, console)
    except (ValueError, OSError) as err:
        print(f"show_rollouts.py: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
