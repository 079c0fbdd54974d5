"""Triton paged attention over the engine's KV cache; the torch backend in attention.py is the spec.

One kernel serves every query shape the engine produces (`AttentionMetadata`, attention.py):

- MODE_DECODE: one new token per sequence, row b of `q` belongs to sequence b (no
  `query_start`, so a CUDA graph needs no extra input);
- MODE_CAUSAL: varlen new tokens after a cached prefix, causal among themselves
  (decode or re-prefill through the generic forward, extend);
- MODE_TREE: Q new tokens per sequence with an explicit `tree_mask[b, i, j]` among them
  (speculative verification) and full attention to the committed prefix.

Work split (grouped-query attention): one program per (sequence, KV head, row tile,
context split). A program loads its KV head's keys/values once and serves *all* query
rows of the group — the G = num_heads / num_kv_heads query heads times the sequence's
new tokens, `rows = query_index * G + head_in_group`, padded to a tile of >= 16 rows so
`tl.dot` runs on tensor cores. Decode is memory-bound: the KV of a head is read exactly
once however many query heads share it.

Split-K ("flash decoding"): with few sequences the (sequence, KV head) grid is far
smaller than the GPU, so the context is cut into `num_splits` contiguous chunks (a
multiple of BLOCK_N, sized from each sequence's own context length inside the kernel, so
the grid is static and CUDA-graph safe while lengths vary); each split writes an
unnormalised partial output with its running max and sum, and the last split program of
each row tile to finish (an atomic counter per tile) merges them with the usual
log-sum-exp rescaling, in split order, so the result does not depend on which finished
last (MEGATRON_TLT_FUSED_COMBINE=1; by default `_combine_kernel`, a second launch, merges
them). Session 17's H200 profile: the combine launch took 2.1 us per layer at batch 1 and
7.6 us at a batch-32 verify (Q = 5), 28 layers a step; yet in session 20 the step ran
faster with it than with the in-kernel merge (see _MERGE). `num_splits == 1` writes the output directly.

Live splits: the split count is static (a graph's), chosen for the longest context the
engine admits, so most splits of a short context hold no keys (the 1.5B shape at batch 1
takes 64 splits; a 212-token context fills 4 of them). A split holds keys when it is one
of the first n_live = ceil(ctx / per_split) (`_split_range`); the others write nothing
and the merge reads only the live ones (decode, and any mode with the in-kernel merge;
_combine_kernel outside decode cannot map its row to a sequence's length, so there every
split writes its max and sum, as before, but only live ones their partial output, which
a merge never reads where the sum is 0). The merged result is the same bit for bit: an
empty split's weight was 0 and its max -inf. A split holds at least `split_min_tiles()`
BLOCK_N tiles (1 by default, MEGATRON_TLT_SPLIT_MIN_TILES; FULL_GRID_MIN_TILES = 4 where the
grid fills the GPU before splitting), and a context that fits in
one split is not merged at all: that split writes the output (`_alone`), and
_combine_kernel skips the row in decode.

Numerics: scores and softmax in float32 (exp2 with log2(e) folded into the scale), the
probabilities are cast to the value dtype for the P @ V product (bf16 on tensor cores,
as FlashAttention does), the output is rounded to q's dtype once. float32 inputs use
IEEE float32 dots (no TF32), so the fp32 kernel agrees with the reference to rounding.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from megatron_tlt.rollout import pdl
from megatron_tlt.rollout.attention import AttentionMetadata
from megatron_tlt.rollout.host import int64_tensor, to_device
from megatron_tlt.rollout.triton_pdl import pdl_enter


MODE_DECODE, MODE_CAUSAL, MODE_TREE = 0, 1, 2
LOG2E = 1.4426950408889634
MAX_BLOCK_M = 64
_SPLIT_CHUNK = 16  # splits merged per iteration of the combine kernel


@triton.jit
def _merge_splits(po_ptr, pm_ptr, pl_ptr, o_ptr, tok, head, row_ok, d, d_ok,
                  stride_pot, stride_poh, stride_pos, stride_pmt, stride_pmh, stride_ot, stride_oh,
                  n_live, BLOCK_M: tl.constexpr, D_PAD: tl.constexpr,
                  CHUNK: tl.constexpr = 4):
    """The output rows (tok, head) from the live splits' partial outputs, maxima and sums
    (splits 0 .. n_live - 1), merged in split order (the last live split program of a row
    tile runs this: _finish). The loops run CHUNK splits unrolled: no load of a chunk
    waits for another's result, so a chunk costs one trip to L2, not one per split (the
    loop of session 20 took one per split and per pass: 8 at 4 live splits). Every split
    below n_live wrote its partial output (_finish), so it is read without looking at its
    sum first; an empty row's weight is 0. Loads bypass L1 (.cg): the other programs'
    partials were written since this SM last looked."""
    ml = tok * stride_pmt + head * stride_pmh
    m_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for c in range(0, n_live, CHUNK):
        for i in tl.static_range(CHUNK):
            ok = row_ok & (c + i < n_live)
            m_max = tl.maximum(m_max, tl.load(pm_ptr + ml + c + i, mask=ok, other=float("-inf"),
                                              cache_modifier=".cg"))
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_tot = tl.zeros([BLOCK_M], tl.float32)
    o = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    po_rows = po_ptr + tok[:, None] * stride_pot + head[:, None] * stride_poh + d[None, :]
    for c in range(0, n_live, CHUNK):
        for i in tl.static_range(CHUNK):
            s = c + i
            ok = row_ok & (s < n_live)
            m = tl.load(pm_ptr + ml + s, mask=ok, other=float("-inf"), cache_modifier=".cg")
            l = tl.load(pl_ptr + ml + s, mask=ok, other=0.0, cache_modifier=".cg")
            part = tl.load(po_rows + s * stride_pos, mask=ok[:, None] & d_ok[None, :], other=0.0,
                           cache_modifier=".cg")
            w = tl.where(ok & (l > 0), tl.exp2(m - m_max), 0.0)  # an empty row or split: 0
            l_tot += w * l
            o += w[:, None] * part
    out = o / tl.where(l_tot > 0, l_tot, 1.0)[:, None]
    tl.store(o_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _split_range(ctx, split, num_splits, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr):
    """This split's share [start, end) of a context of `ctx` keys, and how many splits hold
    keys ("live"): chunks of a multiple of BLOCK_N, at least MIN_TILES of them
    (split_min_tiles), sized from the sequence's own length, so the grid is static while
    lengths vary; the splits past the live ones are empty."""
    per_split = tl.maximum(tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N,
                           MIN_TILES * BLOCK_N)
    start = split * per_split
    end = tl.minimum(start + per_split, ctx)
    n_live = tl.maximum(tl.cdiv(ctx, per_split), 1)
    return start, end, n_live


@triton.jit
def _program(ctx_ptr, qs_ptr, stride_ctx, num_splits, MODE: tl.constexpr):
    """This program's (sequence b, KV head, row tile, split) from the grid (B, KVH,
    row_tiles * num_splits), and sequence b's context length (new tokens included), first
    new token's row q0 and number of new tokens (decode: row b, one)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    pid2 = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b * stride_ctx).to(tl.int32)
    if MODE == 0:
        q0 = b
        n_new = 1
    else:
        q0 = tl.load(qs_ptr + b).to(tl.int32)
        n_new = tl.load(qs_ptr + b + 1).to(tl.int32) - q0
    return b, kvh, pid2 // num_splits, pid2 % num_splits, ctx, q0, n_new


