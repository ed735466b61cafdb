"""Document-causal (or bidirectional) attention over packed micro-batches.

A packed micro-batch folds the batch dimension into tokens: ``seq_ids[t]`` names the sequence
of token t and ``positions[t]`` restarts at 0 for every sequence. Query token i may attend key
token j iff ``seq_ids[j] == seq_ids[i] and positions[j] <= positions[i]``. With
``causal=False`` (the vision encoder: every patch of an image sees the whole image) the
position rule is dropped and the mask is block-diagonal by ``seq_ids`` alone.

Queries and keys are described separately, ``(q_seq_ids, q_positions)`` of length T and
``(kv_seq_ids, kv_positions)`` of length S, so that context parallel can attend local queries
to K/V gathered from other ranks. The rule only looks at ids and positions, never at token
order, so keys may come in any order. Every query must see at least one key (true whenever
the keys include the query's own token); a query with none has no defined output.

Backends: ``sdpa_dense`` is one SDPA call under the dense ``[T, S]`` mask: the rule written
out, and the reference every other backend is tested against, but O(T·S) work.
``sdpa_varlen`` (the CPU default; planned in ``varlen_plan.py``) attends each document's
queries to that document's keys only, documents of similar length batched into one padded
SDPA call, so its work is ∝ Σ Lᵢ² (Σ Lᵢ²/cp on a context-parallel share). ``sdpa_loop``
calls SDPA once per document. ``flex`` (CUDA) runs flex_attention under a block mask; its
call pads queries and keys to whole ``FLEX_BLOCK_SIZE`` blocks with filler tokens that neither
see nor are seen by a real token, and returns the real queries' outputs only.

The mask data depends only on the micro-batch, so it is built once per forward into an
``AttentionContext`` and shared by every layer.

What the layers of one forward attend with is an ``AttentionState``, passed to the model's
forward: ``state.for_layer(i)`` is the ``LayerAttention`` of layer i, a function
``(q, k, v) -> out``. An ``AttentionContext`` is the state of plain packed attention (the same
context for every layer); ``cp_attention_context`` builds one whose keys are gathered over the
context-parallel ranks; an inference engine's KV cache gives each layer its own cache slot
(``rl/kv_cache.py``).
"""

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cache, partial
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.flex_attention import (
    BlockMask,
    create_block_mask,
    flex_attention,
)

from torchtitan_rl.compat import all_gather, all_gather_autograd
from torchtitan_rl.models.varlen_plan import VarlenPlan, plan_varlen

ATTN_BACKENDS = ("sdpa_dense", "sdpa_varlen", "sdpa_loop", "flex")
ATTN_BACKEND_CHOICES = ("auto", *ATTN_BACKENDS)
FLEX_MIN_HEAD_DIM = 16
"""flex_attention's compiled kernels refuse smaller heads (torch 2.11 and 2.13)."""
FLEX_BLOCK_SIZE = 128
"""Tokens per side of a flex block-mask tile. Compiled flex_attention finds no kernel for a
sequence shorter than one tile (torch 2.11, CUDA), so the flex backend pads queries and keys to
whole tiles."""


def resolve_attn_backend(name: str, device: torch.device | str, head_dims: tuple[int, ...] = ()) -> str:
    """Turn a configured backend name into the concrete backend to use on ``device`` for
    attention layers of ``head_dims`` (when known): ``auto`` is flex on CUDA unless a head is
    below ``FLEX_MIN_HEAD_DIM``, where it is ``sdpa_varlen``, as on the CPU."""
    if name not in ATTN_BACKEND_CHOICES:
        raise ValueError(f"unknown attention backend {name!r}; valid: {', '.join(ATTN_BACKEND_CHOICES)}")
    device_type = torch.device(device).type
    small_heads = min(head_dims, default=FLEX_MIN_HEAD_DIM) < FLEX_MIN_HEAD_DIM
    if name == "auto":
        return "flex" if device_type == "cuda" and not small_heads else "sdpa_varlen"
    if name == "flex" and small_heads:
        raise ValueError(
            f"attention backend 'flex' needs heads of at least {FLEX_MIN_HEAD_DIM} dims, the model has "
            f"{min(head_dims)}; use 'auto', 'sdpa_varlen', 'sdpa_dense' or 'sdpa_loop'"
        )
    if name == "flex" and device_type != "cuda":
        raise ValueError(
            f"attention backend 'flex' needs CUDA (flex_attention has no backward on "
            f"{device_type}); use 'sdpa_varlen', 'sdpa_dense' or 'sdpa_loop'"
        )
    return name


