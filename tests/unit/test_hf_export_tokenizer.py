"""The tokenizer side of Hugging Face exports (``hf_tokenizer_files``), against our own code as
the reference: the byte tokenizer's exported ``tokenizer.json`` through ``tokenizers`` and
``transformers.AutoTokenizer`` gives ``ByteTokenizer``'s ids, its chat template
``data.chat``'s tokens, and ``AutoModelForCausalLM.generate`` with only the export's
``generation_config.json`` generates what ``TorchGenerator`` generates greedily, stopping where it
stops. Nothing is downloaded.
"""

import dataclasses
import json
import os
import random
import re
from pathlib import Path

import pytest
import tokenizers
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from torchtitan_rl.config import ConfigManager
from torchtitan_rl.config.job_config import Generation
from torchtitan_rl.data.chat import render_chat, tokenize_prompt, tokenize_row
from torchtitan_rl.data.tokenizer import ByteTokenizer, build_tokenizer
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.hf_checkpoint import save_hf_checkpoint
from torchtitan_rl.hf_tokenizer_files import ExportTokenizer, byte_tokenizer_json
from torchtitan_rl.models.registry import get_model_spec
from torchtitan_rl.recipes.base import build_model
from torchtitan_rl.recipes.sft import SFTRecipe
from torchtitan_rl.rl.generator import SamplingParams, TorchGenerator
from torchtitan_rl.rl.tasks import answered_rows, build_task
from unit.test_tokenizer import QWEN_SPECIAL_TOKENS, make_hf_tokenizer_dir

CONFIGS = Path(__file__).resolve().parents[2] / "train_configs"
CPU = torch.device("cpu")
BYTES = ByteTokenizer()
STOP_TOKENS = Generation().stop_tokens  # the default: <|im_end|>, then <|endoftext|>
SYSTEM = {"role": "system", "content": "You are a careful assistant.\nAnswer briefly."}
# Text pieces of the random strings: ASCII, multi-byte UTF-8, emoji (4 bytes, one with a
# joiner), whitespace runs, and characters of other scripts.
PIECES = [
    "a",
    "Z",
    "7",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    "\r\n",
    "é",
    "ß",
    "你好",
    "Ж",
    "🙂",
    "👩‍💻",
    "ア",
    "€",
    "'",
    "<",
    "|",
]


def debug_args():
    return dataclasses.replace(get_model_spec("qwen3").flavors["debugmodel"], attn_backend="sdpa_dense")


def debug_model():
    dims = ParallelDims(1, 1, 1, 1, world_size=1)
    dims.build_meshes("cpu")
    return build_model(debug_args(), parallel_dims=dims, device=CPU, seed=0, param_dtype=torch.float32)


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> str:
    """A debug model exported with the byte tokenizer (see ``stopping_model``), as a run does."""
    path = str(tmp_path_factory.mktemp("byte") / "export")
    tokenizer = ExportTokenizer.for_run(BYTES, "", STOP_TOKENS)
    save_hf_checkpoint(stopping_model(), path, torch.float32, tokenizer)
    return path


@pytest.fixture(scope="module")
def hf_tokenizer(export_dir):
    return AutoTokenizer.from_pretrained(export_dir)


def read_json(directory: str, name: str) -> dict:
    with open(os.path.join(directory, name)) as f:
        return json.load(f)


def random_strings(seed: int, count: int = 300) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randrange(0, 24))) for _ in range(count)]


def hf_ids(output) -> list[int]:
    """The ids of ``apply_chat_template(..., tokenize=True)``, a list or a BatchEncoding by version."""
    return list(output) if isinstance(output, list) else list(output["input_ids"])


# ---------------------------------------------------------------- tokenizer.json


