import pytest

from test_tokenizer import make_hf_tokenizer_dir
from torchtitan_rl.data.chat import (
    insert_placeholders,
    render_chat,
    tokenize_prompt,
    tokenize_prompt_row,
    tokenize_row,
    tokenize_row_with_images,
)
from torchtitan_rl.data.sample import Sample
from torchtitan_rl.data.tokenizer import ByteTokenizer, HFTokenizer

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 3 + 4?"},
    {"role": "assistant", "content": "7"},
    {"role": "user", "content": "Grüße: reverse 'abc'"},
    {"role": "assistant", "content": "cba, 你好"},
]
EXPECTED_TEXT = (
    "<|im_start|>system\nYou are terse.<|im_end|>\n"
    "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n"
    "<|im_start|>assistant\n7<|im_end|>\n"
    "<|im_start|>user\nGrüße: reverse 'abc'<|im_end|>\n"
    "<|im_start|>assistant\ncba, 你好<|im_end|>\n"
)


@pytest.fixture(params=["byte", "hf"])
def tokenizer(request, tmp_path):
    if request.param == "byte":
        return ByteTokenizer()
    return HFTokenizer(str(make_hf_tokenizer_dir(tmp_path)))


def masked_spans(tokens: list[int], mask: list[bool]) -> list[list[int]]:
    """The maximal runs of consecutive masked tokens."""
    spans: list[list[int]] = []
    for position, (token, is_masked) in enumerate(zip(tokens, mask)):
        if is_masked:
            if position == 0 or not mask[position - 1]:
                spans.append([])
            spans[-1].append(token)
    return spans


def test_render_chat_matches_chatml():
    assert render_chat(CONVERSATION) == EXPECTED_TEXT


def test_chat_tokens_decode_to_rendered_text(tokenizer):
    tokens, mask = tokenize_row({"messages": CONVERSATION}, tokenizer)
    assert len(tokens) == len(mask)
    assert tokenizer.decode(tokens) == render_chat(CONVERSATION)


def test_chat_loss_mask_covers_assistant_content_and_im_end_only(tokenizer):
    tokens, mask = tokenize_row({"messages": CONVERSATION}, tokenizer)
    spans = [tokenizer.decode(span) for span in masked_spans(tokens, mask)]
    assert spans == ["7<|im_end|>", "cba, 你好<|im_end|>"]
    # Every <|im_end|> of an assistant turn is trained, every other special token is not.
    assert [m for t, m in zip(tokens, mask) if t == tokenizer.im_end_id] == [False, False, True, False, True]
    assert not any(m for t, m in zip(tokens, mask) if t == tokenizer.im_start_id)


def test_chat_sample_labels_at_loss_positions_are_the_answers(tokenizer):
    # After the shift, the loss is on predicting exactly the assistant tokens.
    sample = Sample.from_tokens(*tokenize_row({"messages": CONVERSATION}, tokenizer))
    trained_labels = sample.labels[sample.loss_mask].tolist()
    assert tokenizer.decode(trained_labels) == "7<|im_end|>cba, 你好<|im_end|>"


def test_prompt_completion_format(tokenizer):
    row = {"prompt": "Q: 2+2=", "completion": " 4"}
    tokens, mask = tokenize_row(row, tokenizer)
    assert tokens == tokenizer.encode("Q: 2+2=") + tokenizer.encode(" 4") + [tokenizer.eos_id]
    assert tokenizer.decode([t for t, m in zip(tokens, mask) if not m]) == "Q: 2+2="
    assert masked_spans(tokens, mask) == [tokenizer.encode(" 4") + [tokenizer.eos_id]]


def test_text_format(tokenizer):
    tokens, mask = tokenize_row({"text": "hello wörld"}, tokenizer)
    assert tokenizer.decode(tokens) == "hello wörld<|endoftext|>"
    assert all(mask)


def test_unused_none_columns_are_ignored():
    # datasets fills columns a row lacks with None when files have different columns.
    tokenizer = ByteTokenizer()
    row = {"messages": None, "prompt": None, "completion": None, "text": "hi"}
    assert tokenize_row(row, tokenizer) == ([104, 105, 256], [True, True, True])


@pytest.mark.parametrize(
    "row, reason",
    [
        ({"question": "hi", "answer": "yo"}, "no supported format"),
        ({"text": 3}, "'text' must be a string"),
        ({"prompt": "only a prompt"}, "'prompt' and 'completion'"),
        ({"messages": "hi"}, "non-empty list"),
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "user", "content": None}]}, "string 'content'"),
        ({"messages": [{"role": "function", "content": "{}"}]}, "unsupported chat role 'function'"),
    ],
)
def test_invalid_rows_name_keys_and_formats(row, reason):
    with pytest.raises(ValueError) as excinfo:
        tokenize_row(row, ByteTokenizer())
    message = str(excinfo.value)
    assert reason in message
    assert str(sorted(row)) in message
    assert "'messages'" in message and "'prompt'" in message and "'text'" in message


