"""Tokenizers: a built-in byte-level one for tests and tiny runs, and a wrapper for HF ``tokenizer.json``.

Both expose the same small interface (``encode``, ``decode``, ``vocab_size``, ``eos_id``,
``im_start_id``, ``im_end_id``, ``token_to_id``) so the chat template and the loader never care
which one they got. Image placeholder ids are looked up by string (``image_token_ids``) only
when a run has images, so a text model's tokenizer needs none of them.
"""

import os
from dataclasses import dataclass
from typing import Protocol

import tokenizers

EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# Pixtral / Mistral3 image placeholders (the strings Mistral's tokenizers use): the defaults.
IMAGE_TOKEN = "[IMG]"
IMAGE_BREAK_TOKEN = "[IMG_BREAK]"
IMAGE_END_TOKEN = "[IMG_END]"
# What a stock Qwen2.5 / Qwen3 tokenizer.json offers in their place (``image_token_strings``): the
# specials Qwen2-VL reserved for images. Qwen2-VL itself has no row break; its unused
# <|vision_pad|> takes that role.
QWEN_IMAGE_TOKENS = ("<|image_pad|>", "<|vision_pad|>", "<|vision_end|>")


class Tokenizer(Protocol):
    """What the chat template and the loader need from a tokenizer."""

    vocab_size: int
    eos_id: int
    im_start_id: int
    im_end_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_to_id(self, token: str) -> int | None:
        """The id of a special token given as its string (e.g. a stop token), or None."""
        ...


class ByteTokenizer:
    """ids 0..255 are UTF-8 bytes, then the special tokens ``SPECIAL_TOKENS`` in order; needs no files.

    The ChatML specials keep ids 256..258 (models trained before the image tokens existed keep
    working); the image placeholders follow at 259..261.
    """

    NUM_BYTES = 256
    SPECIAL_TOKENS = (EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, IMAGE_TOKEN, IMAGE_BREAK_TOKEN, IMAGE_END_TOKEN)

    def __init__(self):
        self._special_strings = {self.NUM_BYTES + i: token for i, token in enumerate(self.SPECIAL_TOKENS)}
        self._special_ids = {token: token_id for token_id, token in self._special_strings.items()}
        self.eos_id = self._special_ids[EOS_TOKEN]
        self.im_start_id = self._special_ids[IM_START_TOKEN]
        self.im_end_id = self._special_ids[IM_END_TOKEN]
        self.vocab_size = self.NUM_BYTES + len(self.SPECIAL_TOKENS)

    def encode(self, text: str) -> list[int]:
        # Special-token strings inside text stay plain bytes: only the chat template emits specials.
        return list(text.encode("utf-8"))

    def token_to_id(self, token: str) -> int | None:
        return self._special_ids.get(token)

    def decode(self, ids: list[int]) -> str:
        pieces: list[str] = []
        pending_bytes = bytearray()
        for token_id in ids:
            if 0 <= token_id < self.NUM_BYTES:
                pending_bytes.append(token_id)
                continue
            if token_id not in self._special_strings:
                raise ValueError(f"token id {token_id} is outside the byte tokenizer's vocabulary of {self.vocab_size}")
            # Decode bytes in runs so multi-byte characters split across ids are rebuilt.
            pieces.append(pending_bytes.decode("utf-8", errors="replace"))
            pending_bytes.clear()
            pieces.append(self._special_strings[token_id])
        pieces.append(pending_bytes.decode("utf-8", errors="replace"))
        return "".join(pieces)


