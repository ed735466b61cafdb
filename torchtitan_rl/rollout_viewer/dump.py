"""Finding a run's dumped steps and reading them: the folder given on the command line, the
steps asked for, and their records checked to be records of the expected kind."""

import os
import zlib

from torchtitan_rl.rollout_files import EVALS, KINDS, ROLLOUTS, dumped_steps, read_step, step_file

RECORD_KIND = {ROLLOUTS: "rollout", EVALS: "eval"}  # a folder -> the "kind" of its records


def locate(path: str) -> tuple[str, str | None]:
    """The dump folder ``path`` names, and the kind when ``path`` is a kind's own folder (e.g.
    ``run/evals``) rather than the run's dump folder."""
    if not os.path.isdir(path):
        raise ValueError(f"{path}: no such folder")
    name = os.path.basename(os.path.normpath(os.path.abspath(path)))
    holds_kinds = any(os.path.isdir(os.path.join(path, kind)) for kind in KINDS)
    if name in KINDS and not holds_kinds:
        return os.path.dirname(os.path.normpath(os.path.abspath(path))), name
    if not holds_kinds:
        raise ValueError(
            f"{path}: no rollout or evaluation dumps ({ROLLOUTS}/step-N.jsonl.gz or {EVALS}/step-N.jsonl.gz, "
            "written while rl.dump_rollouts is on)"
        )
    return path, None


def describe_steps(steps: list[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``"1-3, 5"``."""
    runs: list[list[int]] = []
    for step in steps:
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "none"


def parse_steps(spec: str, available: list[int]) -> list[int]:
    """The steps of ``spec`` among ``available`` (ascending): ``latest``, ``all``, ``N``, a range
    ``A-B`` (the dumped steps in it, both ends included) or a comma-separated list of these. A step
    named alone must have a file; a range must hold at least one."""
    if not available:
        raise ValueError("no steps dumped")
    chosen: set[int] = set()
    for part in (p.strip() for p in spec.split(",")):
        try:
            if part == "latest":
                chosen.add(available[-1])
            elif part == "all":
                chosen.update(available)
            elif "-" in part.lstrip("-"):
                first, last = (int(x) for x in part.split("-", 1))
                inside = [s for s in available if first <= s <= last]
                if not inside:
                    raise LookupError(f"no step dumped in {part} (dumped: {describe_steps(available)})")
                chosen.update(inside)
            else:
                step = int(part)
                if step not in available:
                    raise LookupError(f"no file for step {step} (dumped: {describe_steps(available)})")
                chosen.add(step)
        except ValueError:
            raise ValueError(f"--step {spec!r}: {part!r} is not a step, a range A-B, 'latest' or 'all'") from None
        except LookupError as err:
            raise ValueError(str(err)) from None
    return sorted(chosen)


def read_records(folder: str, step: int) -> list[dict]:
    """Step ``step``'s records under the kind folder ``folder``; a ValueError naming the file (and
    line) of anything that is not a gzip file of records of that folder's kind."""
    path = step_file(folder, step)
    try:
        records = read_step(folder, step)
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as err:
        # gzip.BadGzipFile is an OSError; a truncated file ends in EOFError.
        raise ValueError(f"{path}: not a readable gzip file of records ({type(err).__name__}: {err})") from None
    expected = RECORD_KIND[os.path.basename(os.path.normpath(folder))]
    for line, record in enumerate(records, 1):
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{line}: a record is a JSON object, found {type(record).__name__}")
        if record.get("kind") != expected:
            raise ValueError(f"{path}:{line}: kind is {record.get('kind')!r}, expected {expected!r}")
    return records


def load(dump_folder: str, kind: str, steps: str) -> dict[int, list[dict]]:
    """``{step: records}`` of ``kind`` (``rollouts`` or ``evals``) under ``dump_folder`` for the
    step specification ``steps`` (see ``parse_steps``)."""
    folder = os.path.join(dump_folder, kind)
    available = dumped_steps(folder)
    if not available:
        others = {k: dumped_steps(os.path.join(dump_folder, k)) for k in KINDS if k != kind}
        held = "; ".join(f"{k}/ holds steps {describe_steps(s)}" for k, s in others.items() if s)
        raise ValueError(f"{folder}: no step files (step-N.jsonl.gz)" + (f"; {held}" if held else ""))
    return {step: read_records(folder, step) for step in parse_steps(steps, available)}


def load_kinds(dump_folder: str, steps: str) -> dict[str, dict[int, list[dict]]]:
    """``{kind: {step: records}}`` of every kind dumped under ``dump_folder``, for the steps of
    ``steps`` among those of any kind (evaluations run at some steps only)."""
    available = {kind: dumped_steps(os.path.join(dump_folder, kind)) for kind in KINDS}
    every = sorted(set().union(*available.values()))
    if not every:
        raise ValueError(f"{dump_folder}: no step files under {ROLLOUTS}/ or {EVALS}/")
    chosen = set(parse_steps(steps, every))
    return {
        kind: {step: read_records(os.path.join(dump_folder, kind), step) for step in dumped if step in chosen}
        for kind, dumped in available.items()
        if dumped
    }
