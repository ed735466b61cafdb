"""What the service tests use to drive it with the tinker-cookbook's own recipes: the client
venv's python (``client_python``), the tokenizer directory (``tokenizer_dir``), local rows of
the built-in arithmetic task, and ``run_cookbook``, which runs ``sl_loop`` or ``rl_loop``
unmodified in the client venv (``cookbook_runner.py``) and returns its metrics per step.
"""

import json
import os
import random
import subprocess
from pathlib import Path

from client_env import client_python
from tokenizer_assets import MODEL_NAME, tokenizer_dir
from torchtitan_rl.data.questions import arithmetic_question

RUNNER = Path(__file__).with_name("cookbook_runner.py")

RECIPE_DEFAULTS = {
    "sl": {"model_name": MODEL_NAME, "batch_size": 2, "max_steps": 3, "save_every": 0, "lora_rank": 4},
    "rl": {
        "model_name": MODEL_NAME,
        "batch_size": 2,
        "group_size": 4,
        "max_tokens": 16,
        "max_steps": 2,
        "save_every": 0,
        "lora_rank": 4,
    },
}
"""Each recipe's config for a few small steps; ``run_cookbook``'s keyword arguments override it.
rl_loop's loss is ``importance_sampling`` (fixed in the recipe)."""


def sl_rows(num_rows: int, num_distinct: int = 1, seed: int = 0) -> list[dict]:
    """``num_rows`` chat rows in the shape of sl_loop's data set (``messages``: a user question
    of the arithmetic task, the assistant's answer), cycling through ``num_distinct`` questions.
    sl_loop shuffles its rows, so only one distinct row gives every step the same batch, and
    losses that can be compared step to step."""
    rng = random.Random(seed)
    distinct = [arithmetic_question(rng) for _ in range(num_distinct)]
    return [
        {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
        for question, answer in (distinct[i % num_distinct] for i in range(num_rows))
    ]


def rl_rows(num_rows: int, seed: int = 0) -> list[dict]:
    """``num_rows`` arithmetic questions in the shape of rl_loop's GSM8K rows: ``question``, and
    an ``answer`` that ends with ``#### <number>``, the part the recipe grades against."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        question, answer = arithmetic_question(rng)
        rows.append(
            {
                "question": question,
                "answer": f"{question.removeprefix('What is ').rstrip('?')} = {answer}\n#### {answer}",
            }
        )
    return rows


# rl_loop's prompt (tinker-cookbook 0.5.8): one worked example, then the question with this suffix.
RL_QUESTION_SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."
RL_PROMPT_PREFIX = [
    {"role": "user", "content": "How many r's are in strawberry?" + RL_QUESTION_SUFFIX},
    {
        "role": "assistant",
        "content": "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a 5) w 6) b 7) e 8) r "
        "9) r 10) y. We have r's at positions 3, 8, and 9. \\boxed{3}",
    },
]


def rl_warmup_rows(rows: list[dict], num_rows: int) -> list[dict]:
    """sl_loop rows that teach rl_loop's answers to the GSM8K-shaped ``rows``: each question in
    rl_loop's prompt, answered ``\\boxed{<number>}``. A random debug model earns no reward in
    rl_loop (all advantages zero: the recipe skips its training step); after enough sl_loop steps
    on these rows, rl_loop resumed from that state (``run_cookbook(..., resume_from=...)``)
    samples right and wrong answers, and trains."""
    return [
        {
            "messages": [
                *RL_PROMPT_PREFIX,
                {"role": "user", "content": row["question"] + RL_QUESTION_SUFFIX},
                {"role": "assistant", "content": "\\boxed{" + row["answer"].rsplit("#### ", 1)[1] + "}"},
            ]
        }
        for row in (rows[i % len(rows)] for i in range(num_rows))
    ]


def run_cookbook(
    kind: str,
    base_url: str,
    workdir: str | Path,
    rows: list[dict] | None = None,
    env: dict[str, str] | None = None,
    resume_from: str | None = None,
    timeout_s: float = 900,
    **overrides,
) -> list[dict]:
    """Runs the cookbook's ``sl_loop`` (``kind="sl"``) or ``rl_loop`` (``"rl"``) against the
    service at ``base_url`` in ``workdir`` (tokenizer files written there, a fresh log folder),
    on ``rows`` (default: ``sl_rows``/``rl_rows`` for ``batch_size * max_steps`` rows) with
    ``RECIPE_DEFAULTS[kind]`` updated by ``overrides``, with the variables ``env`` added (e.g.
    ``TINKER_API_KEY``, else the runner's dummy key); ``resume_from`` (a ``tinker://`` state
    path, e.g. ``last_checkpoint(...)["state_path"]`` of an earlier run) starts it from that
    state through the recipe's own resume path, as if an earlier run of it had saved the state
    before its first batch. Returns the metrics the recipe logged, one dict per step (``step``,
    and e.g. ``train_mean_nll`` for sl, ``reward/total`` for rl). A failed run raises
    RuntimeError with the runner's output."""
    if kind not in RECIPE_DEFAULTS:
        raise ValueError(f"kind must be one of {sorted(RECIPE_DEFAULTS)}, got {kind!r}")
    config = RECIPE_DEFAULTS[kind] | overrides
    workdir = Path(workdir)
    tokenizer_dir(workdir, config["model_name"])
    if rows is None:
        num_rows = config["batch_size"] * config["max_steps"]
        rows = sl_rows(num_rows) if kind == "sl" else rl_rows(num_rows)
    num_runs = len(list(workdir.glob(f"{kind}-run-*")))
    log_path = workdir / f"{kind}-run-{num_runs}"  # fresh: a log folder with checkpoints makes the recipe resume
    rows_path = workdir / f"{kind}-rows-{num_runs}.jsonl"
    log_path.mkdir()
    if resume_from is not None:
        record = {"name": "warm-start", "batch": 0, "state_path": resume_from}
        (log_path / "checkpoints.jsonl").write_text(json.dumps(record) + "\n")
    rows_path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    command = [client_python(), str(RUNNER), kind, "--base-url", base_url, "--log-path", str(log_path)]
    command += ["--rows", str(rows_path), *(f"{key}={value}" for key, value in config.items())]
    try:
        result = _run_client(command, workdir, timeout_s, env)
    except subprocess.TimeoutExpired as error:
        log = log_path / "logs.log"
        raise RuntimeError(
            f"the cookbook's {kind} recipe did not finish in {timeout_s} s; its log:\n"
            + (log.read_text()[-6000:] if log.is_file() else "(none)")
        ) from error
    if result.returncode != 0:
        raise RuntimeError(
            f"the cookbook's {kind} recipe failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
        )
    metrics_path = log_path / "metrics.jsonl"
    return [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]


def last_checkpoint(workdir: str | Path, kind: str) -> dict:
    """The last checkpoint record (``name``, ``state_path``, ``sampler_path``, ...) that the
    latest ``run_cookbook(kind, ...)`` run in ``workdir`` wrote: the recipes save one at the end."""
    runs = sorted(Path(workdir).glob(f"{kind}-run-*"), key=lambda path: int(path.name.rsplit("-", 1)[1]))
    if not runs:
        raise ValueError(f"no {kind} run in {workdir}")
    lines = (runs[-1] / "checkpoints.jsonl").read_text().splitlines()
    return json.loads(lines[-1])


def render_conversation(messages: list[dict], workdir: str | Path, model_name: str = MODEL_NAME) -> dict:
    """What the cookbook's renderer for ``model_name`` makes of ``messages`` (ending with an
    assistant turn) with the tokenizer of ``tokenizer_dir``: see ``cookbook_runner.render``."""
    workdir = Path(workdir)
    tokenizer_dir(workdir, model_name)
    messages_path = workdir / "messages.json"
    messages_path.write_text(json.dumps(messages))
    command = [client_python(), str(RUNNER), "render", "--messages", str(messages_path), "--model-name", model_name]
    result = _run_client(command, workdir, timeout_s=300)
    if result.returncode != 0:
        raise RuntimeError(f"rendering with the cookbook failed ({result.returncode}):\n{result.stderr[-6000:]}")
    return json.loads(result.stdout)


def _run_client(
    command: list[str], workdir: Path, timeout_s: float, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    # The main venv's variables would point the client venv's python at the wrong packages.
    env = {key: value for key, value in os.environ.items() if key not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env |= extra_env or {}
    return subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
