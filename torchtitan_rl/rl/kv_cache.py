"""The rollout generator's KV cache and the attention states that write and read it.

A ``KVCache`` holds every layer's keys and values; row r, slot p holds the key / value of the
token at position p of row r's sequence. An attention state (``models/attention.py``) passed to
the model's forward writes each new token's keys and values to its row's slot, then attends
to the row's slots ``0..position``.

The cache is only ever read through views (a slice of rows and slots), never gathered by
advanced indexing: that would copy a row's slots once per new token and layer, so an
observation of n tokens per row would allocate n times the layer's cache.
"""

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from torchtitan_rl.models.attention import AttentionContext, LayerAttention


@dataclass(frozen=True)
class KVCache:
    """Keys and values of every layer, each ``[n_layers, rows, slots, n_kv_heads, head_dim]``."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def zeros(cls, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> "KVCache":
        # Zeros, not empty: masked slots get zero weight, and 0 * NaN garbage would still be NaN.
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def num_slots(self) -> int:
        return self.k.shape[2]

    @property
    def num_rows(self) -> int:
        return self.k.shape[1]

    def copy_rows_to(self, new: "KVCache", num_kept: int) -> None:
        """Copy this cache's first ``num_kept`` rows into ``new`` (the slots both have). Rows are
        copied one at a time, so nothing but the two caches is allocated."""
        kept = min(new.num_slots, self.num_slots)
        for row in range(num_kept):
            new.k[:, row, :kept].copy_(self.k[:, row, :kept])
            new.v[:, row, :kept].copy_(self.v[:, row, :kept])

    def move_row(self, source: int, target: int, num_slots: int) -> None:
        """Copy the first ``num_slots`` slots of row ``source`` into row ``target``."""
        self.k[:, target, :num_slots].copy_(self.k[:, source, :num_slots])
        self.v[:, target, :num_slots].copy_(self.v[:, source, :num_slots])


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """SDPA of ``q [B, n_heads, L, D]`` over cache views ``[B, n_kv_heads, S, D]`` where ``visible``."""
    return F.scaled_dot_product_attention(
        q,
        keys,
        values,
        attn_mask=visible,
        scale=q.shape[-1] ** -0.5,
        enable_gqa=q.shape[1] != keys.shape[1],
    )


@dataclass(frozen=True)
class PrefillAttention:
    """Attention state of a prefill: each layer attends like the packed forward (``context``)
    and writes its keys and values to the cache, token j of prompt i into slot ``positions[j]``
    of the ``samples`` rows of that prompt (``rows``, ``slots``: one entry per token and sample)."""

    context: AttentionContext
    cache: KVCache
    rows: torch.Tensor
    slots: torch.Tensor
    samples: int

    def for_layer(self, layer_id: int) -> LayerAttention:
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.cache.k[layer_id].index_put_((self.rows, self.slots), k.repeat_interleave(self.samples, dim=0))
            self.cache.v[layer_id].index_put_((self.rows, self.slots), v.repeat_interleave(self.samples, dim=0))
            return self.context(q, k, v)

        return attend


@dataclass(frozen=True)
class DecodeAttention:
    """Attention state of a decode step: one new token for each of the cache's first rows
    (``len(positions)`` of them), row i's at ``positions[i]``. Each is written to its slot, then
    attends to its row's slots ``0..position``, read through the view of the first ``span``
    slots (at least the furthest position + 1). The query heads that share a KV head are that
    head's query rows, so no backend needs the KV heads repeated. ``build`` makes one."""

    cache: KVCache
    positions: torch.Tensor  # [R]
    visible: torch.Tensor  # [R, 1, 1, span] bool: slot s <= positions[r]

    @classmethod
    def build(cls, cache: KVCache, positions: torch.Tensor, span: int) -> "DecodeAttention":
        slots = torch.arange(span, device=positions.device)
        return cls(cache, positions, (slots[None, :] <= positions[:, None])[:, None, None, :])

    def for_layer(self, layer_id: int) -> LayerAttention:
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            num_rows, span = q.shape[0], self.visible.shape[-1]
            keys, values = self.cache.k[layer_id, :num_rows], self.cache.v[layer_id, :num_rows]
            rows = torch.arange(num_rows, device=q.device)
            keys.index_put_((rows, self.positions), k)
            values.index_put_((rows, self.positions), v)
            # Query head h reads KV head h // (heads per KV head), as with enable_gqa.
            queries = q.view(num_rows, k.shape[1], -1, q.shape[-1])
            views = [c[:, :span].transpose(1, 2) for c in (keys, values)]
            return _attend(queries, *views, self.visible).reshape(q.shape)

        return attend


