"""Plan the ``sdpa_varlen`` attention backend: documents grouped into padded SDPA batches.

Each document's queries attend only that document's keys, so the work is the sum over
documents of ``q_len * kv_len`` (Σ Lᵢ² without context parallel, Σ Lᵢ²/cp per rank with it)
instead of the ``T * S`` of one dense masked call. Running one SDPA per document gets that
work but pays a fixed cost per call, which dominates for many short documents; so documents
of similar shape share one batched call ``[count, heads, len, head_dim]``, padded to the
bucket's longest. The split into buckets is the cheapest under the cost model
``CALL_COST + count * q_len * kv_len`` per bucket, so the padded work never exceeds
``Σ q_lenᵢ * kv_lenᵢ + CALL_COST * num_documents`` (the cost of one bucket per document).

Padding slots repeat their document's first row: no real query sees a padded key, and
padded queries' outputs are dropped, so their output gradient is zero and so, exactly, is
every gradient the padded slots send back. A bucket needs no mask when SDPA's own rule is
the document rule: causal with every document's queries and keys exactly positions
``0..n-1`` (padding sits after them and only padded queries can see it), or non-causal with
no key padding. Otherwise it gets a boolean mask ``[count, 1, q_len, kv_len]`` (document rule and key
padding), in which padded query rows see every slot: torch's CPU and math kernels return 0
for a row that sees nothing, but a kernel returning NaN there would turn that zero gradient
into NaN for every key.
"""

import itertools
from dataclasses import dataclass

import torch

# What one more SDPA call (forward and backward) costs on CPU, in query-key pairs of a
# small model: ~150 us per call against ~45 ns per pair at 4 heads of 32 dims
# (scripts/benchmark_attention.py). Merging two documents' shapes into one bucket is worth
# up to this much padding. Wider models pay more per pair, making the padding a bit dearer
# than modelled, but it stays bounded by this constant per document.
CALL_COST = 4096


@dataclass(frozen=True)
class PaddedBucket:
    """Documents attended as one SDPA batch of ``count`` padded documents."""

    count: int
    q_len: int
    kv_len: int
    # [count * q_len] the row of q for each slot, document by document.
    q_index: torch.Tensor
    # [count * kv_len] likewise for k/v.
    kv_index: torch.Tensor
    # When the slots are rows start, start+1, ... (no padding, documents consecutive), that
    # start: the batch is then a view, without a gather and its backward scatter.
    q_start: int | None
    kv_start: int | None
    # [count, 1, q_len, kv_len] which slots each slot may see; None when plain SDPA (causal,
    # or everything when non-causal) is exact.
    mask: torch.Tensor | None


@dataclass(frozen=True)
class VarlenPlan:
    """What ``sdpa_varlen`` runs in every layer of one forward."""

    buckets: tuple[PaddedBucket, ...]
    # [T] for each query row, its slot among the buckets' concatenated outputs; None when
    # that is the identity.
    query_slots: torch.Tensor | None


