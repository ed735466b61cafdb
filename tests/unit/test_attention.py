import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from torchtitan_rl.distributed.context_parallel import ZigzagLayout
from torchtitan_rl.models import attention
from torchtitan_rl.models.attention import (
    FLEX_BLOCK_SIZE,
    FLEX_MIN_HEAD_DIM,
    AttentionContext,
    build_attention_context,
    packed_attention,
    resolve_attn_backend,
)
from torchtitan_rl.models.varlen_plan import CALL_COST

CPU_BACKENDS = ["sdpa_dense", "sdpa_varlen", "sdpa_loop"]
LENGTHS = [5, 1, 9, 3, 1, 7]
N_HEADS, N_KV_HEADS, HEAD_DIM = 4, 2, 8


def pack(lengths, device="cpu"):
    seq_ids = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(lengths)])
    positions = torch.cat([torch.arange(n) for n in lengths])
    return seq_ids.to(device), positions.to(device)


def random_qkv(num_tokens, device="cpu", dtype=torch.float32, seed=0, head_dim=HEAD_DIM):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(num_tokens, N_HEADS, head_dim)] + [(num_tokens, N_KV_HEADS, head_dim)] * 2
    return [torch.randn(s, generator=gen).to(device=device, dtype=dtype).requires_grad_() for s in shapes]


def naive_causal_attention(q, k, v):
    """One sequence, written out by hand: softmax(q k^T / sqrt(d) + causal) v, GQA by repeat."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / q.shape[-1] ** 0.5
    n = q.shape[0]
    future = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return torch.einsum("hts,shd->thd", probs, v)


def per_sequence_reference(q, k, v, lengths):
    bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
    return torch.cat([naive_causal_attention(q[a:b], k[a:b], v[a:b]) for a, b in zip(bounds, bounds[1:])])


def output_and_grads(fn, q, k, v, upstream):
    out = fn(q, k, v)
    grads = torch.autograd.grad((out * upstream).sum(), (q, k, v))
    return out.detach(), grads


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_packed_matches_each_sequence_alone(backend):
    seq_ids, positions = pack(LENGTHS)
    q, k, v = random_qkv(seq_ids.numel())
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    context = build_attention_context(backend, seq_ids, positions)

    out, grads = output_and_grads(lambda *x: packed_attention(*x, context), q, k, v, upstream)
    ref_out, ref_grads = output_and_grads(lambda *x: per_sequence_reference(*x, LENGTHS), q, k, v, upstream)

    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-5)


def test_sdpa_loop_matches_sdpa_dense():
    seq_ids, positions = pack(LENGTHS)
    q, k, v = random_qkv(seq_ids.numel(), seed=3)
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))
    results = {}
    for backend in CPU_BACKENDS:
        context = build_attention_context(backend, seq_ids, positions)
        results[backend] = output_and_grads(lambda *x: packed_attention(*x, context), q, k, v, upstream)
    (loop_out, loop_grads), (dense_out, dense_grads) = results["sdpa_loop"], results["sdpa_dense"]
    torch.testing.assert_close(loop_out, dense_out, rtol=1e-5, atol=1e-6)
    for a, b in zip(loop_grads, dense_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def cp_share(lengths, cp, rank):
    """A CP rank's zigzag queries and the keys of every rank in gathered order."""
    layout = ZigzagLayout.build(lengths, cp)
    kv_seq_ids = torch.cat([layout.seq_ids(r) for r in range(cp)])
    kv_positions = torch.cat([layout.positions(r) for r in range(cp)])
    return layout.seq_ids(rank), layout.positions(rank), kv_seq_ids, kv_positions


def shuffled_keys(lengths, seed):
    seq_ids, positions = pack(lengths)
    perm = torch.randperm(seq_ids.numel(), generator=torch.Generator().manual_seed(seed))
    return seq_ids, positions, seq_ids[perm], positions[perm]


