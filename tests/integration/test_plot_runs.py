"""``scripts/plot_runs.py`` on two real (tiny) training runs, in both formats.

Two single-process runs of the debug recipe that differ only in the learning rate are
trained once for the module; every check compares what is drawn with the scalars
``read_scalars`` reads back on its own.

- PNG (matplotlib): the figure has one panel per tag and one line per run whose points are
  the logged values; in the written image, the run's colour lies at the pixel of every logged
  point, and the CLI writes an image of the expected size with both runs' colours in it.
- SVG (written by hand): parsed back, each panel's polylines map the logged (step, value)
  pairs through one affine map per axis (larger values higher), consistent with the axis'
  tick labels; it is written with matplotlib made unimportable, where PNG is a named error.
- Errors: a tag a run did not log, bad folders, a format the output name contradicts.
"""

import concurrent.futures
import importlib.util
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from torch.utils.tensorboard import SummaryWriter

from reference import launch_env
from torchtitan_rl.tensorboard_io import read_scalars

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "scripts" / "plot_runs.py"
TRAIN = str(REPO / "train.py")
RECIPE = str(REPO / "train_configs" / "debug_model.toml")
STEPS = 4
LOSS, GRAD_NORM, REWARD = "loss_metrics/global_avg_loss", "grad_norm", "rl/reward_mean"
TAGS = [LOSS, GRAD_NORM]
# The debug recipe shrunk to a few seconds per run; the two runs differ in the learning rate
# so their curves differ from step 2 on (a test comparing one run with itself proves little).
SMALL = [
    "--training.steps",
    str(STEPS),
    "--training.global_batch_size",
    "8",
    "--training.seq_len",
    "64",
    "--metrics.log_freq",
    "1",
    "--metrics.enable_tensorboard",
    "true",
]
LRS = {"run_a": "3e-3", "run_b": "3e-4"}
# matplotlib's first two default colours (C0, C1): the lines of the first and second run.
RUN_COLORS = [(0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)]


def _load_tool():
    spec = importlib.util.spec_from_file_location("plot_runs", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


plot_runs_tool = _load_tool()


def _train(dump: Path, lr: str) -> None:
    cmd = [
        sys.executable,
        TRAIN,
        "--job.config_file",
        RECIPE,
        *SMALL,
        "--optimizer.lr",
        lr,
        "--job.dump_folder",
        str(dump),
    ]
    proc = subprocess.run(cmd, check=False, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plot_runs")
    folders = {name: root / name for name in LRS}
    # One thread per run (launch_env), so the two runs share two cores without slowing each other.
    with concurrent.futures.ThreadPoolExecutor(len(folders)) as pool:
        for future in [pool.submit(_train, folders[name], LRS[name]) for name in folders]:
            future.result()
    return folders


def tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TOOL), *args],
        check=False,
        cwd=REPO,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_figure_has_one_panel_per_tag_and_the_logged_values(dumps):
    # The second run is given by its tb folder: both forms are accepted, and both are labelled
    # by the dump folder's name.
    runs = plot_runs_tool.load_runs([str(dumps["run_a"]), str(dumps["run_b"] / "tb")])
    assert list(runs) == ["run_a", "run_b"]
    expected = {name: read_scalars(str(dumps[name] / "tb")) for name in dumps}
    assert expected["run_a"][LOSS][STEPS] != expected["run_b"][LOSS][STEPS], "the two runs should differ"

    fig = plot_runs_tool.plot_runs(runs, TAGS)
    assert len(fig.axes) == len(TAGS)
    for ax, tag in zip(fig.axes, TAGS):
        assert ax.get_title() == tag
        lines = ax.get_lines()
        assert [line.get_label() for line in lines] == ["run_a", "run_b"]
        for line in lines:
            logged = expected[line.get_label()][tag]
            assert list(line.get_xdata()) == list(range(1, STEPS + 1)) == sorted(logged)
            assert list(line.get_ydata()) == [logged[step] for step in sorted(logged)]
    assert [text.get_text() for text in fig.legends[0].get_texts()] == ["run_a", "run_b"]