def test_render_chat_rejects_unknown_role():
    with pytest.raises(ValueError, match="unsupported chat role 'function'"):
        render_chat([{"role": "function", "content": "x"}])


# ---------------------------------------------------------------- generation prompts


@pytest.mark.parametrize("prompt_messages", [CONVERSATION[:2], CONVERSATION[3:4]], ids=["system+user", "user"])
def test_prompt_is_the_row_prefix_before_the_assistant_content(tokenizer, prompt_messages):
    answer = "cba, 你好"
    prompt = tokenize_prompt(prompt_messages, tokenizer)
    row = {"messages": prompt_messages + [{"role": "assistant", "content": answer}]}
    row_tokens, mask = tokenize_row(row, tokenizer)
    assert row_tokens == prompt + tokenizer.encode(answer) + [tokenizer.im_end_id] + tokenizer.encode("\n")
    # The first trained token is the first one the model generates from the prompt.
    assert mask.index(True) == len(prompt)
    assert tokenizer.decode(prompt) == render_chat(prompt_messages) + "<|im_start|>assistant\n"


def test_prompt_accepts_tuples_and_rejects_assistant_turns():
    tokenizer = ByteTokenizer()
    messages = CONVERSATION[:2]
    assert tokenize_prompt(tuple(messages), tokenizer) == tokenize_prompt(messages, tokenizer)
    with pytest.raises(ValueError, match="must not contain an 'assistant' turn"):
        tokenize_prompt(CONVERSATION[:3], tokenizer)
    with pytest.raises(ValueError, match="unsupported chat role 'function'"):
        tokenize_prompt([{"role": "function", "content": "x"}], tokenizer)


# ---------------------------------------------------------------- rows with images

IMAGE_ROW = {
    "messages": [
        {"role": "system", "content": "Look closely."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "First "},
                {"type": "image", "image": "img/a.png"},
                {"type": "text", "text": " then "},
                {"type": "image", "image": b"\x89PNG bytes"},
                {"type": "text", "text": "?"},
            ],
        },
        {"role": "assistant", "content": "red"},
    ]
}
# The same conversation with the images' places marked in plain text.
MARKED_TEXT = "First @ then @?"


def text_with_markers(tokens: list[int], images, tokenizer) -> str:
    """Decodes the tokens with '@' where each image's placeholders go."""
    pieces, previous = [], 0
    for image in images:
        pieces += [tokenizer.decode(tokens[previous : image.position]), "@"]
        previous = image.position
    return "".join(pieces) + tokenizer.decode(tokens[previous:])


def test_content_parts_give_image_positions_and_the_text_template(tokenizer):
    row = tokenize_row_with_images(IMAGE_ROW, tokenizer)
    assert [image.source for image in row.images] == ["img/a.png", b"\x89PNG bytes"]
    assert [image.where for image in row.images] == ["image 0 (message 1 part 1)", "image 1 (message 1 part 3)"]
    text_only = [{**m, "content": MARKED_TEXT} if m["role"] == "user" else m for m in IMAGE_ROW["messages"]]
    assert text_with_markers(row.tokens, row.images, tokenizer) == render_chat(text_only)
    spans = [tokenizer.decode(span) for span in masked_spans(row.tokens, row.target_mask)]
    assert spans == ["red<|im_end|>"]


def test_image_marker_form_matches_content_parts(tokenizer):
    marked = {
        "messages": [
            IMAGE_ROW["messages"][0],
            {"role": "user", "content": "First <image> then <image>?"},
            IMAGE_ROW["messages"][2],
        ],
        "images": ["img/a.png", b"\x89PNG bytes"],
    }
    by_marker = tokenize_row_with_images(marked, tokenizer)
    by_parts = tokenize_row_with_images(IMAGE_ROW, tokenizer)
    assert by_marker.tokens == by_parts.tokens and by_marker.target_mask == by_parts.target_mask
    assert [(i.source, i.position) for i in by_marker.images] == [(i.source, i.position) for i in by_parts.images]
    assert by_marker.images[1].where == "image 1 (message 1, images[1])"


def test_image_marker_in_prompt_and_text_rows():
    tokenizer = ByteTokenizer()
    row = tokenize_row_with_images({"prompt": "<image>Q", "completion": "A", "images": ["x.png"]}, tokenizer)
    assert row.tokens == tokenizer.encode("QA") + [tokenizer.eos_id]
    assert [(i.source, i.position) for i in row.images] == [("x.png", 0)]
    row = tokenize_row_with_images({"text": "a<image>b", "images": ["x.png"]}, tokenizer)
    assert row.tokens == tokenizer.encode("ab") + [tokenizer.eos_id] and all(row.target_mask)
    assert row.images[0].position == 1
    # Without a top-level 'images' list, '<image>' is just text: text rows are unchanged.
    assert tokenize_row({"text": "a<image>b"}, tokenizer)[0] == tokenizer.encode("a<image>b") + [tokenizer.eos_id]


