"""Turn one dataset row into tokens plus a mask of the tokens the model should learn to emit.

Chat rows use Qwen's ChatML template ``<|im_start|>{role}\\n{content}<|im_end|>\\n``. Each
message is tokenized on its own (header, content, footer) so the assistant-only loss mask
falls exactly on token boundaries, whatever the tokenizer would merge across them.
``tokenize_prompt`` gives the prefix an RL rollout generates from, built from the same pieces.
"""

from collections.abc import Sequence
from typing import Any

from torchtitan_rl.data.tokenizer import IM_END_TOKEN, IM_START_TOKEN, Tokenizer

CHAT_ROLES = ("system", "user", "assistant")
TRAINED_ROLE = "assistant"

ACCEPTED_FORMATS = (
    "{'messages': [{'role': 'system'|'user'|'assistant', 'content': str}, ...]}, "
    "{'prompt': str, 'completion': str}, or {'text': str}"
)


def _messages_problem(messages: Any) -> str | None:
    """What is wrong with a ``messages`` value, or None when it is a valid conversation."""
    if not isinstance(messages, list) or not messages:
        return f"'messages' must be a non-empty list of {{role, content}} dicts, got {messages!r}"
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            return f"every message must be a dict with a string 'content', got {message!r}"
        if message.get("role") not in CHAT_ROLES:
            return f"unsupported chat role {message.get('role')!r}; expected one of {CHAT_ROLES}"
    return None


def prompt_messages_problem(messages: Any) -> str | None:
    """What is wrong with ``messages`` as a generation prompt, or None: a valid conversation without assistant turn."""
    # Tasks keep prompts as immutable tuples; JSON rows bring lists.
    problem = _messages_problem(list(messages) if isinstance(messages, tuple) else messages)
    if problem is None and any(m["role"] == TRAINED_ROLE for m in messages):
        problem = f"a prompt must not contain an {TRAINED_ROLE!r} turn (the model generates it), got {messages!r}"
    return problem


def render_chat(messages: list[dict[str, str]]) -> str:
    """The ChatML text of ``messages``; ``tokenize_row`` produces exactly its tokens."""
    problem = _messages_problem(messages)
    if problem is not None:
        raise ValueError(problem)
    return "".join(f"{IM_START_TOKEN}{m['role']}\n{m['content']}{IM_END_TOKEN}\n" for m in messages)


def _header(role: str, tokenizer: Tokenizer) -> list[int]:
    return [tokenizer.im_start_id] + tokenizer.encode(role + "\n")


def _tokenize_messages(messages: Sequence[dict[str, str]], tokenizer: Tokenizer) -> tuple[list[int], list[bool]]:
    tokens: list[int] = []
    target_mask: list[bool] = []
    for message in messages:
        is_target = message["role"] == TRAINED_ROLE
        header = _header(message["role"], tokenizer)
        # The model must learn to emit <|im_end|> to stop; the newline after it is template glue.
        content = tokenizer.encode(message["content"]) + [tokenizer.im_end_id]
        footer = tokenizer.encode("\n")
        tokens += header + content + footer
        target_mask += [False] * len(header) + [is_target] * len(content) + [False] * len(footer)
    return tokens, target_mask


def tokenize_row(row: dict[str, Any], tokenizer: Tokenizer) -> tuple[list[int], list[bool]]:
    """``(tokens, target_mask)`` of one row; ``target_mask[j]`` marks tokens the loss should cover.

    Accepted rows: chat ``messages`` (loss on assistant content and its ``<|im_end|>``),
    ``prompt``/``completion`` plain text (loss on the completion and the final EOS), or
    ``text`` (loss on every token, EOS included).
    """
    # Columns a row does not use are None when datasets merges files with different columns.
    if row.get("messages") is not None:
        problem = _messages_problem(row["messages"])
        if problem is None:
            return _tokenize_messages(row["messages"], tokenizer)
    elif row.get("prompt") is not None or row.get("completion") is not None:
        if isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
            prompt = tokenizer.encode(row["prompt"])
            completion = tokenizer.encode(row["completion"]) + [tokenizer.eos_id]
            return prompt + completion, [False] * len(prompt) + [True] * len(completion)
        problem = "'prompt' and 'completion' must both be strings"
    elif row.get("text") is not None:
        if isinstance(row["text"], str):
            tokens = tokenizer.encode(row["text"]) + [tokenizer.eos_id]
            return tokens, [True] * len(tokens)
        problem = f"'text' must be a string, got {type(row['text']).__name__}"
    else:
        problem = "it matches no supported format"
    raise ValueError(f"dataset row with keys {sorted(row)} is invalid: {problem}; expected {ACCEPTED_FORMATS}")


def tokenize_prompt(messages: Sequence[dict[str, str]], tokenizer: Tokenizer) -> list[int]:
    """The tokens a model generates an assistant turn from: ``messages`` then the assistant header.

    They are exactly the tokens ``tokenize_row`` puts before the assistant content of
    ``messages + [assistant turn]``, so SFT on a task's rows and RL on its prompts see the same
    prefix; the model then emits the content and ``<|im_end|>``.
    """
    problem = prompt_messages_problem(messages)
    if problem is not None:
        raise ValueError(f"invalid generation prompt: {problem}")
    tokens, _ = _tokenize_messages(messages, tokenizer)
    return tokens + _header(TRAINED_ROLE, tokenizer)
