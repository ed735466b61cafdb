"""Reduction weights (docs/design.md, 'Loss weights') against per-token brute force over simulated DP ranks.

A layout is a list of ranks, each a list of micro-batches, each a list of sequence indices
into the raw mini-batch. Ranks are padded to the same number of micro-batches with filler,
as the engine does, and the global counts are the SUM of every rank's ``local_counts`` —
what the all-reduce over the ``batch`` mesh computes.
"""

import math
import random

import pytest
import torch

import reference
from torchtitan_rl.data.packing import pack, padding_microbatch
from torchtitan_rl.data.sample import Sample
from torchtitan_rl.losses.reduction import (
    GROUP_LOSS_TOKENS,
    NUM_LOSS_TOKENS,
    NUM_MICROBATCHES,
    NUM_MICROBATCHES_WITH_LOSS,
    NUM_SEQS,
    NUM_SEQS_WITH_LOSS,
    NUM_TOKENS,
    REDUCTION_MODES,
    SUM_SQUARED_SEQ_LENS,
    global_counts,
    local_counts,
    token_weights,
)

HORIZON = 16
LAYOUT_INVARIANT_MODES = [m for m in REDUCTION_MODES if m != "token_mean_legacy"]


# ---------------------------------------------------------------- helpers


def random_raw(rng: random.Random, num: int, *, empty_every: int = 3, max_len: int = 10):
    """Raw (tokens, target mask) pairs: some sequences without loss tokens, some single-token."""
    raw = []
    for i in range(num):
        n = 2 if i % 5 == 2 else rng.randint(2, max_len)
        tokens = [rng.randint(0, 50) for _ in range(n)]
        if empty_every and i % empty_every == 1:
            mask = [False] * n
        else:
            mask = [False] + [rng.random() < 0.7 for _ in range(n - 1)]
            mask[rng.randint(1, n - 1)] = True  # at least one loss token
        raw.append((tokens, mask))
    return raw


def loss_flags(raw, i):
    """m_t of sequence i, per model input position (the target mask shifted by one)."""
    return [bool(b) for b in raw[i][1][1:]]


def prompt_group(i: int) -> int:
    """The prompt group of sequence i: pairs of neighbours, which random layouts split apart."""
    return i // 2


def build(raw, layout):
    """Per rank: the padded list of (micro-batch, group or None). Samples carry prompt groups."""
    samples = []
    for i, (tokens, mask) in enumerate(raw):
        sample = Sample.from_tokens(tokens, mask)
        sample.group_id = prompt_group(i)
        samples.append(sample)
    num = max(1, max(len(rank) for rank in layout))
    ranks = []
    for rank in layout:
        mbs = [(pack([samples[i] for i in group], inputs=("group_id",)), group) for group in rank]
        mbs += [(padding_microbatch(inputs=("group_id",)), None) for _ in range(num - len(rank))]
        ranks.append(mbs)
    return ranks


def summed_counts(ranks):
    num_groups = 1 + max(int(mb.group_ids.max()) for rank in ranks for mb, _ in rank)
    return sum(local_counts([mb for mb, _ in rank], num_groups) for rank in ranks)


def brute_force_weights(raw, layout, mode, horizon):
    """Expected w_t for every token of every micro-batch (in the order ``build`` makes them)."""
    n = [sum(loss_flags(raw, i)) for i in range(len(raw))]
    big_n = sum(n)
    big_b = sum(1 for x in n if x > 0)
    group_loss = [sum(n[i] for i in group) for rank in layout for group in rank]
    big_k = sum(1 for x in group_loss if x > 0)
    prompt_loss = {}  # N_p of every prompt group
    for i in range(len(raw)):
        prompt_loss[prompt_group(i)] = prompt_loss.get(prompt_group(i), 0) + n[i]
    big_p = sum(1 for x in prompt_loss.values() if x > 0)
    expected = []
    for rank in layout:
        per_rank = []
        for group in rank:
            n_k = sum(n[i] for i in group)
            w = []
            for i in group:
                for m in loss_flags(raw, i):
                    if not m:
                        w.append(0.0)
                    elif mode == "token_mean":
                        w.append(1.0 / big_n)
                    elif mode == "sequence_mean":
                        w.append(1.0 / (n[i] * big_b))
                    elif mode == "seq_mean_token_sum_norm":
                        w.append(1.0 / (horizon * big_b))
                    elif mode == "sum":
                        w.append(1.0)
                    elif mode == "token_mean_legacy":
                        w.append(1.0 / (n_k * big_k))
                    elif mode == "prompt_mean":
                        w.append(1.0 / (big_p * prompt_loss[prompt_group(i)]))
                    else:
                        raise AssertionError(mode)
            per_rank.append(w)
        expected.append(per_rank)
    return expected


