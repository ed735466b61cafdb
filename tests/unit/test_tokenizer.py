import dataclasses
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from torchtitan_rl.data.tokenizer import ByteTokenizer, HFTokenizer, ImageTokenIds, build_tokenizer, image_token_ids

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TRAINING_TEXTS = [
    "user\nWhat is 3 + 4?",
    "assistant\n7",
    "Reverse the string: hello",
    "The quick brown fox jumps over the lazy dog.",
    "Grüße aus Köln, 你好",
]


def make_hf_tokenizer_dir(directory: Path, special_tokens: list[str] = SPECIAL_TOKENS) -> Path:
    """A tiny byte-level BPE (the kind Qwen uses) trained on a few strings, saved as tokenizer.json.

    Its post-processor appends <|endoftext|> so tests can check that ``encode`` does not add it.
    """
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(TRAINING_TEXTS, trainer=trainer)
    if "<|endoftext|>" in special_tokens:
        eos_id = tokenizer.token_to_id("<|endoftext|>")
        tokenizer.post_processor = processors.TemplateProcessing(
            single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", eos_id)]
        )
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


ROUND_TRIP_TEXTS = ["", "plain ascii", "héllo wörld", "你好, 世界 🙂", "tab\tnew\nline", "<|im_end|> as text"]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_byte_tokenizer_round_trip(text):
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text


def test_byte_tokenizer_special_ids_and_decoding():
    tokenizer = ByteTokenizer()
    assert (tokenizer.eos_id, tokenizer.im_start_id, tokenizer.im_end_id, tokenizer.vocab_size) == (256, 257, 258, 262)
    # "é" is two bytes; a special token between text pieces must not break the multi-byte run around it.
    ids = [257] + tokenizer.encode("é") + [258, 256]
    assert tokenizer.decode(ids) == "<|im_start|>é<|im_end|><|endoftext|>"
    # Special-token strings in text are plain bytes, never the special id.
    assert 258 not in tokenizer.encode("<|im_end|>")


def test_byte_tokenizer_invalid_utf8_and_ids():
    tokenizer = ByteTokenizer()
    first_byte_of_e_acute = "é".encode()[0]
    assert tokenizer.decode([ord("a"), first_byte_of_e_acute, ord("b")]) == "a\ufffdb"
    with pytest.raises(ValueError, match="262"):
        tokenizer.decode([262])


def test_byte_tokenizer_image_tokens():
    tokenizer = ByteTokenizer()
    ids = image_token_ids(tokenizer)
    assert ids == ImageTokenIds(image=259, image_break=260, image_end=261)
    assert [tokenizer.token_to_id(t) for t in ["<|endoftext|>", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]] == [
        256,
        259,
        260,
        261,
    ]
    assert tokenizer.token_to_id("[IMG_START]") is None
    assert tokenizer.decode([259, 259, 260, 259, 259, 261]) == "[IMG][IMG][IMG_BREAK][IMG][IMG][IMG_END]"
    # Placeholder strings typed in text stay bytes: only the loader inserts image tokens.
    assert not set(tokenizer.encode("[IMG][IMG_END]")) & {259, 260, 261}


def test_image_token_ids_from_configured_strings(tmp_path):
    with pytest.raises(ValueError, match=r"image_end_token='<img_end>'"):
        image_token_ids(ByteTokenizer(), image_end_token="<img_end>")
    with pytest.raises(ValueError, match="three different tokens"):
        image_token_ids(ByteTokenizer(), image_break_token="[IMG]")
    # An HF tokenizer: ids are whatever tokenizer.json assigns; a text tokenizer has none (error only when asked).
    directory = make_hf_tokenizer_dir(tmp_path / "vlm", SPECIAL_TOKENS + ["[IMG]", "[IMG_BREAK]", "[IMG_END]"])
    tokenizer = HFTokenizer(str(directory))
    reference = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert image_token_ids(tokenizer) == ImageTokenIds(
        *(reference.token_to_id(t) for t in ["[IMG]", "[IMG_BREAK]", "[IMG_END]"])
    )
    with pytest.raises(ValueError, match=r"image_token='\[IMG\]'"):
        image_token_ids(HFTokenizer(str(make_hf_tokenizer_dir(tmp_path / "text"))))


# The added tokens of a stock Qwen3 tokenizer.json up to its vision specials, in Qwen's order.
QWEN_SPECIAL_TOKENS = SPECIAL_TOKENS + [
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
PIXTRAL_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]