@dataclass(frozen=True)
class _Run:
    """Several new tokens of one cache row: packed tokens ``start:end``, which see the row's
    slots where ``visible [end - start, span]``."""

    start: int
    end: int
    row: int
    visible: torch.Tensor


@dataclass(frozen=True)
class ExtendAttention:
    """Attention state feeding any number of new tokens per cache row, packed row after row:
    each token is written to its row's slot at its position, then attends to that row's slots
    ``0..position`` (the row's earlier tokens and the new ones before it). ``build`` makes one.

    Rows with a single new token (decoding) attend together, in one SDPA call over the view of
    cache rows ``first_row..first_row + len(single_visible)``; a row of that range without a
    single new token gets a zero query whose output is dropped. The query heads that share a KV
    head are that call's query rows, so no backend needs the KV heads repeated. A row with
    several new tokens (a turn's stop token and an observation) attends alone, over the view of
    its own row.
    """

    cache: KVCache
    rows: torch.Tensor  # [T] the cache row of each packed token
    positions: torch.Tensor  # [T]
    singles: torch.Tensor  # [S] the packed index of each single new token
    single_rows: torch.Tensor  # [S] its cache row - first_row
    first_row: int
    single_visible: torch.Tensor  # [rows of the range, 1, 1, span] bool
    runs: tuple[_Run, ...]

    @classmethod
    def build(cls, cache: KVCache, rows: list[int], num_cached: list[int], num_new: list[int]) -> "ExtendAttention":
        """The state of a forward of ``num_new[i]`` new tokens of cache row ``rows[i]`` (whose
        first ``num_cached[i]`` slots hold its earlier tokens), packed in that order."""
        device = cache.k.device
        starts = [0, *accumulate(num_new)]
        singles = [i for i, n in enumerate(num_new) if n == 1]
        runs = tuple(
            _Run(starts[i], starts[i + 1], rows[i], _visible(torch.arange(c, c + n, device=device)))
            for i, (c, n) in enumerate(zip(num_cached, num_new))
            if n > 1
        )
        first_row = min((rows[i] for i in singles), default=0)
        num_range = max((rows[i] + 1 - first_row for i in singles), default=0)
        single_positions = [0] * num_range  # a row of the range without a single token: slot 0 only
        for i in singles:
            single_positions[rows[i] - first_row] = num_cached[i]
        return cls(
            cache,
            torch.tensor([row for row, n in zip(rows, num_new) for _ in range(n)], device=device),
            torch.tensor([c + j for c, n in zip(num_cached, num_new) for j in range(n)], device=device),
            torch.tensor([starts[i] for i in singles], dtype=torch.long, device=device),
            torch.tensor([rows[i] - first_row for i in singles], dtype=torch.long, device=device),
            first_row,
            _visible(torch.tensor(single_positions, dtype=torch.long, device=device))[:, None, None, :],
            runs,
        )

    def for_layer(self, layer_id: int) -> LayerAttention:
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys, values = self.cache.k[layer_id], self.cache.v[layer_id]
            keys.index_put_((self.rows, self.positions), k)
            values.index_put_((self.rows, self.positions), v)
            out = torch.empty_like(q)
            if self.singles.numel():
                num_range, span = self.single_visible.shape[0], self.single_visible.shape[-1]
                block = slice(self.first_row, self.first_row + num_range)
                queries = q.new_zeros(num_range, *q.shape[1:])
                queries[self.single_rows] = q[self.singles]
                # Query head h reads KV head h // (heads per KV head), as with enable_gqa.
                queries = queries.view(num_range, k.shape[1], -1, q.shape[-1])
                views = [c[block, :span].transpose(1, 2) for c in (keys, values)]
                attended = _attend(queries, *views, self.single_visible).reshape(num_range, *q.shape[1:])
                out[self.singles] = attended[self.single_rows]
            for run in self.runs:
                span = run.visible.shape[-1]
                views = [c[run.row, :span].transpose(0, 1)[None] for c in (keys, values)]
                queries = q[run.start : run.end].transpose(0, 1)[None]
                out[run.start : run.end] = _attend(queries, *views, run.visible)[0].transpose(0, 1)
            return out

        return attend


def _visible(positions: torch.Tensor) -> torch.Tensor:
    """``[len(positions), max position + 1]`` bool: slot s is visible to a token at position p iff s <= p."""
    span = int(positions.max()) + 1 if positions.numel() else 0
    slots = torch.arange(span, device=positions.device)
    return slots[None, :] <= positions[:, None]
