"""Micro-batch plan and packing (docs/design.md, 'Data path'), checked against brute-force loops over raw tokens."""

import random

import pytest
import torch

from torchtitan_rl.data.balance import plan_microbatches
from torchtitan_rl.data.packing import MicroBatch, VisionPacking, build_microbatches, pack, padding_microbatch
from torchtitan_rl.data.sample import Sample, SampleImage

# ---------------------------------------------------------------- plan_microbatches


def check_greedy_plan(seq_lens: list[int], budget: int, plan: list[list[int]]) -> None:
    """The in-order greedy plan, spelled out as properties of the groups."""
    # In order, every index exactly once.
    assert [i for group in plan for i in group] == list(range(len(seq_lens)))
    assert all(group for group in plan)
    for k, group in enumerate(plan):
        used = sum(seq_lens[i] for i in group)
        assert used <= budget
        if k + 1 < len(plan):
            # Greedy: a group is closed only when the next sample does not fit any more.
            assert used + seq_lens[plan[k + 1][0]] > budget


def test_plan_hand_worked_example():
    # budget 7: 3+4 = 7 fits exactly, 2+5 = 7 fits exactly, then 1 alone.
    assert plan_microbatches([3, 4, 2, 5, 1], 7) == [[0, 1], [2, 3], [4]]
    # budget 6: 3 (+4 too much) | 4+2 | 5 (+1 = 6 fits) -> [5, 1]
    assert plan_microbatches([3, 4, 2, 5, 1], 6) == [[0], [1, 2], [3, 4]]
    # Order is kept even when a later small sample would fit an earlier group.
    assert plan_microbatches([5, 5, 1], 6) == [[0], [1, 2]]


def test_plan_random_is_in_order_greedy():
    rng = random.Random(0)
    for _ in range(200):
        budget = rng.randint(1, 30)
        seq_lens = [rng.randint(1, budget) for _ in range(rng.randint(1, 15))]
        check_greedy_plan(seq_lens, budget, plan_microbatches(seq_lens, budget))


def test_plan_every_sample_at_budget_gets_its_own_microbatch():
    assert plan_microbatches([4, 4, 4], 4) == [[0], [1], [2]]


def test_plan_zero_budget_is_one_microbatch():
    seq_lens = [100, 5000, 1, 7]
    assert plan_microbatches(seq_lens, 0) == [[0, 1, 2, 3]]


@pytest.mark.parametrize("seq_lens", [[9], [2, 3, 9, 1], [3, 3, 3, 12]])
def test_plan_sample_over_budget_raises(seq_lens):
    with pytest.raises(ValueError, match=r"training\.max_tokens_per_microbatch"):
        plan_microbatches(seq_lens, 8)


@pytest.mark.parametrize("budget", [0, 1, 16])
def test_plan_empty_input(budget):
    assert plan_microbatches([], budget) == []


# ---------------------------------------------------------------- pack


def random_raw(rng: random.Random, num: int, min_len: int = 2, max_len: int = 12):
    """Raw token lists and target masks, with some all-false and some length-2 sequences."""
    raw = []
    for i in range(num):
        n = rng.randint(min_len, max_len)
        tokens = [rng.randint(0, 999) for _ in range(n)]
        if i % 4 == 1:
            mask = [False] * n
        else:
            mask = [rng.random() < 0.6 for _ in range(n)]
        raw.append((tokens, mask))
    return raw


def check_packed(mb: MicroBatch, raw: list[tuple[list[int], list[bool]]]) -> None:
    """Every per-token field of ``mb`` against a loop over the raw sequences."""
    exp_ids, exp_labels, exp_mask, exp_pos, exp_seq, exp_n = [], [], [], [], [], []
    for i, (tokens, target) in enumerate(raw):
        n_loss = sum(1 for j in range(1, len(tokens)) if target[j])
        for j in range(len(tokens) - 1):
            exp_ids.append(tokens[j])
            exp_labels.append(tokens[j + 1])
            exp_mask.append(target[j + 1])
            exp_pos.append(j)
            exp_seq.append(i)
            exp_n.append(n_loss)
    assert mb.input_ids.tolist() == exp_ids
    assert mb.labels.tolist() == exp_labels
    assert mb.loss_mask.tolist() == exp_mask
    assert mb.positions.tolist() == exp_pos
    assert mb.seq_ids.tolist() == exp_seq
    assert mb.seq_num_loss_tokens.tolist() == exp_n
    assert mb.seq_lens == [len(tokens) - 1 for tokens, _ in raw]
    assert mb.num_tokens == len(exp_ids)
    assert mb.num_seqs == len(raw)
    assert mb.loss_mask.dtype == torch.bool
    assert not mb.is_padding
    for t in (mb.input_ids, mb.labels, mb.loss_mask, mb.positions, mb.seq_ids, mb.seq_num_loss_tokens):
        assert t.shape == (len(exp_ids),)


