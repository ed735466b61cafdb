"""The SFT step loader: global batches independent of the batch degree, resumption, and row errors."""

import logging
import re
import warnings

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from test_data import TOKENIZER, write_jsonl
from torchtitan_rl.data.datasets import load_rows
from torchtitan_rl.data.loader import SFTDataLoader, build_sft_dataloader

# ---------------------------------------------------------------- the step loader


def make_loader(rows, *, seq_len=12, global_batch_size=8, policy="drop", seed=7, rank=0, degree=1):
    return SFTDataLoader(rows, TOKENIZER, seq_len, global_batch_size, policy, seed, rank, degree)


def text_row(index: int, num_padding: int) -> dict:
    return {"text": f"r{index:03d}" + "x" * num_padding}


def sample_text(sample) -> str:
    return TOKENIZER.decode(sample.input_ids.tolist() + sample.labels[-1:].tolist())


def sample_row_index(sample) -> int:
    return int(sample_text(sample)[1:4])


def reference_stream(rows, seq_len, seed, num_usable):
    """Brute force: row indices of the first ``num_usable`` samples, and every row visited to get them."""
    usable, visited, epoch = [], [], 0
    while len(usable) < num_usable:
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        for index in order:
            if len(usable) == num_usable:
                break
            visited.append(index)
            num_tokens = len(rows[index]["text"].encode()) + 1  # + EOS
            if 2 <= num_tokens <= seq_len + 1:
                usable.append(index)
        epoch += 1
    return usable, visited


# Row i has 4 + 3*(i % 5) text bytes + EOS; with seq_len 12 (at most 13 tokens) rows with i % 5 >= 3
# are too long. Row 13 is empty text: EOS alone, too short.
STREAM_ROWS = [text_row(i, 3 * (i % 5)) for i in range(13)] + [{"text": ""}]


