"""The decode step's sampler in three Triton kernels: `sampling.sample` without top-k, top-p
or a ban, with the exponential-race noise drawn inside (`sampling.sample_streams`
dispatches here on a CUDA device; MEGATRON_TLT_FUSED_SAMPLE=0 keeps the torch ops).

Why: the torch sampler is about ten passes over [B, vocab] float32 (x / T, log_softmax,
two argmaxes, exp, the division by the noise, the noise kernel itself), and torch's
softmax and argmax run one thread block per row. On the H200 at batch 1 and a 151,936
vocabulary that was ~95 us of a 1.77 ms decode step (two softmax launches of 34 us each,
benchmarks/results/gpu_2026-12-04_session17/pg_kernels_a7be282.json), ~5 % of the
step for 600 KB of logits. Here each row is split into fixed parts of `_CHUNK` columns,
one program each:

1. `_stats_kernel`: per part, the max and the sum of exp(s - max) of s = x / T;
2. `_race_kernel`: every program combines its row's part statistics the same way (M, log
   Z), computes lp_i = (s_i - M) - log Z and the score of each column -- s_i for a greedy
   row, exp(lp_i) / E_i for a sampled one, E_i the request's Exp(1) noise computed in
   place from (key, draw, i) by `triton_noise.exp_noise_at` (the bits
   `sampling.exponential_noise` gives) -- and writes its part's best column;
3. `_pick_kernel`: per row, the best of the parts' bests, its logprob lp_token (from the
   same combine, so the same bits as the score used), and the processed logprob (lp for
   a sampled row: no filter, no ban; 0.0 for a greedy one).

The same definitions as the reference sampler (sampling.py): tokens = argmax of the
scores with the lowest id on ties and a NaN score winning (torch.argmax's rules), logprob
= log_softmax(x / T)[token] with T = 1 for greedy rows. The roundings are the kernels':
x / T is IEEE division (torch's quotient), exp and log are libdevice's (what torch's CUDA
exp and log compile to), but Z is summed in another order than torch's softmax, so a
logprob may differ from torch's in the last bits, and a sampled token may differ where
two scores lie within that rounding of each other. Either way every row is an exact
exponential race over the kernels' own softmax, and a row's results depend only on the
row (the parts are fixed by the vocabulary, not by the batch): the same seed gives the
same tokens whatever else is in the batch, which is what `sample_streams` relies on when
it sends the rows without filters here and the others through the torch ops.

Imported only where triton is (CUDA paths, interpreter tests).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from megatron_tlt.rollout.triton_noise import _GOLDEN, _MIX1, _MIX2, exp_noise_at, stream_base

_BLOCK = 1024
_CHUNK = 2048
"""Columns per program: 75 parts for a 151,936 vocabulary (enough programs at batch 1),
fixed so that a row's results never depend on the batch."""
_BIG = tl.constexpr(2 ** 31 - 1)

# exp and log as torch's CUDA ops compute them (libdevice's expf / logf; tl.exp lowers to
# the approximate ex2 on NVIDIA GPUs). Triton's interpreter has no libdevice: NumPy's
# functions stand in there (the CPU tests compare within rounding).
_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _exp(x):
    if _INTERPRET:
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@triton.jit
def _log(x):
    if _INTERPRET:
        return tl.log(x)
    else:
        return libdevice.log(x)


@triton.jit
def _row_temp(temp_ptr, row):
    """(the temperature to divide by, greedy?): T = 0 is greedy and divides by 1."""
    t = tl.load(temp_ptr + row).to(tl.float32)
    return tl.where(t > 0, t, 1.0), t <= 0


@triton.jit
def _exp_as(x, ACCURATE: tl.constexpr):
    """libdevice's exp (torch's) with ACCURATE, else tl.exp (the approximate ex2)."""
    if ACCURATE:
        return _exp(x)
    else:
        return tl.exp(x)