@dataclass(frozen=True)
class DocumentSlice:
    """The queries and keys of one sequence, for the per-document loop."""

    q_index: torch.Tensor  # [t] rows of q belonging to this sequence
    kv_index: torch.Tensor  # [s] rows of k/v belonging to this sequence
    # None when no mask is needed: non-causal attention (every key of the document is
    # visible), or causal with queries and keys both positions 0..n-1 in order, so plain
    # causal SDPA applies. Otherwise the rule evaluated on this document's positions, [t, s].
    mask: torch.Tensor | None


class AdditiveMasks:
    """(id of a boolean mask, dtype) -> the mask as 0 / -inf.

    A plain object on purpose: FSDP2 rebuilds dataclasses, dicts and tuples among a module's
    inputs (casting their tensors) before every block, which would give each layer its own
    copy of a dict, but it passes other objects through as they are.
    """

    def __init__(self):
        self.by_key: dict[tuple[int, torch.dtype], torch.Tensor] = {}


@dataclass(frozen=True)
class AttentionContext:
    """Per-forward mask data; exactly one of the backend-specific fields is set."""

    backend: str
    dense_mask: torch.Tensor | None = None  # sdpa_dense: [T, S] bool
    varlen: VarlenPlan | None = None  # sdpa_varlen: documents in padded SDPA batches
    documents: tuple[DocumentSlice, ...] | None = None  # sdpa_loop
    # sdpa_loop: maps the concatenated per-document outputs back to query order; None when
    # the documents already cover the queries in order.
    inverse_query_order: torch.Tensor | None = None
    block_mask: BlockMask | None = None  # flex
    # Context parallel: gathers this rank's ``[T, ...]`` keys/values into the ``[S, ...]`` keys
    # the mask describes (an autograd all-gather over the CP ranks); None when keys are local.
    gather_kv: Callable[[torch.Tensor], torch.Tensor] | None = None
    # The boolean masks above in additive float form, made once per forward: given a boolean
    # mask, SDPA makes a float copy in every call and keeps it for backward (one [T, S] tensor
    # per layer).
    additive_masks: "AdditiveMasks" = field(default_factory=lambda: AdditiveMasks(), compare=False, repr=False)
    # False: bidirectional within a sequence. sdpa_loop needs it at call time (a document
    # without a mask means "causal" or "everything" depending on it); the other backends
    # have it baked into their masks.
    causal: bool = True

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return packed_attention(q, k, v, self)

    def for_layer(self, layer_id: int) -> "AttentionContext":
        """Every layer attends under the same mask data."""
        return self


LayerAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""One layer's attention: ``q [T, n_heads, head_dim], k, v [T, n_kv_heads, head_dim] ->
[T, n_heads, head_dim]`` (k and v are the layer's own tokens' keys and values)."""


class AttentionState(Protocol):
    """What the layers of one forward attend with (see the module docstring)."""

    def for_layer(self, layer_id: int) -> LayerAttention: ...


def build_attention_context(
    backend: str,
    q_seq_ids: torch.Tensor,
    q_positions: torch.Tensor,
    kv_seq_ids: torch.Tensor | None = None,
    kv_positions: torch.Tensor | None = None,
    causal: bool = True,
) -> AttentionContext:
    """Build the mask data for one forward. Keys default to the queries' own tokens.

    ``backend`` may be "auto"; it is resolved against the device of ``q_seq_ids``. With
    ``causal=False`` a query sees every key of its own sequence (positions are then unused
    by the mask, but still checked for shape).
    """
    if kv_seq_ids is None and kv_positions is None:
        kv_seq_ids, kv_positions = q_seq_ids, q_positions
    elif kv_seq_ids is None or kv_positions is None:
        raise ValueError("pass both kv_seq_ids and kv_positions, or neither")
    for name, ids, pos in (("q", q_seq_ids, q_positions), ("kv", kv_seq_ids, kv_positions)):
        if ids.dim() != 1 or ids.shape != pos.shape:
            raise ValueError(
                f"{name}_seq_ids and {name}_positions must be 1-D of equal length, got "
                f"{tuple(ids.shape)} and {tuple(pos.shape)}"
            )
    backend = resolve_attn_backend(backend, q_seq_ids.device)
    if backend == "sdpa_dense":
        return AttentionContext(
            backend,
            dense_mask=_dense_mask(q_seq_ids, q_positions, kv_seq_ids, kv_positions, causal),
            causal=causal,
        )
    if backend == "sdpa_varlen":
        return AttentionContext(
            backend, varlen=plan_varlen(q_seq_ids, q_positions, kv_seq_ids, kv_positions, causal), causal=causal
        )
    if backend == "sdpa_loop":
        documents, inverse_order = _document_slices(q_seq_ids, q_positions, kv_seq_ids, kv_positions, causal)
        return AttentionContext(backend, documents=documents, inverse_query_order=inverse_order, causal=causal)
    return AttentionContext(
        backend,
        block_mask=_flex_block_mask(q_seq_ids, q_positions, kv_seq_ids, kv_positions, causal),
        causal=causal,
    )


def cp_attention_context(
    cp_mesh: DeviceMesh, backend: str, seq_ids: torch.Tensor, positions: torch.Tensor
) -> AttentionContext:
    """The context of this rank's share of a context-parallel micro-batch, whose keys are the
    tokens of every CP rank.

    Queries stay this rank's tokens; K/V are all-gathered over ``cp`` inside attention (the
    autograd gather's backward reduce-scatters, i.e. sums, the gradients of the gathered
    K/V back to their owners), and the mask is built from the gathered ``(seq_ids,
    positions)`` so it is the same document-causal rule as without CP.
    """
    kv_seq_ids = all_gather(seq_ids, cp_mesh)
    kv_positions = all_gather(positions, cp_mesh)
    context = build_attention_context(backend, seq_ids, positions, kv_seq_ids, kv_positions)
    return replace(context, gather_kv=partial(all_gather_autograd, mesh=cp_mesh))


@torch.compiler.disable  # per-forward mask data: compiled blocks break here, see distributed/compile.py
def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: AttentionContext) -> torch.Tensor:
    """Attend ``q [T, n_heads, head_dim]`` to ``k, v [S, n_kv_heads, head_dim]``.

    With ``context.gather_kv`` (context parallel), ``k, v`` are this rank's ``[T, ...]`` and
    are gathered into the ``S`` keys the context's mask describes.

    GQA: query head h uses kv head ``h // (n_heads // n_kv_heads)``. Returns
    ``[T, n_heads, head_dim]``; the scale is ``1 / sqrt(head_dim)``.
    """
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"n_heads ({q.shape[1]}) must be a multiple of n_kv_heads ({k.shape[1]})")
    scale = q.shape[-1] ** -0.5
    if context.gather_kv is not None:
        # One collective for both: K and V share their token layout.
        k, v = context.gather_kv(torch.cat((k, v), dim=-1)).chunk(2, dim=-1)
    if context.backend == "sdpa_varlen":
        return _varlen_attention(q, k, v, context, scale)
    if context.backend == "sdpa_dense":
        return _sdpa(q, k, v, _additive_mask(context, context.dense_mask, q.dtype), scale, context.causal)
    if context.backend == "sdpa_loop":
        outputs = [
            _sdpa(
                q.index_select(0, doc.q_index),
                k.index_select(0, doc.kv_index),
                v.index_select(0, doc.kv_index),
                _additive_mask(context, doc.mask, q.dtype),
                scale,
                context.causal,
            )
            for doc in context.documents
        ]
        out = torch.cat(outputs)
        if context.inverse_query_order is not None:
            out = out.index_select(0, context.inverse_query_order)
        return out
    assert context.backend == "flex", context.backend
    # The block mask describes the padded tokens (see _pad_for_flex): zero fillers go after the
    # real ones and only the real queries' outputs come back, so fillers add nothing to any real
    # output or gradient.
    padded_q_len, padded_kv_len = context.block_mask.seq_lengths
    out = _compiled_flex_attention()(
        _to_bhld(_pad_tokens(q, padded_q_len)),
        _to_bhld(_pad_tokens(k, padded_kv_len)),
        _to_bhld(_pad_tokens(v, padded_kv_len)),
        block_mask=context.block_mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0, :, : q.shape[0]].transpose(0, 1)


def _pad_tokens(x: torch.Tensor, length: int) -> torch.Tensor:
    """``x [L, heads, head_dim]`` followed by zero rows up to ``length``."""
    assert 0 <= length - x.shape[0] <= FLEX_BLOCK_SIZE, (x.shape, length)
    return x if x.shape[0] == length else F.pad(x, (0, 0, 0, 0, 0, length - x.shape[0]))


def _varlen_attention(q, k, v, context: AttentionContext, scale: float) -> torch.Tensor:
    outputs = []
    for bucket in context.varlen.buckets:
        q_batch = _batch(q, bucket.q_index, bucket.q_start, bucket.count, bucket.q_len)
        k_batch, v_batch = (_batch(x, bucket.kv_index, bucket.kv_start, bucket.count, bucket.kv_len) for x in (k, v))
        out = F.scaled_dot_product_attention(
            q_batch,
            k_batch,
            v_batch,
            attn_mask=_additive_mask(context, bucket.mask, q.dtype),
            is_causal=context.causal and bucket.mask is None,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        outputs.append(out.transpose(1, 2).flatten(0, 1))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    if context.varlen.query_slots is None:
        return out
    return out.index_select(0, context.varlen.query_slots)


def _batch(x: torch.Tensor, index: torch.Tensor, start: int | None, count: int, length: int) -> torch.Tensor:
    """Rows ``index`` of ``x [N, heads, head_dim]`` as ``[count, heads, length, head_dim]``."""
    rows = x.narrow(0, start, count * length) if start is not None else x.index_select(0, index)
    return rows.unflatten(0, (count, length)).transpose(1, 2)


def _dense_mask(q_seq_ids, q_positions, kv_seq_ids, kv_positions, causal: bool = True) -> torch.Tensor:
    same_sequence = q_seq_ids[:, None] == kv_seq_ids[None, :]
    if not causal:
        return same_sequence
    return same_sequence & (kv_positions[None, :] <= q_positions[:, None])


def _document_slices(q_seq_ids, q_positions, kv_seq_ids, kv_positions, causal: bool = True):
    # One host transfer per forward; grouping T tokens in Python is cheap next to attention.
    q_seq, q_pos = q_seq_ids.tolist(), q_positions.tolist()
    kv_seq, kv_pos = kv_seq_ids.tolist(), kv_positions.tolist()
    q_rows: dict[int, list[int]] = {}
    for row, seq in enumerate(q_seq):
        q_rows.setdefault(seq, []).append(row)
    kv_rows: dict[int, list[int]] = {}
    for row, seq in enumerate(kv_seq):
        kv_rows.setdefault(seq, []).append(row)

    device = q_seq_ids.device
    documents = []
    query_order: list[int] = []
    for seq, q_list in q_rows.items():
        kv_list = kv_rows.get(seq, [])
        q_index = torch.tensor(q_list, dtype=torch.long, device=device)
        kv_index = torch.tensor(kv_list, dtype=torch.long, device=device)
        in_order = list(range(len(q_list)))
        if not causal:
            mask = None  # all of the document's keys, in whatever order they come
        elif [q_pos[r] for r in q_list] == in_order and [kv_pos[r] for r in kv_list] == in_order:
            mask = None
        else:
            mask = _dense_mask(
                q_seq_ids.index_select(0, q_index),
                q_positions.index_select(0, q_index),
                kv_seq_ids.index_select(0, kv_index),
                kv_positions.index_select(0, kv_index),
            )
        documents.append(DocumentSlice(q_index, kv_index, mask))
        query_order.extend(q_list)

    if query_order == list(range(len(q_seq))):
        return tuple(documents), None
    inverse = torch.empty(len(query_order), dtype=torch.long)
    inverse[torch.tensor(query_order, dtype=torch.long)] = torch.arange(len(query_order))
    return tuple(documents), inverse.to(device)


def _pad_for_flex(q_seq_ids, q_positions, kv_seq_ids, kv_positions):
    """The queries' and keys' ids and positions, each followed by filler tokens up to a multiple
    of ``FLEX_BLOCK_SIZE``.

    Fillers take a sequence id below every real one and position 0, so under either rule a
    filler sees every filler key and nothing real, and no real query sees a filler. Keys get a
    block of fillers whenever queries get any, even when they already fill whole blocks: every
    filler query then has a key, so its softmax stays finite.
    """
    num_q_fillers = -q_seq_ids.numel() % FLEX_BLOCK_SIZE
    num_kv_fillers = -kv_seq_ids.numel() % FLEX_BLOCK_SIZE or (FLEX_BLOCK_SIZE if num_q_fillers else 0)
    if num_kv_fillers == 0:
        return q_seq_ids, q_positions, kv_seq_ids, kv_positions
    filler_id = torch.cat((q_seq_ids, kv_seq_ids)).min() - 1  # stays on the device: no sync

    def pad(seq_ids, positions, num_fillers):
        return (
            torch.cat((seq_ids, filler_id.expand(num_fillers))),
            torch.cat((positions, positions.new_zeros(num_fillers))),
        )

    return (*pad(q_seq_ids, q_positions, num_q_fillers), *pad(kv_seq_ids, kv_positions, num_kv_fillers))


def _flex_mask_mod(q_seq_ids, q_positions, kv_seq_ids, kv_positions, causal: bool = True):
    """The masking rule as flex_attention's ``mask_mod`` over the given tokens."""

    def document_causal(batch, head, q_idx, kv_idx):
        same_sequence = q_seq_ids[q_idx] == kv_seq_ids[kv_idx]
        return same_sequence & (kv_positions[kv_idx] <= q_positions[q_idx])

    def same_document(batch, head, q_idx, kv_idx):
        return q_seq_ids[q_idx] == kv_seq_ids[kv_idx]

    return document_causal if causal else same_document


