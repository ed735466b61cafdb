"""Preference pairs: each format's tokens against the SFT rows they stand for, the loss on the
final reply only, row errors naming file and line, and the loader's pairs over ranks."""

import io
import re
import types

import pytest
import torch
from PIL import Image

from test_data import write_jsonl
from test_tokenizer import make_hf_tokenizer_dir
from torchtitan_rl.data.chat import tokenize_prompt_row, tokenize_row
from torchtitan_rl.data.datasets import load_rows
from torchtitan_rl.data.loader import SFTDataLoader, build_sft_dataloader
from torchtitan_rl.data.preferences import plan_preference_row, tokenize_preference_row
from torchtitan_rl.data.sample import find_vision_problem
from torchtitan_rl.data.tokenizer import build_tokenizer
from torchtitan_rl.data.vision_samples import RowPlanner, VisionDataConfig
from torchtitan_rl.models.qwen3.args import qwen3_flavors
from torchtitan_rl.recipes.preference_eval import held_out_pairs, hold_out, prompt_and_completion

BYTES = build_tokenizer("")


@pytest.fixture(scope="module", params=["byte", "hf"])
def tokenizer(request, tmp_path_factory):
    if request.param == "byte":
        return BYTES
    return build_tokenizer(str(make_hf_tokenizer_dir(tmp_path_factory.mktemp("hf_tokenizer"))))


def masked_text(tokenized, tokenizer) -> str:
    """The decoded loss targets, checked to be one contiguous run."""
    positions = [j for j, trained in enumerate(tokenized.target_mask) if trained]
    assert positions == list(range(positions[0], positions[-1] + 1))
    return tokenizer.decode([tokenized.tokens[j] for j in positions])


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


# ---------------------------------------------------------------- formats


def test_plain_pair_is_two_prompt_completion_rows(tokenizer):
    row = {"prompt": "What is 3 + 4?", "chosen": " 7", "rejected": " 8, I think"}
    chosen, rejected = tokenize_preference_row(row, tokenizer)
    for side, tokenized in (("chosen", chosen), ("rejected", rejected)):
        tokens, target_mask = tokenize_row({"prompt": row["prompt"], "completion": row[side]}, tokenizer)
        assert (tokenized.tokens, tokenized.target_mask, tokenized.images) == (tokens, target_mask, [])
        assert masked_text(tokenized, tokenizer) == row[side] + "<|endoftext|>"


MULTI_TURN = [
    {"role": "system", "content": "Be brief."},
    user("What is 3 + 4?"),
    assistant("7"),
    user("And 3 + 5?"),
]


@pytest.mark.parametrize("key", ["prompt", "messages"])
@pytest.mark.parametrize("prompt", [[user("What is 3 + 4?")], MULTI_TURN], ids=["one_turn", "multi_turn"])
def test_conversational_pair_trains_only_the_final_reply(tokenizer, key, prompt):
    row = {key: prompt, "chosen": "8", "rejected": [assistant("9, or so")]}
    chosen, rejected = tokenize_preference_row(row, tokenizer)
    for tokenized, reply in ((chosen, "8"), (rejected, "9, or so")):
        tokens, sft_mask = tokenize_row({"messages": prompt + [assistant(reply)]}, tokenizer)
        assert tokenized.tokens == tokens
        assert masked_text(tokenized, tokenizer) == reply + "<|im_end|>"
        assert all(sft for trained, sft in zip(tokenized.target_mask, sft_mask) if trained)
        if any(m["role"] == "assistant" for m in prompt):
            # The prompt's own assistant turn is trained in SFT, not here.
            assert sum(sft_mask) > sum(tokenized.target_mask)
        else:
            # Where a generation prompt ends, the reply begins.
            assert tokenized.target_mask.index(True) == len(tokenize_prompt_row(prompt, tokenizer).tokens)


def test_implicit_prompt_is_what_both_conversations_share(tokenizer):
    row = {"chosen": MULTI_TURN + [assistant("8")], "rejected": MULTI_TURN + [assistant("")]}
    explicit = tokenize_preference_row({"prompt": MULTI_TURN, "chosen": "8", "rejected": ""}, tokenizer)
    implicit = tokenize_preference_row(row, tokenizer)
    assert implicit == explicit
    for tokenized, side in zip(implicit, ("chosen", "rejected")):
        assert tokenized.tokens == tokenize_row({"messages": row[side]}, tokenizer)[0]
    assert masked_text(implicit[1], tokenizer) == "<|im_end|>"  # an empty reply still learns to stop


