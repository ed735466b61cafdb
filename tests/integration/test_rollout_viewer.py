"""The rollout viewer on a real run's dump: ``scripts/show_rollouts.py``'s terminal table, and its
HTML page rendered and used in a real headless browser (Debian's chromium, driven through
chromedriver's WebDriver protocol over HTTP; ``scripts/test.sh`` installs both).

A tiny GRPO run through ``train.py`` (a short SFT warm-up, so rewards differ) dumps its rollouts
and evaluations once for the module. Every check compares what the page shows with the records
read back from the files in Python:

- the page lists every dumped step; per step, the histogram has one bar per bin whose count is
  the number of the step's rewards in it (the counts sum to the step's records), the means are
  the records' means, and the table's rows are the step's records in file order;
- typing in the search box narrows the rows to exactly the records whose text contains it, a
  click on a header sorts them, a click on a row opens the record's prompt and completion;
- the evaluations tab lists the evaluated steps and opens a prompt's greedy and sampled answers;
- an episode (a dump written here: the real run is single-turn) opens with its turns, their
  roles and whether they trained; completion text that closes a <script> stays text;
- the page loads nothing (no request of any kind) and its script runs to its end.
"""

import importlib.util
import io
import json
import math
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from rich.console import Console

from reference import launch_env
from torchtitan_rl.rollout_files import EVALS, ROLLOUTS, dumped_steps, read_step, write_step

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "show_rollouts.py"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# The embedded GRPO recipe cut to seconds: 20 SFT steps make the model answer with digits and a
# stop token (mostly), so partial credit and the format reward spread the rewards of a step.
RUN_OPTIONS = [
    "--training.steps",
    "2",
    "--rl.sft_warmup_steps",
    "20",
    "--rl.prompts_per_step",
    "4",
    "--rl.group_size",
    "4",
    "--rl.eval_interval",
    "2",
    "--rl.num_eval_prompts",
    "4",
    "--rl.eval_num_samples",
    "2",
    "--rl.partial_credit",
    "0.5",
    "--rl.format_reward",
    "0.1",
]
ELEMENT = "element-6066-11e4-a52e-4f735466cecf"  # the W3C WebDriver key of an element reference
CONTROL, RELEASE_MODIFIERS, BACKSPACE = "\ue009", "\ue000", "\ue003"  # WebDriver's codes of these keys


def _load_script():
    spec = importlib.util.spec_from_file_location("show_rollouts", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


show_rollouts = _load_script()


@pytest.fixture(scope="module")
def real_dump(tmp_path_factory) -> Path:
    dump = tmp_path_factory.mktemp("viewer_run")
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "train.py"),
            "--job.config_file",
            str(REPO / "train_configs" / "debug_grpo.toml"),
            "--job.dump_folder",
            str(dump),
            *RUN_OPTIONS,
        ],
        cwd=REPO,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert dumped_steps(str(dump / ROLLOUTS)) == [1, 2], "the run dumped no rollouts (rl.dump_rollouts)"
    return dump


class Browser:
    """A headless chromium session through chromedriver's W3C WebDriver HTTP API: pages opened,
    elements clicked and typed into as a user would, scripts run to read the page back."""

    def __init__(self, base: str, session: str):
        self.base, self.session = base, session

    @staticmethod
    def request(method: str, url: str, body: dict | None = None) -> object:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.loads(response.read())["value"]
        except urllib.error.HTTPError as err:
            raise AssertionError(f"WebDriver {method} {url}: {err.read().decode()[:2000]}") from None

    def call(self, method: str, path: str, body: dict | None = None) -> object:
        return self.request(method, f"{self.base}/session/{self.session}{path}", body)

    def open(self, url: str) -> None:
        self.call("POST", "/url", {"url": url})
        assert self.run("return document.body.dataset.ready") == "true", "the page's script did not run to its end"

    def run(self, script: str, *args: object) -> object:
        return self.call("POST", "/execute/sync", {"script": script, "args": list(args)})

    def element(self, css: str) -> str:
        return self.call("POST", "/element", {"using": "css selector", "value": css})[ELEMENT]

    def click(self, css: str) -> None:
        self.call("POST", f"/element/{self.element(css)}/click", {})

    def type(self, css: str, text: str) -> None:
        """Replace the text of the input ``css`` as a user would: select all, then type."""
        select_all_and_delete = CONTROL + "a" + RELEASE_MODIFIERS + BACKSPACE
        self.call("POST", f"/element/{self.element(css)}/value", {"text": select_all_and_delete + text})

    def texts(self, css: str) -> list[str]:
        return self.run("return [...document.querySelectorAll(arguments[0])].map((e) => e.textContent)", css)

    def attributes(self, css: str, name: str) -> list[str]:
        return self.run(
            "return [...document.querySelectorAll(arguments[0])].map((e) => e.getAttribute(arguments[1]))", css, name
        )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not Path(path).exists()]
    if missing:
        pytest.fail(
            f"{', '.join(missing)} missing: the page is tested in Debian's chromium; scripts/test.sh installs it "
            "(apt-get install chromium chromium-driver)"
        )
    port = free_port()
    driver = subprocess.Popen([CHROMEDRIVER, f"--port={port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                Browser.request("GET", f"{base}/status")
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, "chromedriver did not answer within 30 s"
                time.sleep(0.05)
        args = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--window-size=1400,900",
            f"--user-data-dir={tmp_path_factory.mktemp('chromium_profile')}",
        ]
        options = {"binary": CHROMIUM, "args": args}
        capabilities = {"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": options}}}
        session = Browser.request("POST", f"{base}/session", capabilities)["sessionId"]
        yield Browser(base, session)
        Browser.request("DELETE", f"{base}/session/{session}")
    finally:
        driver.terminate()
        driver.wait(timeout=30)


