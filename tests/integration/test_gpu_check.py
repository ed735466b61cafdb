"""``scripts/gpu_check.sh --cpu``: the GPU check's steps at tiny sizes on the CPU, so that the
script a GPU machine runs keeps working between the times one is available; and its GPU
command lines still parse against the current config keys."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from torchtitan_rl.recipes.config_checks import parse_job_config

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"


def _load_gpu_check():
    sys.path.insert(0, str(SCRIPTS))  # gpu_check imports its sibling scripts
    try:
        spec = importlib.util.spec_from_file_location("gpu_check", SCRIPTS / "gpu_check.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPTS))
    return module


def tables(page: str) -> dict[str, list[dict[str, str]]]:
    """``{section heading: the rows of the section's table as {column: cell}}``."""
    sections, heading, header = {}, None, None
    for line in page.splitlines():
        if line.startswith("## "):
            heading, header = line[3:], None
            sections[heading] = []
        elif heading and line.startswith("|") and not line.startswith("|---"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            if header is None:
                header = cells
            else:
                sections[heading].append(dict(zip(header, cells)))
    return sections


def figure(cell: str) -> float:
    """The number in a cell such as ``"4,565"``, ``"1.48 s"`` or ``"0.42"``."""
    return float(cell.replace(",", "").removesuffix(" s"))


def test_cpu_mode_runs_every_step_and_writes_a_figure_for_each(tmp_path):
    page_path = tmp_path / "gpu.md"
    cmd = ["bash", "scripts/gpu_check.sh", "--cpu", "--out", str(page_path), "--log-dir", str(tmp_path / "logs")]
    proc = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    page = page_path.read_text()
    assert "Command: `bash scripts/gpu_check.sh --cpu`" in page
    sections = tables(page)
    assert "none" in page.split("## Failed steps", 1)[1].split("##", 1)[0]

    (tests,) = sections["`cuda` tests"]
    assert figure(tests["failed"]) == figure(tests["errors"]) == 0
    assert figure(tests["skipped"]) > 0  # the `cuda` tests were found, and skip without a GPU

    (sft,) = sections["SFT"]
    assert sft["attention backend"] == "`sdpa_varlen`"
    assert figure(sft["tokens/s"]) > 0 and figure(sft["peak memory (GiB)"]) > 0
    assert figure(sft["estimated peak (GiB)"]) > 0
    assert sft["MFU (%)"] == "—"  # no known peak for a CPU

    (grpo,) = sections["GRPO"]
    assert figure(grpo["RL step time"]) > 0 and figure(grpo["generation tokens/s"]) > 0
    first, last = (figure(r) for r in grpo["reward first → last"].split(" → "))
    assert 0 <= first <= 1 and 0 <= last <= 1

    generator = sections["Generator"]
    modes = {r["compile"] for r in generator}
    assert len(modes) == 2  # eager and compiled
    expected = [(rows, mode) for rows in _load_gpu_check().CPU_PLAN.generator_rows for mode in modes]
    assert sorted((int(r["rows"]), r["compile"]) for r in generator) == sorted(expected)
    assert all(figure(r["tokens/s"]) > 0 for r in generator)


def test_the_gpu_command_lines_parse(tmp_path):
    gpu_check = _load_gpu_check()
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "abc"}\n')
    plan = gpu_check.GPU_PLAN
    for backend in plan.backends:
        config = parse_job_config(gpu_check.sft_overrides(plan, backend, str(rows)))
        assert (config.model.flavor, config.model.attn_backend) == ("0.6B", backend)
        assert config.training.steps == plan.sft_steps > plan.sft_uncounted_steps
    config = parse_job_config(gpu_check.grpo_overrides(plan))
    assert (config.job.recipe, config.training.steps) == ("grpo", plan.grpo_steps)