def solid_png(width, height):
    out = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(out, format="PNG")
    return out.getvalue()


VISION = VisionDataConfig(patch_size=4, merge_size=2, max_image_tokens=16)
PNG_A, PNG_B = solid_png(12, 20), solid_png(30, 9)
IMAGE_ROWS = [
    {
        "prompt": [user([{"type": "image", "image": PNG_A}, {"type": "text", "text": "colour?"}])],
        "chosen": "green",
        "rejected": [assistant("red")],
    },
    {"prompt": [user("<image> or <image>?")], "chosen": "left", "rejected": "right", "images": [PNG_A, PNG_B]},
    {"prompt": "Which: <image>", "chosen": "this", "rejected": "that", "images": [PNG_B]},
]


def sft_row(row: dict, side: str) -> dict:
    images = {"images": row["images"]} if "images" in row else {}
    if isinstance(row["prompt"], str):
        return {"prompt": row["prompt"], "completion": row[side], **images}
    reply = row[side] if isinstance(row[side], str) else row[side][0]["content"]
    return {"messages": row["prompt"] + [assistant(reply)], **images}


@pytest.mark.parametrize("row", IMAGE_ROWS, ids=["content_parts", "markers", "plain_markers"])
def test_images_are_planned_as_in_sft_rows(row):
    planner = RowPlanner(BYTES, VISION)
    pair = plan_preference_row(planner, row, 5, "dataset row 5", None)
    for planned, side in zip(pair, ("chosen", "rejected")):
        reference = planner.plan_row(sft_row(row, side), 5, "dataset row 5", None)
        assert planned.tokens == reference.tokens
        assert [(i.grid, i.start, i.num_placeholders) for i in planned.images] == [
            (i.grid, i.start, i.num_placeholders) for i in reference.images
        ]
        assert len(planned.images) == len(row.get("images", [None]))
        reply = sft_row(row, side).get("completion") or sft_row(row, side)["messages"][-1]["content"]
        stop = "<|endoftext|>" if isinstance(row["prompt"], str) else "<|im_end|>"
        assert masked_text(planned, BYTES) == reply + stop
    loader = SFTDataLoader([row], BYTES, 512, 1, "drop", 0, 0, 1, vision=VISION, preference_pairs=True)
    samples = next(loader)
    assert find_vision_problem(samples, 3 * VISION.patch_size**2, VISION.merge_size) is None
    assert [len(s.images) for s in samples] == [len(pair[0].images)] * 2
    assert loader.stats()["num_images"] == 2 * len(pair[0].images)


# ---------------------------------------------------------------- bad rows

BAD_ROWS = [
    ({"prompt": "p", "rejected": "r"}, "it has no 'chosen'"),
    ({"prompt": "p", "chosen": "c"}, "it has no 'rejected'"),
    ({"messages": [user("q"), assistant("a")]}, "it has no 'chosen' and no 'rejected'"),
    ({"prompt": "p", "chosen": [assistant("c")], "rejected": "r"}, "'chosen' must be a string, got a list"),
    ({"prompt": 3, "chosen": "c", "rejected": "r"}, "'prompt' must be a string or a list of chat messages, got a int"),
    ({"prompt": [user("q")], "chosen": "c", "rejected": 5}, "'rejected' must be a string or a list holding one"),
    ({"prompt": [user("q")], "chosen": [assistant("a"), assistant("b")], "rejected": "r"}, "got a list of 2 messages"),
    ({"prompt": [user("q")], "chosen": [user("c")], "rejected": "r"}, "'chosen' must be the assistant's reply"),
    ({"prompt": [{"role": "bot", "content": "q"}], "chosen": "c", "rejected": "r"}, "'prompt': .*chat role 'bot'"),
    ({"prompt": "p", "messages": [user("q")], "chosen": "c", "rejected": "r"}, "both 'prompt' and 'messages'"),
    ({"chosen": "c", "rejected": "r"}, "must be whole conversations .* got a str 'chosen'"),
    (
        {"chosen": [user("q"), assistant("a")], "rejected": [user("Q"), assistant("b")]},
        "differ before their final assistant turn \\(message 0 differs\\)",
    ),
    (
        {"chosen": [user("q"), assistant("a")], "rejected": [user("q"), assistant("x"), user("y"), assistant("b")]},
        "differ before their final assistant turn \\('chosen' has 2 messages, 'rejected' 4\\)",
    ),
    (
        {"chosen": [user("q"), assistant("a")], "rejected": [assistant("a"), user("q")]},
        "final turn of 'rejected' is a 'user'",
    ),
    ({"chosen": [assistant("a")], "rejected": [assistant("b")]}, "share no message"),
    (
        {"prompt": [user("q")], "chosen": [assistant([{"type": "image", "image": "x.png"}])], "rejected": "r"},
        "'chosen': .*image in text the model learns to emit",
    ),
    ({"prompt": "p", "chosen": "c", "rejected": "r", "margin": "big"}, "'margin' must be a finite number, got 'big'"),
    ({"prompt": "p", "chosen": "c", "rejected": "r", "margin": float("nan")}, "'margin' must be a finite .* got nan"),
    ({"prompt": "p", "chosen": "c", "rejected": "r", "margin": float("-inf")}, "'margin' must be a finite .* got -inf"),
    ({"prompt": "p", "chosen": "c", "rejected": "r", "margin": [1.0]}, "'margin' must be a finite .* got \\[1.0\\]"),
]


