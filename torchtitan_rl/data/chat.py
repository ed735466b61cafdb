"""Turn one dataset row into tokens plus a mask of the tokens the model should learn to emit.

Chat rows use Qwen's ChatML template ``<|im_start|>{role}\\n{content}<|im_end|>\\n``. Each
message is tokenized on its own (header, content, footer) so the assistant-only loss mask
falls exactly on token boundaries, whatever the tokenizer would merge across them.
``tokenize_prompt`` (``tokenize_prompt_row`` for prompts with images) gives the prefix an RL
rollout generates from, built from the same pieces.

Rows may carry images (``tokenize_row_with_images``), either as content parts
``{"type": "image", "image": ...}`` of a message, or as ``<image>`` markers in the text with a
top-level ``"images"`` list (the k-th marker is ``images[k]``). Tokenizing a row does not touch
its images: it returns where each image goes, and the loader inserts the image's placeholder
tokens (whose number depends on the image's size) with ``insert_placeholders``.
"""

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torchtitan_rl.data.images import is_url
from torchtitan_rl.data.tokenizer import IM_END_TOKEN, IM_START_TOKEN, Tokenizer

CHAT_ROLES = ("system", "user", "assistant", "tool")  # tool: a tool's output in a multi-turn episode
TRAINED_ROLE = "assistant"
CONTENT_PART_TYPES = ("text", "image")
IMAGE_MARKER = "<image>"
"""Stands for the next image of a row's top-level ``images`` list in its text."""

ACCEPTED_FORMATS = (
    "{'messages': [{'role': 'system'|'user'|'assistant'|'tool', 'content': str or a list of "
    "{'type': 'text', 'text': str} / {'type': 'image', 'image': path|bytes|PIL image} parts}, ...]}, "
    "{'prompt': str, 'completion': str}, or {'text': str}; text may hold '<image>' markers for the "
    "entries of a top-level 'images' list"
)


@dataclass
class ImageRef:
    """An image of a tokenized row: its source and where its placeholder tokens go."""

    source: Any  # path (resolved against the row's file), encoded bytes, PIL image, {"bytes", "path"} dict
    position: int  # index into TokenizedRow.tokens before which the placeholders are inserted
    where: str  # names the image in errors, e.g. "image 1 (message 0 part 2)"


@dataclass
class TokenizedRow:
    """A row's text tokens and loss targets, and its images in order (empty for text rows)."""

    tokens: list[int]
    target_mask: list[bool]
    images: list[ImageRef] = field(default_factory=list)


def _part_problem(part: Any) -> str | None:
    """What is wrong with one element of a message's content list, or None."""
    if not isinstance(part, dict) or part.get("type") not in CONTENT_PART_TYPES:
        return f"every content part must be a dict with 'type' in {CONTENT_PART_TYPES}, got {part!r}"
    if part["type"] == "text" and not isinstance(part.get("text"), str):
        return f"a text part needs a string 'text', got {part!r}"
    if part["type"] == "image" and image_of_part(part) is None:
        return f"an image part needs an 'image' (path, bytes or PIL image) or 'path', got keys {sorted(part)}"
    return None


def image_of_part(part: dict) -> Any:
    """The image of a valid image part: its 'image', else its 'path'."""
    return part["image"] if part.get("image") is not None else part.get("path")


def _messages_problem(messages: Any, allow_parts: bool = False) -> str | None:
    """What is wrong with a ``messages`` value, or None when it is a valid conversation.

    ``allow_parts``: a content may also be a list of text/image parts (training rows and
    generation prompts; the text-only paths — rendering, observations — keep plain strings).
    """
    if not isinstance(messages, list) or not messages:
        return f"'messages' must be a non-empty list of {{role, content}} dicts, got {messages!r}"
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and allow_parts:
            problem = next((p for p in map(_part_problem, content) if p is not None), None)
            if problem is not None:
                return f"message {index}: {problem}"
        elif not isinstance(content, str):
            expected = "a string 'content' or a list of content parts" if allow_parts else "a string 'content'"
            return f"every message must be a dict with {expected}, got {message!r}"
        if message.get("role") not in CHAT_ROLES:
            return f"unsupported chat role {message.get('role')!r}; expected one of {CHAT_ROLES}"
    return None