@dataclass(frozen=True)
class _Documents:
    """The rows of a token list grouped by sequence, each group sorted by position."""

    order: torch.Tensor  # [N] rows by (sequence, position)
    positions: torch.Tensor  # [N] positions of the rows in ``order``
    ids: list[int]  # sequence id of each document
    starts: list[int]  # where each document begins in ``order``
    lengths: list[int]
    in_order: list[bool]  # positions are exactly 0..length-1

    @classmethod
    def of(cls, seq_ids: torch.Tensor, positions: torch.Tensor) -> "_Documents":
        order = torch.argsort(positions, stable=True)
        order = order.index_select(0, torch.argsort(seq_ids.index_select(0, order), stable=True))
        sorted_positions = positions.index_select(0, order)
        ids, lengths = torch.unique_consecutive(seq_ids.index_select(0, order), return_counts=True)
        starts = lengths.cumsum(0) - lengths
        document_of_row = torch.repeat_interleave(torch.arange(len(ids), device=ids.device), lengths)
        rank_in_document = torch.arange(len(order), device=order.device) - starts.index_select(0, document_of_row)
        misplaced = torch.zeros(len(ids), dtype=torch.long, device=ids.device).index_add_(
            0, document_of_row, (sorted_positions != rank_in_document).long()
        )
        return cls(order, sorted_positions, ids.tolist(), starts.tolist(), lengths.tolist(), (misplaced == 0).tolist())

    def slots(self, documents: list[int], widths: list[int]) -> "_Slots":
        """``widths[i]`` slots for document ``documents[i]``, one after the other."""
        device = self.order.device
        starts = torch.tensor([self.starts[d] for d in documents], device=device)
        lengths = torch.tensor([self.lengths[d] for d in documents], device=device)
        widths_t = torch.tensor(widths, device=device)
        document_of_slot = torch.repeat_interleave(torch.arange(len(documents), device=device), widths_t)
        offset = torch.arange(sum(widths), device=device) - (widths_t.cumsum(0) - widths_t)[document_of_slot]
        valid = offset < lengths[document_of_slot]
        sorted_rows = starts[document_of_slot] + torch.where(valid, offset, 0)
        return _Slots(self.order[sorted_rows], valid, self.positions[sorted_rows])


@dataclass(frozen=True)
class _Slots:
    """Slots of every bucket, bucket after bucket: the row each reads (padding: its
    document's first row, see the module docstring), whether it is real, its position."""

    rows: torch.Tensor
    valid: torch.Tensor
    positions: torch.Tensor

    def consecutive_starts(self, bounds: list[tuple[int, int]]) -> list[int | None]:
        """For each slot range, its first row if its slots read rows first, first + 1, ...
        (no padding: a range's first slot is always real)."""
        is_break = (self.rows.diff() != 1) | ~self.valid[1:]
        breaks_before = torch.cat((is_break.new_zeros(1, dtype=torch.long), is_break.long().cumsum(0)))
        firsts = torch.tensor([a for a, _ in bounds], device=self.rows.device)
        lasts = torch.tensor([b - 1 for _, b in bounds], device=self.rows.device)
        unbroken = breaks_before[lasts] == breaks_before[firsts]
        return [row if ok else None for row, ok in zip(self.rows[firsts].tolist(), unbroken.tolist())]