def write_page(dump: Path, out: Path) -> str:
    console = Console(file=io.StringIO(), width=120, color_system=None)
    assert show_rollouts.main([str(dump), "--html", str(out)], console=console) == 0
    return out.as_uri()


def bin_counts(values: list[float], bars: list[list[float]]) -> list[int]:
    """How many of ``values`` fall in each bar: lo <= v < hi, the last bar closed; a bar with
    lo == hi holds exactly its value."""
    counts = []
    for i, (lo, hi) in enumerate(bars):
        last = i == len(bars) - 1
        counts.append(sum(v == lo if lo == hi else lo <= v < hi or (last and v == hi) for v in values))
    return counts


def contains(texts: list, query: str) -> bool:
    return any(isinstance(t, str) and query.lower() in t.lower() for t in texts)


def check_step(browser: Browser, records: list[dict], values: list[float]) -> None:
    """The selected step's histogram of ``values`` and its rows (file order)."""
    bars = [
        [float(x) for x in b]
        for b in zip(*(browser.attributes("#histogram rect.bar", a) for a in ("data-lo", "data-hi")))
    ]
    counts = [int(c) for c in browser.attributes("#histogram rect.bar", "data-count")]
    distinct = sorted(set(values))
    if len(distinct) <= 12:
        assert bars == [[v, v] for v in distinct]
    else:
        assert len(bars) == 12 and bars[0][0] == distinct[0] and bars[-1][1] == distinct[-1]
    assert counts == bin_counts(values, bars) and sum(counts) == len(records)
    assert browser.attributes("#records tbody tr.record", "data-index") == [str(i) for i in range(len(records))]
    assert browser.texts("#shown") == [f"{len(records)} of {len(records)}"]


