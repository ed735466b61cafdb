"""The zigzag split of context parallel (docs/design.md, 'Context parallel') against brute-force chunking."""

import random

import pytest
import torch

from torchtitan_rl.data.cp_split import microbatch_layout, shard_microbatch
from torchtitan_rl.data.packing import (
    OPTIONAL_INPUTS,
    TOKEN_FIELDS,
    VisionPacking,
    pack,
    padding_microbatch,
)
from torchtitan_rl.data.sample import RL_TOKEN_INPUTS, Sample, SampleImage
from torchtitan_rl.distributed.context_parallel import ZigzagLayout


def random_lengths(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randint(1, 40) for _ in range(count - 1)]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("multiple", [1, 2])
@pytest.mark.parametrize("seed", range(5))
def test_gather_of_split_is_identity(cp, multiple, seed):
    lens = random_lengths(seed, 1 + seed * 2)
    layout = ZigzagLayout.build(lens, cp, multiple)
    values = torch.randn(sum(lens), 3)
    shards = [layout.split(values, r) for r in range(cp)]
    torch.testing.assert_close(layout.gather(shards), values, rtol=0, atol=0)
    # Every rank holds the same number of tokens, divisible by the SP degree.
    assert len({s.shape[0] for s in shards}) == 1 and shards[0].shape[0] % multiple == 0
    assert sum(s.shape[0] for s in shards) == sum(layout.padded_lens)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_rank_keeps_chunks_r_and_mirror_of_every_sequence(cp):
    """Brute force: pad each sequence, cut in 2cp equal chunks, rank r takes r and 2cp-1-r."""
    lens = random_lengths(7, 6)
    layout = ZigzagLayout.build(lens, cp)
    values = torch.arange(1, sum(lens) + 1)  # 0 marks padding below
    for r in range(cp):
        expected, start = [], 0
        for n in lens:
            padded = -(-n // (2 * cp)) * 2 * cp
            seq = torch.zeros(padded, dtype=torch.long)
            seq[:n] = values[start : start + n]
            chunks = seq.chunk(2 * cp)
            expected += [chunks[r], chunks[2 * cp - 1 - r]]
            start += n
        assert torch.equal(layout.split(values, r), torch.cat(expected))


def test_positions_and_seq_ids_stay_global():
    lens = [5, 1, 8]
    layout = ZigzagLayout.build(lens, cp=2)
    full_positions = torch.cat([torch.arange(n) for n in lens])
    full_ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lens))
    for r in range(2):
        real = layout.split(torch.ones(sum(lens), dtype=torch.bool), r, pad_value=False)
        assert torch.equal(layout.positions(r)[real], layout.split(full_positions, r)[real])
        assert torch.equal(layout.seq_ids(r)[real], layout.split(full_ids, r)[real])
        # Padding continues its sequence's positions past the real tokens.
        for seq in range(3):
            pad = (~real) & (layout.seq_ids(r) == seq)
            assert bool((layout.positions(r)[pad] >= lens[seq]).all())