@triton.jit
def _query_rows(tile, q0, n_new, kvh, G: tl.constexpr, BLOCK_M: tl.constexpr):
    """The row tile's query rows `rows = query_index * G + head_in_group`: (query index,
    valid, query head, token row)."""
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = rows // G
    return qi, qi < n_new, kvh * G + rows % G, (q0 + qi).to(tl.int64)


@triton.jit
def _n_merge(n_live, num_splits, MODE: tl.constexpr, MERGE: tl.constexpr):
    """How many splits the merge reads: the live ones, except for a _combine_kernel
    outside decode, which knows no sequence's length and reads every split."""
    n = n_live
    if MODE != 0 and not MERGE:
        n = num_splits
    return n


@triton.jit
def _load_kv(k_ptr, v_ptr, bt_ptr, b, kvh, n0, end, d, d_ok, stride_kb, stride_ks, stride_kh,
             stride_vb, stride_vs, stride_vh, stride_btb,
             BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
             OFF32: tl.constexpr = False, SAME_STRIDES: tl.constexpr = False):
    """Keys and values n0 .. n0 + BLOCK_N - 1 of sequence b's KV head kvh ([BLOCK_N, D_PAD]
    each; 0 from `end` on). OFF32, SAME_STRIDES: _kv_at's."""
    page = _kv_pages(bt_ptr, b, n0, end, stride_btb, BLOCK_N, PAGE)
    return _kv_at(k_ptr, v_ptr, page, kvh, n0, end, d, d_ok, stride_kb, stride_ks, stride_kh,
                  stride_vb, stride_vs, stride_vh, BLOCK_N, PAGE, OFF32, SAME_STRIDES)