def check_weights(raw, layout, mode, horizon=HORIZON):
    ranks = build(raw, layout)
    counts = summed_counts(ranks)
    expected = brute_force_weights(raw, layout, mode, horizon)
    for rank, exp_rank in zip(ranks, expected):
        for k, (mb, group) in enumerate(rank):
            w = token_weights(mb, mode, counts, horizon)
            assert w.dtype == torch.float32
            assert w.shape == mb.loss_mask.shape
            assert torch.isfinite(w).all()
            if group is None:
                assert torch.equal(w, torch.zeros_like(w)), "padding must weigh exactly 0"
                continue
            exp = torch.tensor(exp_rank[k], dtype=torch.float32)
            torch.testing.assert_close(w, exp, rtol=1e-6, atol=0)
            # Masked-out tokens are exactly zero.
            assert torch.equal(w[~mb.loss_mask], torch.zeros(int((~mb.loss_mask).sum())))


def random_layout(rng: random.Random, num_seqs: int, num_ranks: int, order=None):
    """Split sequence indices over ``num_ranks`` ranks (possibly empty), then into micro-batches."""
    order = list(range(num_seqs)) if order is None else order
    cuts = sorted(rng.randint(0, num_seqs) for _ in range(num_ranks - 1))
    bounds = [0, *cuts, num_seqs]
    layout = []
    for r in range(num_ranks):
        seqs = order[bounds[r] : bounds[r + 1]]
        groups, current = [], []
        for i in seqs:
            current.append(i)
            if rng.random() < 0.4:
                groups.append(current)
                current = []
        if current:
            groups.append(current)
        layout.append(groups)
    return layout


# ---------------------------------------------------------------- per-token weights


@pytest.mark.parametrize("mode", REDUCTION_MODES)
def test_weights_match_brute_force_random(mode):
    rng = random.Random(REDUCTION_MODES.index(mode))
    for _ in range(12):
        raw = random_raw(rng, rng.randint(1, 9))
        layout = random_layout(rng, len(raw), num_ranks=rng.randint(1, 4))
        check_weights(raw, layout, mode)


@pytest.mark.parametrize("mode", REDUCTION_MODES)
def test_weights_with_empty_microbatches_and_empty_ranks(mode):
    rng = random.Random(7)
    raw = random_raw(rng, 10, empty_every=0)
    # Sequences 1, 4, 5, 8, 9 have no loss token.
    for i in (1, 4, 5, 8, 9):
        raw[i] = (raw[i][0], [False] * len(raw[i][0]))
    layout = [
        [[0, 1], [4, 5], [2]],  # a micro-batch with no loss token
        [[8], [9]],  # a whole rank with no loss token
        [],  # a rank with no samples at all: padding only
        [[3, 6, 7]],
    ]
    check_weights(raw, layout, mode)


@pytest.mark.parametrize("mode", REDUCTION_MODES)
def test_weights_single_token_sequences(mode):
    raw = [([1, 2], [False, True]), ([3, 4], [False, True]), ([5, 6], [False, False]), ([7, 8, 9], [True, True, True])]
    check_weights(raw, [[[0], [1, 2]], [[3]]], mode)


@pytest.mark.parametrize("mode", REDUCTION_MODES)
def test_weights_single_sequence_with_loss(mode):
    # B = 1: one sequence has loss tokens, the others none; also a mini-batch of one sequence.
    raw = [([1, 2, 3, 4, 5], [False, False, True, True, False]), ([6, 7, 8], [False] * 3), ([9, 9], [False] * 2)]
    check_weights(raw, [[[0, 1]], [[2]]], mode)
    check_weights(raw[:1], [[[0]]], mode)


@pytest.mark.parametrize("mode", REDUCTION_MODES)
def test_all_zero_batch_weighs_nothing(mode):
    raw = [([1, 2, 3], [False] * 3), ([4, 5], [False] * 2), ([6, 7, 8, 9], [False] * 4)]
    layout = [[[0], [1]], [[2]], []]
    ranks = build(raw, layout)
    counts = summed_counts(ranks)
    assert counts[NUM_LOSS_TOKENS] == 0 and counts[NUM_SEQS_WITH_LOSS] == 0
    assert counts[NUM_MICROBATCHES_WITH_LOSS] == 0
    for rank in ranks:
        for mb, _ in rank:
            w = token_weights(mb, mode, counts, HORIZON)
            assert torch.isfinite(w).all()
            assert torch.equal(w, torch.zeros_like(w))