def prompt_messages_problem(messages: Any) -> str | None:
    """What is wrong with ``messages`` as a generation prompt, or None: a valid conversation
    without assistant turn, whose contents are strings or lists of text/image parts."""
    # Tasks keep prompts as immutable tuples; JSON rows bring lists.
    problem = _messages_problem(list(messages) if isinstance(messages, tuple) else messages, allow_parts=True)
    if problem is None and any(m["role"] == TRAINED_ROLE for m in messages):
        problem = f"a prompt must not contain an {TRAINED_ROLE!r} turn (the model generates it), got {messages!r}"
    return problem


def conversation_problem(messages: Any) -> str | None:
    """What is wrong with ``messages`` as a training conversation (any roles; contents strings
    or lists of text/image parts), or None."""
    return _messages_problem(messages, allow_parts=True)


def render_chat(messages: list[dict[str, str]]) -> str:
    """The ChatML text of ``messages``; ``tokenize_row`` produces exactly its tokens."""
    problem = _messages_problem(messages)
    if problem is not None:
        raise ValueError(problem)
    return "".join(f"{IM_START_TOKEN}{m['role']}\n{m['content']}{IM_END_TOKEN}\n" for m in messages)


def _header(role: str, tokenizer: Tokenizer) -> list[int]:
    return [tokenizer.im_start_id] + tokenizer.encode(role + "\n")


def resolve_image(source: Any, base_dir: str | None) -> Any:
    """Relative image paths are relative to the row's file (``base_dir``), else to the working directory.

    A URL stays as it is, so that opening it names it as a URL (``images.is_url``).
    """
    if base_dir is None:
        return source
    if isinstance(source, str) and is_url(source):
        return source
    if isinstance(source, (str, os.PathLike)) and not os.path.isabs(source):
        return os.path.join(base_dir, source)
    if isinstance(source, dict) and source.get("bytes") is None and isinstance(source.get("path"), str):
        return {**source, "path": resolve_image(source["path"], base_dir)}
    return source


class _RowBuilder:
    """Accumulates a row's tokens, loss targets and image positions."""

    def __init__(self, tokenizer: Tokenizer, base_dir: str | None, marker_images: Sequence[Any] | None):
        self.tokenizer = tokenizer
        self.base_dir = base_dir
        # The top-level 'images' of the '<image>' form, consumed in order; None: '<image>' is plain text.
        self.marker_images = marker_images
        self.num_markers = 0
        self.tokens: list[int] = []
        self.target_mask: list[bool] = []
        self.images: list[ImageRef] = []

    def add(self, ids: list[int], trained: bool) -> None:
        self.tokens += ids
        self.target_mask += [trained] * len(ids)

    def add_text(self, text: str, trained: bool, where: str, images_allowed: bool | None = None) -> None:
        """``images_allowed`` defaults to ``not trained``: no images in what the model learns to emit."""
        if self.marker_images is None or IMAGE_MARKER not in text:
            self.add(self.tokenizer.encode(text), trained)
            return
        pieces = text.split(IMAGE_MARKER)
        for index, piece in enumerate(pieces):
            if index > 0:
                k = self.num_markers
                self.num_markers += 1
                # Past the end of 'images': counted, and reported with both counts in finish().
                if k < len(self.marker_images):
                    allowed = not trained if images_allowed is None else images_allowed
                    self.add_image(self.marker_images[k], f"{where}, images[{k}]", allowed)
            if piece:
                self.add(self.tokenizer.encode(piece), trained)

    def add_image(self, source: Any, where: str, allowed: bool) -> None:
        if not allowed:
            raise ValueError(
                f"{where}: an image in text the model learns to emit (assistant turn or completion) is not "
                "supported; put images in user/system turns, prompts or 'text' rows"
            )
        where = f"image {len(self.images)} ({where})"
        self.images.append(ImageRef(resolve_image(source, self.base_dir), len(self.tokens), where))

    def finish(self) -> TokenizedRow:
        if self.marker_images is not None and self.num_markers != len(self.marker_images):
            raise ValueError(
                f"the row's text has {self.num_markers} {IMAGE_MARKER!r} markers but its 'images' list has "
                f"{len(self.marker_images)} images; each marker stands for the next image of the list"
            )
        return TokenizedRow(self.tokens, self.target_mask, self.images)


