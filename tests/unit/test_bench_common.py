"""The pure helpers of ``scripts/bench_common.py``: alternating timings (with a scripted clock, so
nothing is timed for real), markdown tables, and a page that keeps its hand-written notes when
it is rewritten."""

import argparse
import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "scripts" / "bench_common.py"


def _load_tool():
    spec = importlib.util.spec_from_file_location("bench_common", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load_tool()


class ScriptedClock:
    """A clock that only moves when a variant runs: each call of a variant advances it by that
    variant's next scripted duration, and the calls are logged."""

    def __init__(self, durations: dict[str, list[float]]):
        self.now, self.durations, self.calls = 0.0, {k: list(v) for k, v in durations.items()}, []

    def __call__(self) -> float:
        return self.now

    def variant(self, name: str):
        def run():
            self.calls.append(name)
            self.now += self.durations[name].pop(0)

        return run


def test_alternating_order_reverses_every_other_round():
    assert bench.alternating_order(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    assert bench.alternating_order(["a"], 2) == [["a"], ["a"]]


def test_time_alternating_takes_the_median_of_the_rounds_after_the_warmup():
    # The warm-up round costs 100 (compilation, caches) and must not count.
    clock = ScriptedClock({"a": [100, 1, 5, 3], "b": [100, 2, 2, 8]})
    medians = bench.time_alternating(
        {"a": clock.variant("a"), "b": clock.variant("b")}, rounds=3, warmup=1, clock=clock
    )
    assert clock.calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert medians == {"a": sorted([1, 5, 3])[1], "b": sorted([2, 2, 8])[1]}
    # Without a warm-up every round counts: an even count takes the mean of the middle two.
    clock = ScriptedClock({"a": [4, 1], "b": [10, 30]})
    assert bench.time_alternating(
        {"a": clock.variant("a"), "b": clock.variant("b")}, rounds=2, warmup=0, clock=clock
    ) == {"a": 2.5, "b": 20}
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        bench.time_alternating({"a": clock.variant("a")}, rounds=0)


def test_collect_alternating_keeps_every_round_in_order():
    calls = []

    def variant(name):
        def run():
            calls.append(name)
            return f"{name}{calls.count(name)}"

        return run

    results = bench.collect_alternating({"x": variant("x"), "y": variant("y")}, rounds=3)
    assert calls == ["x", "y", "y", "x", "x", "y"]
    assert results == {"x": ["x1", "x2", "x3"], "y": ["y1", "y2", "y3"]}


def test_ratio():
    assert bench.ratio(3.0, 2.0) == "1.50x"
    assert bench.ratio(1.0, 3.0, digits=3) == "0.333x"
    assert bench.ratio(1.0, 0.0) == "—"


def test_markdown_table():
    lines = bench.markdown_table(["name", "time"], [["a|b", 1.5], ["c", "2 ms"]])
    assert lines == ["| name | time |", "|---|---|", "| a\\|b | 1.5 |", "| c | 2 ms |"]
    with pytest.raises(ValueError, match="every row needs 2 cells"):
        bench.markdown_table(["name", "time"], [["only one"]])


def test_train_run_reads_its_scalars():
    run = bench.TrainRun(wall_s=1.0, scalars={"loss": {3: 0.5, 1: 2.0, 2: 1.0}}, command=[])
    assert run.first_last("loss") == (2.0, 0.5)
    with pytest.raises(KeyError, match="logged no 'lr'; it has: loss"):
        run.series("lr")


def _args(page: Path, no_write: bool = False) -> argparse.Namespace:
    return argparse.Namespace(page=str(page), no_write=no_write)


def test_publish_rewrites_the_page_and_keeps_its_notes(tmp_path, monkeypatch):
    page = tmp_path / "demo.md"
    monkeypatch.setattr(bench.sys, "argv", ["scripts/benchmark_demo.py", "--rounds", "3", "--page", str(page)])
    monkeypatch.setattr(bench, "machine_line", lambda: "a test machine")
    bench.publish(_args(page), "Demo", "What the demo measures.", ["| a |", "|---|", "| 1 |"])
    first = page.read_text()
    assert first.startswith(
        "# Demo\n\nWhat the demo measures.\n\nCommand: `python scripts/benchmark_demo.py --rounds 3`"
    )
    assert "on a test machine." in first and "| 1 |" in first and "## Notes" not in first

    # A maintainer adds notes (with a sub-section); the next run replaces the body only.
    notes = "## Notes\n\n- the first run was noisy.\n\n### Earlier runs\n\n| a |\n|---|\n| 7 |\n"
    page.write_text(first + "\n" + notes)
    bench.publish(_args(page), "Demo", "What the demo measures.", ["| a |", "|---|", "| 2 |"])
    second = page.read_text()
    assert "| 1 |" not in second and "| 2 |" in second
    assert second.endswith(notes)
    assert second.index("| 2 |") < second.index("## Notes")
    assert bench.notes_of(second) == notes

    # --no-write prints only.
    bench.publish(_args(page, no_write=True), "Demo", "What the demo measures.", ["| 3 |"])
    assert page.read_text() == second


def test_render_page_refuses_a_notes_heading_in_the_body():
    with pytest.raises(ValueError, match="may not hold a '## Notes' heading"):
        bench.render_page("T", "S", "python x.py", "m", "2026-01-01", ["## Notes", "x"])
    assert bench.notes_of("# T\n\nno notes here\n") is None


def test_command_line_leaves_out_the_publishing_options():
    argv = [
        str(bench.ROOT) + "/scripts/benchmark_x.py",
        "--no-write",
        "--page",
        "/tmp/p.md",
        "--steps",
        "5",
        "--page=/tmp/q.md",
        "--label",
        "two words",
    ]
    assert bench.command_line(argv) == "python scripts/benchmark_x.py --steps 5 --label 'two words'"


def test_index_lists_every_page_with_its_summary(tmp_path):
    (tmp_path / "zeta.md").write_text(
        "# Zeta bench\n\nMeasures zeta,\nover two lines.\n\nCommand: `python scripts/benchmark_zeta.py --steps 3`\n"
    )
    (tmp_path / "alpha.md").write_text(
        "# Alpha bench\n\nMeasures alpha.\n\nCommand: `python scripts/alpha.py`\n\n## Notes\n\nmore\n"
    )
    (tmp_path / "beta.md").write_text("# Beta bench\n\nMeasured by hand.\n")
    (tmp_path / bench.INDEX).write_text("stale")
    bench.write_index(str(tmp_path))
    index = (tmp_path / bench.INDEX).read_text()
    rows = [line for line in index.splitlines() if line.startswith("| [")]
    assert rows == [
        "| [Alpha bench](alpha.md) | `scripts/alpha.py` | Measures alpha. |",
        "| [Beta bench](beta.md) | — | Measured by hand. |",
        "| [Zeta bench](zeta.md) | `scripts/benchmark_zeta.py` | Measures zeta, over two lines. |",
    ]
    with pytest.raises(ValueError, match="starts with a '# title' line"):
        bench.summary_of("no title\n")