def test_pack_matches_raw_sequences():
    rng = random.Random(1)
    for num in (1, 2, 5, 9):
        raw = random_raw(rng, num)
        mb = pack([Sample.from_tokens(tokens, target) for tokens, target in raw])
        check_packed(mb, raw)


def test_pack_no_label_crosses_a_sequence_boundary():
    raw = [
        ([10, 11, 12, 13], [False, True, True, True]),
        ([20, 21], [False, True]),  # a single-token sample
        ([30, 31, 32], [True, True, True]),
    ]
    mb = pack([Sample.from_tokens(tokens, target) for tokens, target in raw])
    check_packed(mb, raw)
    ends = torch.tensor([len(t) - 1 for t, _ in raw]).cumsum(0) - 1
    for (tokens, _), end in zip(raw, ends.tolist()):
        # The last position of each sequence predicts its own last token ...
        assert mb.labels[end].item() == tokens[-1]
    # ... never the first token of the following sequence.
    assert mb.labels[ends[0]].item() != raw[1][0][0]
    assert mb.labels[ends[1]].item() != raw[2][0][0]
    assert mb.labels.tolist() == [11, 12, 13, 21, 31, 32]
    assert mb.input_ids.tolist() == [10, 11, 12, 20, 30, 31]
    assert mb.positions.tolist() == [0, 1, 2, 0, 0, 1]
    assert mb.seq_ids.tolist() == [0, 0, 0, 1, 2, 2]
    assert mb.seq_num_loss_tokens.tolist() == [3, 3, 3, 1, 2, 2]


def test_pack_to_keeps_everything():
    raw = random_raw(random.Random(2), 4)
    mb = pack([Sample.from_tokens(tokens, target) for tokens, target in raw]).to(torch.device("cpu"))
    check_packed(mb, raw)


# ---------------------------------------------------------------- padding and build_microbatches


def test_padding_microbatch_has_no_loss_tokens():
    mb = padding_microbatch()
    assert mb.is_padding
    assert mb.loss_mask.sum().item() == 0
    assert mb.num_tokens == 1 and mb.num_seqs == 1 and mb.seq_lens == []
    assert mb.num_padding_tokens == 1
    for t in (mb.input_ids, mb.labels, mb.loss_mask, mb.positions, mb.seq_ids, mb.seq_num_loss_tokens):
        assert t.shape == (1,)
    assert mb.positions.tolist() == [0] and mb.seq_ids.tolist() == [0]
    assert mb.to(torch.device("cpu")).is_padding


@pytest.mark.parametrize("budget", [0, 12, 20])
@pytest.mark.parametrize("extra", [0, 1, 3])
def test_build_microbatches_packs_by_plan_and_pads(budget, extra):
    rng = random.Random(3 + budget)
    raw = random_raw(rng, 7, max_len=13)  # at most 12 tokens per sample after the shift
    samples = [Sample.from_tokens(tokens, target) for tokens, target in raw]
    # Expected groups from an explicit greedy loop written here.
    if budget == 0:
        groups = [list(range(len(raw)))]
    else:
        groups, current, used = [], [], 0
        for i, s in enumerate(samples):
            if current and used + len(s) > budget:
                groups.append(current)
                current, used = [], 0
            current.append(i)
            used += len(s)
        groups.append(current)
    count = len(groups) + extra
    mbs = build_microbatches(samples, plan_microbatches([len(s) for s in samples], budget), count)
    assert len(mbs) == count
    for group, mb in zip(groups, mbs):
        check_packed(mb, [raw[i] for i in group])
    for mb in mbs[len(groups) :]:
        assert mb.is_padding and mb.loss_mask.sum().item() == 0


def test_build_microbatches_empty_rank_is_all_padding():
    mbs = build_microbatches([], plan_microbatches([], 16), 3)
    assert len(mbs) == 3
    assert all(mb.is_padding and not mb.loss_mask.any() for mb in mbs)