def test_the_page_of_a_real_run_in_chromium(real_dump, browser, tmp_path):
    browser.open(write_page(real_dump, tmp_path / "run.html"))
    # Nothing loaded: the page is one file (its CSP forbids loads; none was even tried).
    assert browser.run("return performance.getEntriesByType('resource').length") == 0
    steps = dumped_steps(str(real_dump / ROLLOUTS))
    assert browser.attributes("#steps tr.step-row", "data-step") == [str(s) for s in steps]
    assert browser.texts("button.tab") == [
        f"Rollouts ({len(steps)} steps)",
        f"Evaluations ({len(dumped_steps(str(real_dump / EVALS)))} steps)",
    ]
    spread = False
    for step in steps:
        records = read_step(str(real_dump / ROLLOUTS), step)
        browser.click(f'#steps tr.step-row[data-step="{step}"]')
        assert browser.texts("#step-title") == [f"Rollouts, step {step}"]
        row = f'#steps tr.step-row[data-step="{step}"]'
        assert int(browser.attributes(row, "data-count")[0]) == len(records)
        for attribute, field in (("data-mean-reward", "reward"), ("data-mean-advantage", "advantage")):
            shown = float(browser.attributes(row, attribute)[0])
            assert math.isclose(shown, sum(r[field] for r in records) / len(records), rel_tol=1e-12, abs_tol=1e-12)
        check_step(browser, records, [r["reward"] for r in records])
        spread |= len({r["reward"] for r in records}) > 1

    assert spread, "every step's rewards are equal: the histograms prove little"

    # Search, on the last step: the question of its first prompt, then text no record holds.
    records = read_step(str(real_dump / ROLLOUTS), steps[-1])
    query = re.search(r"What is (.*)\?", records[0]["prompt"]).group(1)
    for text in (query, "no record holds this"):
        browser.type("#search", text)
        expected = [i for i, r in enumerate(records) if contains([r["prompt"], r["completion"]], text)]
        assert browser.attributes("#records tbody tr.record", "data-index") == [str(i) for i in expected], text
        assert browser.texts("#shown") == [f"{len(expected)} of {len(records)}"]
    assert 0 < len([r for r in records if contains([r["prompt"], r["completion"]], query)]) < len(records)
    browser.type("#search", "")

    # Sort: a click on the reward header sorts largest first (ties in file order), a second smallest first.
    browser.click('#records th[data-sort="reward"]')
    by_reward = sorted(range(len(records)), key=lambda i: (-records[i]["reward"], i))
    assert browser.attributes("#records tbody tr.record", "data-index") == [str(i) for i in by_reward]
    browser.click('#records th[data-sort="reward"]')
    by_reward = sorted(range(len(records)), key=lambda i: (records[i]["reward"], i))
    assert browser.attributes("#records tbody tr.record", "data-index") == [str(i) for i in by_reward]

    # A row opens its record.
    chosen = by_reward[-1]
    browser.click(f'#records tr.record[data-index="{chosen}"]')
    assert browser.texts("#detail-prompt") == [records[chosen]["prompt"]]
    assert browser.texts("#detail-completion") == [records[chosen]["completion"]]
    assert browser.run("return location.hash").endswith(f"&open={chosen}")

    # Evaluations: every evaluated step; a prompt opens its greedy and sampled answers.
    browser.click('button.tab[data-kind="evals"]')
    eval_steps = dumped_steps(str(real_dump / EVALS))
    assert eval_steps == [0, 2]
    assert browser.attributes("#steps tr.step-row", "data-step") == [str(s) for s in eval_steps]
    for step in eval_steps:
        evaluations = read_step(str(real_dump / EVALS), step)
        browser.click(f'#steps tr.step-row[data-step="{step}"]')
        row = f'#steps tr.step-row[data-step="{step}"]'
        shown = float(browser.attributes(row, "data-pass-1")[0])
        assert math.isclose(shown, sum(e["pass@1"] for e in evaluations) / len(evaluations), abs_tol=1e-12)
        check_step(browser, evaluations, [e["num_correct"] for e in evaluations])
    browser.click('#records tr.record[data-index="1"]')
    evaluation = evaluations[1]
    answers = [evaluation["greedy"], *evaluation["samples"]]
    assert browser.attributes("#detail .eval-answer", "data-which") == ["greedy"] + [
        f"sample {i}" for i in range(len(evaluation["samples"]))
    ]
    assert browser.texts("#detail .eval-answer pre") == [a["completion"] for a in answers]
    assert browser.attributes("#detail .eval-answer", "class") == [
        "eval-answer " + ("correct" if a["correct"] else "wrong") for a in answers
    ]


def episode(step: int, group: int, sample: int, completion: str, turns: list[dict] | None) -> dict:
    return {
        "kind": "rollout",
        "step": step,
        "group": group,
        "sample": sample,
        "prompt": f"<|im_start|>user\nGuess my number ({group}).<|im_end|>\n<|im_start|>assistant\n",
        "completion": completion,
        "turns": turns,
        "num_prompt_tokens": 12,
        "num_completion_tokens": sum(len(t["token_ids"]) for t in turns) if turns else 3,
        "num_loss_tokens": sum(len(t["token_ids"]) for t in turns if t["trained"]) if turns else 3,
        "stop_reason": "stop",
        "end_reason": "done" if turns else None,
        "num_turns": sum(t["role"] == "assistant" for t in turns) if turns else 1,
        "reward": 1.0 if turns else 0.0,
        "correct": bool(turns),
        "reward_components": {"correct": 1.0 if turns else 0.0},
        "advantage": 0.5 if turns else -0.5,
        "version": 0,
        "staleness": 0,
        "behaviour_logprob_mean": -0.5,
        "proximal_logprob_mean": None,
        "correction_weight_mean": None,
        "images": [],
    }