@triton.jit
def part_stats(src, t, lo, CHUNK, V, BLOCK: tl.constexpr, ACCURATE: tl.constexpr):
    """(max, sum of exp(s - max)) of s = x / t (IEEE division) over the columns lo .. lo +
    CHUNK of a row (`src`), those below V; the sum is NaN when an s is NaN or +inf (as
    torch's softmax gives), 0 with the max -inf when every s is -inf. One part of a row
    split over programs: also spec/triton_verify_probs.py's (ACCURATE off there)."""
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    z = tl.zeros((BLOCK,), tl.float32)
    bad = tl.zeros((BLOCK,), tl.int32)
    for off in range(0, CHUNK, BLOCK):
        idx = lo + off + tl.arange(0, BLOCK)
        ok = idx < V
        s = tl.math.div_rn(tl.load(src + idx, mask=ok, other=float("-inf")).to(tl.float32), t)
        bad += tl.where((s != s) | (s == float("inf")), 1, 0)  # NaN, +inf (-inf is a 0)
        m_new = tl.maximum(m, s)
        z = z * _exp_as(m - m_new, ACCURATE) + _exp_as(s - m_new, ACCURATE)
        z = tl.where(m_new == float("-inf"), 0.0, z)  # nothing finite yet in this lane
        m = m_new
    mx = tl.max(m, 0)
    zz = tl.sum(tl.where(m == float("-inf"), 0.0, z * _exp_as(m - mx, ACCURATE)), 0)
    # Explicitly: max and where need not propagate a NaN (the hardware max drops it)
    return mx, tl.where(tl.sum(bad, 0) > 0, float("nan"), zz)


@triton.jit
def combine_stats(pm_row, pz_row, nparts, SPLIT: tl.constexpr, ACCURATE: tl.constexpr):
    """A row's (max, sum) from its parts' part_stats (pm_row / pz_row: the row's first
    entries): every program that calls it for the row computes the same bits."""
    parts = tl.arange(0, SPLIT)
    okp = parts < nparts
    pm = tl.load(pm_row + parts, mask=okp, other=float("-inf"))
    pz = tl.load(pz_row + parts, mask=okp, other=0.0)
    mx = tl.max(pm, 0)
    zz = tl.sum(tl.where(pm == float("-inf"), 0.0, pz * _exp_as(pm - mx, ACCURATE)), 0)
    return mx, tl.where(tl.sum(tl.where(pz != pz, 1, 0), 0) > 0, float("nan"), zz)  # a part had a NaN