def _add_messages(builder: _RowBuilder, messages: Sequence[dict[str, Any]]) -> None:
    tokenizer = builder.tokenizer
    for index, message in enumerate(messages):
        is_target = message["role"] == TRAINED_ROLE
        builder.add(_header(message["role"], tokenizer), False)
        content = message["content"]
        if isinstance(content, str):
            builder.add_text(content, is_target, f"message {index}")
        else:
            for part_index, part in enumerate(content):
                where = f"message {index} part {part_index}"
                if part["type"] == "text":
                    builder.add_text(part["text"], is_target, where)
                else:
                    builder.add_image(image_of_part(part), where, allowed=not is_target)
        # The model must learn to emit <|im_end|> to stop; the newline after it is template glue.
        builder.add([tokenizer.im_end_id], is_target)
        builder.add(tokenizer.encode("\n"), False)


def _marker_images(row: dict[str, Any]) -> Sequence[Any] | None:
    images = row.get("images")
    if images is None:
        return None
    if not isinstance(images, (list, tuple)):
        raise ValueError(
            f"'images' must be a list of images (one per {IMAGE_MARKER!r} marker), got {type(images).__name__}"
        )
    return images


def tokenize_row_with_images(row: dict[str, Any], tokenizer: Tokenizer, base_dir: str | None = None) -> TokenizedRow:
    """The row's text tokens, loss targets, and images with the token index each one goes before.

    Accepted rows: chat ``messages`` (loss on assistant content and its ``<|im_end|>``),
    ``prompt``/``completion`` plain text (loss on the completion and the final EOS), or
    ``text`` (loss on every token, EOS included). Images may appear in user/system turns,
    prompts and ``text`` rows, never in what the model learns to emit; their placeholders are
    never loss tokens. A relative image path is relative to ``base_dir`` (the directory of the
    row's file) when given, else to the working directory.
    """
    marker_images = _marker_images(row)
    builder = _RowBuilder(tokenizer, base_dir, marker_images)
    # Columns a row does not use are None when datasets merges files with different columns.
    if row.get("messages") is not None:
        problem = _messages_problem(row["messages"], allow_parts=True)
        if problem is None:
            if marker_images is not None and any(not isinstance(m["content"], str) for m in row["messages"]):
                raise ValueError("the row has both a top-level 'images' list and content parts; give images one way")
            _add_messages(builder, row["messages"])
            return builder.finish()
    elif row.get("prompt") is not None or row.get("completion") is not None:
        if isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
            builder.add_text(row["prompt"], False, "prompt")
            builder.add_text(row["completion"], True, "completion")
            builder.add([tokenizer.eos_id], True)
            return builder.finish()
        problem = "'prompt' and 'completion' must both be strings"
    elif row.get("text") is not None:
        if isinstance(row["text"], str):
            # Every text token is trained; image placeholders never are (insert_placeholders).
            builder.add_text(row["text"], True, "text", images_allowed=True)
            builder.add([tokenizer.eos_id], True)
            return builder.finish()
        problem = f"'text' must be a string, got {type(row['text']).__name__}"
    else:
        problem = "it matches no supported format"
    if row.get("chosen") is not None or row.get("rejected") is not None:
        problem += " (its 'chosen' / 'rejected' make it a preference pair, data for job.recipe = \"dpo\")"
    raise ValueError(f"dataset row with keys {sorted(row)} is invalid: {problem}; expected {ACCEPTED_FORMATS}")


