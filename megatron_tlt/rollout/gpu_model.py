"""Graph-safe decode forward: one new token per sequence, fused small kernels, no host syncs.

The same math as `model.InferenceModel.forward` (the spec) restricted to decode, written
so that a CUDA graph can capture it: static shapes (the batch is a padded bucket), no
`.item()`/`.tolist()`, no data-dependent Python control flow, every input read from
tensors. Per decoder layer it launches

    add+RMSNorm -> QKV GEMM -> +bias, q/k(-norm), RoPE, K/V written by slot mapping
    -> paged attention (+ split-K combine) -> O GEMM -> add+RMSNorm -> gate_up GEMM
    -> SiLU*mul -> down GEMM

i.e. one GEMM per fused projection (weights are read once per step) and four small
Triton kernels; the tied LM head is the embedding matrix, read once. Each projection runs
as cuBLAS or as a bandwidth-shaped Triton GEMV with split-K, whichever `LinearPlanner`
timed faster for that batch size (triton_linear.py); a split GEMV leaves float32
partial-sum planes that the next small kernel adds up (RMSNorm, RoPE, SiLU * mul all
take planes), so split-K costs no extra kernel and no atomics. At batch 1 the planner may
also fold the residual add + RMSNorm into the QKV and gate_up projections' prologue, and
SiLU * mul into the down projection's (when it times that faster than two kernels).
By default (MEGATRON_TLT_FUSED_ROPE=0 turns it off) a decode step or verify forward of a
model without q/k-norm also folds the RoPE + K/V-write kernel into the attention kernel
(`rope_attention`: every program computes its own query rows' RoPE; the programs holding
the new positions write their K/V first), bit for bit the separate kernels' result.

Numerics follow the reference (and HF) rounding points so the fused kernels round where
the unfused bf16 ops round: the residual sum is rounded to the model dtype, RMSNorm
runs in float32 and rounds `normed` before the weight multiply, RoPE rounds cos/sin and
each product and sum as bf16 torch ops would, SiLU rounds before the multiply.

Padding rows (bucket size > live sequences) carry slot -1 (their K/V is not written),
context length 1 and any valid block table; their logits are ignored.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from megatron_tlt.models.arch import ModelArch
from megatron_tlt.rollout import pdl
from megatron_tlt.rollout.kv_cache import PagedKVCache
from megatron_tlt.rollout.l2_prefetch import l2_prefetch
from megatron_tlt.rollout.triton_attention import (LOG2E, MAX_BLOCK_M, MODE_DECODE,
                                                   MODE_TREE, _attend, _finish, _kv_pages, _load_kv,
                                                   _n_merge, _program, _query_rows, _split_range,
                                                   block_n_for, decode_stages, attention_warps, num_sms,
                                                   combine_splits, paged_attention, split_buffers,
                                                   split_settings, split_strides)
from megatron_tlt.rollout.triton_linear import (LinearPlanner, glu_linear, linear_into,
                                                linear_partials, norm_linear_partials,
                                                silu_linear_partials)
from megatron_tlt.rollout.triton_pdl import pdl_enter
from megatron_tlt.rollout.weights import EngineWeights


FUSED_ROPE_ENV = "MEGATRON_TLT_FUSED_ROPE"


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


_COMPILED = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def _mul_rn(x, y):
    """x * y in float32 that the compiler cannot fuse into an FMA with the add after it.
    RoPE's `round(x * cos) - round(x' * sin)` (two bf16 products, each rounded, then the
    sum rounded: what the bf16 torch ops do) otherwise lost a rounding on the GPU: LLVM
    narrows `fptrunc(fmul(fpext a, fpext b))` of bf16 values to a bf16 multiply (exact),
    and the backend then contracts that multiply and the subtraction into `fma.rn.bf16`
    (session 24: 1-ulp differences in ~20% of the keys against the torch ops). PTX
    `mul.rn` is never contracted. Under the interpreter (CPU tests) a plain product."""
    x, y = tl.broadcast(x, y)
    if _COMPILED:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [x, y],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return x * y


@triton.jit
def _sum_planes(ptr, stride_s, offs, mask, S: tl.constexpr):
    """float32 sum of S partial-sum planes (triton_linear.py), added in plane order."""
    acc = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for s in tl.static_range(1, S):
        acc += tl.load(ptr + s * stride_s + offs, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, stride_xs, stride_x, stride_r,
                     stride_o, eps,
                     N: tl.constexpr, BLOCK: tl.constexpr, S: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                     RES_READ: tl.constexpr = True, USE_PDL: tl.constexpr = False,
                     EARLY_W: tl.constexpr = False):
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    if EARLY_W:  # weights only (never written in a forward): before the wait (NORM_EARLY_WEIGHT)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            bias = tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    pdl_enter(USE_PDL)  # first but for EARLY_W's weight loads: rollout/pdl.py
    row = tl.program_id(0).to(tl.int64)
    x = _sum_planes(x_ptr + row * stride_x, stride_xs, cols, ok, S)
    if HAS_BIAS:  # the projection's bias, added before its output is rounded
        if not EARLY_W:
            bias = tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        x += bias
    x = x.to(out_ptr.dtype.element_ty).to(tl.float32)  # the projection output's rounding
    if HAS_RESIDUAL:
        if RES_READ:  # residual += x
            r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
            s = (x + r).to(res_ptr.dtype.element_ty)
        else:  # the residual stream starts here: residual = x
            s = x.to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_r + cols, s, mask=ok)
        x = s.to(tl.float32)
    var = tl.sum(x * x, 0) / N
    normed = (x * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    if not EARLY_W:
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


NORM_WARPS: int | None = None
"""Warps of an _rms_norm_kernel program; None: one per 128 columns of the padded row,
between 4 and 16 (16 for the 1.5B and 7B shapes' 1536 and 3584 columns; until session 26
it was 4 up to 2048 columns, else 8: 16 was 1.018x-1.029x faster at the 1.5B shape, batch
1 / 8 / 32, and 1.002x-1.008x at the 7B shape, H100, bench rollout --compare-attr,
benchmarks/results/gpu_2026-12-06_session26). Read at each launch, so an A/B run can set
it (--compare-attr megatron_tlt.rollout.gpu_model:NORM_WARPS=4; graphs recaptured)."""
NORM_EARLY_WEIGHT = True
"""_rms_norm_kernel loads its weight (and the projection's bias) before the PDL wait instead
of after the row's sum of squares: the same values, so the same bits; the weight's trip to
L2 then overlaps the previous kernel's tail instead of following the reduction's barriers
(sm_90 SASS, `python tools/sass_norm.py [--early]`, 1536 columns, 16 warps: its LDG
comes after the reduction's second BAR.SYNC without, before the ACQBULK wait with; 136
instructions both). Weights are written only outside a forward (rollout/pdl.py). On by
default since session 36 (H100, bench rollout --compare-attr, one run at 4b43a35,
benchmarks/results/gpu_2026-12-07_session36): 1.013x / 1.009x / 1.012x / 1.002x of the
step's speed without it at the 1.5B shape, batch 1 / 8 / 16 / 32, 0.999x-1.004x at the 7B
shape; graph decode with PDL bit-identical either way (tests/gpu). False restores the
order before. Read at each launch, as NORM_WARPS."""
ROPE_ATTENTION_WARPS: int | None = None
"""Warps of a _rope_attention_kernel program; None: triton_attention.decode_warps in
decode (the paged kernel's, so the two stay bit for bit the same), else 4. Read at each
launch, as NORM_WARPS."""
ROPE_ATTENTION_STAGES: int | None = None
"""Software-pipelining stages of the _rope_attention_kernel's key loop (Triton's
num_stages); None: triton_attention.decode_stages in decode (1 while a split of the
longest context, block_tables' width, holds one key tile, else 2), 2 in the verify (2
everywhere until session 27). Read at each launch, as NORM_WARPS (tools/attention_sweep.py
times others)."""
ROPE_ATTENTION_PAGES_AHEAD = False
"""Decode: the _rope_attention_kernel's key loop loads the next tile's block-table entries
one iteration ahead (the loop's first tile's before the PDL wait), so no tile's key loads wait
for its own block-table load; the same keys and arithmetic, bit for bit. Off until timed
(tools/attention_sweep.py). Read at each launch, as NORM_WARPS."""
ROPE_ATTENTION_WRITE_FIRST: int | None = None
"""Decode: 1 or 2: the _rope_attention_kernel writes the new token's K and V into the cache
right after computing them (after the PDL wait), and its key tiles read that row from the
cache; with 1 but the first tile (loaded before the wait, when the row was not yet written,
so it takes the row from registers: _with_new_row), with 2 every tile (none is loaded
before the wait; no register tile to convert into the dot's layout either). 0: every
tile takes the row from registers, paying that select on its keys and values (about 300
of a 64-key tile's ~980 instructions a warp, sm_90 SASS of the 7B shape). The same bf16
values either way: bit for bit. With 2 a padding row (slot -1: nothing written) reads
whatever its block holds at position 0, where 0 and 1 take its own QKV row; its output is
never used either way. None (the default): decode_write_first over the launch's grid.
Read at each launch, as NORM_WARPS."""
ROPE_ATTENTION_OFF32 = True
"""Decode: the _rope_attention_kernel's key loop computes its cache offsets in 32 bits
where every element offset of both caches fits (offsets_fit_int32; else 64, as before
session 34; the same addresses, bit for bit): key loop 588 -> 423 instructions a warp with
ROPE_ATTENTION_WRITE_FIRST=2 (sm_90 SASS of the 7B shape, tools/sass_attention.py). On by
default since session 34 (timings: decode_write_first). Read at each launch, as NORM_WARPS."""
ROPE_ATTENTION_SAME_STRIDES: bool | None = None
"""Decode: where the value cache has the key cache's strides (the engine allocates them
alike), the _rope_attention_kernel's key loop loads the values at the keys' offsets: key
loop 423 -> 389 instructions a warp with WRITE_FIRST=2 and OFF32, 588 -> 485 with
WRITE_FIRST=2 alone (sm_90 SASS of the 7B shape). The same addresses. None (the default
since session 34): with WRITE_FIRST=2 only, the combination timed over whole steps and
tested bit for bit on the GPU that session (timings: decode_write_first); with 1 it is
interpreter-tested only. Read at each launch, as NORM_WARPS."""


def decode_write_first(programs: int, device: torch.device | str | int) -> int:
    """The decode attention's WRITE_FIRST where ROPE_ATTENTION_WRITE_FIRST is None: 2 (no
    key tile loaded before the PDL wait; the fewest instructions a tile) where the grid has
    more programs than SMs, else 1 (the first tile still loaded before the wait). Session
    34 (H100, benchmarks/results/gpu_2026-12-06_session34, bench rollout --compare-attr, all
    three knobs against the session-33 defaults WRITE_FIRST=0, 64-bit offsets, own value
    offsets): with OFF32 and SAME_STRIDES, WRITE_FIRST=2 ran whole decode steps 1.023x
    faster at the 7B shape, batch 32 (256 programs) and at the 1.5B shape, batch 32 (320),
    and 0.983x / 0.993x as fast at the 1.5B shape, batch 1 / 8 (10 / 80 programs: one wave,
    where the tile loaded before the wait is the overlap PDL buys); WRITE_FIRST=1 with
    OFF32 there 1.003x / 1.010x (7B, batch 1 / 8: 1.000x). The fused attention alone
    (tools/attention_sweep.py, 28 layers' caches): 7B batch 32 18.99 -> 13.15 us a call,
    1.5B batch 1 7.20 -> 6.01 us with 2, where no kernel runs before it to overlap.
    `device` may be an SM count (tools/sass_attention.py's H100/H200 without a GPU)."""
    return 2 if programs > (device if isinstance(device, int) else num_sms(device)) else 1


def decode_loop_knobs(programs: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      device: torch.device | str | int | None = None) -> tuple[int, bool, bool]:
    """(WRITE_FIRST, OFF32, SAME_STRIDES) of a decode attention launch of `programs`
    programs over these caches: the module's knobs, None ones by their rules, each only
    where the caches allow it (offsets that fit int32, equal strides). `device` (default:
    the caches'): decode_write_first's."""
    device = k_cache.device if device is None else device
    wf = (decode_write_first(programs, device) if ROPE_ATTENTION_WRITE_FIRST is None
          else int(ROPE_ATTENTION_WRITE_FIRST))
    off32 = bool(ROPE_ATTENTION_OFF32) and offsets_fit_int32(k_cache, v_cache)
    same = k_cache.stride() == v_cache.stride() and (
        wf == 2 if ROPE_ATTENTION_SAME_STRIDES is None else bool(ROPE_ATTENTION_SAME_STRIDES))
    return wf, off32, same


def offsets_fit_int32(*caches: torch.Tensor) -> bool:
    """Every element offset of each cache (from its own first element) fits int32."""
    return all(sum((n - 1) * st for n, st in zip(c.shape, c.stride())) < 2 ** 31 - 1
               and min(c.stride()) >= 0 for c in caches)


ROPE_ATTENTION_BLOCK_N: int | None = None
"""Keys per inner iteration of the _rope_attention_kernel (a power of two, at least 16);
None: triton_attention.block_n_for the cache's dtype (64 for 16-bit caches, as the paged
kernel's, so the two stay bit for bit the same). Split lengths count these tiles
(FULL_GRID_MIN_TILES, MEGATRON_TLT_SPLIT_MIN_TILES), so a smaller tile also splits
shorter contexts. Read at each launch, as NORM_WARPS, for A/B runs (bench rollout
--compare-attr megatron_tlt.rollout.gpu_model:ROPE_ATTENTION_BLOCK_N=32): session 28's
sweep (tools/attention_sweep.py, H100, benchmarks/results/gpu_2026-12-06_session28) timed
32-key tiles 1.14x faster per call at the 7B shape, batch 32 (two live splits of four
tiles instead of one), and 0.90x at the 1.5B shape, batch 1. Over whole steps (session 29,
H100, bench rollout --compare-attr, benchmarks/results/gpu_2026-12-06_session29): 0.927x /
0.964x / 1.019x at the 1.5B shape, batch 1 / 8 / 32, 0.982x / 0.992x / 0.997x at the 7B
shape: it stays 64."""
ATTN_L2_PREFETCH_MB: float = 4
"""Megabytes of weights DecodeModel asks L2 for right after each layer's fused attention
launch, decode and the tree verify (rollout/l2_prefetch.py): the output projection's, then
the head of the gate/up projection's, read by the next kernels while the attention leaves
HBM idle. Only under PDL (rollout/pdl.py) and with the fused attention (rope_attention);
0: off. 4 since session 29 (H100: 1.000x-1.007x of the step without it at the 1.5B / 7B
shapes, batch 1 / 8 / 32; larger budgets gained more at batch 1 and lost at 32:
l2_prefetch's docstring); one-row forwards take ATTN_L2_PREFETCH_MB_FEW. Read at each
forward, for A/B runs (bench rollout --compare-attr
megatron_tlt.rollout.gpu_model:ATTN_L2_PREFETCH_MB=0; graphs recaptured)."""
ATTN_L2_PREFETCH_MB_FEW: float | None = 8
"""The budget of forwards of at most ATTN_L2_PREFETCH_FEW_ROWS query rows (batch-1 decode),
in place of ATTN_L2_PREFETCH_MB unless that is 0 (off everywhere); None: ATTN_L2_PREFETCH_MB
at every row count. In session 29's runs (H100) 8 MB ran 1.011x / 1.012x as fast as 4 MB at
the 1.5B shape, batch 1, and lost at batch 32, where the attention's own reads fill its
window. Session 39 (H100,
benchmarks/results/gpu_2026-12-07_session39, two runs side by side with the old default
restated as the noise floor: 1.002x / 1.000x): 8 MB 1.011x / 1.009x at 1.5B batch 1,
1.002x / 1.001x at 7B; 12 MB 1.008x / 1.007x, 16 MB 1.006x / 1.004x: 8 by default since
(bench rollout --compare-attr "megatron_tlt.rollout.gpu_model:ATTN_L2_PREFETCH_MB_FEW=None"
for the old budget)."""
ATTN_L2_PREFETCH_FEW_ROWS: int = 1
"""The row count up to which ATTN_L2_PREFETCH_MB_FEW applies."""


def norm_warps(block: int) -> int:
    """_rms_norm_kernel's warps for a row padded to `block` columns (NORM_WARPS unset)."""
    return min(16, max(4, block // 128))


def _planes(x: torch.Tensor) -> torch.Tensor:
    """[T, N] -> [1, T, N]; partial-sum planes [S, T, N] pass through."""
    return x.unsqueeze(0) if x.dim() == 2 else x


def rms_norm(x: torch.Tensor,  # [T, N], or [S, T, N] partial-sum planes of a projection
             weight: torch.Tensor,  # [N] in the model dtype
             eps: float,
             residual: torch.Tensor | None = None,  # [T, N], updated in place: residual += x
             bias: torch.Tensor | None = None,  # [N]: the bias of the projection x came from
             *, sum_out: torch.Tensor | None = None,  # [T, N], written: x (+ bias), rounded
             ) -> torch.Tensor:  # [T, N] in weight's dtype: RMSNorm(residual + x) (or of x)
    """x = sum of the planes (+ bias), rounded to the model dtype once; then the residual
    add (rounded), RMSNorm in float32 and the weight multiply, as the reference rounds.
    `sum_out` instead of `residual`: the rounded x itself is stored there (a residual
    stream that starts at this projection, e.g. the EAGLE drafter's fc), nothing read."""
    xp = _planes(x)
    s, t, n = xp.shape
    if xp.stride(-1) != 1:
        raise ValueError("rms_norm: x must be contiguous in its last dimension")
    if residual is not None and sum_out is not None:
        raise ValueError("rms_norm: residual (read and updated) or sum_out (written), not both")
    out = torch.empty(t, n, dtype=weight.dtype, device=xp.device)
    block = max(16, _next_pow2(n))
    res = residual if residual is not None else sum_out if sum_out is not None else out
    _rms_norm_kernel[(t,)](xp, res, weight, bias if bias is not None else weight, out,
                           xp.stride(0), xp.stride(1), res.stride(0), out.stride(0),
                           float(eps), N=n, BLOCK=block, S=s,
                           HAS_RESIDUAL=residual is not None or sum_out is not None,
                           HAS_BIAS=bias is not None, RES_READ=sum_out is None,
                           EARLY_W=bool(NORM_EARLY_WEIGHT),
                           num_warps=NORM_WARPS or norm_warps(block), **pdl.kwargs())
    return out


@triton.jit
def _qkv_rope_kernel(qkv_ptr, bias_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr,
                     q_out_ptr, k_cache_ptr, v_cache_ptr,
                     stride_qkv_s, stride_qkv, stride_pos, stride_slot, stride_cos,
                     stride_qo_t, stride_qo_h, stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h,
                     eps,
                     NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                     HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                     S: tl.constexpr, HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr,
                     USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)  # first: rollout/pdl.py
    # One program per token, all its query and key heads as rows h = 0..H+KVH-1 (query
    # heads first, as in the fused QKV output). Every `.to(<model dtype>).to(tl.float32)`
    # is one rounding to the model dtype, where the reference's bf16 torch ops round.
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)[:, None]  # [HEADS_PAD, 1]
    i = tl.arange(0, HALF_PAD)[None, :]  # [1, HALF_PAD]
    is_q = h < NUM_HEADS
    ok = (h < NUM_HEADS + NUM_KV_HEADS) & (i < HALF)
    row = qkv_ptr + t * stride_qkv + h * HEAD_DIM  # key head j sits at column (NUM_HEADS + j) * D
    x1 = _sum_planes(row, stride_qkv_s, i, ok, S)
    x2 = _sum_planes(row + HALF, stride_qkv_s, i, ok, S)
    if HAS_BIAS:  # the QKV bias, added before the projection's rounding (F.linear's epilogue)
        x1 += tl.load(bias_ptr + h * HEAD_DIM + i, mask=ok, other=0.0).to(tl.float32)
        x2 += tl.load(bias_ptr + h * HEAD_DIM + HALF + i, mask=ok, other=0.0).to(tl.float32)
    x1 = x1.to(q_out_ptr.dtype.element_ty).to(tl.float32)
    x2 = x2.to(q_out_ptr.dtype.element_ty).to(tl.float32)
    if QK_NORM:
        r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM + eps)[:, None]
        w1 = tl.where(is_q, tl.load(qn_ptr + i, mask=i < HALF, other=0.0),
                      tl.load(kn_ptr + i, mask=i < HALF, other=0.0)).to(tl.float32)
        w2 = tl.where(is_q, tl.load(qn_ptr + HALF + i, mask=i < HALF, other=0.0),
                      tl.load(kn_ptr + HALF + i, mask=i < HALF, other=0.0)).to(tl.float32)
        x1 = (x1 * r).to(q_out_ptr.dtype.element_ty).to(tl.float32)
        x2 = (x2 * r).to(q_out_ptr.dtype.element_ty).to(tl.float32)
        x1 = (w1 * x1).to(q_out_ptr.dtype.element_ty).to(tl.float32)
        x2 = (w2 * x2).to(q_out_ptr.dtype.element_ty).to(tl.float32)
    pos = tl.load(pos_ptr + t * stride_pos).to(tl.int64)
    c = tl.load(cos_ptr + pos * stride_cos + i, mask=i < HALF, other=0.0)
    s = tl.load(sin_ptr + pos * stride_cos + i, mask=i < HALF, other=0.0)
    c = c.to(q_out_ptr.dtype.element_ty).to(tl.float32)
    s = s.to(q_out_ptr.dtype.element_ty).to(tl.float32)
    # x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1]
    # _mul_rn: each product rounded on its own, never fused with the sum that follows
    a1 = _mul_rn(x1, c).to(q_out_ptr.dtype.element_ty).to(tl.float32)
    b1 = _mul_rn(x2, s).to(q_out_ptr.dtype.element_ty).to(tl.float32)
    a2 = _mul_rn(x2, c).to(q_out_ptr.dtype.element_ty).to(tl.float32)
    b2 = _mul_rn(x1, s).to(q_out_ptr.dtype.element_ty).to(tl.float32)
    o1 = (a1 - b1).to(q_out_ptr.dtype.element_ty)
    o2 = (a2 + b2).to(q_out_ptr.dtype.element_ty)
    q_dst = q_out_ptr + t * stride_qo_t + h * stride_qo_h
    tl.store(q_dst + i, o1, mask=ok & is_q)
    tl.store(q_dst + HALF + i, o2, mask=ok & is_q)
    slot = tl.load(slot_ptr + t * stride_slot).to(tl.int64)
    kv_ok = ok & (h >= NUM_HEADS) & (slot >= 0)
    j = h - NUM_HEADS
    k_dst = k_cache_ptr + slot * stride_kc_s + j * stride_kc_h
    tl.store(k_dst + i, o1.to(k_cache_ptr.dtype.element_ty), mask=kv_ok)
    tl.store(k_dst + HALF + i, o2.to(k_cache_ptr.dtype.element_ty), mask=kv_ok)
    v_src = row + NUM_KV_HEADS * HEAD_DIM  # value head j at column (NUM_HEADS + NUM_KV_HEADS + j) * D
    v1 = _sum_planes(v_src, stride_qkv_s, i, kv_ok, S)
    v2 = _sum_planes(v_src + HALF, stride_qkv_s, i, kv_ok, S)
    if HAS_BIAS:
        vb = bias_ptr + (h + NUM_KV_HEADS) * HEAD_DIM
        v1 += tl.load(vb + i, mask=kv_ok, other=0.0).to(tl.float32)
        v2 += tl.load(vb + HALF + i, mask=kv_ok, other=0.0).to(tl.float32)
    v_dst = v_cache_ptr + slot * stride_vc_s + j * stride_vc_h
    tl.store(v_dst + i, v1.to(v_cache_ptr.dtype.element_ty), mask=kv_ok)
    tl.store(v_dst + HALF + i, v2.to(v_cache_ptr.dtype.element_ty), mask=kv_ok)


def qkv_rope_write_kv(qkv: torch.Tensor,  # [T, (H + 2 * KVH) * D] rows: q, k, v heads; or [S, T, ...] planes
                      positions: torch.Tensor,  # [T] int (any stride)
                      slot_mapping: torch.Tensor,  # [T] int (any stride); -1: do not write
                      cos: torch.Tensor,  # [max_positions, D] float32
                      sin: torch.Tensor,  # [max_positions, D] float32
                      k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
                      v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
                      *, num_heads: int, num_kv_heads: int, head_dim: int,
                      bias: torch.Tensor | None = None,  # [(H + 2 * KVH) * D] QKV bias
                      q_norm: torch.Tensor | None = None,  # [D]
                      k_norm: torch.Tensor | None = None,  # [D]
                      eps: float = 1e-6,
                      ) -> torch.Tensor:  # q [T, H, D] with (q-norm and) RoPE applied
    """Split the fused QKV output — the sum of its partial-sum planes plus `bias` (the
    projection then runs without it), rounded once to the model dtype, as F.linear's bias
    epilogue rounds — apply Qwen3 q/k RMSNorm (when given) and RoPE, write K and V into
    the cache at `slot_mapping`; returns q in the cache dtype."""
    qkv = _planes(qkv)
    t = qkv.shape[1]
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    if qkv.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("qkv_rope_write_kv: qkv and the caches must be contiguous in the last dim")
    q = torch.empty(t, num_heads, head_dim, dtype=k_cache.dtype, device=qkv.device)
    kf = k_cache.view(-1, num_kv_heads, head_dim)
    vf = v_cache.view(-1, num_kv_heads, head_dim)
    qk_norm = q_norm is not None
    _qkv_rope_kernel[(t,)](
        qkv, bias if bias is not None else qkv, positions, slot_mapping, cos, sin,
        q_norm if qk_norm else cos, k_norm if qk_norm else cos,
        q, kf, vf,
        qkv.stride(0), qkv.stride(1), positions.stride(0), slot_mapping.stride(0), cos.stride(0),
        q.stride(0), q.stride(1), kf.stride(0), kf.stride(1), vf.stride(0), vf.stride(1),
        float(eps),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=max(2, _next_pow2(num_heads + num_kv_heads)), HEAD_DIM=head_dim,
        HALF=head_dim // 2, HALF_PAD=max(16, _next_pow2(head_dim // 2)),
        S=qkv.shape[0], HAS_BIAS=bias is not None, QK_NORM=qk_norm,
        num_warps=4, **pdl.kwargs())
    return q


@triton.jit
def _rope_rows(row, stride_s, bias_ptr, cos_ptr, sin_ptr, hh, r_ok, pos, stride_cos,
               DT: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
               D_PAD: tl.constexpr, S: tl.constexpr, HAS_BIAS: tl.constexpr):
    """_qkv_rope_kernel's math (without the q/k norm) for R rows: row r is fused-QKV head
    hh[r] of the token whose planes row starts at row[r], at position pos[r]; laid out
    [R, D_PAD] (column d, partner column d +- HALF) instead of as two halves, the same
    roundings element by element, so the result is the separate kernel's bit for bit."""
    d = tl.arange(0, D_PAD)[None, :]
    lo = d < HALF
    partner = tl.where(lo, d + HALF, d - HALF)
    ok = r_ok[:, None] & (d < HEAD_DIM)
    col = hh[:, None] * HEAD_DIM
    base = row[:, None] + col
    x = _sum_planes(base, stride_s, d, ok, S)
    xp = _sum_planes(base, stride_s, partner, ok, S)
    if HAS_BIAS:
        x += tl.load(bias_ptr + col + d, mask=ok, other=0.0).to(tl.float32)
        xp += tl.load(bias_ptr + col + partner, mask=ok, other=0.0).to(tl.float32)
    x = x.to(DT).to(tl.float32)
    xp = xp.to(DT).to(tl.float32)
    trig = pos[:, None] * stride_cos + d % HALF
    c = tl.load(cos_ptr + trig, mask=ok, other=0.0).to(DT).to(tl.float32)
    sn = tl.load(sin_ptr + trig, mask=ok, other=0.0).to(DT).to(tl.float32)
    a = _mul_rn(x, c).to(DT).to(tl.float32)
    b = _mul_rn(xp, sn).to(DT).to(tl.float32)
    return tl.where(lo, a - b, a + b).to(DT)  # x * cos + rotate_half(x) * sin


@triton.jit(do_not_specialize=["num_splits"])
def _rope_attention_kernel(
        qkv_ptr, bias_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr,
        k_ptr, v_ptr, bt_ptr, ctx_ptr, qs_ptr, tm_ptr, o_ptr, po_ptr, pm_ptr, pl_ptr, lk_ptr,
        stride_qkv_s, stride_qkv, stride_pos, stride_slot, stride_cos,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_btb, stride_ctx, stride_tmb, stride_tmi, stride_ot, stride_oh,
        stride_pot, stride_poh, stride_pos_s, stride_pmt, stride_pmh,
        scale_log2, num_splits,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, G: tl.constexpr,
        HEAD_DIM: tl.constexpr, HALF: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, S: tl.constexpr,
        HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, MODE: tl.constexpr,
        WB: tl.constexpr = 16, MERGE: tl.constexpr = False, MIN_TILES: tl.constexpr = 1,
        PAGES_AHEAD: tl.constexpr = False, WRITE_FIRST: tl.constexpr = 0,
        OFF32: tl.constexpr = False, SAME_STRIDES: tl.constexpr = False,
        USE_PDL: tl.constexpr = False):
    """qkv_rope_write_kv + paged_attention in one launch, for decode (MODE 0) and the tree
    verify (MODE 2). Each program (one per sequence, KV head, row tile and context split)
    computes its query rows' RoPE from the QKV planes itself; the new tokens sit at the
    context's last positions, and the program(s) whose split holds them write their K and V
    into the cache (every row tile of the split the same bytes). Every split's arithmetic
    is the separate kernels'.

    Decode: the split holding the new token takes its key and value from registers (the
    bf16 values it stores) instead of reading them back, so nothing waits for a store:
    the first key tile's loads (context length, block table, keys and values already in
    the cache) and the positions are issued first, before the PDL wait. None of those is
    written by the kernel launched right before this one (DecodeModel launches the QKV
    projection there; rollout/pdl.py). The tree verify writes its new tokens' K and V
    first and reads them back after a barrier, as the separate kernels do; so does decode
    with WRITE_FIRST (ROPE_ATTENTION_WRITE_FIRST: 1 after its first, preloaded tile, 2 for
    every tile, none then loaded before the wait)."""
    if MODE != 0:
        pdl_enter(USE_PDL)  # first: rollout/pdl.py
    b, kvh, tile, split, ctx, q0, n_new = _program(ctx_ptr, qs_ptr, stride_ctx, num_splits, MODE)
    prefix = ctx - n_new
    start, end, n_live = _split_range(ctx, split, num_splits, BLOCK_N, MIN_TILES)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    dd = d[None, :]
    qi, row_ok, head, tok = _query_rows(tile, q0, n_new, kvh, G, BLOCK_M)
    # The query rows' positions (an input: in decode loaded before the PDL wait, so the
    # RoPE tables' loads that depend on them need not wait for it either).
    pos = tl.load(pos_ptr + tok * stride_pos, mask=row_ok & (split < n_live), other=0).to(tl.int64)
    if MODE == 0:
        k0 = None
        v0 = None
        if WRITE_FIRST < 2:
            k0, v0 = _load_kv(k_ptr, v_ptr, bt_ptr, b, kvh, start, end, d, d_ok, stride_kb,
                              stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_btb,
                              BLOCK_N, PAGE)
        pages1 = None
        if PAGES_AHEAD:  # the loop's first key tile's cache blocks, before the wait as well
            pages1 = _kv_pages(bt_ptr, b, start + (BLOCK_N if WRITE_FIRST < 2 else 0), end,
                               stride_btb, BLOCK_N, PAGE)
        hold = (prefix >= start) & (prefix < end)  # this split holds the new token
        j_ok = (tl.arange(0, WB) == 0) & hold
        tok_w = (q0 + 0 * tl.arange(0, WB)).to(tl.int64)
        slot = tl.load(slot_ptr + tok_w * stride_slot, mask=j_ok, other=-1).to(tl.int64)
        pos_w = tl.load(pos_ptr + tok_w * stride_pos, mask=j_ok, other=0).to(tl.int64)
        pdl_enter(USE_PDL)  # the loads above read no output of the kernel before: docstring
        row_w = qkv_ptr + tok_w * stride_qkv
        kh = NUM_HEADS + kvh + 0 * tl.arange(0, WB)
        k_new = _rope_rows(row_w, stride_qkv_s, bias_ptr, cos_ptr, sin_ptr, kh, j_ok, pos_w,
                           stride_cos, k_ptr.dtype.element_ty, HEAD_DIM, HALF, D_PAD, S, HAS_BIAS)
        v_new = _v_rows(row_w, bias_ptr, kh, j_ok, dd, stride_qkv_s, NUM_KV_HEADS, HEAD_DIM, S,
                        HAS_BIAS).to(v_ptr.dtype.element_ty)
        # The new token's row of each (the one valid row of k_new / v_new, exactly).
        # (padding columns are 0 in both; -inf everywhere when the split does not hold the
        # token, and then never used: _with_new_row)
        k_row = tl.max(tl.where(j_ok[:, None], k_new.to(tl.float32), float("-inf")), 0).to(k_new.dtype)
        v_row = tl.max(tl.where(j_ok[:, None], v_new.to(tl.float32), float("-inf")), 0).to(v_new.dtype)
        if WRITE_FIRST:  # the key tiles (after the first, with 1) read the new row from the cache
            _store_kv(k_ptr, v_ptr, slot, j_ok, kvh, k_new, v_new, dd, stride_kb, stride_ks,
                      stride_kh, stride_vb, stride_vs, stride_vh, HEAD_DIM, PAGE)
            tl.debug_barrier()  # the stores before this block's loads of them
    else:
        # New token j sits at position prefix + j: this split writes those in [start, end).
        j_lo = tl.maximum(start - prefix, 0)
        j_hi = tl.minimum(end - prefix, n_new)
        for j0 in range(j_lo, j_hi, WB):
            j = j0 + tl.arange(0, WB)
            tok_w = (q0 + j).to(tl.int64)
            j_ok = j < j_hi
            slot = tl.load(slot_ptr + tok_w * stride_slot, mask=j_ok, other=-1).to(tl.int64)
            pos_w = tl.load(pos_ptr + tok_w * stride_pos, mask=j_ok, other=0).to(tl.int64)
            row_w = qkv_ptr + tok_w * stride_qkv
            kh = NUM_HEADS + kvh + 0 * j
            k_new = _rope_rows(row_w, stride_qkv_s, bias_ptr, cos_ptr, sin_ptr, kh, j_ok, pos_w,
                               stride_cos, k_ptr.dtype.element_ty, HEAD_DIM, HALF, D_PAD, S,
                               HAS_BIAS)
            v_new = _v_rows(row_w, bias_ptr, kh, j_ok, dd, stride_qkv_s, NUM_KV_HEADS, HEAD_DIM,
                            S, HAS_BIAS)
            _store_kv(k_ptr, v_ptr, slot, j_ok, kvh, k_new, v_new, dd, stride_kb, stride_ks,
                      stride_kh, stride_vb, stride_vs, stride_vh, HEAD_DIM, PAGE)
        tl.debug_barrier()  # the K/V stores before this block's loads of them

    q = tl.zeros([BLOCK_M, D_PAD], k_ptr.dtype.element_ty)
    if split < n_live:  # a split without keys (most, for short contexts) needs no query
        q = _rope_rows(qkv_ptr + tok * stride_qkv, stride_qkv_s, bias_ptr, cos_ptr, sin_ptr,
                       head, row_ok, pos, stride_cos, k_ptr.dtype.element_ty, HEAD_DIM, HALF,
                       D_PAD, S, HAS_BIAS)  # 0 past n_new
    if MODE == 0:
        m_i, l_i, acc = _attend(q, k_ptr, v_ptr, bt_ptr, tm_ptr, b, kvh, start, end, prefix, qi,
                                row_ok, d, d_ok, stride_kb, stride_ks, stride_kh, stride_vb,
                                stride_vs, stride_vh, stride_btb, stride_tmb, stride_tmi,
                                scale_log2, BLOCK_M, BLOCK_N, D_PAD, PAGE, MODE,
                                k0, v0, k_row, v_row, NEW_ROW=WRITE_FIRST < 2,
                                PAGES_AHEAD=PAGES_AHEAD, pages_from=pages1,
                                ROW_IN_CACHE=WRITE_FIRST > 0, OFF32=OFF32,
                                SAME_STRIDES=SAME_STRIDES)
        if not WRITE_FIRST:
            # The new token's K and V into the cache: read by later launches, not this one.
            _store_kv(k_ptr, v_ptr, slot, j_ok, kvh, k_new, v_new, dd, stride_kb, stride_ks,
                      stride_kh, stride_vb, stride_vs, stride_vh, HEAD_DIM, PAGE)
    else:
        m_i, l_i, acc = _attend(q, k_ptr, v_ptr, bt_ptr, tm_ptr, b, kvh, start, end, prefix, qi,
                                row_ok, d, d_ok, stride_kb, stride_ks, stride_kh, stride_vb,
                                stride_vs, stride_vh, stride_btb, stride_tmb, stride_tmi,
                                scale_log2, BLOCK_M, BLOCK_N, D_PAD, PAGE, MODE)
    n_merge = _n_merge(n_live, num_splits, MODE, MERGE)
    _finish(acc, m_i, l_i, o_ptr, po_ptr, pm_ptr, pl_ptr, lk_ptr, tok, head, row_ok, d, d_ok,
            b, kvh, tile, split, n_live, n_merge, num_splits, stride_ot, stride_oh, stride_pot,
            stride_poh, stride_pos_s, stride_pmt, stride_pmh, BLOCK_M, D_PAD, SPLIT, MERGE, MODE)


@triton.jit
def _v_rows(row_w, bias_ptr, kh, j_ok, dd, stride_qkv_s, NUM_KV_HEADS: tl.constexpr,
            HEAD_DIM: tl.constexpr, S: tl.constexpr, HAS_BIAS: tl.constexpr):
    """float32 V rows of the tokens whose QKV planes rows start at row_w (K head kh, its V
    head kh + NUM_KV_HEADS), summed in plane order (+ bias); 0 for rows without j_ok."""
    ok = j_ok[:, None] & (dd < HEAD_DIM)
    vcol = (kh + NUM_KV_HEADS)[:, None] * HEAD_DIM
    v = _sum_planes(row_w[:, None] + vcol, stride_qkv_s, dd, ok, S)
    if HAS_BIAS:
        v += tl.load(bias_ptr + vcol + dd, mask=ok, other=0.0).to(tl.float32)
    return v


@triton.jit
def _store_kv(k_ptr, v_ptr, slot, j_ok, kvh, k_new, v_new, dd, stride_kb, stride_ks,
              stride_kh, stride_vb, stride_vs, stride_vh, HEAD_DIM: tl.constexpr,
              PAGE: tl.constexpr):
    """Rows k_new / v_new (cast to the cache dtype) into the cache at `slot` (rows with
    j_ok and slot >= 0)."""
    w_ok = (j_ok & (slot >= 0))[:, None] & (dd < HEAD_DIM)
    blk = (slot // PAGE)[:, None]
    off = (slot % PAGE)[:, None]
    tl.store(k_ptr + blk * stride_kb + off * stride_ks + kvh * stride_kh + dd, k_new, mask=w_ok)
    tl.store(v_ptr + blk * stride_vb + off * stride_vs + kvh * stride_vh + dd,
             v_new.to(v_ptr.dtype.element_ty), mask=w_ok)


def rope_attention(qkv: torch.Tensor,  # [T, (H + 2 KVH) * D] or [S, T, ...] planes
                   positions: torch.Tensor,  # [T] int (any stride)
                   slot_mapping: torch.Tensor,  # [T] int (any stride); -1: do not write
                   cos: torch.Tensor,  # [max_positions, D] float32
                   sin: torch.Tensor,  # [max_positions, D] float32
                   k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
                   v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
                   block_tables: torch.Tensor,  # [B, max_blocks] int, last dim contiguous
                   context_lens: torch.Tensor,  # [B] int (any stride), new tokens included
                   *, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                   bias: torch.Tensor | None = None,
                   query_start: torch.Tensor | None = None,  # [B + 1] with tree_mask; None: decode
                   tree_mask: torch.Tensor | None = None,  # [B, Q, Q] bool
                   num_splits: int = 1,
                   after_launch=None) -> torch.Tensor:  # [T, H, D] attention output
    """qkv_rope_write_kv followed by paged_attention in one kernel launch (plus
    _combine_kernel's with split-K, unless the in-kernel merge is on): decode (T = B), or
    with `query_start` and `tree_mask` the speculative verify (Q new tokens per sequence,
    at the context's last positions). The same K/V written and the same output, bit for bit.
    With PDL, decode loads context_lens, positions, slot_mapping, block_tables and the
    cached keys/values before it waits for the kernel launched before it: none of them
    may be that kernel's output (in DecodeModel it is the QKV projection; rollout/pdl.py).
    No q/k norm (Qwen3): the norm's sum of squares is reduced in whatever layout the
    compiler picks for each kernel, and the two kernels' orders differed on the H100
    (session 24), so such models keep the separate kernels (DecodeModel.fused_rope).
    after_launch: called right after the attention kernel's launch, before the split
    merge's (DecodeModel's L2 prefetch, ATTN_L2_PREFETCH_MB)."""
    qkv = _planes(qkv)
    s_in, t = qkv.shape[0], qkv.shape[1]
    nb, page, kvh, hd = k_cache.shape
    bsz = context_lens.shape[0]
    if head_dim % 2 or hd != head_dim or kvh != num_kv_heads or num_heads % num_kv_heads:
        raise ValueError(f"rope_attention: heads {num_heads}/{num_kv_heads} x {head_dim} and cache "
                         f"{tuple(k_cache.shape)} disagree (head_dim must be even)")
    if tuple(v_cache.shape) != tuple(k_cache.shape) or v_cache.dtype != k_cache.dtype:
        raise ValueError("rope_attention: k_cache and v_cache must match")
    if block_tables.shape[0] != bsz:
        raise ValueError(f"rope_attention: block_tables for {block_tables.shape[0]} sequences, "
                         f"context_lens for {bsz}")
    if (query_start is None) != (tree_mask is None):
        raise ValueError("rope_attention: query_start and tree_mask go together (verify), "
                         "or neither (decode)")
    if tree_mask is None:
        mode, q_len = MODE_DECODE, 1
        if t != bsz:
            raise ValueError(f"rope_attention: decode takes one token per sequence, got {t} tokens "
                             f"for {bsz} sequences")
        tm = block_tables  # unused
    else:
        mode, q_len = MODE_TREE, tree_mask.shape[1]
        if query_start.shape[0] != bsz + 1 or tuple(tree_mask.shape) != (bsz, q_len, q_len):
            raise ValueError(f"rope_attention: query_start {tuple(query_start.shape)} / tree_mask "
                             f"{tuple(tree_mask.shape)} do not fit {bsz} sequences")
        tm = tree_mask.to(torch.bool).contiguous().view(torch.uint8)
    for name, x in (("qkv", qkv), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("block_tables", block_tables)):
        if x.stride(-1) != 1:
            raise ValueError(f"rope_attention: {name} must be contiguous in its last dimension")
    group = num_heads // num_kv_heads
    rows = q_len * group
    block_m = min(MAX_BLOCK_M, max(16, _next_pow2(rows)))
    row_tiles = -(-rows // block_m)
    num_splits = max(1, int(num_splits))
    out = torch.empty(t, num_heads, head_dim, dtype=k_cache.dtype, device=qkv.device)
    merge, min_tiles = split_settings(num_splits, bsz * kvh * row_tiles, qkv.device)
    po, pm, pl, lk = split_buffers(out, num_splits, merge)
    sp = num_splits > 1
    block_n = ROPE_ATTENTION_BLOCK_N or block_n_for(k_cache.dtype)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"rope_attention: key tiles of {block_n} keys (need a power of two >= 16)")
    qs = query_start if query_start is not None else context_lens
    grid = (bsz, kvh, row_tiles * num_splits)
    write_first, off32, same_strides = (
        decode_loop_knobs(bsz * kvh * row_tiles * num_splits, k_cache, v_cache)
        if mode == MODE_DECODE else (0, False, False))
    _rope_attention_kernel[grid](
        qkv, bias if bias is not None else qkv, positions, slot_mapping, cos, sin, k_cache,
        v_cache, block_tables, context_lens, qs, tm, out, po, pm, pl, lk,
        qkv.stride(0), qkv.stride(1), positions.stride(0), slot_mapping.stride(0), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), context_lens.stride(0),
        tm.stride(0) if mode == MODE_TREE else 0, tm.stride(1) if mode == MODE_TREE else 0,
        out.stride(0), out.stride(1), *split_strides(po, pm, num_splits),
        float(scale) * LOG2E, num_splits,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, G=group, HEAD_DIM=head_dim,
        HALF=head_dim // 2, D_PAD=max(16, _next_pow2(head_dim)), BLOCK_M=block_m,
        BLOCK_N=block_n, PAGE=page, S=s_in, HAS_BIAS=bias is not None, SPLIT=sp, MODE=mode,
        WB=2 if mode == MODE_DECODE else 16, MERGE=merge, MIN_TILES=min_tiles,
        PAGES_AHEAD=bool(ROPE_ATTENTION_PAGES_AHEAD) and mode == MODE_DECODE,
        WRITE_FIRST=write_first,
        OFF32=off32, SAME_STRIDES=same_strides,
        num_warps=attention_warps(grid, mode, qkv.device, ROPE_ATTENTION_WARPS),
        num_stages=ROPE_ATTENTION_STAGES or (
            decode_stages(block_tables.shape[1] * page, num_splits, block_n, min_tiles)
            if mode == MODE_DECODE else 2), **pdl.kwargs())
    if after_launch is not None:
        after_launch()
    if sp and not merge:
        combine_splits(po, pm, pl, out, context_lens, block_n=block_n, decode=mode == MODE_DECODE,
                       min_tiles=min_tiles)
    return out


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_xs, stride_x, stride_o,
                     N: tl.constexpr, BLOCK: tl.constexpr, S: tl.constexpr,
                     USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)  # first: rollout/pdl.py
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    g = _sum_planes(x_ptr + row * stride_x, stride_xs, cols, ok, S)
    u = _sum_planes(x_ptr + row * stride_x + N, stride_xs, cols, ok, S)
    g = g.to(out_ptr.dtype.element_ty).to(tl.float32)  # the projection output's rounding
    u = u.to(out_ptr.dtype.element_ty).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (a * u).to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor,  # [T, 2 * I]: gate columns, then up; or [S, T, 2 * I] planes
             dtype: torch.dtype | None = None,  # output dtype (default: gate_up's)
             ) -> torch.Tensor:  # [T, I] silu(gate) * up
    gu = _planes(gate_up)
    s, t, two_i = gu.shape
    n = two_i // 2
    out = torch.empty(t, n, dtype=dtype or gate_up.dtype, device=gu.device)
    block = 1024
    _silu_mul_kernel[(t, -(-n // block))](gu, out, gu.stride(0), gu.stride(1), out.stride(0),
                                          N=n, BLOCK=block, S=s, num_warps=4, **pdl.kwargs())
    return out


def norm_linear(planner: LinearPlanner, h: torch.Tensor, residual: torch.Tensor,
                norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, *,
                bias: torch.Tensor | None = None, rows: int | None = None,
                row_local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """linear(RMSNorm(residual + h (+ bias))) -> (planes, the new residual): fused into the
    projection's prologue when the planner timed that faster, else rms_norm (residual
    updated in place) and the projection. `rows`, `row_local` as in LinearPlanner.config."""
    planes = _planes(h)
    cfg = planner.fused_config("norm", planes, weight, norm_weight=norm_weight, eps=eps, rows=rows,
                               row_local=row_local)
    if cfg is not None:
        return norm_linear_partials(planes, residual, norm_weight, eps, weight, cfg, bias=bias)
    y = rms_norm(h, norm_weight, eps, residual=residual, bias=bias)
    return linear_partials(y, weight, planner.config(y, weight, rows=rows, row_local=row_local)), residual


def silu_linear(planner: LinearPlanner, gate_up: torch.Tensor, weight: torch.Tensor,
                dtype: torch.dtype, *, rows: int | None = None, row_local: bool = False) -> torch.Tensor:
    """down(SiLU(gate) * up) as planes: fused into the projection's prologue when the
    planner timed that faster, else silu_mul and the projection."""
    cfg = planner.fused_config("silu", gate_up, weight, rows=rows, row_local=row_local)
    if cfg is not None:
        return silu_linear_partials(gate_up, weight, cfg)
    x = silu_mul(gate_up, dtype=dtype)
    return linear_partials(x, weight, planner.config(x, weight, rows=rows, row_local=row_local))


class DecodeModel:
    """Decode forward over `EngineWeights` and a `PagedKVCache` (see module docstring)."""

    def __init__(self, arch: ModelArch, weights: EngineWeights, cos: torch.Tensor,
                 sin: torch.Tensor, *, planner: LinearPlanner | None = None):
        """cos, sin: [max_positions, head_dim] float32 RoPE tables (model.rope_table).
        planner: picks each projection's kernel per batch size (triton_linear.py); the
        default times cuBLAS against Triton configs once per shape on the device."""
        if arch.head_dim % 2:
            raise ValueError(f"decode model needs an even head_dim, got {arch.head_dim}")
        self.arch = arch
        self.weights = weights
        self.cos = cos
        self.sin = sin
        self.scale = arch.head_dim ** -0.5
        self.planner = planner if planner is not None else LinearPlanner()
        self.fused_rope = os.environ.get(FUSED_ROPE_ENV, "1") != "0"
        """Decode steps and verify forwards run RoPE + the K/V write inside the attention
        kernel (rope_attention; MEGATRON_TLT_FUSED_ROPE=0, read here, turns it off;
        extends and models with q/k-norm keep the separate kernels). Same tokens either
        way: the fused kernel is the separate ones bit for bit (tests/gpu, session 24). On
        by default since session 24: faster in every bench rollout configuration timed
        (1.5B and 7B shapes, batch 1/8/32, with and without PDL): 1.008-1.037x on an
        H100, 1.005-1.024x on an H200 (benchmarks/results/gpu_2026-12-05_session24)."""
        self.pdl = pdl.requested() and pdl.supported(weights.device)
        """Launch this model's Triton kernels with programmatic dependent launch (pdl.py):
        on by default on a Hopper or later GPU (MEGATRON_TLT_PDL=0 turns it off); a runner's
        graphs take the setting they were captured with (release() and recapture after
        changing it)."""

    def _linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return linear_partials(x, weight, self.planner.config(x, weight))

    def _norm_linear(self, h, residual, norm_weight, weight, bias=None):
        return norm_linear(self.planner, h, residual, norm_weight, self.arch.rms_norm_eps, weight,
                           bias=bias)

    @torch.no_grad()
    def forward(self, *args, **kwargs) -> torch.Tensor:
        """`_forward` (below) with this model's kernels launched as `self.pdl` says."""
        on = self.pdl
        with pdl.launches(on, pdl.prefetch_bytes() if on else 0, pdl.preload_bytes() if on else 0):
            return self._forward(*args, **kwargs)

    def _forward(self,
                input_ids: torch.Tensor,  # [T] int32/int64 (any stride); T = B (decode) or B * Q
                positions: torch.Tensor,  # [T] int (any stride)
                slot_mapping: torch.Tensor,  # [T] int (any stride); -1 for padding rows
                block_tables: torch.Tensor,  # [B, max_blocks] int, last dim contiguous
                context_lens: torch.Tensor,  # [B] int (any stride), new tokens included
                kv_cache: PagedKVCache,
                *, num_splits: int = 1,
                logits_out: torch.Tensor | None = None,  # [T, vocab] float32, written in place
                query_start: torch.Tensor | None = None,  # [B + 1]: tree verify / extend (else decode)
                tree_mask: torch.Tensor | None = None,  # [B, Q, Q] bool: query i sees query j
                hidden_out: dict | None = None,  # filled with "final" / "pre_norm" [T, hidden]
                max_query_len: int | None = None,  # extend: query_start without a tree mask
                logits_rows: torch.Tensor | None = None,  # [N] rows whose logits to compute
                ) -> torch.Tensor:  # [T or N, vocab] float32
        """Decode (one token per sequence); with `query_start` and `tree_mask`, the
        speculative verify forward: Q tokens per sequence that see the committed prefix and
        the query tokens the mask allows; with `query_start` and `max_query_len` (no mask),
        an extend (prefill): each sequence's new tokens see its prefix and themselves
        causally. Everything but attention is per token, so the same fused kernels serve
        all three. `logits_rows`: the LM head over those rows only (a prefill needs each
        sequence's last); hidden_out still gets every row."""
        a, w = self.arch, self.weights
        if tree_mask is not None and query_start is None:
            raise ValueError("DecodeModel.forward: a tree_mask needs query_start")
        if query_start is not None and (tree_mask is None) == (max_query_len is None):
            raise ValueError("DecodeModel.forward: query_start takes a tree_mask (verify) or "
                             "max_query_len (extend), one of them")
        attn_kw = {}
        if tree_mask is not None:
            attn_kw = dict(query_start=query_start, max_query_len=tree_mask.shape[1],
                           tree_mask=tree_mask)
        elif query_start is not None:
            attn_kw = dict(query_start=query_start, max_query_len=int(max_query_len))
        eps = a.rms_norm_eps
        plan = self.planner
        # bytes each layer asks L2 for after its attention (ATTN_L2_PREFETCH_MB, or _MB_FEW
        # for few rows; PDL only)
        mb = ATTN_L2_PREFETCH_MB
        few = input_ids.shape[0] <= ATTN_L2_PREFETCH_FEW_ROWS
        if mb and few and ATTN_L2_PREFETCH_MB_FEW is not None:
            mb = ATTN_L2_PREFETCH_MB_FEW
        prefetch = int(mb * 2 ** 20) if pdl.active() else 0
        residual = torch.index_select(w.embed, 0, input_ids)  # [B, hidden]
        h = None  # partial-sum planes of the last down projection
        for layer, lw in enumerate(w.layers):
            # [S, B, (H + 2 KVH) * D]; the QKV bias is added below
            if layer == 0:
                qkv = self._linear(rms_norm(residual, lw.input_norm, eps), lw.qkv_weight)
            else:
                qkv, residual = self._norm_linear(h, residual, lw.input_norm, lw.qkv_weight)
            heads = dict(num_heads=a.num_heads, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim,
                         bias=lw.qkv_bias)
            if self.fused_rope and max_query_len is None and lw.q_norm is None:
                # decode or verify: one launch fewer (rope_attention: no q/k-norm models)
                o = rope_attention(qkv, positions, slot_mapping, self.cos, self.sin,
                                   kv_cache.k[layer], kv_cache.v[layer], block_tables,
                                   context_lens, scale=self.scale, num_splits=num_splits,
                                   query_start=query_start, tree_mask=tree_mask,
                                   after_launch=functools.partial(
                                       l2_prefetch, lw.o_weight, lw.gate_up_weight, prefetch)
                                   if prefetch else None,
                                   **heads)
            else:
                q = qkv_rope_write_kv(qkv, positions, slot_mapping, self.cos, self.sin,
                                      kv_cache.k[layer], kv_cache.v[layer], q_norm=lw.q_norm,
                                      k_norm=lw.k_norm, eps=eps, **heads)
                o = paged_attention(q, kv_cache.k[layer], kv_cache.v[layer], block_tables,
                                    context_lens, scale=self.scale, num_splits=num_splits,
                                    **attn_kw)
            h = self._linear(o.view(o.shape[0], -1), lw.o_weight)
            glu = plan.glu_config(residual, lw.gate_up_weight)
            if glu is not None:  # SiLU * up stored by the gate/up projection (triton_linear._GLU)
                y = rms_norm(h, lw.post_attn_norm, eps, residual=residual, bias=lw.o_bias)
                h = self._linear(glu_linear(y, lw.gate_up_weight, glu), lw.down_weight)
            else:
                gate_up, residual = self._norm_linear(h, residual, lw.post_attn_norm,
                                                      lw.gate_up_weight, bias=lw.o_bias)
                h = silu_linear(plan, gate_up, lw.down_weight, residual.dtype)
        y = rms_norm(h, w.final_norm, eps, residual=residual)
        if hidden_out is not None:
            hidden_out["final"], hidden_out["pre_norm"] = y, residual
        if logits_rows is not None:
            y = y.index_select(0, logits_rows)
        if logits_out is None:
            logits_out = torch.empty(y.shape[0], a.vocab_size, dtype=torch.float32, device=y.device)
        # The LM head's output rounded to the model dtype, as the reference's, then float32.
        return linear_into(y, w.lm_head, logits_out, self.planner.config(y, w.lm_head, split=False))
