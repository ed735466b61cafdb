"""Context parallel: the per-sequence load-balanced split of packed token buffers over the CP
ranks, and the gather that undoes it. Splitting a micro-batch with it is ``data/cp_split.py``;
attention over K/V gathered from every CP rank is ``models.attention.cp_attention_context``.

Causal attention makes late tokens expensive, so cutting a sequence into ``cp`` contiguous
pieces would leave the last rank with most of the work. Instead each sequence is padded to
a multiple of ``2·cp`` (times ``multiple``, the sequence-parallel degree, so every rank's
share still splits evenly over TP), cut into ``2·cp`` equal chunks, and rank r keeps chunks
r and ``2cp−1−r`` ("zigzag"): every rank gets one early and one late chunk of every sequence.

Padding tokens belong to their sequence with positions continuing past its end: the
document-causal rule (a key is visible when its position is <= the query's) hides them from
every real token, and their loss mask is 0, so they change no number.
"""

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_rl.compat import all_gather


def padded_length(num_tokens: int, cp: int, multiple: int = 1) -> int:
    """``num_tokens`` rounded up to a multiple of ``2·cp·multiple``."""
    unit = 2 * cp * multiple
    return -(-num_tokens // unit) * unit


@dataclass(frozen=True)
class ZigzagLayout:
    """Where every token of a packed buffer goes when its segments are split over ``cp`` ranks.

    A segment is a run of tokens sharing one ``seq_id`` (a sequence, or the zero-weight
    filler). All index tensors live on the host.
    """

    cp: int
    segment_lens: tuple[int, ...]
    padded_lens: tuple[int, ...]
    real_index: torch.Tensor  # [T] where each original token sits in the padded buffer
    rank_index: tuple[torch.Tensor, ...]  # per rank: the padded-buffer rows it keeps, in order

    @classmethod
    def build(cls, segment_lens: list[int], cp: int, multiple: int = 1) -> "ZigzagLayout":
        if cp < 1 or multiple < 1:
            raise ValueError(f"cp and multiple must be >= 1, got cp={cp}, multiple={multiple}")
        if any(n < 1 for n in segment_lens):
            raise ValueError(f"every segment needs at least one token, got lengths {segment_lens}")
        padded_lens = [padded_length(n, cp, multiple) for n in segment_lens]
        real, per_rank = [], [[] for _ in range(cp)]
        start = 0
        for n, padded in zip(segment_lens, padded_lens):
            real.append(torch.arange(start, start + n))
            chunk = padded // (2 * cp)
            for r in range(cp):
                for c in (r, 2 * cp - 1 - r):
                    per_rank[r].append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
            start += padded
        empty = torch.zeros(0, dtype=torch.long)
        return cls(
            cp=cp,
            segment_lens=tuple(segment_lens),
            padded_lens=tuple(padded_lens),
            real_index=torch.cat(real) if real else empty,
            rank_index=tuple(torch.cat(rows) if rows else empty for rows in per_rank),
        )

    @property
    def num_padded_tokens(self) -> int:
        return sum(self.padded_lens)

    def split(self, values: torch.Tensor, rank: int, pad_value=0) -> torch.Tensor:
        """Rank ``rank``'s share of a per-token tensor (dim 0 = the original tokens)."""
        assert values.shape[0] == self.real_index.numel(), (values.shape, self.real_index.shape)
        padded = values.new_full((self.num_padded_tokens, *values.shape[1:]), pad_value)
        padded[self.real_index] = values
        return padded[self.rank_index[rank]]

    def gather(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of ``split``: the original tokens from every rank's share, padding dropped."""
        assert len(shards) == self.cp
        first = shards[0]
        padded = first.new_empty((self.num_padded_tokens, *first.shape[1:]))
        for index, shard in zip(self.rank_index, shards):
            padded[index.to(shard.device)] = shard
        return padded[self.real_index.to(first.device)]

    def positions(self, rank: int) -> torch.Tensor:
        """Each kept token's position in its own segment (padding continues past the end)."""
        return torch.cat([torch.arange(n) for n in self.padded_lens])[self.rank_index[rank]]

    def seq_ids(self, rank: int) -> torch.Tensor:
        lens = torch.tensor(self.padded_lens)
        return torch.repeat_interleave(torch.arange(len(lens)), lens)[self.rank_index[rank]]


def gather_from_cp_ranks(local: torch.Tensor, layout: ZigzagLayout, cp_mesh: DeviceMesh) -> torch.Tensor:
    """Every token's value (no gradient) in the original order, from each rank's share."""
    return layout.gather(list(all_gather(local, cp_mesh).chunk(layout.cp)))