def test_exported_byte_tokenizer_gives_our_ids_and_decodes_back(export_dir, hf_tokenizer):
    fast = tokenizers.Tokenizer.from_file(os.path.join(export_dir, "tokenizer.json"))
    for text in random_strings(seed=0):
        expected = BYTES.encode(text)
        assert fast.encode(text, add_special_tokens=False).ids == expected, text
        assert hf_tokenizer(text, add_special_tokens=False)["input_ids"] == expected, text
        assert hf_tokenizer.encode(text) == expected, text  # nothing added around the text either
        assert fast.decode(expected, skip_special_tokens=False) == text
        assert hf_tokenizer.decode(expected) == text
    for token in ByteTokenizer.SPECIAL_TOKENS:
        assert fast.token_to_id(token) == hf_tokenizer.convert_tokens_to_ids(token) == BYTES.token_to_id(token)
    assert len(hf_tokenizer) == fast.get_vocab_size(with_added_tokens=True) == BYTES.vocab_size


def test_any_ids_decode_as_the_byte_tokenizer_decodes_them(export_dir, hf_tokenizer):
    """Special tokens between bytes, and byte runs that are no valid UTF-8 (replaced alike)."""
    fast = tokenizers.Tokenizer.from_file(os.path.join(export_dir, "tokenizer.json"))
    rng = random.Random(1)
    for _ in range(300):
        ranges = [(0, 128), (128, ByteTokenizer.NUM_BYTES), (ByteTokenizer.NUM_BYTES, BYTES.vocab_size)]
        ids = [rng.randrange(*rng.choice(ranges)) for _ in range(12)]
        expected = BYTES.decode(ids)
        assert fast.decode(ids, skip_special_tokens=False) == expected, ids
        assert hf_tokenizer.decode(ids) == expected, ids


def test_special_token_text_is_the_one_difference(export_dir, hf_tokenizer):
    """The text of a special token: bytes for ``ByteTokenizer.encode``, the special for HF. Every
    other piece of the string gets the same ids."""
    fast = tokenizers.Tokenizer.from_file(os.path.join(export_dir, "tokenizer.json"))
    specials = ByteTokenizer.SPECIAL_TOKENS
    split = re.compile("(" + "|".join(map(re.escape, specials)) + ")")
    rng = random.Random(2)
    for text in random_strings(seed=3, count=100):
        text += rng.choice(specials) + "".join(rng.choice(PIECES + list(specials)) for _ in range(8))
        as_hf_reads_it = []
        for piece in split.split(text):
            as_hf_reads_it += [BYTES.token_to_id(piece)] if piece in specials else BYTES.encode(piece)
        assert fast.encode(text, add_special_tokens=False).ids == as_hf_reads_it, text
        assert hf_tokenizer.encode(text) == as_hf_reads_it, text
        assert BYTES.encode(text) != as_hf_reads_it


# ---------------------------------------------------------------- chat template


def task_prompts() -> list[list[dict]]:
    """Prompts of the built-in RL tasks, as they are and after a system message."""
    prompts = []
    for name in ("arithmetic", "reverse"):
        task = build_task(name, num_train=20, num_eval=10, seed=0)
        for problem in task.train_problems + task.eval_problems:
            prompts += [list(problem.messages), [SYSTEM, *problem.messages]]
    return prompts


def test_chat_template_renders_our_prompts(hf_tokenizer):
    for messages in task_prompts():
        expected = tokenize_prompt(messages, BYTES)
        got = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        assert hf_ids(got) == expected, messages
        text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert text == render_chat(messages) + "<|im_start|>assistant\n"


