"""Tokenizers: a built-in byte-level one for tests and tiny runs, and a wrapper for HF ``tokenizer.json``.

Both expose the same small interface (``encode``, ``decode``, ``vocab_size``, ``eos_id``,
``im_start_id``, ``im_end_id``) so the chat template and the loader never care which one they got.
"""

import os
from typing import Protocol

import tokenizers

EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"


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
    """ids 0..255 are UTF-8 bytes, followed by the three special tokens; needs no files."""

    NUM_BYTES = 256

    def __init__(self):
        self.eos_id = self.NUM_BYTES
        self.im_start_id = self.NUM_BYTES + 1
        self.im_end_id = self.NUM_BYTES + 2
        self.vocab_size = self.NUM_BYTES + 3
        self._special_strings = {
            self.eos_id: EOS_TOKEN,
            self.im_start_id: IM_START_TOKEN,
            self.im_end_id: IM_END_TOKEN,
        }

    def encode(self, text: str) -> list[int]:
        # Special-token strings inside text stay plain bytes: only the chat template emits specials.
        return list(text.encode("utf-8"))

    def token_to_id(self, token: str) -> int | None:
        return next((i for i, s in self._special_strings.items() if s == token), None)

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


def build_tokenizer(hf_assets_path: str) -> Tokenizer:
    if hf_assets_path == "":
        return ByteTokenizer()
    if os.path.isfile(os.path.join(hf_assets_path, "tokenizer.json")):
        return HFTokenizer(hf_assets_path)
    raise ValueError(
        f"model.hf_assets_path={hf_assets_path!r} is not a directory containing tokenizer.json; "
        "set it to such a directory, or to an empty string for the built-in byte tokenizer"
    )