def test_default_tags_add_the_reward_panel_for_rl_runs(dumps, tmp_path):
    runs = plot_runs_tool.load_runs([str(dumps["run_a"]), str(dumps["run_b"])])
    assert plot_runs_tool.default_tags(runs) == TAGS

    # A stand-in RL run: the three default scalars, written the way the trainer writes them.
    writer = SummaryWriter(str(tmp_path / "rl_run" / "tb"))
    for step, (loss, norm, reward) in enumerate([(0.5, 1.0, 0.2), (0.4, 0.9, 0.5)], start=1):
        writer.add_scalar(LOSS, loss, step)
        writer.add_scalar(GRAD_NORM, norm, step)
        writer.add_scalar(REWARD, reward, step)
    writer.close()
    runs = plot_runs_tool.load_runs([str(dumps["run_a"]), str(tmp_path / "rl_run")])
    tags = plot_runs_tool.default_tags(runs)
    assert tags == [LOSS, GRAD_NORM, REWARD]
    # Chosen tags are strict: the SFT run has no reward ...
    with pytest.raises(ValueError, match="run 'run_a' has no scalar 'rl/reward_mean'"):
        plot_runs_tool.plot_runs(runs, tags)
    # ... the default reward panel just leaves it out, as the CLI does without --tags.
    fig = plot_runs_tool.plot_runs(runs, tags, allow_missing=True)
    assert [len(ax.get_lines()) for ax in fig.axes] == [2, 2, 1]
    reward_line = fig.axes[2].get_lines()[0]
    assert reward_line.get_label() == "rl_run"
    assert list(reward_line.get_ydata()) == pytest.approx([0.2, 0.5])
    proc = tool(str(dumps["run_a"]), str(tmp_path / "rl_run"), "--out", str(tmp_path / "rl.png"))
    assert proc.returncode == 0, proc.stderr
    assert "3 panel(s) x 2 run(s)" in proc.stdout