def _sample(n: int, loss_from: int, seed: int) -> Sample:
    """A sample with every RL input, each a different random tensor."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 50, (n,), generator=gen)
    labels = torch.randint(3, 50, (n,), generator=gen)
    return Sample(
        input_ids=ids,
        labels=labels,
        loss_mask=torch.arange(n) >= loss_from,
        advantages=torch.randn(n, generator=gen),
        sampler_logprobs=-torch.rand(n, generator=gen),
        prox_logprobs=-torch.rand(n, generator=gen),
        rollout_weights=torch.rand(n, generator=gen),
        ref_logprobs=-torch.rand(n, generator=gen),
        loss_weights=torch.randn(n, generator=gen),
        ratio_mask=(torch.rand(n, generator=gen) < 0.5).float(),
        returns=torch.randn(n, generator=gen),
        old_values=torch.randn(n, generator=gen),
        group_id=seed // 2,
    )


@pytest.mark.parametrize("cp, tp", [(2, 1), (3, 1), (2, 2), (4, 2)])
def test_shard_microbatch_moves_every_field_with_one_index(cp, tp):
    samples = [_sample(11, 4, 0), _sample(1, 0, 1), _sample(6, 6, 2), _sample(9, 0, 3)]
    mb = pack(samples, inputs=OPTIONAL_INPUTS)
    layout = microbatch_layout(mb, cp, tp)
    shards = [shard_microbatch(mb, cp, r, tp) for r in range(cp)]
    assert set(mb.token_fields()) == set(TOKEN_FIELDS) - {"vision_index", "seq_log_ratio", "routed_experts"}
    for name in (*mb.token_fields(), "positions", "seq_ids"):
        restored = layout.gather([getattr(s, name) for s in shards])
        assert torch.equal(restored, getattr(mb, name)), name
    # Each token's RL inputs are those of its own sequence at the same position as its label.
    for name in RL_TOKEN_INPUTS:
        assert torch.equal(getattr(mb, name), torch.cat([getattr(x, name) for x in samples])), name
    assert mb.group_ids.tolist() == [x.group_id for x in samples for _ in range(len(x))]
    for r, s in enumerate(shards):
        # Padding carries zero RL inputs (and, as before, no loss).
        pad = ~layout.split(torch.ones(mb.num_tokens, dtype=torch.bool), r)
        assert pad.any() and all(not getattr(s, name)[pad].any() for name in RL_TOKEN_INPUTS)
    for s in shards:
        assert s.num_tokens % tp == 0 and s.seq_lens == mb.seq_lens and s.num_seqs == mb.num_seqs
        # Whole-micro-batch counts travel unchanged: weights need the unsplit n_i and N_k.
        assert s.num_loss_tokens == mb.num_loss_tokens == sum(x.num_loss_tokens for x in samples)
    # No loss token is lost or duplicated, and padding never carries loss.
    assert sum(int(s.loss_mask.sum()) for s in shards) == mb.num_loss_tokens


def test_filler_microbatch_splits_into_equal_shares():
    shards = [shard_microbatch(padding_microbatch(1), 4, r, 2) for r in range(4)]
    assert [s.num_tokens for s in shards] == [4, 4, 4, 4]  # 1 token padded to 2·cp·tp = 16
    assert all(s.is_padding and not s.loss_mask.any() for s in shards)


def test_layout_rejects_empty_segments_and_bad_degrees():
    with pytest.raises(ValueError, match="at least one token"):
        ZigzagLayout.build([3, 0], 2)
    with pytest.raises(ValueError, match="cp and multiple"):
        ZigzagLayout.build([3], 0)


@pytest.mark.parametrize("cp, tp", [(2, 1), (2, 2), (4, 1)])
def test_vision_index_splits_like_every_token_and_pads_with_minus_one(cp, tp):
    """An image's placeholder tokens straddle chunk boundaries; every rank keeps its own
    feature rows, padding points at no feature, and the images themselves are not split."""
    vision = VisionPacking(patch_dim=12, merge_size=2)
    samples = [_sample(13, 4, 0), _sample(5, 0, 1)]
    samples[0].images = [SampleImage(torch.randn(8, 12), 2, 4)]  # two feature rows
    samples[0].vision_rows = torch.tensor([-1, -1, -1, 0, 1] + [-1] * 8)
    samples[1].images = [SampleImage(torch.randn(4, 12), 2, 2)]
    samples[1].vision_rows = torch.tensor([-1, -1, 0, -1, -1])
    mb = pack(samples, vision=vision)
    assert mb.vision_index.tolist() == [-1, -1, -1, 0, 1] + [-1] * 8 + [-1, -1, 2, -1, -1]
    layout = microbatch_layout(mb, cp, tp)
    shards = [shard_microbatch(mb, cp, r, tp) for r in range(cp)]
    assert torch.equal(layout.gather([s.vision_index for s in shards]), mb.vision_index)
    for r, s in enumerate(shards):
        pad = ~layout.split(torch.ones(mb.num_tokens, dtype=torch.bool), r)
        assert bool((s.vision_index[pad] == -1).all())
        assert torch.equal(s.image_patches, mb.image_patches) and s.image_grids == ((2, 4), (2, 2))
    # Sample 0's image tokens sit at positions 3 and 4, on both sides of a chunk boundary.
    owners = {r for r, s in enumerate(shards) for v in s.vision_index.tolist() if v in (0, 1)}
    assert len(owners) == 2


@pytest.mark.parametrize("cp, tp", [(1, 1), (1, 4), (2, 1), (2, 2), (4, 1)])
def test_real_token_mask_excludes_every_kind_of_padding(cp, tp):
    """Router statistics count real tokens only: not the sequence-parallel filler, not the CP
    zigzag padding, not a filler micro-batch, on the whole micro-batch and on every share."""
    samples = [_sample(11, 4, 0), _sample(1, 0, 1), _sample(6, 6, 2)]
    whole = pack(samples, pad_multiple=tp if cp == 1 else 1)
    real = whole.real_token_mask()
    assert int(real.sum()) == 18 and bool(real[:18].all())  # padding, if any, comes after
    if cp == 1:
        assert whole.num_padding_tokens == -18 % tp
        return
    layout = microbatch_layout(whole, cp, tp)
    shares = [shard_microbatch(whole, cp, r, tp) for r in range(cp)]
    for r, share in enumerate(shares):
        assert torch.equal(share.real_token_mask(), layout.split(real, r, pad_value=False))
    assert sum(int(s.real_token_mask().sum()) for s in shares) == 18
    assert not shard_microbatch(padding_microbatch(1), cp, 0, tp).real_token_mask().any()
