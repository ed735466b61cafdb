"""A packed micro-batch split over the context-parallel ranks: each rank's zigzag share of
every per-token field (the layout itself is ``distributed.context_parallel.ZigzagLayout``)."""

from dataclasses import replace

import torch

from torchtitan_rl.data.packing import TOKEN_PAD_VALUES, MicroBatch
from torchtitan_rl.distributed.context_parallel import ZigzagLayout


def microbatch_layout(mb: MicroBatch, cp: int, multiple: int = 1) -> ZigzagLayout:
    """The zigzag layout of a (whole, unsplit) packed micro-batch."""
    segment_lens = torch.bincount(mb.seq_ids, minlength=mb.num_seqs).tolist()
    return ZigzagLayout.build(segment_lens, cp, multiple)


def shard_microbatch(mb: MicroBatch, cp: int, rank: int, multiple: int = 1) -> MicroBatch:
    """CP rank ``rank``'s share of a whole micro-batch.

    Labels, loss masks, RL inputs and the per-sequence loss-token counts were built on the
    whole sequences and are only moved here, all with the same index, so weights computed
    from the share are exactly the whole sequence's weights, restricted to this rank's tokens.
    Images are not split: every CP rank runs the vision tower on all of them and its share
    of ``vision_index`` picks its own feature rows, so an image whose tokens straddle a chunk
    boundary lands on both ranks correctly.
    """
    layout = microbatch_layout(mb, cp, multiple)
    return replace(
        mb,
        **{
            name: layout.split(values, rank, TOKEN_PAD_VALUES.get(name, 0))
            for name, values in mb.token_fields().items()
        },
        positions=layout.positions(rank),
        seq_ids=layout.seq_ids(rank),
        cp_layout=layout,
    )