@pytest.mark.parametrize("row, message", BAD_ROWS)
def test_bad_rows_are_named_with_file_and_line(tmp_path, row, message):
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "p", "chosen": "c", "rejected": "r"}, row])
    rows = load_rows("", str(path), "train", 0, 0)
    loader = SFTDataLoader(rows, BYTES, 64, 2, "drop", 0, 0, 1, preference_pairs=True)
    with pytest.raises(ValueError, match=rf"^dataset row 1 \({re.escape(str(path))}:2\): .*{message}"):
        next(loader)


def test_sft_rows_are_not_pairs_and_pairs_are_not_sft_rows():
    with pytest.raises(ValueError, match="no 'chosen' and no 'rejected'"):
        next(SFTDataLoader([{"text": "t"}], BYTES, 64, 1, "drop", 0, 0, 1, preference_pairs=True))
    with pytest.raises(
        ValueError, match=r"'completion' must both be strings \(its 'chosen' / 'rejected' make it a pref"
    ):
        next(SFTDataLoader([{"prompt": "p", "chosen": "c", "rejected": "r"}], BYTES, 64, 1, "drop", 0, 0, 1))


# ---------------------------------------------------------------- the loader

SEQ_LEN = 12


def pair_row(i: int) -> dict:
    """Row i: prompt 'q<i>:' (4 bytes); every 5th pair has a chosen side too long for SEQ_LEN, every
    7th identical sides; the rest differ in length, so balancing has something to move."""
    chosen = "c" * (30 if i % 5 == 4 else 1 + i % 4)
    rejected = chosen if i % 7 == 6 else "r" * (1 + (3 * i) % 7)
    return {"prompt": f"q{i:02d}:", "chosen": chosen, "rejected": rejected}


PAIR_ROWS = [pair_row(i) for i in range(23)]


def usable(row: dict) -> str:
    """'' for a kept pair, else the counter that drops it (byte tokens: text bytes plus EOS)."""
    if max(len(row["prompt"]) + len(row[side]) + 1 for side in ("chosen", "rejected")) - 1 > SEQ_LEN:
        return "num_dropped"
    return "num_identical_pairs" if row["chosen"] == row["rejected"] else ""


def reference_pairs(rows, seed, num_pairs):
    """Brute force: the row indices of the first ``num_pairs`` kept pairs, and every row visited."""
    kept, visited, epoch = [], [], 0
    while len(kept) < num_pairs:
        for index in torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed + epoch)).tolist():
            if len(kept) == num_pairs:
                break
            visited.append(index)
            if not usable(rows[index]):
                kept.append(index)
        epoch += 1
    return kept, visited


def text_of(sample) -> str:
    return BYTES.decode(sample.input_ids.tolist() + sample.labels[-1:].tolist())


def pair_loader(rank=0, degree=1, balance=False, rows=PAIR_ROWS, batch=4, seed=3):
    # The truncate policy on purpose: pairs are dropped whatever it says.
    return SFTDataLoader(
        rows, BYTES, SEQ_LEN, batch, "truncate", seed, rank, degree, balance_dp_compute=balance, preference_pairs=True
    )