def test_chat_template_renders_our_rows(hf_tokenizer):
    rows = []
    for name in ("arithmetic", "reverse"):
        rows += answered_rows(build_task(name, num_train=10, num_eval=0, seed=1).train_problems)
    rows.append({"messages": [SYSTEM, *rows[0]["messages"]]})
    # Content as text parts (joined), and a multi-turn episode with a tool's answer.
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "3 + 4?\n"}]
    rows.append({"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "7"}]})
    tool_turns = [
        {"role": "user", "content": "Add 2 and 5 with the calculator."},
        {"role": "assistant", "content": "<call>2+5</call>"},
        {"role": "tool", "content": "7"},
        {"role": "assistant", "content": "7"},
    ]
    rows.append({"messages": tool_turns})
    for row in rows:
        tokens, _ = tokenize_row(row, BYTES)
        assert hf_ids(hf_tokenizer.apply_chat_template(row["messages"], tokenize=True)) == tokens, row


def test_chat_template_refuses_what_we_refuse(hf_tokenizer):
    for messages in (
        [{"role": "robot", "content": "hi"}],
        [{"role": "user", "content": [{"type": "image", "image": "cat.png"}]}],
    ):
        with pytest.raises(ValueError):
            tokenize_prompt(messages, BYTES)
        with pytest.raises(Exception, match="unsupported chat role|only text content parts"):
            hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


# ---------------------------------------------------------------- token ids


def expected_ids(tokenizer, stop_tokens: list[str]) -> dict:
    stop = [tokenizer.token_to_id(token) for token in stop_tokens]
    eos = stop[0] if len(stop) == 1 else stop or None
    return {"eos_token_id": eos, "pad_token_id": tokenizer.eos_id, "bos_token_id": tokenizer.eos_id}


def token_ids_of(config: dict) -> dict:
    return {key: config[key] for key in ("eos_token_id", "pad_token_id", "bos_token_id")}


def test_byte_tokenizer_export_holds_the_stop_token_ids(export_dir):
    for name in ("config.json", "generation_config.json"):
        assert token_ids_of(read_json(export_dir, name)) == expected_ids(BYTES, STOP_TOKENS), name
    assert expected_ids(BYTES, STOP_TOKENS)["eos_token_id"] == [BYTES.im_end_id, BYTES.eos_id]
    generation_config = AutoModelForCausalLM.from_pretrained(export_dir).generation_config
    assert generation_config.eos_token_id == [BYTES.im_end_id, BYTES.eos_id]
    assert generation_config.pad_token_id == BYTES.eos_id


@pytest.mark.parametrize("stop_tokens", [STOP_TOKENS, ["<|im_end|>"], []], ids=["default", "one", "none"])
def test_copied_tokenizer_export_holds_its_stop_token_ids(tmp_path, stop_tokens):
    source = make_hf_tokenizer_dir(tmp_path / "tokenizer", QWEN_SPECIAL_TOKENS)
    theirs = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "eos_token_id": 12345}
    (source / "generation_config.json").write_text(json.dumps(theirs))
    tokenizer = build_tokenizer(str(source))
    assert tokenizer.im_end_id != BYTES.im_end_id  # ids of this tokenizer, not the byte tokenizer's
    out = str(tmp_path / "export")
    save_hf_checkpoint(debug_model(), out, torch.float32, ExportTokenizer.for_run(tokenizer, str(source), stop_tokens))

    assert (source / "tokenizer.json").read_bytes() == open(os.path.join(out, "tokenizer.json"), "rb").read()
    assert token_ids_of(read_json(out, "config.json")) == expected_ids(tokenizer, stop_tokens)
    generation_config = read_json(out, "generation_config.json")
    assert generation_config == {**theirs, **expected_ids(tokenizer, stop_tokens)}
    loaded = AutoModelForCausalLM.from_pretrained(out).generation_config
    assert (loaded.eos_token_id, loaded.temperature) == (expected_ids(tokenizer, stop_tokens)["eos_token_id"], 0.7)


def test_a_stop_token_the_tokenizer_lacks_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"generation.stop_tokens: '</s>' is not a special token"):
        ExportTokenizer.for_run(BYTES, "", ["<|im_end|>", "</s>"])


def test_a_tokenizer_that_is_not_the_one_of_hf_assets_path_is_a_value_error(tmp_path):
    # An error, not an assert: it must also stop a run under ``python -O``.
    with pytest.raises(ValueError, match=r"model.hf_assets_path = 'assets/qwen', but the run's tokenizer is a ByteTo"):
        ExportTokenizer.for_run(BYTES, "assets/qwen", STOP_TOKENS)
    hf_tokenizer = build_tokenizer(str(make_hf_tokenizer_dir(tmp_path)))
    with pytest.raises(ValueError, match=r"no model.hf_assets_path, but the run's tokenizer is a HFTokenizer"):
        ExportTokenizer.for_run(hf_tokenizer, "", STOP_TOKENS)


