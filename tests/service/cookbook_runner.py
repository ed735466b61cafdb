"""Runs a tinker-cookbook recipe as its module's ``__main__`` does, inside the client venv
(``client_env.py``), against a Tinker-compatible service, on local rows instead of hub data sets.

    cookbook_runner.py sl|rl --base-url URL --log-path DIR --rows ROWS.jsonl [key=value ...]
    cookbook_runner.py render --messages MESSAGES.json

``sl`` runs ``tinker_cookbook.recipes.sl_loop`` and ``rl`` runs ``recipes.rl_loop``, unmodified:
the ``key=value`` arguments are the recipe's own chz config, ``datasets.load_dataset`` returns
the rows of ``--rows`` (JSON lines: ``messages`` conversations for sl, ``question`` / ``answer``
rows in GSM8K's shape for rl) as the train split of the data set the recipe names, and nothing
else. The recipe writes one JSON line of metrics per step to ``<log-path>/metrics.jsonl``.
``render`` prints, as JSON, what the recipe's renderer makes of a conversation ending with an
assistant turn (the generation prompt of the turns before it, the stop sequences, the supervised
datum of the whole conversation, and the parse of that datum's trained tokens).

Run with the working directory holding ``<model_name>/`` with the tokenizer files
(``tokenizer_assets.py``): the cookbook loads the tokenizer from there, and no call leaves the
machine but those to ``--base-url``.
"""

import argparse
import json
import os
import socket
import sys
from pathlib import Path
from urllib.parse import urlsplit

# Read when the SDK and the hub libraries are imported: a key of the form the SDK requires (a
# service started with service.api_key needs that one, set in the environment), no telemetry
# posts, no hub look-ups.
for name, value in {
    "TINKER_API_KEY": "tml-service-tests",
    "TINKER_TELEMETRY": "0",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
}.items():
    os.environ.setdefault(name, value)

import chz  # noqa: E402
import datasets  # noqa: E402

RECIPE_DATASETS = {"sl": ("HuggingFaceH4/no_robots",), "rl": ("openai/gsm8k", "main")}
"""The ``load_dataset`` arguments each recipe reads its train split with."""
RENDER_MODEL_NAME = "Qwen/Qwen3-8B"


def serve_rows(rows: list[dict], expected_args: tuple[str, ...]) -> None:
    """Makes ``datasets.load_dataset(*expected_args)`` return ``rows`` as a train split; any
    other data set is an error, so a recipe that reads something else fails loudly."""

    def load_dataset(*args, **kwargs):
        if args != expected_args or kwargs:
            raise ValueError(f"the recipe loads dataset {args} {kwargs}; this runner serves only {expected_args}")
        return datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)})

    datasets.load_dataset = load_dataset


def check_tokenizer_dir(model_name: str) -> None:
    if not (Path(model_name) / "tokenizer.json").is_file():
        raise SystemExit(
            f"no {model_name}/tokenizer.json under the working directory {os.getcwd()}: the cookbook would look "
            f"{model_name!r} up on the hub; write it with tokenizer_assets.tokenizer_dir"
        )


def check_reachable(base_url: str) -> None:
    """Fails at once when nothing listens at ``base_url``: the SDK would retry for minutes."""
    url = urlsplit(base_url)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=5).close()
    except OSError as error:
        raise SystemExit(f"the service at {base_url} cannot be reached: {error}") from error


def run_recipe(kind: str, base_url: str, log_path: str, rows_path: str, overrides: list[str]) -> None:
    if kind == "sl":
        from tinker_cookbook.recipes import sl_loop as recipe
    else:
        from tinker_cookbook.recipes import rl_loop as recipe
    argv = [f"base_url={base_url}", f"log_path={log_path}", *overrides]
    model_names = [arg.split("=", 1)[1] for arg in argv if arg.startswith("model_name=")]
    if not model_names:
        raise SystemExit("pass model_name=...: the recipe's default names a model the service does not serve")
    check_tokenizer_dir(model_names[-1])
    with open(rows_path) as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    serve_rows(rows, RECIPE_DATASETS[kind])
    check_reachable(base_url)
    chz.nested_entrypoint(recipe.main, argv=argv)
    metrics_path = Path(log_path) / "metrics.jsonl"
    for line in metrics_path.read_text().splitlines():
        print("metrics", line, flush=True)


def render(messages_path: str, model_name: str) -> dict:
    from tinker_cookbook import model_info, renderers
    from tinker_cookbook.supervised.data import conversation_to_datum
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    check_tokenizer_dir(model_name)
    messages = json.loads(Path(messages_path).read_text())
    renderer_name = model_info.get_recommended_renderer_name(model_name)
    renderer = renderers.get_renderer(renderer_name, get_tokenizer(model_name))
    datum = conversation_to_datum(messages, renderer, max_length=None)
    targets = datum.loss_fn_inputs["target_tokens"].data
    weights = datum.loss_fn_inputs["weights"].data
    trained = [token for token, weight in zip(targets, weights) if weight > 0]
    message, termination = renderer.parse_response(trained)
    return {
        "renderer": renderer_name,
        "generation_prompt": renderer.build_generation_prompt(messages[:-1]).to_ints(),
        "stop_sequences": renderer.get_stop_sequences(),
        "model_input": datum.model_input.to_ints(),
        "target_tokens": targets,
        "weights": weights,
        "parsed_message": message,
        "parsed_text": renderers.get_text_content(message),
        "parse_termination": termination.value,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=["sl", "rl", "render"])
    parser.add_argument("--base-url", help="the service's URL (sl, rl)")
    parser.add_argument("--log-path", help="the recipe's log_path: a fresh folder, else the recipe resumes (sl, rl)")
    parser.add_argument("--rows", help="JSON lines served as the recipe's train split (sl, rl)")
    parser.add_argument("--messages", help="a JSON list of chat messages ending with an assistant turn (render)")
    parser.add_argument("--model-name", default=RENDER_MODEL_NAME, help="the model whose renderer to use (render)")
    parser.add_argument("overrides", nargs="*", help="the recipe's config as key=value (sl, rl)")
    args = parser.parse_intermixed_args()
    if args.kind == "render":
        if not args.messages:
            parser.error("render needs --messages")
        json.dump(render(args.messages, args.model_name), sys.stdout)
        return
    missing = [flag for flag in ("base_url", "log_path", "rows") if getattr(args, flag) is None]
    if missing:
        parser.error(f"{args.kind} needs " + ", ".join("--" + flag.replace("_", "-") for flag in missing))
    run_recipe(args.kind, args.base_url, args.log_path, args.rows, args.overrides)


if __name__ == "__main__":
    main()