def test_cli_writes_the_png(dumps, tmp_path):
    out = tmp_path / "plots" / "runs.png"  # the parent folder does not exist yet
    proc = tool(str(dumps["run_a"]), str(dumps["run_b"]), "--tags", *TAGS, "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"wrote {out}: 2 panel(s) x 2 run(s)" in proc.stdout
    with Image.open(out) as image:
        assert image.format == "PNG"
        # Two panels side by side of PANEL_SIZE inches each at 100 dpi.
        width, height = plot_runs_tool.PANEL_SIZE
        assert image.size == (round(2 * width * 100), round(height * 100))
        pixels = np.asarray(image.convert("RGB"), dtype=np.int16)
    # Both runs were drawn: each line colour covers pixels (anti-aliasing blends the edges, so
    # count near matches). A blank or one-run image fails here.
    for color in RUN_COLORS:
        near = int((np.abs(pixels - np.array(color)).max(axis=-1) <= 12).sum())
        assert near > 100, f"colour {color} covers only {near} pixels"


def test_missing_tag_is_a_named_error(dumps, tmp_path):
    out = tmp_path / "never.png"
    proc = tool(str(dumps["run_a"]), str(dumps["run_b"]), "--tags", LOSS, "no/such_tag", "--out", str(out))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: run 'run_a' has no scalar 'no/such_tag'; its tags: ")
    assert GRAD_NORM in proc.stderr and LOSS in proc.stderr  # the tags the run does have
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def test_bad_folders_are_named_errors(dumps, tmp_path):
    (tmp_path / "empty").mkdir()
    proc = tool(str(tmp_path / "empty"))
    assert proc.returncode == 2
    assert "error: no TensorBoard event files" in proc.stderr and "empty" in proc.stderr
    proc = tool(str(tmp_path / "missing"))
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr
    # The parent of both dumps would merge their curves into one line.
    with pytest.raises(ValueError, match="holds the event files of several runs"):
        plot_runs_tool.load_runs([str(dumps["run_a"].parent)])
    with pytest.raises(ValueError, match="--labels needs one label per run"):
        plot_runs_tool.load_runs([str(dumps["run_a"]), str(dumps["run_b"])], labels=["only one"])


def test_png_pixels_lie_on_the_logged_values(dumps, tmp_path):
    # One run alone, so no other line can cover its pixels.
    runs = plot_runs_tool.load_runs([str(dumps["run_a"])])
    logged = read_scalars(str(dumps["run_a"] / "tb"))[LOSS]
    out = tmp_path / "one.png"
    fig = plot_runs_tool.plot_runs(runs, [LOSS], str(out))
    (ax,) = fig.axes
    with Image.open(out) as image:
        assert image.size == (round(plot_runs_tool.PANEL_SIZE[0] * 100), round(plot_runs_tool.PANEL_SIZE[1] * 100))
        pixels = np.asarray(image.convert("RGB"), dtype=np.int16)
    near_c0 = np.abs(pixels - np.array(RUN_COLORS[0])).max(axis=-1) <= 40
    height = pixels.shape[0]
    for step, value in logged.items():
        # Where the axes put (step, value) in the saved image (display y grows upwards).
        x, y = ax.transData.transform((step, value))
        col, row = round(float(x)), round(float(height - y))
        assert near_c0[row - 2 : row + 3, col - 2 : col + 3].any(), f"no line at step {step} ({col}, {row})"
    # The line is a line, not a filled area.
    assert near_c0.mean() < 0.05


SVG = "{http://www.w3.org/2000/svg}"


def _svg_panels(path: Path) -> dict[str, dict]:
    """{tag: {"curves": {run: [(x, y) pixels]}, "area": (x, y, w, h), "y_ticks": [(label, y)],
    "x_ticks": [(label, x)]}} of an SVG written by plot_runs."""
    panels = {}
    for group in ET.parse(path).getroot().iter(f"{SVG}g"):
        if group.get("class") != "panel":
            continue
        curves = {
            line.get("data-run"): [tuple(map(float, point.split(","))) for point in line.get("points").split()]
            for line in group.iter(f"{SVG}polyline")
        }
        (area,) = [r for r in group.iter(f"{SVG}rect") if r.get("class") == "plot-area"]
        texts = list(group.iter(f"{SVG}text"))
        ticks = {
            kind: [
                (float(t.text), float(t.get("y" if kind == "y-tick" else "x"))) for t in texts if t.get("class") == kind
            ]
            for kind in ("y-tick", "x-tick")
        }
        panels[group.get("data-tag")] = {
            "curves": curves,
            "area": tuple(float(area.get(k)) for k in ("x", "y", "width", "height")),
            "y_ticks": ticks["y-tick"],
            "x_ticks": ticks["x-tick"],
        }
    return panels


def _affine(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    """(slope, offset) of pixel = slope * value + offset, from the two most distant values."""
    (v0, p0), (v1, p1) = min(pairs), max(pairs)
    assert v1 > v0, "the check needs two different values"
    slope = (p1 - p0) / (v1 - v0)
    return slope, p0 - slope * v0


def _check_svg_panel(panel: dict, expected: dict[str, list[tuple[float, float]]]) -> None:
    """The polylines of ``panel`` are ``expected`` {run: [(x value, y value)]} through one affine
    map per axis; the tick labels sit where that map puts them."""
    assert list(panel["curves"]) == list(expected)
    xs = [(x, px) for run in expected for (x, _), (px, _) in zip(expected[run], panel["curves"][run], strict=True)]
    ys = [(y, py) for run in expected for (_, y), (_, py) in zip(expected[run], panel["curves"][run], strict=True)]
    x_slope, x_offset = _affine(xs)
    y_slope, y_offset = _affine(ys)
    assert x_slope > 0 and y_slope < 0  # later steps to the right, larger values higher
    # Coordinates are written with 2 decimals; values were float32 in TensorBoard.
    for value, pixel in xs:
        assert pixel == pytest.approx(x_slope * value + x_offset, abs=0.02)
    for value, pixel in ys:
        assert pixel == pytest.approx(y_slope * value + y_offset, abs=0.02)
    left, top, width, height = panel["area"]
    assert all(left - 0.01 <= px <= left + width + 0.01 for _, px in xs)
    assert all(top - 0.01 <= py <= top + height + 0.01 for _, py in ys)
    # Tick labels (4 significant digits; a y label's baseline is 4 px below its grid line).
    for label, y in panel["y_ticks"]:
        assert y - 4 == pytest.approx(y_slope * label + y_offset, abs=abs(y_slope * label) * 1e-3 + 0.02)
    for label, x in panel["x_ticks"]:
        assert x == pytest.approx(x_slope * label + x_offset, abs=abs(x_slope * label) * 1e-3 + 0.02)
    assert min(label for label, _ in panel["y_ticks"]) == pytest.approx(min(v for v, _ in ys), rel=1e-3)
    assert max(label for label, _ in panel["y_ticks"]) == pytest.approx(max(v for v, _ in ys), rel=1e-3)


def _without_matplotlib(tmp_path: Path) -> dict:
    """launch_env with a ``matplotlib`` package first on the path that fails to import."""
    fake = tmp_path / "no_matplotlib" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('matplotlib is made unimportable by the test')\n")
    env = launch_env()
    env["PYTHONPATH"] = os.pathsep.join([str(fake.parent), *filter(None, [env.get("PYTHONPATH")])])
    return env


def test_svg_polylines_are_the_logged_values_without_matplotlib(dumps, tmp_path):
    env = _without_matplotlib(tmp_path)
    out = tmp_path / "svg" / "runs.svg"
    cmd = [
        sys.executable,
        str(TOOL),
        str(dumps["run_a"]),
        str(dumps["run_b"]),
        "--tags",
        *TAGS,
        "--format",
        "svg",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"wrote {out}: 2 panel(s) x 2 run(s)" in proc.stdout
    logged = {name: read_scalars(str(dumps[name] / "tb")) for name in dumps}
    panels = _svg_panels(out)
    assert list(panels) == TAGS
    for tag in TAGS:
        _check_svg_panel(
            panels[tag],
            {name: sorted((float(s), v) for s, v in logged[name][tag].items()) for name in ("run_a", "run_b")},
        )
    # The same environment cannot write a PNG, and says why.
    png = tmp_path / "never.png"
    proc = subprocess.run(
        cmd[:-4] + ["--out", str(png)], check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "plotting needs matplotlib" in proc.stderr, proc.stdout + proc.stderr
    assert not png.exists()


def test_x_tag_plots_against_the_running_sum(tmp_path):
    # A stand-in RL run whose steps take different times; the reward is logged on steps 1, 2, 4.
    writer = SummaryWriter(str(tmp_path / "rl_run" / "tb"))
    for step, seconds in enumerate([0.5, 1.5, 1.0, 2.0], start=1):
        writer.add_scalar("time/step_s", seconds, step)
    for step, reward in [(1, 0.1), (2, 0.4), (4, 0.3)]:
        writer.add_scalar(REWARD, reward, step)
    writer.close()
    expected = [(0.5, 0.1), (2.0, 0.4), (5.0, 0.3)]  # seconds after steps 1, 2, 4
    runs = plot_runs_tool.load_runs([str(tmp_path / "rl_run")])
    flat = [c for point in expected for c in point]
    got = plot_runs_tool.curve(runs["rl_run"], REWARD, "time/step_s")
    assert [c for point in got for c in point] == pytest.approx(flat)  # float32 rewards

    out = tmp_path / "reward.svg"
    proc = tool(
        str(tmp_path / "rl_run"),
        "--tags",
        REWARD,
        "--x-tag",
        "time/step_s",
        "--title",
        "reward vs time",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    _check_svg_panel(_svg_panels(out)[REWARD], {"rl_run": expected})
    text = out.read_text()
    assert ">reward vs time</text>" in text and ">cumulative time/step_s</text>" in text

    fig = plot_runs_tool.plot_runs(runs, [REWARD], x_tag="time/step_s")
    (line,) = fig.axes[0].get_lines()
    assert [c for point in zip(line.get_xdata(), line.get_ydata()) for c in point] == pytest.approx(flat)
    with pytest.raises(ValueError, match="run 'rl_run' has no scalar 'grad_norm' \\(--x-tag\\)"):
        plot_runs_tool.svg_figure(runs, [REWARD], x_tag="grad_norm")


def test_format_and_output_name_must_agree(dumps, tmp_path):
    proc = tool(str(dumps["run_a"]), "--format", "svg", "--out", str(tmp_path / "x.png"))
    assert proc.returncode == 2 and "does not end in .svg (--format svg)" in proc.stderr
    proc = tool(str(dumps["run_a"]), "--out", str(tmp_path / "x.pdf"))
    assert proc.returncode == 2 and "cannot tell the format" in proc.stderr
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "x.pdf").exists()