def test_a_tokenizers_library_with_another_byte_alphabet_is_a_runtime_error(monkeypatch):
    monkeypatch.setattr(tokenizers.pre_tokenizers.ByteLevel, "alphabet", staticmethod(lambda: ["a", "b"]))
    with pytest.raises(RuntimeError, match="the ByteLevel alphabet is not the 256 byte symbols"):
        byte_tokenizer_json()


def test_an_sft_run_exports_a_complete_hf_model(tmp_path):
    """Through the recipe: build_checkpointer hands the run's tokenizer to the export."""
    args = ["--job.config_file", str(CONFIGS / "debug_model.toml"), "--job.dump_folder", str(tmp_path)]
    args += ["--training.steps", "1", "--training.global_batch_size", "4", "--training.seq_len", "64"]
    args += ["--metrics.enable_tensorboard", "false", "--checkpoint.enable", "true"]
    args += ["--checkpoint.last_save_model_only", "true", "--checkpoint.last_save_in_hf", "true"]
    recipe = SFTRecipe(ConfigManager().parse_args(args))
    recipe.setup()
    recipe.train()
    recipe.close()
    out = str(tmp_path / "checkpoint" / "step-1")
    assert token_ids_of(read_json(out, "config.json")) == expected_ids(BYTES, STOP_TOKENS)
    assert token_ids_of(read_json(out, "generation_config.json")) == expected_ids(BYTES, STOP_TOKENS)
    messages = [SYSTEM, {"role": "user", "content": "What is 12 + 30?"}]
    ids = AutoTokenizer.from_pretrained(out).apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert hf_ids(ids) == tokenize_prompt(messages, BYTES)


# ---------------------------------------------------------------- generation


def stopping_model():
    """The debug model, made to stop on some prompts only: its seeded init plus noise (so each
    step of greedy decoding has a clear winner), with the <|im_end|> row of the output head
    scaled up so that it wins at some steps. Some prompts then stop after a few tokens and
    others run to MAX_NEW_TOKENS, which the generation test asserts."""
    model = debug_model()
    noise = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=noise) * 0.06)
        model.output.weight[BYTES.im_end_id] *= 2.0
    return model


MAX_NEW_TOKENS = 8


def test_transformers_generates_what_our_generator_generates(export_dir, hf_tokenizer):
    """Greedy, as evaluation asks our generator (temperature 0), against ``generate`` with only
    the export: its tokenizer's chat template and its generation_config's stop tokens."""
    prompts = [messages for index, messages in enumerate(task_prompts()) if index % 5 == 0]
    tokens = [tokenize_prompt(messages, BYTES) for messages in prompts]
    generator = TorchGenerator(debug_args(), CPU)
    generator.update_weights(stopping_model())
    stop_ids = tuple(BYTES.token_to_id(token) for token in STOP_TOKENS)
    greedy = SamplingParams(MAX_NEW_TOKENS, temperature=0.0, stop_token_ids=stop_ids)
    ours = generator.generate(tokens, list(range(len(tokens))), 1, greedy, seed=0, step=0)

    model = AutoModelForCausalLM.from_pretrained(export_dir).eval()
    for messages, rollout in zip(prompts, ours):
        ids = torch.tensor([hf_ids(hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True))])
        assert ids[0].tolist() == rollout.prompt_tokens
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW_TOKENS
            )
        assert out[0, ids.shape[1] :].tolist() == rollout.completion_tokens, messages
    # Both endings happen: stopped on <|im_end|> after some tokens, and cut at the maximum.
    stopped = [r.completion_tokens for r in ours if r.stop_reason == "stop"]
    assert any(1 < len(tokens) < MAX_NEW_TOKENS and tokens[-1] == BYTES.im_end_id for tokens in stopped)
    assert any(r.stop_reason == "length" and len(r.completion_tokens) == MAX_NEW_TOKENS for r in ours)