@pytest.mark.parametrize("pad_multiple", [1, 2, 4, 5])
def test_pack_pads_to_multiple_with_an_isolated_zero_weight_sequence(pad_multiple):
    raw = [([1, 2, 3, 4], [False, True, True, True]), ([5, 6, 7], [False, False, True])]
    samples = [Sample.from_tokens(t, m) for t, m in raw]
    mb = pack(samples, pad_multiple)
    real = sum(len(t) - 1 for t, _ in raw)  # 5 tokens after shifting
    expected_padding = (pad_multiple - real % pad_multiple) % pad_multiple
    assert mb.num_tokens == real + expected_padding and mb.num_tokens % pad_multiple == 0
    assert mb.num_padding_tokens == expected_padding
    assert mb.seq_lens == [3, 2]
    pad = slice(real, None)
    assert not mb.loss_mask[pad].any()
    assert mb.seq_ids[pad].tolist() == [2] * expected_padding  # its own sequence: attends nothing real
    assert mb.positions[pad].tolist() == list(range(expected_padding))
    assert mb.num_seqs == 2 + (1 if expected_padding else 0)
    for t in (mb.input_ids, mb.labels, mb.positions, mb.seq_ids, mb.seq_num_loss_tokens):
        assert t.shape == (mb.num_tokens,)
    padded_filler = padding_microbatch(pad_multiple)
    assert padded_filler.num_tokens == pad_multiple and not padded_filler.loss_mask.any()


# ---------------------------------------------------------------- vision patches


def test_plan_budgets_tokens_and_patches_together():
    rng = random.Random(1)
    for _ in range(200):
        max_tokens, max_patches = rng.choice([0, rng.randint(5, 30)]), rng.choice([0, rng.randint(8, 40)])
        seq_lens = [rng.randint(1, max_tokens or 30) for _ in range(rng.randint(1, 12))]
        patches = [rng.choice([0, 0, rng.randint(4, max_patches or 40)]) for _ in seq_lens]
        plan = plan_microbatches(seq_lens, max_tokens, patches, max_patches)
        assert [i for group in plan for i in group] == list(range(len(seq_lens)))
        for k, group in enumerate(plan):
            used = (sum(seq_lens[i] for i in group), sum(patches[i] for i in group))
            assert all(not budget or u <= budget for u, budget in zip(used, (max_tokens, max_patches)))
            if k + 1 < len(plan):
                nxt = plan[k + 1][0]
                # Closed only when the next sample would break one of the budgets.
                assert (max_tokens and used[0] + seq_lens[nxt] > max_tokens) or (
                    max_patches and used[1] + patches[nxt] > max_patches
                )


def test_plan_sample_over_patch_budget_names_the_key():
    with pytest.raises(
        ValueError, match=r"a sample of 50 vision patches exceeds training.max_patches_per_microbatch=40 \(sample 1"
    ):
        plan_microbatches([3, 4], 0, [8, 50], 40)


def _image_sample(n: int, grids: list[tuple[int, int]], rows: list[int], seed: int) -> Sample:
    gen = torch.Generator().manual_seed(seed)
    images = [SampleImage(torch.randn(r * c, 12, generator=gen), r, c) for r, c in grids]
    return Sample(
        input_ids=torch.arange(n),
        labels=torch.arange(n),
        loss_mask=torch.ones(n, dtype=torch.bool),
        images=images or None,
        vision_rows=torch.tensor(rows) if images else None,
    )


def test_pack_offsets_each_samples_vision_rows_past_earlier_images():
    vision = VisionPacking(patch_dim=12, merge_size=2)
    a = _image_sample(4, [(2, 4), (2, 2)], [0, 1, -1, 2], seed=0)  # 2 + 1 feature rows
    b = _image_sample(3, [], [], seed=1)  # text only
    c = _image_sample(3, [(4, 2)], [-1, 1, 0], seed=2)
    mb = pack([a, b, c], pad_multiple=4, vision=vision)
    assert mb.vision_index.tolist() == [0, 1, -1, 2] + [-1] * 3 + [-1, 4, 3] + [-1, -1]  # padded to 12 with -1
    assert mb.image_grids == ((2, 4), (2, 2), (4, 2)) and mb.num_images == 3
    assert torch.equal(mb.image_patches, torch.cat([im.patches for im in a.images + c.images]))


def test_microbatches_without_images_run_one_dummy_image_that_no_token_uses():
    vision = VisionPacking(patch_dim=12, merge_size=2)
    for mb in (pack([_image_sample(3, [], [], 0)], vision=vision), padding_microbatch(2, vision=vision)):
        assert mb.num_images == 0 and mb.image_grids == ((2, 2),)
        assert torch.equal(mb.image_patches, torch.zeros(4, 12))
        assert bool((mb.vision_index == -1).all())
    text = pack([_image_sample(3, [], [], 0)])
    assert text.vision_index is None and text.image_patches is None