def plan_varlen(
    q_seq_ids: torch.Tensor,
    q_positions: torch.Tensor,
    kv_seq_ids: torch.Tensor,
    kv_positions: torch.Tensor,
    causal: bool,
) -> VarlenPlan:
    """Bucket the documents of these queries and keys (see the module docstring)."""
    self_attention = kv_seq_ids is q_seq_ids and kv_positions is q_positions  # keys are the queries
    queries = _Documents.of(q_seq_ids, q_positions)
    keys = queries if self_attention else _Documents.of(kv_seq_ids, kv_positions)
    key_document = {seq: d for d, seq in enumerate(keys.ids)}
    for seq in queries.ids:
        if seq not in key_document:
            raise ValueError(f"the queries of sequence {seq} have no keys; every query must see at least one key")

    # Documents of one (q_len, kv_len) shape always share a bucket; the DP splits the
    # shapes, largest first.
    by_shape: dict[tuple[int, int], list[int]] = {}
    for d, seq in enumerate(queries.ids):
        by_shape.setdefault((queries.lengths[d], keys.lengths[key_document[seq]]), []).append(d)
    shapes = sorted(by_shape, key=lambda s: (s[1], s[0]), reverse=True)
    groups = []  # (query documents, key documents, q_len, kv_len) of each bucket
    for start, end in _cheapest_split(shapes, [len(by_shape[s]) for s in shapes]):
        q_docs = [d for shape in shapes[start:end] for d in by_shape[shape]]
        kv_docs = [key_document[queries.ids[d]] for d in q_docs]
        groups.append((q_docs, kv_docs, max(s[0] for s in shapes[start:end]), max(s[1] for s in shapes[start:end])))

    q_slots = queries.slots([d for g in groups for d in g[0]], [g[2] for g in groups for _ in g[0]])
    q_bounds = _bounds([len(g[0]) * g[2] for g in groups])
    q_starts = q_slots.consecutive_starts(q_bounds)
    if self_attention:  # then every bucket has the same documents and lengths on both sides
        kv_slots, kv_bounds, kv_starts = q_slots, q_bounds, q_starts
    else:
        kv_slots = keys.slots([d for g in groups for d in g[1]], [g[3] for g in groups for _ in g[1]])
        kv_bounds = _bounds([len(g[1]) * g[3] for g in groups])
        kv_starts = kv_slots.consecutive_starts(kv_bounds)
    buckets = []
    for (q_docs, kv_docs, q_len, kv_len), (qa, qb), (ka, kb), q_start, kv_start in zip(
        groups, q_bounds, kv_bounds, q_starts, kv_starts
    ):
        plain = (
            all(
                queries.in_order[q] and keys.in_order[k] and queries.lengths[q] == keys.lengths[k]
                for q, k in zip(q_docs, kv_docs)
            )
            if causal
            else all(keys.lengths[k] == kv_len for k in kv_docs)
        )
        mask = (
            None
            if plain
            else _mask(
                *(x[qa:qb].view(len(q_docs), q_len) for x in (q_slots.valid, q_slots.positions)),
                *(x[ka:kb].view(len(kv_docs), kv_len) for x in (kv_slots.valid, kv_slots.positions)),
                causal,
            )
        )
        buckets.append(
            PaddedBucket(len(q_docs), q_len, kv_len, q_slots.rows[qa:qb], kv_slots.rows[ka:kb], q_start, kv_start, mask)
        )

    query_slots = torch.empty(len(queries.order), dtype=torch.long, device=q_slots.rows.device)
    query_slots[q_slots.rows[q_slots.valid]] = torch.nonzero(q_slots.valid).squeeze(1)
    if q_slots.rows.numel() == query_slots.numel() and torch.equal(
        query_slots, torch.arange(len(query_slots), device=query_slots.device)
    ):
        query_slots = None  # the buckets' slots are the query rows in order
    return VarlenPlan(tuple(buckets), query_slots)


def _bounds(sizes: list[int]) -> list[tuple[int, int]]:
    ends = list(itertools.accumulate(sizes))
    return [(end - size, end) for size, end in zip(sizes, ends)]


def _cheapest_split(shapes: list[tuple[int, int]], counts: list[int]) -> list[tuple[int, int]]:
    """Cut the shapes, sorted by kv_len descending, into consecutive runs minimizing
    Σ CALL_COST + count·q_len·kv_len over the runs (dynamic programming over the last cut).

    At most O(m²) in the number m of distinct shapes, and m ≤ sqrt(2·S) since distinct
    lengths sum to at most the S keys.
    """
    best = [0] + [float("inf")] * len(shapes)
    cut = [0] * (len(shapes) + 1)
    for end in range(1, len(shapes) + 1):
        max_q = count = 0
        for start in range(end - 1, -1, -1):
            max_q = max(max_q, shapes[start][0])
            count += counts[start]
            run_cost = CALL_COST + count * max_q * shapes[start][1]  # kv_len: the run's largest
            if run_cost >= best[end]:
                break  # and run_cost only grows as the run reaches further back
            if best[start] + run_cost < best[end]:
                best[end], cut[end] = best[start] + run_cost, start
    runs, end = [], len(shapes)
    while end > 0:
        runs.append((cut[end], end))
        end = cut[end]
    return runs[::-1]


def _mask(q_valid, q_pos, kv_valid, kv_pos, causal: bool) -> torch.Tensor:
    """``[count, 1, q_len, kv_len]``: the document rule on the slots' positions, no padded key
    visible, and padded queries seeing every slot (see the module docstring)."""
    visible = kv_valid[:, None, :].expand(-1, q_valid.shape[1], -1)
    if causal:
        visible = visible & (kv_pos[:, None, :] <= q_pos[:, :, None])
    return (visible | ~q_valid[:, :, None]).unsqueeze(1)