def test_a_qwen_tokenizer_uses_its_vision_specials_with_the_default_strings(tmp_path):
    directory = make_hf_tokenizer_dir(tmp_path / "qwen", QWEN_SPECIAL_TOKENS)
    reference = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    qwen_ids = ImageTokenIds(*(reference.token_to_id(t) for t in ["<|image_pad|>", "<|vision_pad|>", "<|vision_end|>"]))
    assert None not in dataclasses.astuple(qwen_ids)
    tokenizer = HFTokenizer(str(directory))
    assert image_token_ids(tokenizer) == qwen_ids
    assert image_token_ids(tokenizer, "[IMG]", "[IMG_BREAK]", "[IMG_END]") == qwen_ids  # the defaults, spelt out
    # Strings set to anything else are used as given: Qwen's own ...
    assert image_token_ids(tokenizer, "<|image_pad|>", "<|video_pad|>", "<|vision_end|>") == ImageTokenIds(
        qwen_ids.image, reference.token_to_id("<|video_pad|>"), qwen_ids.image_end
    )
    # ... or missing ones, which stay an error.
    with pytest.raises(ValueError, match=r"image_token='<img>'"):
        image_token_ids(tokenizer, image_token="<img>")
    # A tokenizer that has the defaults uses them, whatever else it has.
    both = HFTokenizer(str(make_hf_tokenizer_dir(tmp_path / "both", QWEN_SPECIAL_TOKENS + PIXTRAL_TOKENS)))
    assert image_token_ids(both) == ImageTokenIds(*(both.token_to_id(t) for t in PIXTRAL_TOKENS))
    # One default present is not Qwen's layout: the missing ones are named.
    partial = HFTokenizer(str(make_hf_tokenizer_dir(tmp_path / "partial", QWEN_SPECIAL_TOKENS + ["[IMG]"])))
    with pytest.raises(ValueError, match=r"image_break_token='\[IMG_BREAK\]', image_end_token='\[IMG_END\]'"):
        image_token_ids(partial)
    # Qwen's specials only in part: no mapping, and the error says which tokens would be used.
    no_pad = [t for t in QWEN_SPECIAL_TOKENS if t != "<|vision_pad|>"]
    with pytest.raises(ValueError, match=r"image_token='\[IMG\]'.*<\|image_pad\|>, <\|vision_pad\|>, <\|vision_end\|>"):
        image_token_ids(HFTokenizer(str(make_hf_tokenizer_dir(tmp_path / "no_pad", no_pad))))


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS[:-1])
def test_hf_tokenizer_round_trip_without_added_specials(tmp_path, text):
    tokenizer = HFTokenizer(str(make_hf_tokenizer_dir(tmp_path)))
    ids = tokenizer.encode(text)
    assert tokenizer.eos_id not in ids  # the post-processor's EOS is not added
    assert tokenizer.decode(ids) == text


def test_hf_tokenizer_special_ids(tmp_path):
    tokenizer = HFTokenizer(str(make_hf_tokenizer_dir(tmp_path)))
    reference = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tokenizer.eos_id == reference.token_to_id("<|endoftext|>")
    assert tokenizer.im_start_id == reference.token_to_id("<|im_start|>")
    assert tokenizer.im_end_id == reference.token_to_id("<|im_end|>")
    assert tokenizer.vocab_size == reference.get_vocab_size(with_added_tokens=True)
    ids = [tokenizer.im_start_id] + tokenizer.encode("user\nhi") + [tokenizer.im_end_id, tokenizer.eos_id]
    assert tokenizer.decode(ids) == "<|im_start|>user\nhi<|im_end|><|endoftext|>"


def test_hf_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        HFTokenizer(str(tmp_path))
    directory = make_hf_tokenizer_dir(tmp_path / "no_im_end", special_tokens=["<|endoftext|>", "<|im_start|>"])
    with pytest.raises(ValueError, match=r"<\|im_end\|>"):
        HFTokenizer(str(directory))


def test_build_tokenizer(tmp_path):
    assert isinstance(build_tokenizer(""), ByteTokenizer)
    assert isinstance(build_tokenizer(str(make_hf_tokenizer_dir(tmp_path / "hf"))), HFTokenizer)
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "a_file.txt").write_text("x")
    for bad_path in [tmp_path / "missing", tmp_path / "empty_dir", tmp_path / "a_file.txt"]:
        with pytest.raises(ValueError, match=r"model\.hf_assets_path.*tokenizer\.json"):
            build_tokenizer(str(bad_path))