VARLEN_CASES = {
    "mixed_with_length_1": (lambda: (*pack([5, 1, 9, 3, 1, 7]),) * 2, True),
    "many_short_one_long": (lambda: (*pack([1, 2, 1, 3] * 6 + [70]),) * 2, True),
    "two_buckets_in_row_order": (lambda: (*pack([70, 70, 2, 2]),) * 2, True),
    "non_causal_mixed": (lambda: (*pack([5, 1, 9, 3, 1, 7]),) * 2, False),
    "keys_shuffled": (lambda: shuffled_keys([5, 1, 9, 3, 1, 7], seed=21), True),
    "non_causal_keys_shuffled": (lambda: shuffled_keys([6, 2, 6, 1], seed=22), False),
    # As many keys as queries per document, but not the same positions: plain causal SDPA
    # over slots would be wrong, the mask must come from the positions.
    "keys_at_other_positions": (lambda: (*pack([5, 3]), pack([5, 3])[0], torch.tensor([0, 1, 2, 3, 5, 0, 2, 1])), True),
    "cp2_share": (lambda: cp_share([30, 1, 17, 45], cp=2, rank=1), True),
    "cp4_share_non_causal": (lambda: cp_share([30, 1, 17, 45], cp=4, rank=0), False),
}


@pytest.mark.parametrize("case", VARLEN_CASES)
def test_varlen_matches_sdpa_dense(case):
    """sdpa_dense is the reference: its mask is the rule itself. fp64 so only the
    grouping can differ, not the rounding; GQA (4 query heads on 2 KV heads) throughout."""
    make, causal = VARLEN_CASES[case]
    q_seq_ids, q_positions, kv_seq_ids, kv_positions = make()
    q = random_qkv(q_seq_ids.numel(), dtype=torch.float64, seed=23)[0]
    _, k, v = random_qkv(kv_seq_ids.numel(), dtype=torch.float64, seed=24)
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(25), dtype=torch.float64)
    results = {}
    for backend in ("sdpa_varlen", "sdpa_dense"):
        context = build_attention_context(backend, q_seq_ids, q_positions, kv_seq_ids, kv_positions, causal=causal)
        results[backend] = output_and_grads(lambda *x: packed_attention(*x, context), q, k, v, upstream)
    (out, grads), (ref_out, ref_grads) = results["sdpa_varlen"], results["sdpa_dense"]
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)


def varlen_work(plan):
    return sum(b.count * b.q_len * b.kv_len for b in plan.buckets)


