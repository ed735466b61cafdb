"""``scripts/plot_runs.py`` on two real (tiny) training runs.

Two single-process runs of the debug recipe that differ only in the learning rate are
trained once for the module. In-process, the figure ``plot_runs`` returns must have one
panel per tag and one line per run whose points are exactly the scalars ``read_scalars``
reads back on its own; as a user runs it, the CLI must write a PNG of the expected size
with both runs' colours in it, and stop with exit code 2 and a named error on a tag a run
did not log.
"""

import concurrent.futures
import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib", reason="plot_runs needs matplotlib: pip install -e .[test]")
from PIL import Image  # noqa: E402
from torch.utils.tensorboard import SummaryWriter  # noqa: E402

from reference import launch_env  # noqa: E402
from torchtitan_rl.tensorboard_io import read_scalars  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "scripts" / "plot_runs.py"
TRAIN = str(REPO / "train.py")
RECIPE = str(REPO / "train_configs" / "debug_model.toml")
STEPS = 4
LOSS, GRAD_NORM, REWARD = "loss_metrics/global_avg_loss", "grad_norm", "rl/reward_mean"
TAGS = [LOSS, GRAD_NORM]
# The debug recipe shrunk to a few seconds per run; the two runs differ in the learning rate
# so their curves differ from step 2 on (a test comparing one run with itself proves little).
SMALL = ["--training.steps", str(STEPS), "--training.global_batch_size", "8", "--training.seq_len", "64",
         "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "true"]
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
    cmd = [sys.executable, TRAIN, "--job.config_file", RECIPE, *SMALL, "--optimizer.lr", lr,
           "--job.dump_folder", str(dump)]
    proc = subprocess.run(cmd, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=300)
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
    return subprocess.run([sys.executable, str(TOOL), *args], cwd=REPO, env=launch_env(), capture_output=True,
                          text=True, timeout=120)


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