def test_global_batch_is_independent_of_batch_degree():
    num_steps, global_batch_size = 5, 8
    expected, visited = reference_stream(STREAM_ROWS, 12, seed=7, num_usable=num_steps * global_batch_size)
    for degree in [1, 2, 4]:
        loaders = [make_loader(STREAM_ROWS, rank=rank, degree=degree) for rank in range(degree)]
        for step in range(num_steps):
            shares = [next(loader) for loader in loaders]
            assert all(len(share) == global_batch_size // degree for share in shares)
            global_batch = [sample for share in shares for sample in share]
            step_rows = expected[step * global_batch_size : (step + 1) * global_batch_size]
            assert [sample_row_index(s) for s in global_batch] == step_rows
            for sample, row_index in zip(global_batch, step_rows):
                assert sample_text(sample) == STREAM_ROWS[row_index]["text"] + "<|endoftext|>"
        expected_stats = {
            "num_samples": num_steps * global_batch_size,
            "num_truncated": 0,
            "num_dropped": sum(1 for i in visited if i < 13 and i % 5 >= 3),
            "num_too_short": visited.count(13),
            "num_without_loss_tokens": 0,
        }
        assert all(loader.stats() == expected_stats for loader in loaders)


def test_truncation_keeps_the_first_seq_len_plus_one_tokens():
    rows = [text_row(0, 20), text_row(1, 0)]
    loader = make_loader(rows, seq_len=8, global_batch_size=2, policy="truncate")
    samples = {sample_row_index(s): s for s in next(loader)}
    full_tokens = TOKENIZER.encode(rows[0]["text"]) + [TOKENIZER.eos_id]
    assert samples[0].input_ids.tolist() == full_tokens[:8]
    assert samples[0].labels.tolist() == full_tokens[1:9]
    assert sample_text(samples[1]) == "r001<|endoftext|>"  # short enough: untouched
    assert loader.stats()["num_truncated"] == 1 and loader.stats()["num_dropped"] == 0


def test_samples_without_loss_tokens_are_kept_and_warned_about_once(caplog):
    # The prompt fills seq_len, so truncation removes the whole completion.
    rows = [{"prompt": "p" * 10, "completion": "c"}]
    loader = make_loader(rows, seq_len=6, global_batch_size=2, policy="truncate")
    with caplog.at_level(logging.WARNING, logger="torchtitan_rl.data.loader"):
        for _ in range(3):
            batch = next(loader)
            assert len(batch) == 2
            assert all(len(s) == 6 and s.num_loss_tokens == 0 for s in batch)
    assert loader.stats()["num_without_loss_tokens"] == 6
    assert loader.stats()["num_truncated"] == 6
    assert sum("no loss tokens" in record.message for record in caplog.records) == 1


def test_epoch_wraparound_reshuffles_and_covers_every_row():
    rows = [text_row(i, 0) for i in range(5)]
    loader = make_loader(rows, global_batch_size=2, seed=11)
    stream = [sample_row_index(s) for _ in range(10) for s in next(loader)]  # 20 samples = 4 epochs
    for epoch in range(4):
        order = torch.randperm(5, generator=torch.Generator().manual_seed(11 + epoch)).tolist()
        assert stream[epoch * 5 : (epoch + 1) * 5] == order
    assert len({tuple(stream[e * 5 : (e + 1) * 5]) for e in range(4)}) > 1


def test_global_batch_size_must_divide_by_batch_degree():
    with pytest.raises(ValueError, match=r"training\.global_batch_size=6 .* degree 4"):
        make_loader(STREAM_ROWS, global_batch_size=6, degree=4)


def test_no_usable_sample_in_an_epoch_is_an_error():
    rows = [{"text": ""}, text_row(0, 20)]
    loader = make_loader(rows, seq_len=8, policy="drop")
    with pytest.raises(ValueError, match="no usable sample"):
        next(loader)


def test_invalid_rows_name_the_row_index():
    loader = make_loader([{"question": "?"}], global_batch_size=1)
    with pytest.raises(ValueError, match="dataset row 0: .*no supported format"):
        next(loader)


def test_resume_through_stateful_dataloader_is_exact():
    kwargs = dict(seq_len=12, global_batch_size=4, long_sample_policy="drop", seed=3, batch_rank=1, batch_degree=2)
    uninterrupted = build_sft_dataloader(STREAM_ROWS, TOKENIZER, **kwargs)
    uninterrupted_iter = iter(uninterrupted)
    expected = [next(uninterrupted_iter) for _ in range(9)]  # several epochs of ~10 usable rows

    first = build_sft_dataloader(STREAM_ROWS, TOKENIZER, **kwargs)
    first_iter = iter(first)
    for step in range(4):
        assert [sample_text(s) for s in next(first_iter)] == [sample_text(s) for s in expected[step]]
    state = first.state_dict()
    stats_at_checkpoint = first.dataset.stats()

    resumed = build_sft_dataloader(STREAM_ROWS, TOKENIZER, **kwargs)
    resumed.load_state_dict(state)
    resumed_iter = iter(resumed)  # the state is applied when iteration starts
    assert resumed.dataset.stats() == stats_at_checkpoint
    for step in range(4, 9):
        batch = next(resumed_iter)
        for sample, reference in zip(batch, expected[step], strict=True):
            assert torch.equal(sample.input_ids, reference.input_ids)
            assert torch.equal(sample.labels, reference.labels)
            assert torch.equal(sample.loss_mask, reference.loss_mask)
    assert resumed.dataset.stats() == uninterrupted.dataset.stats()


def test_building_iterating_and_resuming_the_loader_warns_nothing():
    # The premise: torchdata's loader calls torch's deprecated set_vital when built.
    with pytest.warns(UserWarning, match="'set_vital' is deprecated"):
        StatefulDataLoader([0], batch_size=None)
    kwargs = dict(seq_len=12, global_batch_size=4, long_sample_policy="drop", seed=3, batch_rank=0, batch_degree=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = build_sft_dataloader(STREAM_ROWS, TOKENIZER, **kwargs)
        batches = iter(loader)
        for _ in range(3):
            next(batches)
        resumed = build_sft_dataloader(STREAM_ROWS, TOKENIZER, **kwargs)
        resumed.load_state_dict(loader.state_dict())
        next(iter(resumed))
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []


def test_loader_state_is_rank_independent():
    whole = make_loader(STREAM_ROWS, global_batch_size=4)
    for _ in range(3):
        next(whole)
    state = whole.state_dict()
    expected_next = next(whole)

    second_half = make_loader(STREAM_ROWS, global_batch_size=4, rank=1, degree=2)
    second_half.load_state_dict(state)
    assert [sample_text(s) for s in next(second_half)] == [sample_text(s) for s in expected_next[2:]]
    assert second_half.stats() == whole.stats()


def test_loader_errors_name_file_and_line(tmp_path):
    write_jsonl(tmp_path / "rows.jsonl", [{"text": "ok"}, {"question": "?"}])
    rows = load_rows("", str(tmp_path / "rows.jsonl"), "train", 0, 0)
    loader = make_loader(rows, global_batch_size=2)
    with pytest.raises(
        ValueError, match=rf"dataset row 1 \({re.escape(str(tmp_path / 'rows.jsonl'))}:2\): .*no supported format"
    ):
        next(loader)