def test_varlen_work_is_bounded_by_sum_of_squares():
    """Padded work ≤ Σ q_lenᵢ·kv_lenᵢ + CALL_COST per document, whatever the mix of lengths,
    also on a CP share (queries L/cp of each document, keys all L)."""
    gen = torch.Generator().manual_seed(26)
    lengths = (torch.randint(1, 40, (40,), generator=gen) ** 2 // 8 + 1).tolist()  # 1 .. ~190, skewed short
    for q_seq_ids, q_positions, kv_seq_ids, kv_positions in (
        (*pack(lengths),) * 2,
        cp_share(lengths, cp=2, rank=0),
    ):
        plan = build_attention_context("sdpa_varlen", q_seq_ids, q_positions, kv_seq_ids, kv_positions).varlen
        q_lens = torch.bincount(q_seq_ids).tolist()
        kv_lens = torch.bincount(kv_seq_ids).tolist()
        exact = sum(a * b for a, b in zip(q_lens, kv_lens))
        assert exact <= varlen_work(plan) <= exact + CALL_COST * len(lengths)
        assert sum(b.count for b in plan.buckets) == len(lengths)
        dense = q_seq_ids.numel() * kv_seq_ids.numel()
        assert varlen_work(plan) < dense / 4


def test_varlen_needs_no_mask_for_whole_causal_documents():
    """Without CP, padding at the end under is_causal is exact: no mask is built at all."""
    plan = build_attention_context("sdpa_varlen", *pack([37, 36, 39, 1, 120, 118])).varlen
    assert len(plan.buckets) < 6 and all(b.mask is None for b in plan.buckets)
    assert build_attention_context("sdpa_varlen", *pack([4, 4]), causal=False).varlen.buckets[0].mask is None


def test_varlen_rejects_queries_without_keys():
    seq_ids, positions = pack([2, 3])
    with pytest.raises(ValueError, match="sequence 1 have no keys"):
        build_attention_context("sdpa_varlen", seq_ids, positions, seq_ids[:2], positions[:2])


def test_dense_mask_is_the_rule():
    seq_ids, positions = pack([3, 1, 2])
    mask = build_attention_context("sdpa_dense", seq_ids, positions).dense_mask
    # Written out by hand: block-diagonal lower-triangular.
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 0, 1, 0],
            [0, 0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_keys_in_any_order_and_query_subset(backend):
    """Context parallel attends local queries to gathered keys: only ids/positions matter."""
    seq_ids, positions = pack(LENGTHS)
    num_tokens = seq_ids.numel()
    q, k, v = random_qkv(num_tokens, seed=5)
    full = per_sequence_reference(q, k, v, LENGTHS).detach()

    gen = torch.Generator().manual_seed(6)
    key_perm = torch.randperm(num_tokens, generator=gen)
    # Shuffled subset of queries, like a zigzag CP chunk.
    query_rows = torch.randperm(num_tokens, generator=gen)[: num_tokens // 2]
    context = build_attention_context(
        backend, seq_ids[query_rows], positions[query_rows], seq_ids[key_perm], positions[key_perm]
    )
    out = packed_attention(q[query_rows], k[key_perm], v[key_perm], context)
    torch.testing.assert_close(out, full[query_rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_gradients_flow_to_permuted_keys(backend):
    seq_ids, positions = pack(LENGTHS)
    num_tokens = seq_ids.numel()
    q, k, v = random_qkv(num_tokens, seed=7)
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(8))
    _, ref_grads = output_and_grads(lambda *x: per_sequence_reference(*x, LENGTHS), q, k, v, upstream)

    perm = torch.randperm(num_tokens, generator=torch.Generator().manual_seed(9))
    context = build_attention_context(backend, seq_ids[perm], positions[perm], seq_ids[perm], positions[perm])
    _, grads = output_and_grads(
        lambda q_, k_, v_: packed_attention(q_[perm], k_[perm], v_[perm], context),
        q,
        k,
        v,
        upstream[perm],
    )
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-5)


def test_resolve_attn_backend():
    assert resolve_attn_backend("auto", "cpu") == "sdpa_varlen"
    assert resolve_attn_backend("auto", torch.device("cuda", 0)) == "flex"
    assert resolve_attn_backend("sdpa_loop", "cpu") == "sdpa_loop"
    with pytest.raises(ValueError, match="sdpa_dense, sdpa_varlen, sdpa_loop, flex"):
        resolve_attn_backend("flash", "cpu")
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve_attn_backend("flex", "cpu")
    with pytest.raises(ValueError, match="needs CUDA"):
        build_attention_context("flex", *pack([2, 3]))


def test_rejects_mismatched_shapes():
    seq_ids, positions = pack([2, 3])
    with pytest.raises(ValueError, match="equal length"):
        build_attention_context("sdpa_dense", seq_ids, positions[:-1])
    with pytest.raises(ValueError, match="both"):
        build_attention_context("sdpa_dense", seq_ids, positions, kv_seq_ids=seq_ids)


def test_flex_is_chosen_only_for_heads_it_can_run():
    assert resolve_attn_backend("auto", "cuda", (FLEX_MIN_HEAD_DIM, 64)) == "flex"
    assert resolve_attn_backend("auto", "cuda", (FLEX_MIN_HEAD_DIM // 2, 64)) == "sdpa_varlen"
    assert resolve_attn_backend("auto", "cpu", (64,)) == "sdpa_varlen"
    with pytest.raises(ValueError, match=f"'flex' needs heads of at least {FLEX_MIN_HEAD_DIM} dims, the model has 8"):
        resolve_attn_backend("flex", "cuda", (8, 32))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lengths", [LENGTHS, [130, 1, 77, 300]])
def test_flex_matches_sdpa_dense_on_cuda(lengths):
    seq_ids, positions = pack(lengths, device="cuda")
    q, k, v = random_qkv(seq_ids.numel(), device="cuda", head_dim=FLEX_MIN_HEAD_DIM, seed=10)
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(11)).cuda()
    results = {}
    for backend in ("flex", "sdpa_dense"):
        context = build_attention_context(backend, seq_ids, positions)
        results[backend] = output_and_grads(lambda *x: packed_attention(*x, context), q, k, v, upstream)
    (flex_out, flex_grads), (dense_out, dense_grads) = results["flex"], results["sdpa_dense"]
    torch.testing.assert_close(flex_out, dense_out, rtol=2e-4, atol=2e-4)
    for a, b in zip(flex_grads, dense_grads):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cp", [2, 4])
def test_flex_matches_sdpa_dense_on_cp_shares_on_cuda(cp):
    """The CUDA path of context parallel: a rank's zigzag queries against the keys of all
    ranks in gathered order (what the CP all-gather hands attention), flex vs sdpa_dense."""
    lengths = [130, 1, 77, 300]
    layout = ZigzagLayout.build(lengths, cp)
    kv_seq_ids = torch.cat([layout.seq_ids(r) for r in range(cp)]).cuda()
    kv_positions = torch.cat([layout.positions(r) for r in range(cp)]).cuda()
    num_kv = kv_seq_ids.numel()
    for rank in range(cp):
        seq_ids, positions = layout.seq_ids(rank).cuda(), layout.positions(rank).cuda()
        q = random_qkv(seq_ids.numel(), device="cuda", head_dim=FLEX_MIN_HEAD_DIM, seed=12 + rank)[0]
        _, k, v = random_qkv(num_kv, device="cuda", head_dim=FLEX_MIN_HEAD_DIM, seed=20)
        upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(13)).cuda()
        results = {}
        for backend in ("flex", "sdpa_dense"):
            context = build_attention_context(backend, seq_ids, positions, kv_seq_ids, kv_positions)
            results[backend] = output_and_grads(lambda *x: packed_attention(*x, context), q, k, v, upstream)
        (flex_out, flex_grads), (dense_out, dense_grads) = results["flex"], results["sdpa_dense"]
        torch.testing.assert_close(flex_out, dense_out, rtol=2e-4, atol=2e-4)
        for a, b in zip(flex_grads, dense_grads):
            torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_masks_are_made_additive_once_per_forward(backend):
    """Every layer must share one float mask: SDPA keeps the one it gets for backward."""
    seq_ids, positions = pack(LENGTHS)
    perm = torch.randperm(seq_ids.numel(), generator=torch.Generator().manual_seed(3))
    queries = perm[: seq_ids.numel() // 2]  # a query subset, as in CP: forces masks on every backend
    context = build_attention_context(backend, seq_ids[queries], positions[queries], seq_ids[perm], positions[perm])
    q, k, v = random_qkv(seq_ids.numel(), seed=4)
    q = q[queries]
    first = packed_attention(q, k, v, context)
    built = dict(context.additive_masks.by_key)
    second = packed_attention(q, k, v, context)  # the next layer
    assert built and context.additive_masks.by_key == built
    assert torch.equal(first, second)
    for mask in built.values():
        assert mask.dtype == q.dtype and set(mask.unique().tolist()) <= {0.0, float("-inf")}


def naive_bidirectional_attention(q, k, v):
    """One sequence, every query sees every key: softmax(q k^T / sqrt(d)) v, GQA by repeat."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    probs = (torch.einsum("thd,shd->hts", q, k) / q.shape[-1] ** 0.5).softmax(dim=-1)
    return torch.einsum("hts,shd->thd", probs, v)


def per_sequence_bidirectional_reference(q, k, v, lengths):
    bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
    return torch.cat([naive_bidirectional_attention(q[a:b], k[a:b], v[a:b]) for a, b in zip(bounds, bounds[1:])])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_non_causal_matches_each_sequence_alone(backend):
    seq_ids, positions = pack(LENGTHS)
    q, k, v = random_qkv(seq_ids.numel(), seed=14)
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(15))
    context = build_attention_context(backend, seq_ids, positions, causal=False)
    assert context.causal is False

    out, grads = output_and_grads(lambda *x: packed_attention(*x, context), q, k, v, upstream)
    ref_out, ref_grads = output_and_grads(
        lambda *x: per_sequence_bidirectional_reference(*x, LENGTHS), q, k, v, upstream
    )
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-5)
    # Sanity: the causal result differs (the first token of a sequence sees more than itself).
    causal = packed_attention(q, k, v, build_attention_context(backend, seq_ids, positions))
    assert not torch.allclose(causal, out)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_non_causal_keys_in_any_order_and_query_subset(backend):
    """Only seq_ids decide what a query sees: token order and positions do not matter."""
    seq_ids, positions = pack(LENGTHS)
    num_tokens = seq_ids.numel()
    q, k, v = random_qkv(num_tokens, seed=16)
    full = per_sequence_bidirectional_reference(q, k, v, LENGTHS).detach()
    gen = torch.Generator().manual_seed(17)
    key_perm = torch.randperm(num_tokens, generator=gen)
    query_rows = torch.randperm(num_tokens, generator=gen)[: num_tokens // 2]
    context = build_attention_context(
        backend,
        seq_ids[query_rows],
        positions[query_rows],
        seq_ids[key_perm],
        positions[key_perm],
        causal=False,
    )
    out = packed_attention(q[query_rows], k[key_perm], v[key_perm], context)
    torch.testing.assert_close(out, full[query_rows], rtol=1e-5, atol=1e-5)


def test_non_causal_dense_mask_is_block_diagonal():
    seq_ids, positions = pack([3, 1, 2])
    mask = build_attention_context("sdpa_dense", seq_ids, positions, causal=False).dense_mask
    expected = torch.block_diag(torch.ones(3, 3), torch.ones(1, 1), torch.ones(2, 2)).to(torch.bool)
    assert torch.equal(mask, expected)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_non_causal_flex_matches_sdpa_dense_on_cuda():
    seq_ids, positions = pack([130, 1, 77, 300], device="cuda")
    q, k, v = random_qkv(seq_ids.numel(), device="cuda", head_dim=FLEX_MIN_HEAD_DIM, seed=18)
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(19)).cuda()
    results = {}
    for backend in ("flex", "sdpa_dense"):
        context = build_attention_context(backend, seq_ids, positions, causal=False)
        results[backend] = output_and_grads(lambda *x: packed_attention(*x, context), q, k, v, upstream)
    (flex_out, flex_grads), (dense_out, dense_grads) = results["flex"], results["sdpa_dense"]
    torch.testing.assert_close(flex_out, dense_out, rtol=2e-4, atol=2e-4)
    for a, b in zip(flex_grads, dense_grads):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-4)


def short_query_subset():
    """A CP-like share: 40 of 128 keys' tokens as queries, so the keys fill a whole block and
    the queries do not."""
    seq_ids, positions = pack([60, 1, 30, 37])
    rows = torch.randperm(128, generator=torch.Generator().manual_seed(30))[:40]
    return seq_ids[rows], positions[rows], seq_ids, positions


FLEX_PADDING_CASES = {
    "short_packed": (lambda: (*pack([20, 17, 13]),) * 2, True),
    "short_packed_non_causal": (lambda: (*pack([20, 17, 13]),) * 2, False),
    "query_subset_of_whole_block": (short_query_subset, True),
    "queries_whole_keys_not": (lambda: (*pack([100, 28]), *pack([100, 28, 5])), True),
    "longer_than_a_block": (lambda: (*pack([130, 1, 77, 300]),) * 2, True),
    "whole_blocks": (lambda: (*pack([100, 28]),) * 2, True),
}


def padded_mask_by_brute_force(make, causal):
    """The flex rule over the padded tokens, evaluated at every (query, key) pair, with the
    unpadded tokens and the padded ones."""
    q_seq_ids, q_positions, kv_seq_ids, kv_positions = make()
    padded = attention._pad_for_flex(q_seq_ids, q_positions, kv_seq_ids, kv_positions)
    mask_mod = attention._flex_mask_mod(*padded, causal)
    mask = mask_mod(0, 0, torch.arange(padded[0].numel())[:, None], torch.arange(padded[2].numel())[None, :])
    return (q_seq_ids, q_positions, kv_seq_ids, kv_positions), padded, mask


@pytest.mark.parametrize("case", FLEX_PADDING_CASES)
def test_flex_padding_isolates_fillers(case):
    """Fillers bring both sides to whole blocks; no real token sees a filler or is seen by one,
    each filler query sees some key, and among real tokens the mask is the rule itself."""
    make, causal = FLEX_PADDING_CASES[case]
    tokens, padded, mask = padded_mask_by_brute_force(make, causal)
    num_q, num_kv = tokens[0].numel(), tokens[2].numel()
    for real, padded_tensor in zip(tokens, padded):
        assert padded_tensor.numel() % FLEX_BLOCK_SIZE == 0
        assert padded_tensor.numel() - real.numel() <= FLEX_BLOCK_SIZE
        assert torch.equal(padded_tensor[: real.numel()], real)
    assert padded[0].numel() == padded[1].numel() and padded[2].numel() == padded[3].numel()
    assert torch.equal(mask[:num_q, :num_kv], attention._dense_mask(*tokens, causal))
    assert not mask[:num_q, num_kv:].any() and not mask[num_q:, :num_kv].any()
    assert mask[num_q:].any(dim=1).all()
    if num_q % FLEX_BLOCK_SIZE == 0 and num_kv % FLEX_BLOCK_SIZE == 0:
        assert all(a is b for a, b in zip(tokens, padded))  # nothing to pad: no copy


@pytest.fixture
def eager_flex(monkeypatch):
    """flex_attention's forward and block masks on the CPU without compiling them, which would
    take most of a test's time: the same rule and padding, the unfused kernel."""
    monkeypatch.setattr(attention, "_compiled_flex_attention", lambda: flex_attention)
    monkeypatch.setattr(attention, "_compiled_create_block_mask", lambda: create_block_mask)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        yield


@pytest.mark.parametrize("case", ["short_packed", "queries_whole_keys_not"])
def test_flex_block_mask_covers_padded_tokens(eager_flex, case):
    make, causal = FLEX_PADDING_CASES[case]
    tokens, padded, mask = padded_mask_by_brute_force(make, causal)
    block_mask = attention._flex_block_mask(*tokens, causal)
    assert all(length % FLEX_BLOCK_SIZE == 0 for length in block_mask.seq_lengths)
    assert block_mask.seq_lengths == (padded[0].numel(), padded[2].numel())
    assert block_mask.BLOCK_SIZE == (FLEX_BLOCK_SIZE, FLEX_BLOCK_SIZE)
    q_idx, kv_idx = torch.arange(mask.shape[0])[:, None], torch.arange(mask.shape[1])[None, :]
    assert torch.equal(block_mask.mask_mod(0, 0, q_idx, kv_idx), mask)


@pytest.mark.parametrize("case", ["short_packed", "short_packed_non_causal", "query_subset_of_whole_block"])
def test_padded_flex_forward_matches_sdpa_dense_on_cpu(eager_flex, case):
    """flex has only a forward on the CPU (the CUDA test below checks gradients too)."""
    make, causal = FLEX_PADDING_CASES[case]
    q_seq_ids, q_positions, kv_seq_ids, kv_positions = make()
    q = random_qkv(q_seq_ids.numel(), head_dim=FLEX_MIN_HEAD_DIM, seed=31)[0].detach()
    _, k, v = (x.detach() for x in random_qkv(kv_seq_ids.numel(), head_dim=FLEX_MIN_HEAD_DIM, seed=32))
    flex_context = AttentionContext(
        "flex",
        block_mask=attention._flex_block_mask(q_seq_ids, q_positions, kv_seq_ids, kv_positions, causal),
        causal=causal,
    )
    dense_context = build_attention_context("sdpa_dense", q_seq_ids, q_positions, kv_seq_ids, kv_positions, causal)
    out = packed_attention(q, k, v, flex_context)
    assert out.shape == q.shape
    torch.testing.assert_close(out, packed_attention(q, k, v, dense_context), rtol=1e-5, atol=1e-5)


SHORT_CUDA_CASES = {
    "packed_64": (lambda: (*pack([30, 1, 20, 13]),) * 2, True),
    "packed_64_non_causal": (lambda: (*pack([30, 1, 20, 13]),) * 2, False),
    "query_subset_of_whole_block": (short_query_subset, True),
}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", SHORT_CUDA_CASES)
def test_flex_on_micro_batch_shorter_than_a_block_on_cuda(case):
    """Micro-batches shorter than one flex block (64 packed tokens, or 40 queries against 128
    keys): flex forward and backward against sdpa_varlen."""
    make, causal = SHORT_CUDA_CASES[case]
    q_seq_ids, q_positions, kv_seq_ids, kv_positions = (x.cuda() for x in make())
    q = random_qkv(q_seq_ids.numel(), device="cuda", head_dim=FLEX_MIN_HEAD_DIM, seed=33)[0]
    _, k, v = random_qkv(kv_seq_ids.numel(), device="cuda", head_dim=FLEX_MIN_HEAD_DIM, seed=34)
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(35)).cuda()
    results = {}
    for backend in ("flex", "sdpa_varlen"):
        context = build_attention_context(backend, q_seq_ids, q_positions, kv_seq_ids, kv_positions, causal)
        results[backend] = output_and_grads(lambda *x: packed_attention(*x, context), q, k, v, upstream)
    (flex_out, flex_grads), (ref_out, ref_grads) = results["flex"], results["sdpa_varlen"]
    torch.testing.assert_close(flex_out, ref_out, rtol=2e-4, atol=2e-4)
    for a, b in zip(flex_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-4)