def tokenize_row(row: dict[str, Any], tokenizer: Tokenizer) -> tuple[list[int], list[bool]]:
    """``(tokens, target_mask)`` of a text row (see ``tokenize_row_with_images`` for the formats);
    ``target_mask[j]`` marks the tokens the loss should cover. A row with images is a ValueError."""
    tokenized = tokenize_row_with_images(row, tokenizer)
    if tokenized.images:
        raise ValueError(f"the row has {len(tokenized.images)} image(s); tokenize it with tokenize_row_with_images")
    return tokenized.tokens, tokenized.target_mask


def insert_placeholders(row: TokenizedRow, placeholders: list[list[int]]) -> tuple[list[int], list[bool], list[int]]:
    """``(tokens, target_mask, starts)``: the row with ``placeholders[k]`` inserted for image k.

    ``starts[k]`` is the index of image k's first placeholder token; placeholders are never
    loss targets.
    """
    if len(placeholders) != len(row.images):
        raise ValueError(f"{len(placeholders)} placeholder lists for {len(row.images)} images")
    tokens: list[int] = []
    target_mask: list[bool] = []
    starts: list[int] = []
    previous = 0
    for image, placeholder in zip(row.images, placeholders):
        tokens += row.tokens[previous : image.position]
        target_mask += row.target_mask[previous : image.position]
        starts.append(len(tokens))
        tokens += placeholder
        target_mask += [False] * len(placeholder)
        previous = image.position
    tokens += row.tokens[previous:]
    target_mask += row.target_mask[previous:]
    return tokens, target_mask, starts


def _tokenize_messages(messages: Sequence[dict[str, str]], tokenizer: Tokenizer) -> tuple[list[int], list[bool]]:
    builder = _RowBuilder(tokenizer, None, None)
    _add_messages(builder, messages)
    return builder.tokens, builder.target_mask


def tokenize_prompt_row(messages: Sequence[dict[str, Any]], tokenizer: Tokenizer) -> TokenizedRow:
    """What a model generates an assistant turn from: ``messages`` then the assistant header,
    with its images (content parts, never ``<image>`` markers) and where each one goes.

    The tokens and images are exactly those ``tokenize_row_with_images`` puts before the
    assistant content of ``messages + [assistant turn]``, so SFT on a task's rows and RL on its
    prompts see the same prefix; the model then emits the content and ``<|im_end|>``. Nothing
    is a loss target. Image paths are taken as given (a task resolves them when it reads them).
    """
    problem = prompt_messages_problem(messages)
    if problem is not None:
        raise ValueError(f"invalid generation prompt: {problem}")
    builder = _RowBuilder(tokenizer, None, None)
    _add_messages(builder, messages)
    builder.add(_header(TRAINED_ROLE, tokenizer), False)
    return builder.finish()


def tokenize_prompt(messages: Sequence[dict[str, Any]], tokenizer: Tokenizer) -> list[int]:
    """The tokens of ``tokenize_prompt_row`` for a prompt without images; images are a ValueError."""
    prompt = tokenize_prompt_row(messages, tokenizer)
    if prompt.images:
        raise ValueError(
            f"the generation prompt has {len(prompt.images)} image(s); tokenize it with tokenize_prompt_row, "
            "which also says where each image's placeholder tokens go"
        )
    return prompt.tokens


def tokenize_observation(messages: Sequence[dict[str, str]], tokenizer: Tokenizer) -> list[int]:
    """The tokens that follow an assistant turn's ``<|im_end|>`` in a multi-turn episode: the
    template's newline, ``messages`` (an environment's answer, e.g. a ``tool`` message) and the
    next assistant header. Prompt, sampled turns and these pieces together are exactly the
    tokens ``tokenize_row`` gives the whole conversation, so an SFT row of an episode and the
    RL episode see the same tokens."""
    problem = _messages_problem(list(messages))
    if problem is None and any(m["role"] == TRAINED_ROLE for m in messages):
        problem = "an observation cannot contain an assistant turn"
    if problem is not None:
        raise ValueError(f"invalid observation: {problem}")
    tokens, _ = _tokenize_messages(messages, tokenizer)
    return tokenizer.encode("\n") + tokens + _header(TRAINED_ROLE, tokenizer)
