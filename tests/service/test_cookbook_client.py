"""The tinker-cookbook's client side of the service tests, without a service: its renderer for
the served model name tokenizes with exactly the server model's ids, and its environment
reuses the main environment's torch instead of a second copy."""

import json
import os
import subprocess

import pytest

from cookbook_client import client_python, render_conversation
from torchtitan_rl.data.chat import tokenize_prompt, tokenize_row
from torchtitan_rl.data.tokenizer import ByteTokenizer

# Qwen3's renderer gives the last assistant turn an empty thinking block when it has none.
EMPTY_THINKING = "<think>\n\n</think>\n\n"


def test_cookbook_renderer_uses_the_server_models_token_ids(tmp_path):
    question, answer = "What is 7 * 8? Ünïcode too.", "56"
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    rendered = render_conversation(messages, tmp_path)
    tokenizer = ByteTokenizer()

    assert rendered["renderer"] == "qwen3"
    assert rendered["generation_prompt"] == tokenize_prompt(messages[:1], tokenizer)
    assert rendered["stop_sequences"] == [tokenizer.im_end_id]

    # Our template tokenizes the same conversation, then a newline after <|im_end|> that the
    # renderer's supervised sequence leaves out; a datum is the sequence shifted by one.
    expected_row = {"messages": [messages[0], {"role": "assistant", "content": EMPTY_THINKING + answer}]}
    tokens, trained = tokenize_row(expected_row, tokenizer)
    assert tokens[-2:] == [tokenizer.im_end_id, *tokenizer.encode("\n")]
    tokens, trained = tokens[:-1], trained[:-1]
    assert rendered["model_input"] == tokens[:-1]
    assert rendered["target_tokens"] == tokens[1:]
    num_trained = sum(trained[1:])
    assert rendered["weights"] == pytest.approx([1 / num_trained if t else 0.0 for t in trained[1:]], rel=1e-6)

    # The trained tokens end with the stop token, once: the parse stops there.
    assert rendered["parsed_message"]["role"] == "assistant"
    assert rendered["parsed_text"] == answer
    assert rendered["parse_termination"] == "stop_sequence"


def test_client_environment_links_the_main_torch():
    import torch

    script = "import json, torch, transformers; print(json.dumps([torch.__file__, transformers.__version__]))"
    env = {key: value for key, value in os.environ.items() if key != "VIRTUAL_ENV"}
    result = subprocess.run([client_python(), "-c", script], capture_output=True, text=True, env=env, check=True)
    torch_file, transformers_version = json.loads(result.stdout)
    assert os.path.realpath(torch_file) == os.path.realpath(torch.__file__)
    assert transformers_version == "5.5.4"  # the cookbook's cap, not the main environment's