@triton.jit
def _kv_pages(bt_ptr, b, n0, end, stride_btb, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """The cache block of each key n0 .. n0 + BLOCK_N - 1 of sequence b (0 from `end` on)."""
    n = n0 + tl.arange(0, BLOCK_N)
    return tl.load(bt_ptr + b * stride_btb + n // PAGE, mask=n < end, other=0).to(tl.int64)


@triton.jit
def _kv_at(k_ptr, v_ptr, page, kvh, n0, end, d, d_ok, stride_kb, stride_ks, stride_kh,
           stride_vb, stride_vs, stride_vh, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
           OFF32: tl.constexpr = False, SAME_STRIDES: tl.constexpr = False):
    """_load_kv with the keys' cache blocks `page` (_kv_pages) given. OFF32: the caller
    checked that every element offset of both caches fits int32 (offsets in 32 bits: 18-28%
    fewer instructions a key tile, sm_90 SASS of the 7B shape, tools/sass_attention.py).
    SAME_STRIDES: the caller checked that the value cache has the key cache's strides, so
    the values' loads take the keys' offsets (8-18% fewer)."""
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < end
    if OFF32:
        in_page = n % PAGE
        page = page.to(tl.int32)
    else:
        in_page = (n % PAGE).to(tl.int64)
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptr + (page * stride_kb + in_page * stride_ks + kvh * stride_kh)[:, None]
                + d[None, :], mask=kv_mask, other=0.0)
    # Each load spells out its pointer expression (ptr + offsets[:, None] + d[None, :]): a
    # shared `k_off` for both, tried in session 34, grouped the sum differently and gave
    # the 7B batch-32 key loop 393 instructions instead of 389 (tools/sass_attention.py).
    if SAME_STRIDES:  # the value cache has the key cache's strides: the keys' offsets
        v = tl.load(v_ptr + (page * stride_kb + in_page * stride_ks + kvh * stride_kh)[:, None]
                    + d[None, :], mask=kv_mask, other=0.0)
    else:
        v = tl.load(v_ptr + (page * stride_vb + in_page * stride_vs + kvh * stride_vh)[:, None]
                    + d[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _attend_tile(q, k, v, n0, end, prefix, qi, row_ok, m_i, l_i, acc, tm_ptr, b, stride_tmb,
                 stride_tmi, scale_log2, BLOCK_N: tl.constexpr, MODE: tl.constexpr):
    """One step of the online softmax: rows q over the keys k / values v at n0 .. n0 +
    BLOCK_N - 1 (those below `end`, and those the mode lets each row see)."""
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < end
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2  # [BLOCK_M, BLOCK_N]
    vis = row_ok[:, None] & n_ok[None, :]
    if MODE == 1:
        vis = vis & (n[None, :] <= prefix + qi[:, None])
    if MODE == 2:
        j = n - prefix
        is_new = j >= 0
        tm = tl.load(tm_ptr + b * stride_tmb + qi[:, None] * stride_tmi + j[None, :],
                     mask=vis & is_new[None, :], other=0)
        vis = vis & ((j[None, :] < 0) | (tm != 0))
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _with_new_row(k, v, k_row, v_row, n0, end, prefix, BLOCK_N: tl.constexpr):
    """The key tile k / value tile v at n0 .. n0 + BLOCK_N - 1 with the row at position
    `prefix` (the decode step's new token, when below `end`) replaced by k_row / v_row."""
    n = n0 + tl.arange(0, BLOCK_N)
    new = ((n == prefix) & (n < end))[:, None]
    return tl.where(new, k_row[None, :], k), tl.where(new, v_row[None, :], v)


@triton.jit
def _attend(q, k_ptr, v_ptr, bt_ptr, tm_ptr, b, kvh, start, end, prefix, qi, row_ok, d, d_ok,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_btb,
            stride_tmb, stride_tmi, scale_log2,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr,
            PAGE: tl.constexpr, MODE: tl.constexpr,
            k0=None, v0=None, k_row=None, v_row=None, NEW_ROW: tl.constexpr = False,
            PAGES_AHEAD: tl.constexpr = False, pages_from=None, ROW_IN_CACHE: tl.constexpr = False,
            OFF32: tl.constexpr = False, SAME_STRIDES: tl.constexpr = False):
    """Online softmax of the rows q [BLOCK_M, D_PAD] over keys [start, end) of sequence b's
    KV head kvh: (running max m, running sum l, unnormalised output acc). NEW_ROW (the
    fused decode): the first tile's keys/values k0 / v0 are loaded already, and the key at
    position `prefix` (the new token) is k_row / v_row from registers (_with_new_row).
    PAGES_AHEAD: each iteration loads the next tile's block-table entries, so a tile's key
    loads do not wait for its own block-table load (the same keys, the same arithmetic);
    The caller may pass the loop's first tile's entries (`pages_from`), loaded early.
    ROW_IN_CACHE (with NEW_ROW): the caller has written the new token's K/V into the cache
    before this call, so only the first tile (loaded before that) takes them from registers.
    OFF32, SAME_STRIDES: the loop's loads' offsets (_kv_at)."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    n_from = start
    if NEW_ROW:
        k0, v0 = _with_new_row(k0, v0, k_row, v_row, start, end, prefix, BLOCK_N)
        m_i, l_i, acc = _attend_tile(q, k0, v0, start, end, prefix, qi, row_ok, m_i, l_i, acc,
                                     tm_ptr, b, stride_tmb, stride_tmi, scale_log2, BLOCK_N, MODE)
        n_from = start + BLOCK_N
    page = pages_from
    if PAGES_AHEAD and pages_from is None:
        page = _kv_pages(bt_ptr, b, n_from, end, stride_btb, BLOCK_N, PAGE)
    for n0 in range(n_from, end, BLOCK_N):
        if PAGES_AHEAD:
            k, v = _kv_at(k_ptr, v_ptr, page, kvh, n0, end, d, d_ok, stride_kb, stride_ks,
                          stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_N, PAGE, OFF32,
                          SAME_STRIDES)
            page = _kv_pages(bt_ptr, b, n0 + BLOCK_N, end, stride_btb, BLOCK_N, PAGE)
        else:
            k, v = _load_kv(k_ptr, v_ptr, bt_ptr, b, kvh, n0, end, d, d_ok, stride_kb, stride_ks,
                            stride_kh, stride_vb, stride_vs, stride_vh, stride_btb, BLOCK_N, PAGE,
                            OFF32, SAME_STRIDES)
        if NEW_ROW and not ROW_IN_CACHE:
            k, v = _with_new_row(k, v, k_row, v_row, n0, end, prefix, BLOCK_N)
        m_i, l_i, acc = _attend_tile(q, k, v, n0, end, prefix, qi, row_ok, m_i, l_i, acc, tm_ptr,
                                     b, stride_tmb, stride_tmi, scale_log2, BLOCK_N, MODE)
    return m_i, l_i, acc


@triton.jit
def _finish(acc, m_i, l_i, o_ptr, po_ptr, pm_ptr, pl_ptr, lk_ptr, tok, head, row_ok, d, d_ok,
            b, kvh, tile, split, n_live, n_merge, num_splits,
            stride_ot, stride_oh, stride_pot, stride_poh, stride_pos, stride_pmt, stride_pmh,
            BLOCK_M: tl.constexpr, D_PAD: tl.constexpr, SPLIT: tl.constexpr,
            MERGE: tl.constexpr, MODE: tl.constexpr):
    """Without split-K, the normalised output. With it, the splits the merge reads (split <
    n_merge: the live ones, or every split for a _combine_kernel that cannot tell) write
    their max and sum, and the live ones (split < n_live) their partial output too (a merge
    never reads an empty split's: its sum is 0); with MERGE the last live split of the row
    tile to finish merges them. A context that fits in one split needs no merge: its split
    writes the output (_alone)."""
    if not SPLIT:
        _store_out(acc, l_i, o_ptr, tok, head, row_ok, d, d_ok, stride_ot, stride_oh)
    elif split < n_merge:
        if _alone(n_live, MODE, MERGE):  # one live split: it holds the whole context
            _store_out(acc, l_i, o_ptr, tok, head, row_ok, d, d_ok, stride_ot, stride_oh)
        else:
            _finish_split(acc, m_i, l_i, o_ptr, po_ptr, pm_ptr, pl_ptr, lk_ptr, tok, head, row_ok,
                          d, d_ok, b, kvh, tile, split, n_live, n_merge, num_splits, stride_ot,
                          stride_oh, stride_pot, stride_poh, stride_pos, stride_pmt, stride_pmh,
                          BLOCK_M, D_PAD, MERGE)


@triton.jit
def _store_out(acc, l_i, o_ptr, tok, head, row_ok, d, d_ok, stride_ot, stride_oh):
    """The normalised output rows (tok, head)."""
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _alone(n_live, MODE: tl.constexpr, MERGE: tl.constexpr):
    """Whether the one live split writes the output itself (no partials, no merge): when
    the context fits in one split, in decode (_combine_kernel skips such rows) or with
    the in-kernel merge; never for a _combine_kernel outside decode, which merges every
    split of every row."""
    one = n_live == 1
    if MODE != 0 and not MERGE:
        one = n_live < 0
    return one


@triton.jit
def _finish_split(acc, m_i, l_i, o_ptr, po_ptr, pm_ptr, pl_ptr, lk_ptr, tok, head, row_ok, d,
                  d_ok, b, kvh, tile, split, n_live, n_merge, num_splits,
                  stride_ot, stride_oh, stride_pot, stride_poh, stride_pos, stride_pmt,
                  stride_pmh, BLOCK_M: tl.constexpr, D_PAD: tl.constexpr, MERGE: tl.constexpr):
    """_finish for a split whose partials a merge reads."""
    if split < n_live:
        tl.store(po_ptr + tok[:, None] * stride_pot + head[:, None] * stride_poh
                 + split * stride_pos + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
    ml = tok * stride_pmt + head * stride_pmh + split
    tl.store(pm_ptr + ml, m_i, mask=row_ok)
    tl.store(pl_ptr + ml, l_i, mask=row_ok)
    if MERGE:
        # Count this split in; the last of the row tile's live splits to finish merges
        # them (one launch fewer than _combine_kernel) and sets the counter back to 0
        # for the next launch or graph replay. The barrier puts every thread's partial
        # stores before the counting thread's release; the acquire orders the merge's
        # loads.
        tl.debug_barrier()
        n_tiles = tl.num_programs(2) // num_splits
        lock = lk_ptr + (b * tl.num_programs(1) + kvh) * n_tiles + tile
        if tl.atomic_add(lock, 1, sem="acq_rel") == n_merge - 1:
            tl.atomic_xchg(lock, 0, sem="relaxed")
            _merge_splits(po_ptr, pm_ptr, pl_ptr, o_ptr, tok, head, row_ok, d, d_ok,
                          stride_pot, stride_poh, stride_pos, stride_pmt, stride_pmh,
                          stride_ot, stride_oh, n_merge, BLOCK_M, D_PAD)


@triton.jit(do_not_specialize=["num_splits"])
def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, qs_ptr, tm_ptr, o_ptr, po_ptr, pm_ptr, pl_ptr, lk_ptr,
        stride_qt, stride_qh,
        stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh,
        stride_btb, stride_ctx,
        stride_tmb, stride_tmi,
        stride_ot, stride_oh,
        stride_pot, stride_poh, stride_pos,
        stride_pmt, stride_pmh,
        scale_log2, num_splits,
        G: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
        SPLIT: tl.constexpr, MODE: tl.constexpr, MERGE: tl.constexpr = False,
        MIN_TILES: tl.constexpr = 1, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)  # first: rollout/pdl.py
    b, kvh, tile, split, ctx, q0, n_new = _program(ctx_ptr, qs_ptr, stride_ctx, num_splits, MODE)
    prefix = ctx - n_new
    qi, row_ok, head, tok = _query_rows(tile, q0, n_new, kvh, G, BLOCK_M)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    start, end, n_live = _split_range(ctx, split, num_splits, BLOCK_N, MIN_TILES)
    n_merge = _n_merge(n_live, num_splits, MODE, MERGE)
    if MODE == 1:
        # Causal: no row of this tile sees past prefix + its last query index.
        last_q = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // G, n_new - 1)
        end = tl.minimum(end, prefix + last_q + 1)

    m_i, l_i, acc = _attend(q, k_ptr, v_ptr, bt_ptr, tm_ptr, b, kvh, start, end, prefix, qi,
                            row_ok, d, d_ok, stride_kb, stride_ks, stride_kh, stride_vb,
                            stride_vs, stride_vh, stride_btb, stride_tmb, stride_tmi, scale_log2,
                            BLOCK_M, BLOCK_N, D_PAD, PAGE, MODE)
    _finish(acc, m_i, l_i, o_ptr, po_ptr, pm_ptr, pl_ptr, lk_ptr, tok, head, row_ok, d, d_ok,
            b, kvh, tile, split, n_live, n_merge, num_splits, stride_ot, stride_oh, stride_pot,
            stride_poh, stride_pos, stride_pmt, stride_pmh, BLOCK_M, D_PAD, SPLIT, MERGE, MODE)


@triton.jit(do_not_specialize=["num_splits"])
def _combine_kernel(po_ptr, pm_ptr, pl_ptr, o_ptr, ctx_ptr,
                    stride_pot, stride_poh, stride_pos, stride_pmt, stride_pmh,
                    stride_ot, stride_oh, stride_ctx, num_splits,
                    S_CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                    BLOCK_N: tl.constexpr = 64, DECODE: tl.constexpr = False,
                    MIN_TILES: tl.constexpr = 1, USE_PDL: tl.constexpr = False):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    n_live = num_splits
    if DECODE:  # row t is sequence t: only its live splits wrote (_finish)
        # Before the PDL wait: the context lengths are no output of the attention launch
        # this merges (rollout/pdl.py).
        ctx = tl.load(ctx_ptr + t * stride_ctx).to(tl.int32)
        _, _, n_live = _split_range(ctx, 0, num_splits, BLOCK_N, MIN_TILES)
    pdl_enter(USE_PDL)  # before the partials' loads and the store: rollout/pdl.py
    if n_live > 1:  # else the one live split wrote the row (_alone)
        _combine_row(po_ptr, pm_ptr, pl_ptr, o_ptr, t, h, n_live, stride_pot, stride_poh,
                     stride_pos, stride_pmt, stride_pmh, stride_ot, stride_oh, S_CHUNK, HEAD_DIM,
                     D_PAD, ALL_WROTE=DECODE)


@triton.jit
def _combine_row(po_ptr, pm_ptr, pl_ptr, o_ptr, t, h, n_live, stride_pot, stride_poh,
                 stride_pos, stride_pmt, stride_pmh, stride_ot, stride_oh,
                 S_CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                 ALL_WROTE: tl.constexpr = False):
    """_combine_kernel's merge of row t, head h: splits 0 .. n_live - 1, in chunks of
    S_CHUNK. The first chunk's maxima, sums and partial outputs are loaded up front; in
    decode (ALL_WROTE: every split below n_live has keys and wrote its partial output)
    all three at once, one trip to memory where n_live <= S_CHUNK (the usual case)
    instead of three (maxima, then sums, then the outputs of the splits with keys).
    Elsewhere a split below n_live may hold no keys and leave its output unwritten, so
    the outputs are read after the sums, for the splits with keys only, as before. The
    arithmetic is the same either way (an entry of a split without keys is discarded by
    the `where`s, never multiplied in)."""
    ml = t * stride_pmt + h * stride_pmh
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    s0 = tl.arange(0, S_CHUNK)
    ok0 = s0 < n_live
    m0 = tl.load(pm_ptr + ml + s0, mask=ok0, other=float("-inf"))
    l0 = tl.load(pl_ptr + ml + s0, mask=ok0, other=0.0)
    rd0 = ok0 if ALL_WROTE else ok0 & (l0 > 0)
    o0 = tl.load(po_ptr + t * stride_pot + h * stride_poh + s0[:, None] * stride_pos + d[None, :],
                 mask=rd0[:, None] & d_ok[None, :], other=0.0)
    m_run = m0
    for c in range(S_CHUNK, n_live, S_CHUNK):
        s = c + tl.arange(0, S_CHUNK)
        m_run = tl.maximum(m_run, tl.load(pm_ptr + ml + s, mask=s < n_live,
                                          other=float("-inf")))
    m_max = tl.max(m_run, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w0 = tl.exp2(m0 - m_max)  # 0 for empty splits (m = -inf)
    live0 = ok0 & (l0 > 0)
    l_acc = tl.zeros([S_CHUNK], tl.float32) + tl.where(live0, w0 * l0, 0.0)
    o_acc = tl.zeros([S_CHUNK, D_PAD], tl.float32) + tl.where(live0[:, None], w0[:, None] * o0, 0.0)
    for c in range(S_CHUNK, n_live, S_CHUNK):
        s = c + tl.arange(0, S_CHUNK)
        s_ok = s < n_live
        m = tl.load(pm_ptr + ml + s, mask=s_ok, other=float("-inf"))
        l = tl.load(pl_ptr + ml + s, mask=s_ok, other=0.0)
        w = tl.exp2(m - m_max)
        live = s_ok & (l > 0)
        o = tl.load(po_ptr + t * stride_pot + h * stride_poh + s[:, None] * stride_pos + d[None, :],
                    mask=live[:, None] & d_ok[None, :], other=0.0)
        l_acc += tl.where(live, w * l, 0.0)
        o_acc += tl.where(live[:, None], w[:, None] * o, 0.0)
    l_tot = tl.sum(l_acc, 0)
    out = tl.sum(o_acc, 0) / tl.where(l_tot > 0, l_tot, 1.0)
    tl.store(o_ptr + t * stride_ot + h * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d_ok)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


MERGE_ENV = "MEGATRON_TLT_FUSED_COMBINE"
_MERGE = os.environ.get(MERGE_ENV, "0") == "1"
"""Split-K partials merged by the last split program of each row tile (one launch per
attention call) instead of by `_combine_kernel` (two). Read at import; opt-in (=1): on
the H200 (session 20, 1.5B target, t09x512 drafter, T=0.9) the in-kernel merge made the
step slower, not faster: batch-1 plain decode 1.76 / 1.84 ms/step with it against 1.67 /
1.69 without, the batch-1 EAGLE step 3.03 / 3.03 ms against 2.59 / 2.59 (two runs each),
and the batch-1 verify-forward graph (Q = 5, random weights) 1.767 ms against 1.697 ms
with every session 18-19 kernel off. Those timings predate the live-split merge, which
loops over the live splits only instead of all of them (4 instead of 64 at batch 1 with a
short context): bench rollout --compare-merge times the two again. Session 28 (H100,
291d019, benchmarks/results/gpu_2026-12-06_session28): with the in-kernel merge everywhere
the 1.5B step ran at 0.978x / 0.984x / 1.018x of the default's speed at batch 1 / 8 / 32,
the 7B step 0.996x / 0.996x / 1.000x (batch 32 merges in the kernel either way there), so
grids below FULL_GRID_MIN_TILES' threshold keep the combine launch."""
SPLIT_MIN_ENV = "MEGATRON_TLT_SPLIT_MIN_TILES"
_MIN_TILES = int(os.environ.get(SPLIT_MIN_ENV, "1"))
"""The fewest BLOCK_N key tiles a live split holds (read at import; set_split_min_tiles).
1 (the default): every tile may be its own split. Larger minimums save short contexts
the merge (a context of up to MIN_TILES tiles is one split that writes its output,
_alone) at the price of tiles run one after another in one program; session 25 timed 4
(bench rollout --compare-split-min, H100, benchmarks/results/gpu_2026-12-06_session25):
0.88x-0.91x of the 1-tile rule's speed at batch 1 and 8 on the 1.5B shape, 0.96x-0.97x on
the 7B shape, 0.97x-1.02x at batch 32, so it stays 1."""
MAX_MERGE_TILES = 1 << 16
ATTENTION_WARPS: int | None = None
"""Warps of a _paged_attention_kernel program; None: decode_warps in decode, else 4. Read
at each launch, so an A/B run can set it (bench rollout --compare-attr
megatron_tlt.rollout.triton_attention:ATTENTION_WARPS=4; graphs recaptured)."""
COMBINE_WARPS = 4
"""Warps of a _combine_kernel program (read at each launch, as ATTENTION_WARPS)."""
_locks: dict[torch.device, torch.Tensor] = {}


def attention_merge_in_kernel() -> bool:
    """Whether split-K launches merge in the kernel (MEGATRON_TLT_FUSED_COMBINE=1, read at
    import; set_merge_in_kernel) rather than in _combine_kernel."""
    return _MERGE


def set_merge_in_kernel(flag: bool) -> bool:
    """Set the process's choice (A/B benchmarks: bench rollout --compare-merge); returns the
    previous one. Captured CUDA graphs keep the choice they were captured with."""
    global _MERGE
    prev, _MERGE = _MERGE, bool(flag)
    return prev


FULL_GRID_MIN_TILES = 4
"""The fewest key tiles of a live split where the grid's (sequence, KV head, row tile)
programs fill at least 3/4 of the SMs before any split (CUDA only; the 7B shape at batch
32 and up on 132 SMs): splitting a short context there only adds partial writes and a
merge. Measured over whole decode steps at the 7B shape, batch 32, as a process-wide
4-tile minimum (bench rollout --compare-split-min, H100): 1.020x (PDL on) / 1.011x (off)
faster than 1-tile splits in session 25, 1.037x in session 26; at the 1.5B shape, batch
32 (64 programs, below the threshold) it was 0.970x-0.990x, and 0.87x-0.97x at batch 1
and 8 (both shapes), which the threshold leaves at MEGATRON_TLT_SPLIT_MIN_TILES. Long
contexts keep their splits (a 1000-key context still takes three splits of six tiles).
Session 28 (H100, this rule against FULL_GRID_MIN_TILES=1 with FULL_GRID_MERGE=False in
one bench rollout run, benchmarks/results/gpu_2026-12-06_session28): the 7B decode step at
batch 32 ran 1.040x faster with the rule (6.198 against 6.443 ms); the other shapes and
batches, whose grids do not fill the SMs, 0.998x-1.005x (noise).
Read at each launch; 1 turns it off (bench rollout --compare-attr
megatron_tlt.rollout.triton_attention:FULL_GRID_MIN_TILES=1; graphs recaptured)."""
FULL_GRID_MERGE = True
"""Where the grid fills the GPU (FULL_GRID_MIN_TILES' test), split-K launches merge in
the kernel (the last split program of a row tile) instead of in a _combine_kernel launch:
with 4-tile splits a short context is one split that needs no merge, and the second
launch would only skip its rows. Session 25 (H100, process-wide 4-tile splits, bench
rollout --compare-merge) timed the in-kernel merge 1.005x-1.020x faster than the combine
launch in all 12 timings (1.5B / 7B, batch 1 / 8 / 32, PDL on and off). Read at each
launch; False leaves the choice to MEGATRON_TLT_FUSED_COMBINE. Session 28 (H100, as
FULL_GRID_MIN_TILES): the 7B step at batch 32 with 4-tile splits ran 1.017x faster
merging in the kernel than in the combine launch (6.198 against 6.301 ms)."""
_FULL_GRID_DEVICES = ("cuda",)  # tests add "cpu" to run the rule under the interpreter


def full_grid(programs: int | None, device: torch.device | str | None) -> bool:
    """Whether `programs` (sequence, KV head, row tile) programs, before any split, fill at
    least 3/4 of `device`'s SMs (CUDA devices only)."""
    if programs is None or device is None:
        return False
    dev = torch.device(device)
    return dev.type in _FULL_GRID_DEVICES and 4 * int(programs) >= 3 * num_sms(dev)


def split_min_tiles(programs: int | None = None, device: torch.device | str | None = None) -> int:
    """The fewest key tiles of a live split: MEGATRON_TLT_SPLIT_MIN_TILES (default 1); for a
    launch of `programs` (sequence, KV head, row tile) programs before splitting on
    `device`, at least FULL_GRID_MIN_TILES where they fill 3/4 of its SMs. Every kernel of
    one attention call (attention, merge) and its split choice must take the same value."""
    if full_grid(programs, device):
        return max(_MIN_TILES, int(FULL_GRID_MIN_TILES))
    return _MIN_TILES


def merge_in_kernel(num_splits: int, programs: int, device: torch.device | str) -> bool:
    """Whether a launch of `num_splits` splits over `programs` (sequence, KV head, row tile)
    programs merges its splits in the kernel: MEGATRON_TLT_FUSED_COMBINE=1, or a full grid
    with FULL_GRID_MERGE; never without splits or past MAX_MERGE_TILES row tiles."""
    if num_splits <= 1 or programs > MAX_MERGE_TILES:
        return False
    return _MERGE or (bool(FULL_GRID_MERGE) and full_grid(programs, device))


def split_settings(num_splits: int, programs: int, device: torch.device | str) -> tuple[bool, int]:
    """(merge_in_kernel, split_min_tiles) of one attention launch of `num_splits` splits over
    `programs` (sequence, KV head, row tile) programs: its kernels and merge take both."""
    return merge_in_kernel(num_splits, programs, device), split_min_tiles(programs, device)


def set_split_min_tiles(n: int) -> int:
    """Set the process's minimum (A/B benchmarks: bench rollout --compare-split-min);
    returns the previous one. Captured CUDA graphs keep the value they were captured with,
    and choose_num_splits takes it into account: release and recapture after a change."""
    global _MIN_TILES
    if int(n) < 1:
        raise ValueError(f"set_split_min_tiles: need at least 1 tile, got {n}")
    prev, _MIN_TILES = _MIN_TILES, int(n)
    return prev


def merge_counters(device: torch.device) -> torch.Tensor:
    """The device's int32 split counters, zero between launches (each launch leaves them
    as it found them). Allocated at the first call, which must not be inside a CUDA graph
    capture (the engine's graphs are captured after an eager warm-up of the same calls);
    never reallocated, so captured graphs keep a valid address. One set per device: two
    split-K launches must not run concurrently on one device (the engine's launches and
    replays are ordered on one stream; its side streams only warm up captures, joined
    before and after)."""
    lk = _locks.get(device)  # a tensor's device: found at once (every call but the first)
    if lk is not None:
        return lk
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    lk = _locks.get(device)
    if lk is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("paged_attention: first split-K call on this device during CUDA graph "
                               "capture; run it eagerly first (the merge counters are allocated then)")
        lk = _locks[device] = torch.zeros(MAX_MERGE_TILES, dtype=torch.int32, device=device)
    return lk


def block_n_for(dtype: torch.dtype) -> int:
    """Keys per inner iteration: 64 for 16-bit caches, 32 for float32 (shared memory)."""
    return 64 if torch.empty((), dtype=dtype).element_size() <= 2 else 32


_SMS: dict[torch.device, int] = {}


def num_sms(device: torch.device | str) -> int:
    device = torch.device(device)
    if device.type != "cuda":
        return 4
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def decode_warps(programs: int, device: torch.device | str) -> int:
    """Warps of a decode attention program (the paged and the fused RoPE kernel alike, so
    the two stay bit for bit the same): 8 while the grid has at most one program per SM,
    else 4. Timed on an H100 in session 26 (bench rollout --compare-attr, 1.5B / 7B shapes,
    batch 1 / 8 / 32; benchmarks/results/gpu_2026-12-06_session26): 8 warps were 1.008x-
    1.029x faster where the grid had fewer programs than SMs (1.5B batch 1 and 8, 7B batch
    1) and 0.949x-0.990x where it had more."""
    return 8 if programs <= num_sms(device) else 4


def decode_stages(max_context: int, num_splits: int, block_n: int, min_tiles: int = 1) -> int:
    """Software-pipelining stages of the fused decode attention's key loop (its first tile
    is loaded before the loop): 1 while a split of the longest context holds at most one
    key tile, else 2. Session 27's sweep (tools/attention_sweep.py, H100, 28 layers of
    per-layer caches, benchmarks/results/gpu_2026-12-06_session27): with one-tile splits,
    1 stage took 1.07x-1.12x less time per call than 2 at the 1.5B and 7B shapes, batch
    1 / 8 / 32 (the same output bit for bit: pipelining reorders loads, not arithmetic);
    with 4-tile splits 0.93x-0.96x, so longer splits keep 2. Over whole decode steps
    (session 28, H100, bench rollout --compare-attr gpu_model:ROPE_ATTENTION_STAGES=2,
    benchmarks/results/gpu_2026-12-06_session28): 2 stages everywhere ran at 0.959x-0.997x
    of this rule's speed at the 1.5B and 7B shapes, batch 1 / 8 / 32."""
    chunk = -(-max_context // max(1, num_splits))  # keys per split, before tile rounding
    tiles = max(-(-chunk // block_n), int(min_tiles))
    return 1 if tiles <= 1 else 2


def attention_warps(grid: tuple[int, int, int], mode: int, device: torch.device | str,
                    override: int | None) -> int:
    """An attention launch's warps: `override` (the kernel's module knob) when set, else
    decode_warps over the grid's programs in decode and 4 otherwise."""
    if override:
        return override
    return decode_warps(grid[0] * grid[1] * grid[2], device) if mode == MODE_DECODE else 4


SPLIT_PROGRAMS: int | None = None
"""The most programs a split-K grid may have: choose_num_splits takes the largest split
count whose grid stays within it (at least 1). None (the default): about two programs
per SM, rounded up. Session 27's sweep (tools/attention_sweep.py, H100, bench rollout's
contexts, benchmarks/results/gpu_2026-12-06_session27) timed the fused decode attention
1.37x faster per call at the 7B shape, batch 32, with one split (128 programs) than with
the default three (384), and 1.11x at batch 8 with four (128) than with five; not yet
timed over whole decode steps, and those contexts were short (212 keys): at long ones
fewer programs per SM leave each SM one serial chain of key tiles, so it is not the
default (FULL_GRID_MIN_TILES takes the short-context gain at full grids instead). Over
whole decode steps (session 28, H100, bench rollout --compare-attr, the session 28
results directory) 132 ran at 0.967x-1.004x of the default's speed, 264 0.994x-1.001x. Read
at each choice, so an A/B run can set it (bench rollout --compare-attr
megatron_tlt.rollout.triton_attention:SPLIT_PROGRAMS=132; graphs recaptured)."""


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, *, sms: int,
                      block_n: int = 64, row_tiles: int = 1, max_splits: int = 64,
                      min_tiles: int | None = None, device: torch.device | str | None = None) -> int:
    """Splits so that about two programs per SM exist (or at most SPLIT_PROGRAMS
    programs, when set), never more than the context has splits of `min_tiles` BLOCK_N
    tiles (by default split_min_tiles of this grid on `device`; a static choice:
    per-sequence chunk sizes are computed in the kernel)."""
    programs = max(1, num_seqs * num_kv_heads * row_tiles)
    min_tiles = split_min_tiles(programs, device) if min_tiles is None else max(1, int(min_tiles))
    want = -(-2 * sms // programs) if SPLIT_PROGRAMS is None else max(1, SPLIT_PROGRAMS // programs)
    tiles = max(1, -(-max_context // (block_n * min_tiles)))
    return max(1, min(want, tiles, max_splits))


def splits_for(k_cache: torch.Tensor, num_seqs: int, max_context: int, query_rows: int) -> int:
    """choose_num_splits for a call on this cache: `query_rows` = new tokens per sequence
    x query heads per KV head (the rows one program serves, in tiles of <= MAX_BLOCK_M)."""
    return choose_num_splits(num_seqs, k_cache.shape[2], max_context, sms=num_sms(k_cache.device),
                             block_n=block_n_for(k_cache.dtype),
                             row_tiles=-(-query_rows // MAX_BLOCK_M), device=k_cache.device)


def split_buffers(out: torch.Tensor,  # [T, num_heads, head_dim]: the attention output
                  num_splits: int, merge: bool):
    """(partial outputs [T, H, S, D], maxima [T, H, S], sums [T, H, S], merge counters) for
    a split-K launch; placeholders (`out`) where num_splits == 1 / without the merge."""
    if num_splits > 1:
        t, h, d = out.shape
        po = torch.empty(t, h, num_splits, d, dtype=torch.float32, device=out.device)
        pm = torch.empty(t, h, num_splits, dtype=torch.float32, device=out.device)
        pl = torch.empty_like(pm)
    else:
        po = pm = pl = out  # unused
    lk = merge_counters(out.device) if merge else out  # unused without the merge
    return po, pm, pl, lk


def split_strides(po, pm, num_splits: int) -> tuple[int, int, int, int, int]:
    """The kernels' stride_pot, stride_poh, stride_pos, stride_pmt, stride_pmh of
    split_buffers' partials (zeros without split-K: placeholders)."""
    if num_splits == 1:
        return 0, 0, 0, 0, 0
    return po.stride(0), po.stride(1), po.stride(2), pm.stride(0), pm.stride(1)


def combine_splits(po, pm, pl, out, context_lens, *, block_n: int, decode: bool,
                   min_tiles: int) -> None:
    """_combine_kernel: out <- the merge of split_buffers' partials (`decode`: row t is
    sequence t, whose live splits alone wrote; else every split wrote); min_tiles: the
    attention launch's (split_min_tiles), which sets a sequence's live splits."""
    t, h, s, d = po.shape
    _combine_kernel[(t, h)](
        po, pm, pl, out, context_lens, po.stride(0), po.stride(1), po.stride(2),
        pm.stride(0), pm.stride(1), out.stride(0), out.stride(1), context_lens.stride(0),
        s, S_CHUNK=_SPLIT_CHUNK, HEAD_DIM=d, D_PAD=max(16, _next_pow2(d)), BLOCK_N=block_n,
        DECODE=decode, MIN_TILES=min_tiles, num_warps=COMBINE_WARPS, **pdl.kwargs())


def paged_attention(q: torch.Tensor,  # [T, num_heads, head_dim], RoPE applied
                    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
                    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
                    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64
                    context_lens: torch.Tensor,  # [B] int32/int64 (any stride)
                    *, scale: float,
                    query_start: torch.Tensor | None = None,  # [B + 1]; None: decode, T == B
                    max_query_len: int = 1,
                    tree_mask: torch.Tensor | None = None,  # [B, Q, Q] bool
                    num_splits: int = 1,
                    out: torch.Tensor | None = None,  # [T, num_heads, head_dim]
                    ) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Attention of the new tokens over the paged cache (their K/V already written).

    No host synchronisation: everything data-dependent is read inside the kernel, so a
    call with static shapes (decode) can be captured in a CUDA graph. `max_query_len`
    (host int) bounds the new tokens per sequence; `num_splits` is the split-K factor.
    """
    t, num_heads, head_dim = q.shape
    nb, page, kvh, hd = k_cache.shape
    bsz = context_lens.shape[0]
    if hd != head_dim or tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"paged_attention: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                         f"v_cache {tuple(v_cache.shape)} disagree on head_dim")
    if num_heads % kvh:
        raise ValueError(f"paged_attention: num_heads ({num_heads}) must be a multiple of "
                         f"num_kv_heads ({kvh})")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"paged_attention: q dtype {q.dtype} and cache dtypes {k_cache.dtype}/"
                         f"{v_cache.dtype} must match")
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("block_tables", block_tables)):
        if x.stride(-1) != 1:
            raise ValueError(f"paged_attention: {name} must be contiguous in its last dimension")
    if block_tables.dim() != 2 or block_tables.shape[0] != bsz:
        raise ValueError(f"paged_attention: block_tables {tuple(block_tables.shape)} must be "
                         f"[{bsz}, max_blocks]")
    if tree_mask is not None:
        mode = MODE_TREE
        if query_start is None or tuple(tree_mask.shape) != (bsz, max_query_len, max_query_len):
            raise ValueError(f"paged_attention: tree_mask {tuple(tree_mask.shape)} needs query_start "
                             f"and shape [{bsz}, {max_query_len}, {max_query_len}]")
        tm = tree_mask.to(torch.bool).contiguous().view(torch.uint8)
    elif query_start is None:
        mode = MODE_DECODE
        if t != bsz or max_query_len != 1:
            raise ValueError(f"paged_attention: decode mode needs one query row per sequence "
                             f"(q has {t} rows for {bsz} sequences)")
        tm = block_tables  # unused
    else:
        mode = MODE_CAUSAL
        tm = block_tables  # unused
    if query_start is not None and query_start.shape[0] != bsz + 1:
        raise ValueError(f"paged_attention: query_start has {query_start.shape[0]} entries, "
                         f"expected {bsz + 1}")
    qs = query_start if query_start is not None else context_lens
    group = num_heads // kvh
    rows = max(1, max_query_len) * group
    block_m = min(MAX_BLOCK_M, max(16, _next_pow2(rows)))
    row_tiles = -(-rows // block_m)
    d_pad = max(16, _next_pow2(head_dim))
    block_n = block_n_for(k_cache.dtype)
    num_splits = max(1, int(num_splits))
    if out is None:
        out = torch.empty_like(q)
    merge, min_tiles = split_settings(num_splits, bsz * kvh * row_tiles, q.device)
    po, pm, pl, lk = split_buffers(out, num_splits, merge)
    grid = (bsz, kvh, row_tiles * num_splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, qs, tm, out, po, pm, pl, lk,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), context_lens.stride(0),
        tm.stride(0) if mode == MODE_TREE else 0, tm.stride(1) if mode == MODE_TREE else 0,
        out.stride(0), out.stride(1), *split_strides(po, pm, num_splits),
        float(scale) * LOG2E, num_splits,
        G=group, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=page,
        SPLIT=num_splits > 1, MODE=mode, MERGE=merge, MIN_TILES=min_tiles,
        num_warps=attention_warps(grid, mode, q.device, ATTENTION_WARPS),
        num_stages=2, **pdl.kwargs())
    if num_splits > 1 and not merge:
        combine_splits(po, pm, pl, out, context_lens, block_n=block_n, decode=mode == MODE_DECODE,
                       min_tiles=min_tiles)
    return out


class TritonPagedAttention:
    """Attention backend `"triton"` (engine `attention_backend="triton"`).

    - Prefill (every sequence's new tokens are its whole context): PyTorch SDPA,
      `is_causal=True`, one batched call per group of equal-length prompts, on the new
      tokens' K/V read back from the cache by slot mapping (where write_kv put them).
    - Everything else (decode, re-prefill after a partial prefix, tree verification):
      `paged_attention`. This generic path reads query/context lengths on the host (one
      sync per call); the CUDA-graph decode path (cuda_graphs.py) calls
      `paged_attention` directly with static arguments instead.

    `precise` is accepted for interface compatibility with the torch backend and ignored:
    the kernel is float32-accumulating, not float64.
    """

    name = "triton"

    def __init__(self, *, precise: bool = False):
        self.precise = precise

    def forward(self,
                q: torch.Tensor,  # [T, num_heads, head_dim], RoPE applied
                k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
                v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
                meta: AttentionMetadata,
                scale: float | None = None,
                ) -> torch.Tensor:  # [T, num_heads, head_dim]
        head_dim = q.shape[-1]
        scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        bsz = meta.num_seqs
        group = q.shape[1] // k_cache.shape[2]
        if meta.tree_mask is not None:
            qn = meta.tree_mask.shape[1]
            splits = splits_for(k_cache, bsz, meta.block_tables.shape[1] * k_cache.shape[1], qn * group)
            return paged_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                   scale=scale, query_start=meta.query_start, max_query_len=qn,
                                   tree_mask=meta.tree_mask, num_splits=splits)
        starts, ctx = meta.host_lengths()  # the builder's lists: no device read per layer
        n_new = [starts[b + 1] - starts[b] for b in range(bsz)]
        if all(n == c for n, c in zip(n_new, ctx)) and max(n_new) > 1:
            return self._prefill(q, k_cache, v_cache, meta, starts, n_new, scale)
        max_q = max(n_new)
        splits = splits_for(k_cache, bsz, max(ctx), max_q * group)
        return paged_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                               scale=scale, query_start=meta.query_start, max_query_len=max_q,
                               num_splits=splits)

    @staticmethod
    def _prefill(q, k_cache, v_cache, meta, starts, n_new, scale):
        t, num_heads, head_dim = q.shape
        kvh = k_cache.shape[2]
        rep = num_heads // kvh
        k_new = k_cache.view(-1, kvh, head_dim).index_select(0, meta.slot_mapping)  # [T, KVH, D]
        v_new = v_cache.view(-1, kvh, head_dim).index_select(0, meta.slot_mapping)
        out = torch.empty_like(q)
        groups = meta.derived.get("prefill_groups")
        if groups is None:
            # Once per forward (every layer reuses it): each group of equal prompt lengths
            # and its rows, all groups' rows in one non-blocking copy (a copy per group and
            # layer from pageable memory made the host wait for the device each time).
            by_len: dict[int, list[int]] = {}
            for b, n in enumerate(n_new):
                by_len.setdefault(n, []).append(b)
            flat = [starts[b] + i for seqs in by_len.values() for b in seqs for i in range(n_new[b])]
            dev_rows = to_device(int64_tensor(flat), q.device)
            groups, at = [], 0
            for n, seqs in by_len.items():
                groups.append((n, len(seqs), dev_rows[at:at + n * len(seqs)]))
                at += n * len(seqs)
            meta.derived["prefill_groups"] = groups
        for n, g, rows in groups:
            qg = q.index_select(0, rows).view(g, n, num_heads, head_dim).transpose(1, 2)
            kg = k_new.index_select(0, rows).view(g, n, kvh, head_dim).transpose(1, 2)
            vg = v_new.index_select(0, rows).view(g, n, kvh, head_dim).transpose(1, 2)
            if rep > 1:
                kg = kg.repeat_interleave(rep, dim=1)
                vg = vg.repeat_interleave(rep, dim=1)
            og = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=True,
                                                                  scale=scale)
            out.index_copy_(0, rows, og.transpose(1, 2).reshape(g * n, num_heads, head_dim))
        return out