@triton.jit(do_not_specialize=["stride_x"])
def _stats_kernel(x_ptr, stride_x, temp_ptr, pm_ptr, pz_ptr, V,
                  BLOCK: tl.constexpr, CHUNK: tl.constexpr, SPLIT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    t, _ = _row_temp(temp_ptr, row)
    mx, zz = part_stats(x_ptr + row * stride_x, t, part * CHUNK, CHUNK, V, BLOCK, True)
    tl.store(pm_ptr + row * SPLIT + part, mx)
    tl.store(pz_ptr + row * SPLIT + part, zz)


@triton.jit
def _row_norm(pm_ptr, pz_ptr, row, nparts, SPLIT: tl.constexpr):
    """The row's (M, log Z) from its parts' statistics: every caller, the same bits."""
    mx, zz = combine_stats(pm_ptr + row * SPLIT, pz_ptr + row * SPLIT, nparts, SPLIT, True)
    return mx, _log(zz)


@triton.jit(do_not_specialize=["stride_x"])
def _race_kernel(x_ptr, stride_x, temp_ptr, keys_ptr, draws_ptr, pm_ptr, pz_ptr, bv_ptr, bi_ptr,
                 V, nparts, GOLDEN, M1, M2, TINY,
                 BLOCK: tl.constexpr, CHUNK: tl.constexpr, SPLIT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    t, greedy = _row_temp(temp_ptr, row)
    mx, lz = _row_norm(pm_ptr, pz_ptr, row, nparts, SPLIT)
    base = stream_base(keys_ptr, draws_ptr, row, GOLDEN, M1, M2)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_i = tl.full((BLOCK,), _BIG, tl.int32)
    nan_i = tl.full((BLOCK,), _BIG, tl.int32)
    for off in tl.static_range(0, CHUNK, BLOCK):
        idx = part * CHUNK + off + tl.arange(0, BLOCK)
        ok = idx < V
        s = tl.math.div_rn(tl.load(x_ptr + row * stride_x + idx, mask=ok, other=float("-inf")), t)
        if greedy:
            score = s
        else:
            lp = (s - mx) - lz
            score = tl.math.div_rn(_exp(lp), exp_noise_at(base, idx, GOLDEN, M1, M2, TINY))
        nan_i = tl.minimum(nan_i, tl.where(ok & (score != score), idx, _BIG))
        better = ok & (score > best)  # strict: a lane keeps its lowest column on ties
        best_i = tl.where(better, idx, best_i)
        best = tl.where(better, score, best)
        # a lane whose columns are all -inf keeps its first valid one
        best_i = tl.where(ok & (best_i == _BIG) & (score == float("-inf")), idx, best_i)
    top = tl.max(best, 0)
    top_i = tl.min(tl.where(best == top, best_i, _BIG), 0)
    first_nan = tl.min(nan_i, 0)
    has_nan = first_nan < _BIG
    tl.store(bv_ptr + row * SPLIT + part, tl.where(has_nan, float("nan"), top))
    tl.store(bi_ptr + row * SPLIT + part, tl.where(has_nan, first_nan, top_i))


@triton.jit(do_not_specialize=["stride_x"])
def _pick_kernel(x_ptr, stride_x, temp_ptr, pm_ptr, pz_ptr, bv_ptr, bi_ptr, tok_ptr, lp_ptr, plp_ptr,
                 nparts, SPLIT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    parts = tl.arange(0, SPLIT)
    okp = parts < nparts
    bv = tl.load(bv_ptr + row * SPLIT + parts, mask=okp, other=float("-inf"))
    bi = tl.load(bi_ptr + row * SPLIT + parts, mask=okp, other=_BIG)
    # parts are in column order: the first part holding a NaN, else the first holding the max
    nan_part = tl.min(tl.where(okp & (bv != bv), parts, SPLIT), 0)
    top = tl.max(tl.where(bv != bv, float("-inf"), bv), 0)
    top_part = tl.min(tl.where(okp & (bv == top), parts, SPLIT), 0)
    pick = tl.where(nan_part < SPLIT, nan_part, top_part)
    tok = tl.sum(tl.where(parts == pick, bi, 0), 0)
    t, greedy = _row_temp(temp_ptr, row)
    mx, lz = _row_norm(pm_ptr, pz_ptr, row, nparts, SPLIT)
    s = tl.math.div_rn(tl.load(x_ptr + row * stride_x + tok), t)
    lp = (s - mx) - lz
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(lp_ptr + row, lp)
    tl.store(plp_ptr + row, tl.where(greedy, 0.0, lp))


def _split(v: int) -> tuple[int, int]:
    """(parts per row, the power of two >= it that sizes the per-row statistics)."""
    parts = max(1, -(-v // _CHUNK))
    return parts, max(16, 1 << (parts - 1).bit_length())


def sample_fused(logits: torch.Tensor,  # [B, V] float32, rows contiguous (any row stride)
                 temperature: torch.Tensor,  # [B] float32, 0 = greedy
                 keys: torch.Tensor,  # [B] int64: the rows' noise streams (ignored for greedy rows)
                 draws: torch.Tensor,  # [B] int64
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [B] int64, logprobs [B] float32, processed logprobs [B] float32): three
    launches, no host sync (capturable). Module docstring for the definitions."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError(f"sample_fused: logits must be [B, V] float32 with contiguous rows, got "
                         f"{logits.dtype}{tuple(logits.shape)} strides {logits.stride()}")
    b, v = logits.shape
    for name, x, dt in (("temperature", temperature, torch.float32), ("keys", keys, torch.int64),
                        ("draws", draws, torch.int64)):
        if tuple(x.shape) != (b,) or x.dtype != dt:
            raise ValueError(f"sample_fused: {name} must be [{b}] {dt}, got {x.dtype}{tuple(x.shape)}")
    temperature, keys, draws = temperature.contiguous(), keys.contiguous(), draws.contiguous()
    dev = logits.device
    tokens = torch.empty(b, dtype=torch.int64, device=dev)
    lp = torch.empty(b, dtype=torch.float32, device=dev)
    plp = torch.empty(b, dtype=torch.float32, device=dev)
    if b == 0:
        return tokens, lp, plp
    if v == 0:
        raise ValueError("sample_fused: empty vocabulary")
    parts, split = _split(v)
    stride = logits.stride(0) if b > 1 else v
    pm = torch.empty(b, split, dtype=torch.float32, device=dev)
    pz = torch.empty_like(pm)
    bv = torch.empty_like(pm)
    bi = torch.empty(b, split, dtype=torch.int32, device=dev)
    _stats_kernel[(b, parts)](logits, stride, temperature, pm, pz, v,
                              BLOCK=_BLOCK, CHUNK=_CHUNK, SPLIT=split, num_warps=4)
    _race_kernel[(b, parts)](logits, stride, temperature, keys, draws, pm, pz, bv, bi, v, parts,
                             _GOLDEN, _MIX1, _MIX2, torch.finfo(torch.float32).tiny,
                             BLOCK=_BLOCK, CHUNK=_CHUNK, SPLIT=split, num_warps=4)
    _pick_kernel[(b,)](logits, stride, temperature, pm, pz, bv, bi, tokens, lp, plp, parts,
                       SPLIT=split, num_warps=1)
    return tokens, lp, plp


# ---------------------------------------------------------------- a device decode loop's step


@triton.jit
def _argmax_update(score, idx, V, best, best_i):
    """Fold one block's maximum into the running (best, best_i): the lowest index of the
    block's maximum, kept only when strictly greater (an earlier block keeps a tie).
    Used by spec/triton_pick.py."""
    cmax = tl.max(score, 0)
    ci = tl.min(tl.where(score == cmax, idx, V), 0).to(tl.int64)
    take = cmax > best
    return tl.where(take, cmax, best), tl.where(take, ci, best_i)


@triton.jit(do_not_specialize=["stride_l", "stride_m", "stride_w"])
def _greedy_advance_kernel(logits_ptr, stride_l, V, meta_ptr, stride_m, work_ptr, stride_w, page,
                           ID: tl.constexpr, POS: tl.constexpr, SLOT: tl.constexpr,
                           CTX: tl.constexpr, NCOL: tl.constexpr, BLOCK: tl.constexpr,
                           PARTS_PAD: tl.constexpr):
    # Program (row, part): the part's best column by torch.argmax's rules (the lowest id
    # among the largest; a NaN beats every number, the first NaN among several), stored
    # in the row's work slots (value bits, column). The last of the row's parts to count
    # itself in (the ticket in the row's slot 0, set back to 0 for the next launch or
    # graph replay) folds the parts in order and writes the row's next decode inputs in
    # the runner's int32 buffer. The barrier puts every thread's stores before the
    # counting thread's release; the acquire orders the fold's loads (the pattern of
    # triton_attention's in-kernel split merge).
    row = tl.program_id(0)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + cols, mask=cols < V,
                other=float("-inf"))
    isn = x != x  # masked columns hold -inf
    nan_i = tl.min(tl.where(isn, cols, _BIG), 0)
    y = tl.where(isn, float("-inf"), x)
    cmax = tl.max(y, 0)
    best_i = tl.min(tl.where(y == cmax, cols, _BIG), 0)  # a valid column: masked ones follow
    val = tl.where(nan_i < _BIG, float("nan"), cmax)
    wrow = work_ptr + row.to(tl.int64) * stride_w
    tl.store(wrow + 1 + part, val.to(tl.int32, bitcast=True))
    tl.store(wrow + 1 + parts + part, tl.where(nan_i < _BIG, nan_i, best_i))
    tl.debug_barrier()
    if tl.atomic_add(wrow, 1, sem="acq_rel") == parts - 1:
        tl.atomic_xchg(wrow, 0, sem="relaxed")
        p = tl.arange(0, PARTS_PAD)
        ok = p < parts
        v = tl.load(wrow + 1 + p, mask=ok, other=0).to(tl.float32, bitcast=True)
        i = tl.load(wrow + 1 + parts + p, mask=ok, other=_BIG)
        vn = ok & (v != v)
        first_nan = tl.min(tl.where(vn, i, _BIG), 0)
        num = ok & (v == v)
        v = tl.where(num, v, float("-inf"))
        m = tl.max(v, 0)
        tok = tl.min(tl.where(num & (v == m), i, _BIG), 0)  # parts in column order
        tok = tl.where(first_nan < _BIG, first_nan, tok)
        mrow = meta_ptr + row.to(tl.int64) * stride_m
        pos = tl.load(mrow + POS) + 1
        tl.store(mrow + ID, tok)
        tl.store(mrow + POS, pos)
        tl.store(mrow + CTX, tl.load(mrow + CTX) + 1)
        blk = tl.load(mrow + NCOL + pos // page)
        tl.store(mrow + SLOT, blk * page + pos % page)


_ADVANCE_BLOCK = 2048
"""Columns per greedy_advance program: 75 parts of a 151,936 vocabulary, enough programs
at batch 1 (one program per row walked the row serially)."""


def greedy_advance_work(rows: int, vocab: int, device: torch.device | str) -> torch.Tensor:
    """greedy_advance's work buffer for up to `rows` rows of `vocab` logits: per row a
    ticket (zero between launches: the kernel sets it back) and each part's best."""
    parts = -(-vocab // _ADVANCE_BLOCK)
    return torch.zeros(rows, 1 + 2 * parts, dtype=torch.int32, device=device)


def greedy_advance(logits: torch.Tensor, meta: torch.Tensor, page: int, *, id_col: int,
                   pos_col: int, slot_col: int, ctx_col: int, table_col: int,
                   work: torch.Tensor | None = None) -> None:
    """The next decode step's inputs of a device decode loop, in place, in one launch: per
    row r of `logits` [n, V] float32, meta[r, id_col] = argmax(logits[r]) (torch.argmax's
    rules), position and context length + 1, slot = block_tables[r, pos // page] * page +
    pos % page with the block table from `table_col` on (cuda_graphs.DecodeRunner's int32
    input buffer; its `advance_greedy`). The same values as those torch ops (a dozen
    launches: ~44 us of a 1.26 ms 1.5B batch-1 step on the H200, session 42). `work`:
    greedy_advance_work(>= n, V) kept between calls (its tickets are back at 0 after each
    launch), else a fresh one."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"greedy_advance: logits must be [n, V] float32 with contiguous rows, got "
                         f"{logits.dtype}{tuple(logits.shape)} strides {logits.stride()}")
    n, v = logits.shape
    if meta.dim() != 2 or meta.dtype != torch.int32 or meta.stride(1) != 1 or meta.shape[0] < n:
        raise ValueError(f"greedy_advance: meta must be [>= {n}, C] int32 with contiguous rows, got "
                         f"{meta.dtype}{tuple(meta.shape)}")
    parts = -(-v // _ADVANCE_BLOCK)
    if work is None:
        work = greedy_advance_work(n, v, logits.device)
    elif (work.dim() != 2 or work.dtype != torch.int32 or work.stride(1) != 1
          or work.shape[0] < n or work.shape[1] < 1 + 2 * parts or work.device != logits.device):
        raise ValueError(f"greedy_advance: work must be greedy_advance_work(>= {n}, {v}) "
                         f"([>= {n}, >= {1 + 2 * parts}] int32 on {logits.device}), got "
                         f"{work.dtype}{tuple(work.shape)} on {work.device}")
    if n == 0:
        return
    _greedy_advance_kernel[(n, parts)](logits, logits.stride(0), v, meta, meta.stride(0), work,
                                       work.stride(0), page, ID=id_col, POS=pos_col,
                                       SLOT=slot_col, CTX=ctx_col, NCOL=table_col,
                                       BLOCK=_ADVANCE_BLOCK,
                                       PARTS_PAD=triton.next_power_of_2(parts), num_warps=4)