def test_unknown_mode_lists_valid_modes():
    mb = pack([Sample.from_tokens([1, 2, 3], [False, True, True])])
    counts = local_counts([mb])
    with pytest.raises(ValueError) as info:
        token_weights(mb, "mean", counts, HORIZON)
    message = str(info.value)
    assert "'mean'" in message
    for mode in REDUCTION_MODES:
        assert mode in message


# ---------------------------------------------------------------- the layout-invariance property


def minibatch_loss(raw, token_losses, mode, horizon, groups=None):
    """The mode's loss, from per-sequence losses (no micro-batches, no ranks)."""
    seq_sums, n = [], []
    for i in range(len(raw)):
        flags = loss_flags(raw, i)
        seq_sums.append(sum(l for l, m in zip(token_losses[i], flags) if m))
        n.append(sum(flags))
    groups = groups or [prompt_group(i) for i in range(len(raw))]
    return reference.minibatch_loss(seq_sums, n, mode, horizon, groups)


def legacy_loss(raw, token_losses, layout):
    """Mean over the non-empty micro-batches (of all ranks) of each one's token mean."""
    means = []
    for rank in layout:
        for group in rank:
            num = sum(l for i in group for l, m in zip(token_losses[i], loss_flags(raw, i)) if m)
            den = sum(sum(loss_flags(raw, i)) for i in group)
            if den > 0:
                means.append(num / den)
    return sum(means) / len(means)


def weighted_total(raw, token_losses, layout, mode, horizon):
    """Σ_t w_t ℓ_t summed over every micro-batch of every simulated rank."""
    ranks = build(raw, layout)
    counts = summed_counts(ranks)
    total = 0.0
    for rank in ranks:
        for mb, group in rank:
            if group is None:
                losses = torch.rand(mb.num_tokens, dtype=torch.float64) * 10  # must not matter
            else:
                losses = torch.tensor([l for i in group for l in token_losses[i]], dtype=torch.float64)
            w = token_weights(mb, mode, counts, horizon)
            total += float((w.double() * losses).sum())
    return total


def random_splits(rng, num_seqs, how_many):
    """Several different layouts of the same mini-batch, including the trivial one."""
    splits = [
        [[list(range(num_seqs))]],  # one rank, one micro-batch
        [[[i] for i in range(num_seqs)]],  # one rank, one sequence per micro-batch
        [[[i]] for i in range(num_seqs)],  # one sequence per rank
    ]
    for _ in range(how_many):
        order = list(range(num_seqs))
        rng.shuffle(order)
        splits.append(random_layout(rng, num_seqs, rng.randint(1, 5), order))
    return splits


@pytest.mark.parametrize("mode", LAYOUT_INVARIANT_MODES)
def test_weighted_sum_is_minibatch_loss_for_any_split(mode):
    rng = random.Random(11)
    for trial in range(4):
        raw = random_raw(rng, 7 + trial)
        token_losses = [[rng.uniform(0.0, 5.0) for _ in range(len(t) - 1)] for t, _ in raw]
        expected = minibatch_loss(raw, token_losses, mode, HORIZON)
        for layout in random_splits(rng, len(raw), 6):
            got = weighted_total(raw, token_losses, layout, mode, HORIZON)
            assert math.isclose(got, expected, rel_tol=1e-5), (layout, got, expected)


def test_legacy_depends_on_the_split():
    rng = random.Random(5)
    raw = [
        ([1] * 12, [False] + [True] * 11),  # 11 loss tokens
        ([2, 3], [False, True]),  # 1 loss token
        ([4, 5, 6, 7], [False, True, True, True]),  # 3 loss tokens
    ]
    token_losses = [[rng.uniform(0.0, 5.0) for _ in range(len(t) - 1)] for t, _ in raw]
    layouts = [
        [[[0, 1, 2]]],
        [[[0], [1, 2]]],
        [[[0]], [[1]], [[2]]],
        [[[0, 1]], [[2]]],
    ]
    values = []
    for layout in layouts:
        got = weighted_total(raw, token_losses, layout, "token_mean_legacy", HORIZON)
        assert math.isclose(got, legacy_loss(raw, token_losses, layout), rel_tol=1e-5)
        values.append(got)
    for a in range(len(values)):
        for b in range(a + 1, len(values)):
            assert abs(values[a] - values[b]) > 1e-3, values
    # While token_mean is the same for all of them.
    means = [weighted_total(raw, token_losses, layout, "token_mean", HORIZON) for layout in layouts]
    assert max(means) - min(means) < 1e-5