def test_an_episode_opens_with_its_turns_and_text_stays_text(browser, tmp_path):
    turns = [
        {"role": "assistant", "text": "50<|im_end|>", "token_ids": [53, 48, 7], "trained": True},
        {"role": "user", "text": "\n<|im_start|>user\nhigher<|im_end|>\n", "token_ids": [1, 2, 3, 4], "trained": False},
        {"role": "assistant", "text": "75<|im_end|>", "token_ids": [55, 53, 7], "trained": True},
    ]
    hostile = "</script><script>window.injected = 1</script><!-- <b>bold</b>"
    records = [
        episode(1, 0, 0, hostile, None),
        episode(1, 0, 1, "".join(t["text"] for t in turns), turns),
        episode(1, 1, 0, "42", None),
    ]
    write_step(str(tmp_path / "run" / ROLLOUTS), 1, records)
    # A step of many distinct rewards: the histogram bins them (12 equal-width bins).
    spread = [dict(episode(2, i // 4, i % 4, f"answer {i}", None), reward=(i * 7919 % 37) / 8) for i in range(40)]
    write_step(str(tmp_path / "run" / ROLLOUTS), 2, spread)
    url = write_page(tmp_path / "run", tmp_path / "episode.html")
    browser.open(url)
    check_step(browser, spread, [r["reward"] for r in spread])
    browser.type("#search", "ANSWER 1")  # the completion's text, case-insensitive
    expected = [i for i, r in enumerate(spread) if "answer 1" in r["completion"]]
    assert browser.attributes("#records tbody tr.record", "data-index") == [str(i) for i in expected]
    browser.type("#search", "")  # the search stays when another step is selected
    browser.click('#steps tr.step-row[data-step="1"]')
    assert browser.run("return window.injected === undefined && document.scripts.length") == 2
    browser.click('#records tr.record[data-index="1"]')
    assert browser.texts("#detail-prompt") == [records[1]["prompt"]]
    assert browser.attributes("#detail .turn", "data-role") == [t["role"] for t in turns]
    assert browser.attributes("#detail .turn", "class") == [
        "turn " + ("trained" if t["trained"] else "untrained") for t in turns
    ]
    assert browser.texts("#detail .turn .turn-text") == [t["text"] for t in turns]
    assert browser.texts("#detail .turn .badge") == ["trained", "not trained", "trained"]
    assert browser.texts("#detail .turn-head .summary") == [f"{len(t['token_ids'])} tokens" for t in turns]
    # Trained and untrained turns are styled apart (their background colours differ).
    backgrounds = browser.run(
        "return [...document.querySelectorAll('#detail .turn')].map((e) => getComputedStyle(e).backgroundColor)"
    )
    assert backgrounds[0] == backgrounds[2] != backgrounds[1]
    # The completion that closes a <script> is shown as the text it is; so is the table's cell.
    browser.click("#detail button.close")
    assert browser.texts("#detail") == [""]
    browser.click('#records tr.record[data-index="0"]')
    assert browser.texts("#detail-completion") == [hostile]
    # The view is in the link: reopening it restores the search and the opened record.
    browser.type("#search", "window.injected")
    assert browser.attributes("#records tbody tr.record", "data-index") == ["0"]
    browser.type("#search", "guess my number (1)")
    assert browser.attributes("#records tbody tr.record", "data-index") == ["2"]
    browser.click('#records tr.record[data-index="2"]')
    browser.open(browser.run("return location.href"))
    assert browser.run("return document.getElementById('search').value") == "guess my number (1)"
    assert browser.texts("#detail-completion") == ["42"]


def test_the_terminal_table_of_a_real_run(real_dump):
    out = io.StringIO()
    console = Console(file=out, width=200, color_system=None)
    assert show_rollouts.main([str(real_dump), "--step", "all", "--limit", "0"], console=console) == 0
    lines = [line.rstrip() for line in out.getvalue().splitlines()]
    start = lines.index("rollouts") + 3  # the title, the header, the rule
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines[start:] if line.strip()]
    records = [
        r for step in dumped_steps(str(real_dump / ROLLOUTS)) for r in read_step(str(real_dump / ROLLOUTS), step)
    ]
    assert [(int(c[0]), c[1], c[2], c[3], int(c[4]), c[5]) for c in rows] == [
        (
            r["step"],
            f"{r['group']}/{r['sample']}",
            f"{r['reward']:.3f}",
            f"{r['advantage']:.3f}",
            r["num_completion_tokens"],
            r["stop_reason"],
        )
        for r in records
    ]
    summary_start = lines.index("rollouts per step") + 3
    for line, step in zip(lines[summary_start:], (1, 2)):
        chosen = [r for r in records if r["step"] == step]
        assert re.split(r"\s{2,}", line.strip())[:3] == [
            str(step),
            str(len(chosen)),
            f"{sum(r['reward'] for r in chosen) / len(chosen):.3f}",
        ]