def test_insert_placeholders_never_trains_image_tokens():
    tokenizer = ByteTokenizer()
    row = tokenize_row_with_images({"text": "a<image>b<image>", "images": ["1.png", "2.png"]}, tokenizer)
    tokens, mask, starts = insert_placeholders(row, [[900, 901], [902]])
    assert tokens == [ord("a"), 900, 901, ord("b"), 902, tokenizer.eos_id]
    assert mask == [True, False, False, True, False, True]
    assert starts == [1, 4]
    with pytest.raises(ValueError, match="1 placeholder lists for 2 images"):
        insert_placeholders(row, [[900]])


def test_relative_image_paths_resolve_against_the_rows_directory(tmp_path):
    row = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": "img/1.png"},
                    {"type": "image", "image": "/abs/2.png"},
                    {"type": "image", "image": {"bytes": None, "path": "img/3.png"}},
                    {"type": "image", "path": "4.png"},
                ],
            },
            {"role": "assistant", "content": "ok"},
        ]
    }
    sources = [i.source for i in tokenize_row_with_images(row, ByteTokenizer(), base_dir=str(tmp_path)).images]
    assert sources == [
        str(tmp_path / "img/1.png"),
        "/abs/2.png",
        {"bytes": None, "path": str(tmp_path / "img/3.png")},
        str(tmp_path / "4.png"),
    ]
    # No base directory (in-memory rows): relative to the working directory, i.e. left as given.
    assert tokenize_row_with_images(row, ByteTokenizer()).images[0].source == "img/1.png"


@pytest.mark.parametrize(
    "row, reason",
    [
        ({"text": "<image><image>", "images": ["a.png"]}, "2 '<image>' markers but its 'images' list has 1"),
        ({"text": "no marker", "images": ["a.png"]}, "0 '<image>' markers but its 'images' list has 1"),
        ({"text": "<image>", "images": "a.png"}, "'images' must be a list"),
        (
            {"prompt": "q", "completion": "<image>", "images": ["a.png"]},
            "completion, images[0]: an image in text the model learns",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": [{"type": "image", "image": "a.png"}]},
                ]
            },
            "message 1 part 0: an image in text the model learns",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}]}], "images": ["b.png"]},
            "both a top-level 'images' list and content parts",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "video", "video": "a.mp4"}]}]},
            "message 0: every content part",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "url": "http://x"}]}]},
            "an image part needs an 'image'",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
            "a text part needs a string 'text'",
        ),
    ],
)
def test_invalid_image_rows_name_the_cause(row, reason):
    with pytest.raises(ValueError) as excinfo:
        tokenize_row_with_images(row, ByteTokenizer())
    assert reason in str(excinfo.value)


def test_text_paths_refuse_images():
    with pytest.raises(ValueError, match="has 2 image"):
        tokenize_row(IMAGE_ROW, ByteTokenizer())
    with pytest.raises(ValueError, match="string 'content'"):
        render_chat(IMAGE_ROW["messages"])
    with pytest.raises(ValueError, match="has 2 image.*tokenize_prompt_row"):
        tokenize_prompt(IMAGE_ROW["messages"][:2], ByteTokenizer())


def test_prompt_row_with_images_is_the_row_prefix_before_the_assistant_content(tokenizer):
    prompt_messages = IMAGE_ROW["messages"][:2]
    prompt = tokenize_prompt_row(tuple(prompt_messages), tokenizer)
    row = tokenize_row_with_images(IMAGE_ROW, tokenizer)
    assert row.tokens[: len(prompt.tokens)] == prompt.tokens and row.target_mask.index(True) == len(prompt.tokens)
    assert [(i.source, i.position, i.where) for i in prompt.images] == [
        (i.source, i.position, i.where) for i in row.images
    ]
    assert prompt.target_mask == [False] * len(prompt.tokens)
    text_only = [{**m, "content": MARKED_TEXT} if m["role"] == "user" else m for m in prompt_messages]
    assert text_with_markers(prompt.tokens, prompt.images, tokenizer) == render_chat(text_only) + (
        "<|im_start|>assistant\n"
    )


def test_prompt_row_of_text_is_tokenize_prompt():
    tokenizer = ByteTokenizer()
    prompt = tokenize_prompt_row(CONVERSATION[:2], tokenizer)
    assert prompt.tokens == tokenize_prompt(CONVERSATION[:2], tokenizer) and prompt.images == []
    # Text parts alone are a text prompt too.
    parts = [{"role": "user", "content": [{"type": "text", "text": CONVERSATION[1]["content"]}]}]
    assert tokenize_prompt(parts, tokenizer) == tokenize_prompt(CONVERSATION[1:2], tokenizer)
    with pytest.raises(ValueError, match="must not contain an 'assistant' turn"):
        tokenize_prompt_row(IMAGE_ROW["messages"], tokenizer)
    with pytest.raises(ValueError, match="an image part needs an 'image'"):
        tokenize_prompt_row([{"role": "user", "content": [{"type": "image"}]}], tokenizer)
