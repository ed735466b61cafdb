"""``scripts/show_rollouts.py`` and its package (``torchtitan_rl.rollout_viewer``) on dumps written
with ``rollout_files.write_step`` from records built here: a few rollout steps (one with a gap
before it, one holding a multi-turn episode) and two evaluation steps.

- Loading: the steps a ``--step`` spec selects, the dump folder or a kind's folder given.
- Filters and sorts equal brute-force selections of the records written.
- The terminal table (the script's main, a fixed console width): its rows are exactly the
  selected records in the selected order, with their values, within the width.
- The page embeds every record so that no text can end its <script> element.
- Errors: a one-line message naming the folder, step, file or line; exit code 2; no torch.
"""

import gzip
import importlib.util
import io
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from torchtitan_rl.rollout_files import EVALS, ROLLOUTS, step_file, write_step
from torchtitan_rl.rollout_viewer import dump, selection
from torchtitan_rl.rollout_viewer.html_page import render_page

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "show_rollouts.py"
ROLLOUT_STEPS = (1, 2, 4)
EVAL_STEPS = (0, 4)
NUM_GROUPS, GROUP_SIZE = 3, 4
MULTI_TURN = (2, 1, 2)  # (step, group, sample) of the multi-turn episode


def _load_script():
    spec = importlib.util.spec_from_file_location("show_rollouts", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


show_rollouts = _load_script()


def chatml(question: str) -> str:
    return f"<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def rollout(rng: random.Random, step: int, group: int, sample: int) -> dict:
    reward = rng.choice([0.0, 0.25, 0.5, 1.0, 1.0])
    completion = rng.choice(["7<|im_end|>", "It is 12<|im_end|>", "</script><b>x</b>", "SEVEN", "7 7 7 7 7 7 7"])
    turns = None
    if (step, group, sample) == MULTI_TURN:
        turns = [
            {"role": "assistant", "text": "50<|im_end|>", "token_ids": [1, 2], "trained": True},
            {"role": "tool", "text": "higher", "token_ids": [3, 4, 5], "trained": False},
            {"role": "assistant", "text": "75<|im_end|>", "token_ids": [6, 7], "trained": True},
        ]
        completion = "".join(t["text"] for t in turns)
    return {
        "kind": "rollout",
        "step": step,
        "group": group,
        "sample": sample,
        "prompt": chatml(f"What is {group}+{step}?"),
        "completion": completion,
        "turns": turns,
        "num_prompt_tokens": 30,
        "num_completion_tokens": rng.randint(1, 9),
        "num_loss_tokens": 4,
        "stop_reason": rng.choice(["stop", "length"]),
        "end_reason": "done" if turns else None,
        "num_turns": len(turns) if turns else 1,
        "reward": reward,
        "correct": reward >= 1,
        "reward_components": {"answer": reward, "format": float(rng.random() < 0.5)},
        "advantage": round(rng.uniform(-1.5, 1.5), 6),
        "version": step - 1,
        "staleness": 0,
        "behaviour_logprob_mean": round(-rng.random(), 6),
        "proximal_logprob_mean": None if sample == 0 else round(-rng.random(), 6),
        "correction_weight_mean": 1.0,
        "images": [],
    }


def answer(completion: str, correct: bool, tokens: int) -> dict:
    return {
        "completion": completion,
        "turns": None,
        "correct": correct,
        "reward": float(correct),
        "num_completion_tokens": tokens,
        "stop_reason": "stop",
    }


def evaluation(rng: random.Random, step: int, index: int) -> dict:
    samples = [answer(rng.choice(["5", "6", "sampled-only"]), rng.random() < 0.4, rng.randint(1, 5)) for _ in range(3)]
    greedy = answer(rng.choice(["5", "x"]), rng.random() < 0.5, rng.randint(1, 5))
    return {
        "kind": "eval",
        "step": step,
        "prompt_index": index,
        "prompt": chatml(f"What is {index}+1?"),
        "answer": str(index + 1),
        "k": len(samples),
        "greedy": greedy,
        "samples": samples,
        "num_correct": sum(s["correct"] for s in samples),
        "pass@1": float(greedy["correct"]),
        "pass@k": float(any(s["correct"] for s in samples)),
        "images": [],
    }


@pytest.fixture
def written(tmp_path) -> tuple[Path, dict[str, dict[int, list[dict]]]]:
    """A dump folder and ``{kind: {step: records}}`` written into it."""
    rng = random.Random(0)
    records = {
        ROLLOUTS: {
            step: [rollout(rng, step, g, s) for g in range(NUM_GROUPS) for s in range(GROUP_SIZE)]
            for step in ROLLOUT_STEPS
        },
        EVALS: {step: [evaluation(rng, step, i) for i in range(5)] for step in EVAL_STEPS},
    }
    for kind, steps in records.items():
        for step, rows in steps.items():
            write_step(str(tmp_path / "run" / kind), step, rows)
    return tmp_path / "run", records


def flat(steps: dict[int, list[dict]], chosen=None) -> list[dict]:
    return [r for step in sorted(steps) if chosen is None or step in chosen for r in steps[step]]


# ---------------------------------------------------------------- loading


def test_steps_specs_select_the_dumped_steps(written):
    folder, records = written
    cases = {"latest": [4], "all": [1, 2, 4], "2": [2], "1-3": [1, 2], "4,1": [1, 4], "latest,1-2": [1, 2, 4]}
    for spec, steps in cases.items():
        assert dump.load(str(folder), ROLLOUTS, spec) == {s: records[ROLLOUTS][s] for s in steps}, spec
    assert dump.load(str(folder), EVALS, "latest") == {4: records[EVALS][4]}
    # The page's steps: among those of either kind (step 0 has only evaluations).
    assert dump.load_kinds(str(folder), "0-1") == {ROLLOUTS: {1: records[ROLLOUTS][1]}, EVALS: {0: records[EVALS][0]}}
    for spec, message in (
        ("3", "no file for step 3 (dumped: 1-2, 4)"),
        ("5-9", "no step dumped in 5-9 (dumped: 1-2, 4)"),
        ("two", "--step 'two': 'two' is not a step"),
        ("1-", "'1-' is not a step"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            dump.load(str(folder), ROLLOUTS, spec)


def test_the_dump_folder_or_a_kind_folder_is_accepted(written, tmp_path):
    folder, _ = written
    assert dump.locate(str(folder)) == (str(folder), None)
    assert dump.locate(str(folder / EVALS)) == (str(folder), EVALS)
    assert dump.locate(str(folder / ROLLOUTS) + "/") == (str(folder), ROLLOUTS)
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'nowhere'}: no such folder")):
        dump.locate(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no rollout or evaluation dumps"):
        dump.locate(str(tmp_path / "empty"))


# ---------------------------------------------------------------- filters and sorts


def contains(record: dict, needle: str, kind: str = ROLLOUTS) -> bool:
    if kind == ROLLOUTS:
        texts = [record["prompt"], record["completion"]]
    else:
        texts = [record["prompt"], record["answer"], record["greedy"]["completion"]]
        texts += [s["completion"] for s in record["samples"]]
    return any(needle.lower() in t.lower() for t in texts)


ROLLOUT_FILTERS = {
    ("correct=true",): lambda r: r["correct"] is True,
    ("correct == false",): lambda r: r["correct"] is False,
    ("correct=1",): lambda r: r["correct"] is True,  # booleans compare as 0 and 1
    ("proximal_logprob_mean!=null",): lambda r: r["proximal_logprob_mean"] is not None,
    ("proximal_logprob_mean<-0.5",): lambda r: (
        r["proximal_logprob_mean"] is not None and r["proximal_logprob_mean"] < -0.5
    ),
    ("reward>0.5",): lambda r: r["reward"] > 0.5,
    ("reward<=0.25",): lambda r: r["reward"] <= 0.25,
    ("advantage>=0",): lambda r: r["advantage"] >= 0,
    ("reward=1",): lambda r: r["reward"] == 1,
    ("stop_reason=length",): lambda r: r["stop_reason"] == "length",
    ("stop_reason!=length",): lambda r: r["stop_reason"] != "length",
    ("length>=5",): lambda r: r["num_completion_tokens"] >= 5,
    ("reward_components.format=1",): lambda r: r["reward_components"]["format"] == 1,
    ("proximal_logprob_mean=null",): lambda r: r["proximal_logprob_mean"] is None,
    ("end_reason~^do",): lambda r: (r["end_reason"] or "") == "done",
    ("0+2",): lambda r: contains(r, "0+2"),  # text, not a field: "0" is no field name
    ("seven",): lambda r: contains(r, "seven"),
    ("text~^it IS \\d+",): lambda r: re.search(r"^it is \d+", r["completion"], re.IGNORECASE) is not None,
    ("text~</script>", "reward<1"): lambda r: "</script>" in r["completion"] and r["reward"] < 1,
    ("correct=false", "length>2", "1+"): lambda r: (
        not r["correct"] and r["num_completion_tokens"] > 2 and contains(r, "1+")
    ),
}
EVAL_FILTERS = {
    ("pass@k=1",): lambda r: r["pass@k"] == 1,
    ("greedy.correct=false",): lambda r: r["greedy"]["correct"] is False,
    ("correct=true",): lambda r: r["greedy"]["correct"] is True,  # the greedy completion's
    ("reward>0",): lambda r: r["greedy"]["reward"] > 0,
    ("num_correct>=2",): lambda r: r["num_correct"] >= 2,
    ("length<3",): lambda r: r["greedy"]["num_completion_tokens"] < 3,
    ("sampled-only",): lambda r: contains(r, "sampled-only", EVALS),
}


@pytest.mark.parametrize(
    "kind, filters",
    [(ROLLOUTS, f) for f in ROLLOUT_FILTERS] + [(EVALS, f) for f in EVAL_FILTERS],
    ids=lambda x: x if isinstance(x, str) else " & ".join(x),
)
def test_filters_keep_what_a_brute_force_selection_keeps(written, kind, filters):
    _, records = written
    rows = flat(records[kind])
    keep = (ROLLOUT_FILTERS if kind == ROLLOUTS else EVAL_FILTERS)[filters]
    expected = [r for r in rows if keep(r)]
    assert 0 < len(expected) < len(rows), "a filter case that keeps all or nothing proves little"
    chosen = selection.select(rows, kind, [selection.parse_filter(f) for f in filters], None, False)
    assert chosen == expected


@pytest.mark.parametrize("key", ["reward", "advantage", "length", "proximal_logprob_mean"])
@pytest.mark.parametrize("ascending", [False, True])
def test_sorting_orders_like_a_brute_force_sort(written, key, ascending):
    _, records = written
    rows = flat(records[ROLLOUTS])
    field = "num_completion_tokens" if key == "length" else key
    valued = [(i, r) for i, r in enumerate(rows) if r[field] is not None]
    # Stable: equal values keep the file order; records without a value come last.
    valued.sort(key=lambda pair: (pair[1][field] if ascending else -pair[1][field], pair[0]))
    expected = [r for _, r in valued] + [r for r in rows if r[field] is None]
    assert selection.select(rows, ROLLOUTS, [], key, ascending) == expected
    evals = flat(records[EVALS])
    by_length = sorted(evals, key=lambda r: -r["greedy"]["num_completion_tokens"])
    assert selection.select(evals, EVALS, [], "length", False) == by_length


@pytest.mark.parametrize(
    "expression, message",
    [
        ("", "empty filter"),
        ("  ", "empty filter"),
        ("=3", "no field before '='"),
        ("reward>abc", "'>' compares numbers, 'abc' is not one"),
        ("reward>", "no value after '>'"),
        ("text~(", "bad regular expression '('"),
        ("text=abc", "text is searched with ~"),
    ],
)
def test_bad_filter_syntax_is_a_named_error(expression, message):
    with pytest.raises(ValueError, match=re.escape(f"--filter {expression!r}: {message}")):
        selection.parse_filter(expression)


def test_unknown_fields_and_unsortable_fields_are_named_errors(written):
    _, records = written
    rows = flat(records[ROLLOUTS])
    with pytest.raises(ValueError, match=r"--filter 'rewrad>0': no field 'rewrad' in the rollouts \(fields: .*reward,"):
        selection.select(rows, ROLLOUTS, [selection.parse_filter("rewrad>0")], None, False)
    with pytest.raises(ValueError, match=r"--sort prompt: not a number"):
        selection.select(rows, ROLLOUTS, [], "prompt", False)
    with pytest.raises(ValueError, match=r"--sort advantage: no such field in the evals"):
        selection.select(flat(records[EVALS]), EVALS, [], "advantage", False)


# ---------------------------------------------------------------- the terminal table


def run(*args: str, width: int = 160) -> tuple[int, str]:
    out = io.StringIO()
    status = show_rollouts.main(list(args), console=Console(file=out, width=width, color_system=None))
    return status, out.getvalue()


def table_rows(output: str, title: str) -> list[list[str]]:
    """The rows of the table titled ``title`` split into cells (two spaces apart)."""
    lines = [line.rstrip() for line in output.splitlines()]
    start = lines.index(title) + 3  # the title, the header, the rule
    rows = []
    for line in lines[start:]:
        if not line.strip() or line.startswith(("rollouts", "evals")) or " shown (" in line:
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


def test_terminal_rows_are_the_selected_records_in_order(written):
    folder, records = written
    rows = flat(records[ROLLOUTS])
    status, output = run(str(folder), "--step", "all", "--sort", "reward", "--filter", "correct=false", "--limit", "7")
    assert status == 0, output
    wrong = [r for r in rows if not r["correct"]]
    expected = sorted(wrong, key=lambda r: -r["reward"])  # stable: file order among equal rewards
    shown = table_rows(output, "rollouts")
    assert [(int(c[0]), c[1], c[2], c[3], int(c[4]), c[5]) for c in shown] == [
        (
            r["step"],
            f"{r['group']}/{r['sample']}",
            f"{r['reward']:.3f}",
            f"{r['advantage']:.3f}",
            r["num_completion_tokens"],
            r["end_reason"] or r["stop_reason"],
        )
        for r in expected[:7]
    ]
    # The prompt column shows the question of the ChatML prompt, not its system text or glue.
    assert [c[6] for c in shown] == [f"What is {r['group']}+{r['step']}?" for r in expected[:7]]
    assert f"7 of {len(wrong)} rollouts shown" in output
    # The summary: one row per step of the selection, with its count and means.
    summary = table_rows(output, "rollouts per step")
    for cells, step in zip(summary, ROLLOUT_STEPS, strict=True):
        chosen = [r for r in wrong if r["step"] == step]
        mean_reward = sum(r["reward"] for r in chosen) / len(chosen)
        assert cells[:3] == [str(step), str(len(chosen)), f"{mean_reward:.3f}"]
    assert max(len(line) for line in output.splitlines()) <= 160


def test_terminal_defaults_to_the_latest_step_and_fits_narrow_consoles(written):
    folder, records = written
    status, output = run(str(folder), width=80)
    assert status == 0
    shown = table_rows(output, "rollouts")
    latest = records[ROLLOUTS][ROLLOUT_STEPS[-1]]
    assert [(int(c[0]), c[1]) for c in shown] == [(r["step"], f"{r['group']}/{r['sample']}") for r in latest[:20]]
    assert max(len(line) for line in output.splitlines()) <= 80
    # Evaluations: the kind from the folder given; every row with --limit 0.
    status, output = run(str(folder / EVALS), "--step", "all", "--limit", "0", "--sort", "pass@k", "--ascending")
    assert status == 0
    expected = sorted(flat(records[EVALS]), key=lambda r: r["pass@k"])
    shown = table_rows(output, "evals")
    assert [(int(c[0]), int(c[1]), c[4]) for c in shown] == [
        (r["step"], r["prompt_index"], f"{r['num_correct']}/{r['k']}") for r in expected
    ]


def test_control_characters_are_shown_not_sent_to_the_terminal(tmp_path):
    # A sampled completion may hold any byte: an escape sequence printed raw would drive the terminal.
    record = rollout(random.Random(0), 1, 0, 0)
    record["completion"] = "\x1b[2J\x1b]0;title\x07done\x7f"
    write_step(str(tmp_path / ROLLOUTS), 1, [record])
    status, output = run(str(tmp_path))
    assert status == 0
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", output)
    assert "␛[2J␛]0;title␇done␡" in output


# ---------------------------------------------------------------- the page


def embedded_data(page: str) -> dict:
    opening = '<script type="application/json" id="rollout-data">'
    start = page.index(opening) + len(opening)
    return json.loads(page[start : page.index("</script>", start)])


def test_the_page_embeds_every_record_and_no_text_escapes_its_script(written):
    folder, records = written
    hostile = dict(
        records[ROLLOUTS][1][0], completion="</script><script>alert(1)</script><!-- </SCRIPT ", reward=float("nan")
    )
    steps = {ROLLOUTS: {1: [hostile, *records[ROLLOUTS][1][1:]], 2: records[ROLLOUTS][2]}, EVALS: records[EVALS]}
    page = render_page("run <b>", steps)
    # Two script elements, each closed once: the data and the page's code.
    assert page.lower().count("</script") == 2
    assert "<title>run &lt;b&gt;</title>" in page
    assert not re.search(r"<(link|img|iframe)\b|\ssrc=", page)
    data = embedded_data(page)
    assert data["title"] == "run <b>"
    pages = data["kinds"][ROLLOUTS]
    assert [s["step"] for s in pages] == [1, 2]
    first = pages[0]["records"][0]
    assert first["completion"] == hostile["completion"] and first["reward"] is None  # NaN is no JSON
    episode = pages[1]["records"][MULTI_TURN[1] * GROUP_SIZE + MULTI_TURN[2]]
    original = records[ROLLOUTS][2][MULTI_TURN[1] * GROUP_SIZE + MULTI_TURN[2]]
    # Turns keep their text and role, their token ids become a count.
    assert episode["turns"] == [
        {"role": t["role"], "text": t["text"], "trained": t["trained"], "num_tokens": len(t["token_ids"])}
        for t in original["turns"]
    ]
    assert pages[1]["records"][0] == records[ROLLOUTS][2][0]
    assert [s["records"] for s in data["kinds"][EVALS]] == [records[EVALS][s] for s in EVAL_STEPS]


def test_html_option_writes_the_page_of_the_selected_steps(written, tmp_path):
    folder, records = written
    page = tmp_path / "page.html"
    status, output = run(str(folder), "--html", str(page), "--step", "2-4")
    assert status == 0
    assert f"wrote {page} (" in output
    data = embedded_data(page.read_text(encoding="utf-8"))
    assert {kind: [s["step"] for s in steps] for kind, steps in data["kinds"].items()} == {ROLLOUTS: [2, 4], EVALS: [4]}


# ---------------------------------------------------------------- errors


def write_lines(path: Path, lines: list[bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wb") as out:
        out.write(b"".join(line + b"\n" for line in lines))


def test_errors_are_one_line_naming_the_culprit_with_exit_code_2(written, tmp_path, capsys):
    folder, records = written
    good = json.dumps(records[ROLLOUTS][1][0]).encode()
    write_lines(Path(step_file(str(folder / ROLLOUTS), 7)), [good, b'{"kind": "rollout", "step": 7,'])
    write_lines(Path(step_file(str(folder / ROLLOUTS), 8)), [good, b"[1, 2]"])
    write_lines(Path(step_file(str(folder / ROLLOUTS), 9)), [json.dumps(records[EVALS][0][0]).encode()])
    truncated = Path(step_file(str(folder / EVALS), 9))
    truncated.write_bytes(gzip.compress(good * 50)[:40])
    (tmp_path / "bare" / ROLLOUTS).mkdir(parents=True)
    rollouts = folder / ROLLOUTS
    cases = [
        ([str(tmp_path / "missing")], f"{tmp_path / 'missing'}: no such folder"),
        ([str(tmp_path / "bare")], f"{tmp_path / 'bare' / ROLLOUTS}: no step files (step-N.jsonl.gz)"),
        ([str(folder), "--step", "3"], "no file for step 3 (dumped: 1-2, 4, 7-9)"),
        ([str(folder), "--step", "7"], f"{rollouts / 'step-7.jsonl.gz'}:2: not a JSON record"),
        ([str(folder), "--step", "8"], f"{rollouts / 'step-8.jsonl.gz'}:2: a record is a JSON object, found list"),
        ([str(folder), "--step", "9"], f"{rollouts / 'step-9.jsonl.gz'}:1: kind is 'eval', expected 'rollout'"),
        ([str(folder / EVALS), "--step", "9"], f"{folder / EVALS / 'step-9.jsonl.gz'}: not a readable gzip file"),
        ([str(folder), "--step", "1", "--filter", "reward>x"], "--filter 'reward>x': '>' compares numbers"),
        ([str(folder / EVALS), "--kind", ROLLOUTS], f"{folder / EVALS} is the evals folder, --kind says rollouts"),
        ([str(folder), "--html", str(tmp_path / "p.html"), "--sort", "reward"], "--sort shape the terminal table only"),
        ([str(folder), "--step", "1", "--limit", "-1"], "--limit -1: a number of rows"),
    ]
    for args, message in cases:
        status, output = run(*args)
        err = capsys.readouterr().err
        assert status == 2, (args, output)
        assert err.startswith("show_rollouts.py: error: ") and err.count("\n") == 1, err
        assert message in err, (message, err)


def test_the_script_runs_without_torch_and_exits_2_without_traceback(written):
    folder, _ = written
    bad = Path(step_file(str(folder / ROLLOUTS), 5))
    write_lines(bad, [b"{not json"])
    # The viewer reads dumps on machines without torch: importing it must not import torch.
    probe = (
        "import runpy, sys\n"
        f"sys.argv = ['show_rollouts.py', {str(folder)!r}, '--step', '5']\n"
        "try:\n"
        f"    runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
        "except SystemExit as exit:\n"
        "    print('exit', exit.code, 'torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "exit 2 False", proc.stdout + proc.stderr
    assert (
        proc.stderr
        == f"show_rollouts.py: error: {bad}:1: not a JSON record (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))\n"
    )