@pytest.mark.parametrize("degree, balance", [(1, False), (2, False), (2, True), (4, False), (4, True)])
def test_pairs_of_a_global_batch_over_ranks(degree, balance):
    num_steps, batch = 6, 4
    kept, visited = reference_pairs(PAIR_ROWS, 3, num_steps * batch)
    loaders = [pair_loader(rank, degree, balance) for rank in range(degree)]
    num_split_pairs = 0
    for step in range(num_steps):
        shares = [next(loader) for loader in loaders]
        step_rows = [PAIR_ROWS[i] for i in kept[step * batch : (step + 1) * batch]]
        # Global order: pair k's chosen, then its rejected.
        expected = [row["prompt"] + row[side] + "<|endoftext|>" for row in step_rows for side in ("chosen", "rejected")]
        order = [(s.group_id, not s.preferred) for share in shares for s in share]
        assert sorted(order) == [(k, side) for k in range(batch) for side in (False, True)]
        for share in shares:
            assert share and [(s.group_id, not s.preferred) for s in share] == sorted(
                (s.group_id, not s.preferred) for s in share
            )
            for sample in share:
                assert text_of(sample) == expected[2 * sample.group_id + (not sample.preferred)]
                assert (
                    sample.num_loss_tokens
                    == len(step_rows[sample.group_id]["chosen" if sample.preferred else "rejected"]) + 1
                )
        if not balance:
            assert [text_of(s) for share in shares for s in share] == expected
            assert all(len(share) == 2 * batch // degree for share in shares)
        rank_of = {(s.group_id, s.preferred): rank for rank, share in enumerate(shares) for s in share}
        num_split_pairs += sum(rank_of[(k, True)] != rank_of[(k, False)] for k in range(batch))
    # Balancing moves samples, not pairs: some pairs train on two ranks (the recipe exchanges their sums).
    assert (num_split_pairs > 0) == balance
    expected_stats = {
        "num_samples": 2 * num_steps * batch,
        "num_pairs": num_steps * batch,
        "num_truncated": 0,
        "num_dropped": sum(usable(PAIR_ROWS[i]) == "num_dropped" for i in visited),
        "num_too_short": 0,
        "num_without_loss_tokens": 0,
        "num_identical_pairs": sum(usable(PAIR_ROWS[i]) == "num_identical_pairs" for i in visited),
    }
    assert expected_stats["num_dropped"] > 0 and expected_stats["num_identical_pairs"] > 0
    assert all(loader.stats() == expected_stats for loader in loaders)


def test_a_too_short_side_drops_the_pair():
    rows = [{"prompt": "", "chosen": "", "rejected": "r"}, {"prompt": "q", "chosen": "c", "rejected": "r"}]
    loader = pair_loader(rows=rows, batch=1, seed=0)
    for _ in range(3):
        assert [text_of(s) for s in next(loader)] == ["qc<|endoftext|>", "qr<|endoftext|>"]
    assert loader.stats()["num_too_short"] >= 2 and loader.stats()["num_pairs"] == 3


def test_a_dataset_without_a_usable_pair_is_an_error():
    rows = [{"prompt": "q", "chosen": "same", "rejected": "same"}, {"prompt": "q", "chosen": "c" * 40, "rejected": "r"}]
    with pytest.raises(ValueError, match="no usable preference pair .*'num_dropped': 1.*'num_identical_pairs': 1"):
        next(pair_loader(rows=rows, batch=1))


def test_resume_gives_the_same_next_batches():
    kwargs = dict(
        seq_len=SEQ_LEN,
        global_batch_size=2,
        long_sample_policy="drop",
        seed=5,
        batch_rank=1,
        batch_degree=2,
        balance_dp_compute=True,
        preference_pairs=True,
    )
    uninterrupted = iter(build_sft_dataloader(PAIR_ROWS, BYTES, **kwargs))
    expected = [next(uninterrupted) for _ in range(12)]  # past the first epoch's ~15 kept pairs
    first = build_sft_dataloader(PAIR_ROWS, BYTES, **kwargs)
    first_iter = iter(first)
    for _ in range(5):
        next(first_iter)
    resumed = build_sft_dataloader(PAIR_ROWS, BYTES, **kwargs)
    resumed.load_state_dict(first.state_dict())
    resumed_iter = iter(resumed)  # the state is applied when iteration starts
    assert resumed.dataset.stats() == first.dataset.stats()
    for step in range(5, 12):
        batch = next(resumed_iter)
        assert [(text_of(s), s.group_id, s.preferred) for s in batch] == [
            (text_of(s), s.group_id, s.preferred) for s in expected[step]
        ]
        assert all(torch.equal(a.loss_mask, b.loss_mask) for a, b in zip(batch, expected[step], strict=True))


def test_every_sample_carries_its_pairs_margin_over_ranks(tmp_path):
    """Rows with a margin (int or float, any sign) mixed with rows without one (margin 0): each
    side of each pair carries its row's, in the training batches over balanced ranks and in the
    held-out pairs."""
    rows = [dict(pair_row(i), **({"margin": [1.5, -2, 0.25][i % 3]} if i % 4 else {})) for i in range(23)]
    # Files merge rows with and without the column: datasets gives None to the rows without it.
    loaded = load_rows("unused", str(write_jsonl(tmp_path / "pairs.jsonl", rows)), "train", 0, 0)
    margin_of = {row["prompt"]: float(row.get("margin", 0)) for row in rows}
    loaders = [pair_loader(rank, 2, True, rows=loaded) for rank in range(2)]
    seen = set()
    for _ in range(6):
        for share in [next(loader) for loader in loaders]:
            for sample in share:
                prompt = text_of(sample)[:4]
                assert sample.margin == margin_of[prompt], prompt
                seen.add(sample.margin)
    assert seen == {0.0, 1.5, -2.0, 0.25}
    recipe = types.SimpleNamespace(
        parallel_dims=types.SimpleNamespace(batch_rank=lambda: 0, batch_degree=1),
        job_config=None,
        model_args=qwen3_flavors["debugmodel"],
        tokenizer=BYTES,
    )
    pairs, samples = held_out_pairs(recipe, loaded)
    assert [s.margin for s in samples] == [margin_of[loaded[s.group_id]["prompt"]] for s in samples]
    assert [(s.group_id, s.preferred) for s in samples] == [(k, side) for k in range(23) for side in (True, False)]


def test_sft_mode_leaves_preference_fields_unset():
    samples = next(SFTDataLoader([{"text": "abc"}], BYTES, 64, 2, "drop", 0, 0, 1))
    assert [(s.group_id, s.preferred) for s in samples] == [(None, None)] * 2
    assert "num_pairs" not in SFTDataLoader([{"text": "abc"}], BYTES, 64, 2, "drop", 0, 0, 1).stats()


def test_held_out_pairs_are_a_seeded_draw_never_trained_on(tmp_path):
    path = write_jsonl(
        tmp_path / "prefs.jsonl", [{"prompt": f"q{i}", "chosen": "a", "rejected": "b"} for i in range(30)]
    )
    rows = load_rows("unused", str(path), "train", 1, 0)
    train, held = hold_out(rows, 8, seed=3)
    prompts = lambda part: [part[i]["prompt"] for i in range(len(part))]  # noqa: E731
    assert len(held) == 8 and len(train) == 22
    assert sorted(prompts(train) + prompts(held), key=lambda p: int(p[1:])) == [f"q{i}" for i in range(30)]
    assert prompts(hold_out(rows, 8, seed=3)[1]) == prompts(held) != prompts(hold_out(rows, 8, seed=4)[1])
    # Each held-out row is still named by its file and line.
    line = int(held[0]["prompt"][1:]) + 1
    assert held.source_of(0) == f"{path}:{line}"
    with pytest.raises(ValueError, match="preference.num_eval_pairs=30 holds out every one of the dataset's 30 rows"):
        hold_out(rows, 30, seed=3)


@pytest.mark.parametrize(
    "row,completion",
    [
        ({"prompt": [{"role": "user", "content": "2 + 2?"}], "chosen": "4", "rejected": "5"}, "4<|im_end|>"),
        ({"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"}, " 4<|endoftext|>"),
    ],
)
def test_the_evaluation_prompts_with_the_chosen_sides_prompt_and_expects_its_reply(row, completion):
    tokenizer = build_tokenizer("")
    planner = RowPlanner(tokenizer, None)
    chosen, _ = plan_preference_row(planner, row, 0, "row 0", None)
    prompt, expected = prompt_and_completion(chosen)
    assert prompt + expected == chosen.tokens[: len(prompt) + len(expected)]
    assert tokenizer.decode(expected) == completion
    assert tokenizer.decode(prompt).endswith(
        "<|im_start|>assistant\n" if isinstance(row["prompt"], list) else "2 + 2 ="
    )
