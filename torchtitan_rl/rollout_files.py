"""The rollout and evaluation dumps of an RL run on disk: where they live, how a step's file is
written and how it is read back (no torch: the viewer and tests read them anywhere).

``{dump_folder}/rollouts/step-{N}.jsonl.gz`` holds every rollout trained at step N and
``{dump_folder}/evals/step-{N}.jsonl.gz`` every held-out prompt evaluated after step N, one JSON
object per line, gzip-compressed. The fields of a record are documented in docs/rl.md
('Seeing the rollouts'); every record has ``step`` and ``kind`` (``"rollout"`` or ``"eval"``).
"""

import gzip
import json
import os
import re
from collections.abc import Iterable

ROLLOUTS = "rollouts"  # the folder of the trained rollouts, under the run's dump folder
EVALS = "evals"  # the folder of the evaluations
KINDS = (ROLLOUTS, EVALS)
_STEP_FILE = re.compile(r"step-(\d+)\.jsonl\.gz")


def step_file(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step}.jsonl.gz")


def write_step(folder: str, step: int, records: Iterable[dict]) -> str:
    """Write ``records`` as step ``step``'s file under ``folder``, replacing any earlier one
    whole: the file appears only once complete (a crash mid-write leaves none)."""
    os.makedirs(folder, exist_ok=True)
    path = step_file(folder, step)
    partial = f"{path}.partial"
    # mtime=0: the same records give the same bytes.
    with open(partial, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6, mtime=0) as out:
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False).encode() + b"\n")
    os.replace(partial, path)
    return path


def dumped_steps(folder: str) -> list[int]:
    """The steps with a file under ``folder``, ascending ([] when there is no folder)."""
    if not os.path.isdir(folder):
        return []
    return sorted(int(m.group(1)) for name in os.listdir(folder) if (m := _STEP_FILE.fullmatch(name)))


def read_step(folder: str, step: int) -> list[dict]:
    """The records of step ``step``'s file under ``folder``; a ValueError naming the file and
    line of a record that is not JSON."""
    path = step_file(folder, step)
    records = []
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not a JSON record ({err})") from None
    return records


def remove_steps_after(folder: str, step: int) -> list[int]:
    """Delete the files of steps after ``step`` (a resumed run makes them again) and any
    half-written file; the steps removed."""
    removed = [s for s in dumped_steps(folder) if s > step]
    for s in removed:
        os.remove(step_file(folder, s))
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            if name.endswith(".partial"):
                os.remove(os.path.join(folder, name))
    return removed