class HFTokenizer:
    """A HuggingFace ``tokenizers`` model loaded from ``<assets_dir>/tokenizer.json``."""

    def __init__(self, assets_dir: str):
        path = os.path.join(assets_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(f"no tokenizer.json in {assets_dir!r}: expected a HuggingFace tokenizer file at {path!r}")
        self._tokenizer = tokenizers.Tokenizer.from_file(path)
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._special_id(EOS_TOKEN, path)
        self.im_start_id = self._special_id(IM_START_TOKEN, path)
        self.im_end_id = self._special_id(IM_END_TOKEN, path)

    def _special_id(self, token: str, path: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{path!r} has no special token {token!r}, which the ChatML template needs")
        return token_id

    def encode(self, text: str) -> list[int]:
        # BOS/EOS are placed explicitly by the chat template, never by the tokenizer's post-processor.
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        """Token string -> id (``tokenizers.Tokenizer.get_vocab``)."""
        return self._tokenizer.get_vocab(with_added_tokens=with_added_tokens)


def build_tokenizer(hf_assets_path: str) -> Tokenizer:
    if hf_assets_path == "":
        return ByteTokenizer()
    if os.path.isfile(os.path.join(hf_assets_path, "tokenizer.json")):
        return HFTokenizer(hf_assets_path)
    raise ValueError(
        f"model.hf_assets_path={hf_assets_path!r} is not a directory containing tokenizer.json; "
        "set it to such a directory, or to an empty string for the built-in byte tokenizer"
    )


def stop_token_ids(tokenizer: Tokenizer, stop_tokens: list[str] | tuple[str, ...]) -> tuple[int, ...]:
    """The ids of ``generation.stop_tokens``; one that is no special token of ``tokenizer`` is a
    ValueError naming that key."""
    ids = []
    for token in stop_tokens:
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"generation.stop_tokens: {token!r} is not a special token of the tokenizer")
        ids.append(token_id)
    return tuple(ids)


@dataclass(frozen=True)
class ImageTokenIds:
    """The ids of one image's placeholder tokens (see ``data.images.placeholder_tokens``)."""

    image: int
    image_break: int
    image_end: int


def image_token_strings(
    tokenizer: Tokenizer,
    image_token: str = IMAGE_TOKEN,
    image_break_token: str = IMAGE_BREAK_TOKEN,
    image_end_token: str = IMAGE_END_TOKEN,
) -> tuple[str, str, str]:
    """The image, row-break and end placeholder strings a run uses with ``tokenizer``.

    The given strings, except in one case: when they are the defaults (``[IMG]``,
    ``[IMG_BREAK]``, ``[IMG_END]``), the tokenizer has none of them and it has all of Qwen's
    ``QWEN_IMAGE_TOKENS``, those are used (``<|image_pad|>`` per image feature,
    ``<|vision_pad|>`` ending each row, ``<|vision_end|>`` ending the image), so a stock Qwen
    tokenizer.json works as it is. Strings set to anything else are used as given.
    """
    strings = (image_token, image_break_token, image_end_token)
    if (
        strings == (IMAGE_TOKEN, IMAGE_BREAK_TOKEN, IMAGE_END_TOKEN)
        and all(tokenizer.token_to_id(token) is None for token in strings)
        and all(tokenizer.token_to_id(token) is not None for token in QWEN_IMAGE_TOKENS)
    ):
        return QWEN_IMAGE_TOKENS
    return strings


def image_token_ids(
    tokenizer: Tokenizer,
    image_token: str = IMAGE_TOKEN,
    image_break_token: str = IMAGE_BREAK_TOKEN,
    image_end_token: str = IMAGE_END_TOKEN,
) -> ImageTokenIds:
    """The ids of the placeholder strings ``image_token_strings`` picks; a string the tokenizer
    lacks is a ValueError.

    Call it only when images are used: text models' tokenizers usually have none of them.
    """
    keys = ("image_token", "image_break_token", "image_end_token")
    strings = dict(zip(keys, image_token_strings(tokenizer, image_token, image_break_token, image_end_token)))
    ids = {key: tokenizer.token_to_id(token) for key, token in strings.items()}
    missing = [f"{key}={strings[key]!r}" for key, token_id in ids.items() if token_id is None]
    if missing:
        raise ValueError(
            f"the tokenizer has no token for {', '.join(missing)}: image placeholders must be single special "
            "tokens of the tokenizer (add them to its tokenizer.json, or set model.image_token / image_break_token "
            f"/ image_end_token; with the defaults, a tokenizer with Qwen's {', '.join(QWEN_IMAGE_TOKENS)} uses those)"
        )
    if len(set(ids.values())) != 3:
        raise ValueError(f"the image placeholder tokens {strings} must be three different tokens, got ids {ids}")
    return ImageTokenIds(ids["image_token"], ids["image_break_token"], ids["image_end_token"])