# ---------------------------------------------------------------- local_counts


def test_local_counts_brute_force():
    rng = random.Random(21)
    for _ in range(20):
        raw = random_raw(rng, rng.randint(1, 8))
        layout = random_layout(rng, len(raw), 1)
        groups = layout[0]
        mbs = [pack([Sample.from_tokens(*raw[i]) for i in group]) for group in groups]
        # Padding anywhere in the list must not count.
        mbs = [padding_microbatch()] + mbs + [padding_microbatch(), padding_microbatch()]
        n = [sum(loss_flags(raw, i)) for i in range(len(raw))]
        lens = [len(raw[i][0]) - 1 for i in range(len(raw))]
        expected = [0] * GROUP_LOSS_TOKENS
        expected[NUM_LOSS_TOKENS] = sum(n)
        expected[NUM_SEQS_WITH_LOSS] = sum(1 for x in n if x > 0)
        expected[NUM_MICROBATCHES_WITH_LOSS] = sum(1 for g in groups if sum(n[i] for i in g) > 0)
        expected[NUM_TOKENS] = sum(lens)
        expected[SUM_SQUARED_SEQ_LENS] = sum(x * x for x in lens)
        expected[NUM_SEQS] = len(raw)
        expected[NUM_MICROBATCHES] = len(groups)
        counts = local_counts(mbs)
        assert counts.dtype == torch.int64
        assert counts.tolist() == expected
        # Single rank: the "all-reduce" is the identity.
        assert global_counts(counts, None, torch.device("cpu")).tolist() == expected


def test_local_counts_of_padding_only_is_zero():
    assert local_counts([padding_microbatch(), padding_microbatch()]).tolist() == [0] * GROUP_LOSS_TOKENS
    assert local_counts([]).tolist() == [0] * GROUP_LOSS_TOKENS


# ---------------------------------------------------------------- prompt_mean


def grouped_total(raw, token_losses, groups, mode):
    """Σ w_t ℓ_t over one micro-batch holding every sequence, sequence i in prompt group groups[i]."""
    samples = []
    for (tokens, mask), group in zip(raw, groups):
        samples.append(Sample.from_tokens(tokens, mask))
        samples[-1].group_id = group
    mb = pack(samples, inputs=("group_id",))
    counts = local_counts([mb], num_groups=max(groups) + 1)
    losses = torch.tensor([l for per_seq in token_losses for l in per_seq], dtype=torch.float64)
    return float((token_weights(mb, mode, counts, HORIZON).double() * losses).sum())


def test_prompt_mean_equals_sequence_mean_for_equal_groups_of_equal_sequences():
    rng = random.Random(3)
    mask = [False, False, True, True, False, True, True]
    raw = [([rng.randint(0, 50) for _ in mask], mask) for _ in range(6)]
    token_losses = [[rng.uniform(0.0, 5.0) for _ in range(len(mask) - 1)] for _ in raw]
    equal = [0, 0, 1, 1, 2, 2]
    sequence_mean = grouped_total(raw, token_losses, equal, "sequence_mean")
    assert grouped_total(raw, token_losses, equal, "prompt_mean") == pytest.approx(sequence_mean, rel=1e-6)
    # Groups of 3, 2 and 1 sequences: every prompt weighs 1/3, not every sequence 1/6.
    unequal = [0, 0, 0, 1, 1, 2]
    got = grouped_total(raw, token_losses, unequal, "prompt_mean")
    assert abs(got - sequence_mean) > 1e-3 * sequence_mean
    assert got == pytest.approx(minibatch_loss(raw, token_losses, "prompt_mean", HORIZON, unequal), rel=1e-6)


def test_group_loss_token_counts_brute_force():
    rng = random.Random(8)
    raw = random_raw(rng, 9)
    layout = [[[0, 3], [5]], [[1, 2, 8]], [[4, 6, 7]]]  # every group split over ranks
    ranks = build(raw, layout)
    counts = summed_counts(ranks)
    n = [sum(loss_flags(raw, i)) for i in range(len(raw))]
    expected = [sum(n[i] for i in range(len(raw)) if prompt_group(i) == g) for g in range(prompt_group(8) + 1)]
    assert counts[GROUP_LOSS_TOKENS:].tolist() == expected
    assert counts[NUM_LOSS_TOKENS] == sum(expected)
