import pytest
from test_tokenizer import make_hf_tokenizer_dir

from torchtitan_rl.data.chat import render_chat, tokenize_prompt, tokenize_row
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
        ({"messages": [{"role": "tool", "content": "{}"}]}, "unsupported chat role 'tool'"),
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
    with pytest.raises(ValueError, match="unsupported chat role 'tool'"):
        render_chat([{"role": "tool", "content": "x"}])


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
    with pytest.raises(ValueError, match="unsupported chat role 'tool'"):
        tokenize_prompt([{"role": "tool", "content": "x"}], tokenizer)
