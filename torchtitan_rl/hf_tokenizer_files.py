"""The tokenizer side of a Hugging Face export: the tokenizer files, and the special-token ids
that ``config.json`` and ``generation_config.json`` carry, so that transformers tokenizes,
renders chats and stops generating as the run did.

A run with an HF tokenizer (``model.hf_assets_path``) gets that tokenizer's files copied. A run
with the built-in ``ByteTokenizer`` gets equivalent files written: a ``tokenizer.json`` (a
byte-level BPE without merges, one vocabulary symbol per byte, the byte tokenizer's specials as
added special tokens with its ids) and a ``tokenizer_config.json`` whose ``chat_template``
renders ChatML as ``data.chat`` tokenizes it (``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per
message, content parts of type text joined, ``<|im_start|>assistant\\n`` as generation prompt).

Every string gets the same ids from both, and the same ids decode to the same string, with one
known difference: the text of a special token inside a string (e.g. a user typing
``<|im_end|>``). ``ByteTokenizer.encode`` keeps it as plain bytes (only the chat template emits
specials); the HF tokenizer matches it as the special token, as HF tokenizers do.

Both kinds of export get ``eos_token_id`` = the ids of ``generation.stop_tokens`` (an int for
one token, a list for several, null for none: generation then never stops early, as in the
run), ``pad_token_id`` and ``bos_token_id`` = the ``<|endoftext|>`` id (as Qwen's checkpoints
have them), in ``config.json`` and in ``generation_config.json`` (which keeps the other fields
of a copied tokenizer directory's own ``generation_config.json``).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from torchtitan_rl.data.chat import CHAT_ROLES, TRAINED_ROLE
from torchtitan_rl.data.tokenizer import (
    EOS_TOKEN,
    IM_END_TOKEN,
    IM_START_TOKEN,
    ByteTokenizer,
    Tokenizer,
    stop_token_ids,
)


@dataclass(frozen=True)
class ExportTokenizer:
    """What an HF export writes of the run's tokenizer."""

    source_dir: str | None
    """The HF tokenizer directory whose files the export copies; None: the built-in byte
    tokenizer, whose files the export writes."""
    stop_token_ids: tuple[int, ...]
    """The ids of ``generation.stop_tokens``: ``eos_token_id``."""
    endoftext_id: int
    """The ``<|endoftext|>`` id: ``pad_token_id`` and ``bos_token_id``."""

    @classmethod
    def for_run(cls, tokenizer: Tokenizer, hf_assets_path: str, stop_tokens: Sequence[str]) -> "ExportTokenizer":
        """The export of a run's ``tokenizer`` (built from ``model.hf_assets_path``) that stops at
        ``generation.stop_tokens``. A stop token that is no special token of the tokenizer is a
        ValueError naming that key, raised when the recipe builds its checkpointer, not at the
        last save. In a run it never reaches here: GRPO checks its stop tokens when it reads its
        prompts, and an SFT run cannot set them (config validation), so it stops at the default
        ``<|im_end|>`` and ``<|endoftext|>``, which every tokenizer has (``HFTokenizer``).
        ``tokenizer`` must be the one ``hf_assets_path`` builds (the byte tokenizer for ""): the
        export copies that directory's files, or writes the byte tokenizer's; ValueError else."""
        if (hf_assets_path == "") != isinstance(tokenizer, ByteTokenizer):
            source = f"model.hf_assets_path = {hf_assets_path!r}" if hf_assets_path else "no model.hf_assets_path"
            raise ValueError(
                f"the HF export's tokenizer files: {source}, but the run's tokenizer is a {type(tokenizer).__name__} "
                "(the byte tokenizer goes with an empty model.hf_assets_path, an HF tokenizer with its directory)"
            )
        return cls(hf_assets_path or None, stop_token_ids(tokenizer, stop_tokens), tokenizer.eos_id)

    def token_ids(self) -> dict[str, int | list[int] | None]:
        """The special-token ids of ``config.json`` and ``generation_config.json``."""
        ids = self.stop_token_ids
        eos = ids[0] if len(ids) == 1 else list(ids) or None
        return {"eos_token_id": eos, "pad_token_id": self.endoftext_id, "bos_token_id": self.endoftext_id}


def byte_tokenizer_json() -> tokenizers.Tokenizer:
    """The ``tokenizers`` equivalent of ``ByteTokenizer`` (see the module's doc).

    A ByteLevel pre-tokenizer without its split regex and prefix space turns the UTF-8 bytes of
    the whole text into one word of byte symbols; a BPE without merges maps each symbol to its
    byte's id; the ByteLevel decoder turns the symbols back into bytes and UTF-8.
    """
    symbols = _byte_symbols()
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab={symbol: i for i, symbol in enumerate(symbols)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ByteTokenizer.SPECIAL_TOKENS
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    # Added tokens take the next free ids, in order: the byte tokenizer's.
    ids = [tokenizer.token_to_id(token) for token in specials]
    if ids != [ByteTokenizer.NUM_BYTES + i for i in range(len(specials))]:
        raise RuntimeError(
            f"tokenizers {tokenizers.__version__} gave the byte tokenizer's special tokens {specials} the ids {ids}, "
            f"not {ByteTokenizer.NUM_BYTES}.. in order: the exported tokenizer.json would not match the run's"
        )
    return tokenizer


def _byte_symbols() -> list[str]:
    """The symbol of each byte in a ByteLevel vocabulary: the printable Latin-1 characters stand
    for their own byte; the other bytes, in order, for the characters from U+0100 on."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    shifted = iter(range(0x100, 0x200))
    symbols = [chr(byte) if byte in printable else chr(next(shifted)) for byte in range(ByteTokenizer.NUM_BYTES)]
    if set(symbols) != set(pre_tokenizers.ByteLevel.alphabet()):
        raise RuntimeError(
            f"tokenizers {tokenizers.__version__}: the ByteLevel alphabet is not the 256 byte symbols the "
            "byte tokenizer's export maps its ids to"
        )
    return symbols


def byte_tokenizer_config() -> dict:
    """``tokenizer_config.json`` of the byte tokenizer: the generic fast tokenizer class (a
    model-specific one would rebuild its own pre-tokenizer), its specials, the ChatML template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,  # decode must give back the text, spaces included
        "chat_template": chat_template(),
    }


def chat_template() -> str:
    """The Jinja chat template that renders ``data.chat``'s ChatML: what ``tokenize_row`` and
    ``tokenize_prompt`` tokenize, and what they refuse (unknown roles, image parts: a text
    template cannot say how many placeholders an image takes)."""
    header, footer = f"'{IM_START_TOKEN}' + message.role + '\\n'", f"'{IM_END_TOKEN}\\n'"
    return (
        "{%- for message in messages -%}"
        f"{{%- if message.role not in {list(CHAT_ROLES)} -%}}"
        "{{- raise_exception('unsupported chat role ' + message.role) -}}"
        "{%- endif -%}"
        f"{{{{- {header} -}}}}"
        "{%- if message.content is string -%}{{- message.content -}}"
        "{%- else -%}{%- for part in message.content -%}"
        "{%- if part.type == 'text' -%}{{- part.text -}}"
        "{%- else -%}{{- raise_exception('only text content parts are supported, got ' + part.type) -}}"
        "{%- endif -%}{%- endfor -%}{%- endif -%}"
        f"{{{{- {footer} -}}}}"
        "{%- endfor -%}"
        f"{{%- if add_generation_prompt -%}}{{{{- '{IM_START_TOKEN}{TRAINED_ROLE}\\n' -}}}}{{%- endif -%}}"
    )