def _flex_block_mask(q_seq_ids, q_positions, kv_seq_ids, kv_positions, causal: bool = True) -> BlockMask:
    """The block mask of the tokens padded by ``_pad_for_flex``; its ``seq_lengths`` are the
    padded lengths the flex call pads q, k and v to."""
    padded = _pad_for_flex(q_seq_ids, q_positions, kv_seq_ids, kv_positions)
    return _compiled_create_block_mask()(
        _flex_mask_mod(*padded, causal),
        B=None,
        H=None,
        Q_LEN=padded[0].numel(),
        KV_LEN=padded[2].numel(),
        device=q_seq_ids.device,
        BLOCK_SIZE=FLEX_BLOCK_SIZE,
    )


def _additive_mask(context: AttentionContext, mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``mask`` as 0 / -inf in ``dtype``, shared by every layer of the forward."""
    if mask is None:
        return None
    cache = context.additive_masks.by_key
    key = (id(mask), dtype)
    if key not in cache:
        cache[key] = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return cache[key]


def _sdpa(q, k, v, mask: torch.Tensor | None, scale: float, causal: bool) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        _to_bhld(q),
        _to_bhld(k),
        _to_bhld(v),
        attn_mask=mask,
        # No mask means "the plain rule": causal SDPA, or attend to everything when non-causal.
        is_causal=causal and mask is None,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


def _to_bhld(x: torch.Tensor) -> torch.Tensor:
    """[L, heads, head_dim] -> [1, heads, L, head_dim], the layout attention kernels take."""
    return x.transpose(0, 1).unsqueeze(0)


# Compiled lazily: compiling at import would cost every CPU-only user a torch.compile.
@cache
def _compiled_flex_attention():
    return torch.compile(flex_attention)


@cache
def _compiled_create_block_mask():
    return torch.compile(create_block_mask)
