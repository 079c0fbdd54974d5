"""Decode-shaped linear layers: `y = x @ W.T` for a few rows x [M, K] against a weight
W [N, K] (row-major, as EngineWeights stores it), written for memory bandwidth.

At decode batch sizes a projection reads far more weight bytes than it does arithmetic,
and cuBLAS picks kernels tuned for compute: at M = 1 its GEMV leaves much of the HBM
bandwidth unused on the small projections of a 1.5B model. Here one program reads a
[BLOCK_N, K / splits] slab of W once and serves every row of x:

- `dot` configs tile x as [BLOCK_M >= 16, BLOCK_K] (rows past M are masked to zero) and
  use `tl.dot` (tensor cores, float32 accumulation);
- `fma` configs (M == 1) keep a [BLOCK_N, BLOCK_K] float32 accumulator of products and
  reduce it once at the end: no tensor-core tiling constraints, so BLOCK_N can be small
  and the grid large.

Split-K without atomics: with `splits > 1` each split writes its own float32 partial sum
plane `out[s]`, and the CONSUMING kernel (RMSNorm, RoPE + KV write, SiLU * mul — all in
gpu_model.py) adds the planes in a fixed order, rounds once to the model dtype (where
`F.linear` would round its output) and goes on. Deterministic, and no extra kernel.

Prologues (dot configs, and fma configs for one row): the input tile can be computed in
the kernel from the previous kernels' inputs instead of being read: SiLU(gate) * up from
gate/up planes (the down projection), or RMSNorm(residual + planes) (the QKV and gate_up
projections; every program first sums the whole row's squares, so this pays only for a
row or two). Same roundings as the separate kernels; one launch fewer each. (Dropped after
session 29's H100 A/B, 0.998x-1.004x per step and never picked by the planner: the norm
prologue's first weight tile loaded early, and decode's split-K merge in the O projection.)

`LinearPlanner` picks, per (M, N, K, dtype), the fastest of cuBLAS and a few Triton
configs by timing them once on the device as CUDA-graph replays (outside any capture),
and whether a fused prologue beats the separate kernel + projection; the choices are
cached for the process (`LinearPlanner.shared`: one planner per device, whichever engine
asks) and, with MEGATRON_TLT_LINEAR_PLANS, in a file across runs: the candidates round
differently, so the choice is part of "same seed -> same tokens" (linear_plans.py). On
CPU it always answers cuBLAS (`F.linear`) and no fusion.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from megatron_tlt.rollout import pdl
from megatron_tlt.rollout.host import graph_capture
from megatron_tlt.rollout.linear_plans import CUBLAS, LinearConfig, PlanCache, PlanFile  # noqa: F401 (re-exported)
from megatron_tlt.rollout.triton_pdl import pdl_enter


def _triton_ok(x: torch.Tensor) -> bool:
    """Triton runs on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1 (tests)."""
    return x.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _x_tile(x_ptr, stride_xs, stride_xm, b_ptr, r_ptr, r_out_ptr, nw_ptr, stride_rm, rstd,
            rm, rk, m_ok, k_ok, K, WRITE_RES, w_ptr, S_IN: tl.constexpr,
            PRO: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The [BLOCK_M, BLOCK_K] input tile in the model dtype (w_ptr's). PRO 0: x itself; 1: SiLU(gate)
    * up of gate/up partial-sum planes (gpu_model.silu_mul's roundings); 2: RMSNorm(residual
    + planes (+ bias)) with the row's rstd given (gpu_model.rms_norm's roundings), writing
    the new residual when WRITE_RES."""
    DT = w_ptr.dtype.element_ty
    mask = m_ok[:, None] & k_ok[None, :]
    offs = rm[:, None] * stride_xm + rk[None, :]
    if PRO == 0:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    elif PRO == 1:
        g = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + K + offs, mask=mask, other=0.0).to(tl.float32)
        for s in tl.static_range(1, S_IN):
            g += tl.load(x_ptr + s * stride_xs + offs, mask=mask, other=0.0).to(tl.float32)
            u += tl.load(x_ptr + s * stride_xs + K + offs, mask=mask, other=0.0).to(tl.float32)
        g = g.to(DT).to(tl.float32)
        u = u.to(DT).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32)
        x = (a * u).to(DT)
    else:
        h = _residual_sum(x_ptr, stride_xs, stride_xm, b_ptr, r_ptr, stride_rm, rm, rk, mask,
                          w_ptr, S_IN, HAS_BIAS)
        if WRITE_RES:
            tl.store(r_out_ptr + rm[:, None] * stride_rm + rk[None, :], h.to(DT), mask=mask)
        normed = (h * rstd[:, None]).to(DT).to(tl.float32)
        nw = tl.load(nw_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)
        x = (nw[None, :] * normed).to(DT)
    return x


@triton.jit
def _residual_sum(x_ptr, stride_xs, stride_xm, b_ptr, r_ptr, stride_rm, rm, rk, mask,
                  w_ptr, S_IN: tl.constexpr, HAS_BIAS: tl.constexpr):
    """round(round(sum of planes (+ bias)) + residual), float32 [BLOCK_M, BLOCK_K], rounded
    to the model dtype (w_ptr's)."""
    DT = w_ptr.dtype.element_ty
    offs = rm[:, None] * stride_xm + rk[None, :]
    h = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for s in tl.static_range(1, S_IN):
        h += tl.load(x_ptr + s * stride_xs + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        h += tl.load(b_ptr + rk[None, :] + 0 * rm[:, None], mask=mask, other=0.0).to(tl.float32)
    h = h.to(DT).to(tl.float32)
    r = tl.load(r_ptr + rm[:, None] * stride_rm + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    return (h + r).to(DT).to(tl.float32)


@triton.jit
def _prefetch_slab(w_ptr, rn, N, stride_wn, k_lo, k_hi, LINE: tl.constexpr):
    """Ask L2 for the program's weight slab, rows rn x columns [k_lo, k_hi): one
    `prefetch.global.L2` per LINE elements (128 bytes), addresses clamped into the weight
    (a line asked twice costs nothing). A hint: nothing is read into registers, and L2 is
    the device's point of coherence, so it cannot make a later load see older data."""
    rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * stride_wn
    for k0 in range(k_lo, k_hi, 16 * LINE):
        rk = tl.minimum(k0 + tl.arange(0, 16) * LINE, k_hi - 1)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [rows + rk[None, :]],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _w_tile(w_rows, n_ok, k0, k_hi, BLOCK_K: tl.constexpr):
    """The weight tile [BLOCK_N, BLOCK_K] of columns k0 .. (0 from k_hi on)."""
    rk = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & (rk < k_hi)[None, :], other=0.0)


@triton.jit
def _x_in(k0, k_hi, x_ptr, stride_xs, stride_xm, b_ptr, r_ptr, r_out_ptr, nw_ptr, stride_rm,
          rstd, rm, m_ok, K, write_res, w_ptr, pid_m, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
          S_IN: tl.constexpr, PRO: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The input tile of columns k0 ..: [BLOCK_M, BLOCK_K] in the model dtype (dot configs),
    or [1, BLOCK_K] float32 (fma: plain x, or the prologue's tile)."""
    rk = k0 + tl.arange(0, BLOCK_K)
    k_ok = rk < k_hi
    if DOT:
        x = _x_tile(x_ptr, stride_xs, stride_xm, b_ptr, r_ptr, r_out_ptr, nw_ptr, stride_rm,
                    rstd, rm, rk, m_ok, k_ok, K, write_res, w_ptr, S_IN, PRO, HAS_BIAS)
    elif PRO == 0:
        x = tl.load(x_ptr + pid_m * stride_xm + rk, mask=k_ok, other=0.0).to(tl.float32)[None, :]
    else:
        x = _x_tile(x_ptr, stride_xs, stride_xm, b_ptr, r_ptr, r_out_ptr, nw_ptr, stride_rm,
                    rstd, rm, rk, m_ok, k_ok, K, write_res, w_ptr, S_IN, PRO,
                    HAS_BIAS).to(tl.float32)
    return x


@triton.jit
def _mac(acc, w, x, DOT: tl.constexpr):
    """acc plus the weight tile w times the input tile x (_x_in): a tl.dot into acc
    [BLOCK_M, BLOCK_N] (dot configs), or products into acc [BLOCK_N, BLOCK_K] (fma)."""
    if DOT:
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    else:
        acc += w.to(tl.float32) * x
    return acc


@triton.jit
def _k_step(acc, w, k0, k_hi, x_ptr, stride_xs, stride_xm, b_ptr, r_ptr, r_out_ptr, nw_ptr,
            stride_rm, rstd, rm, m_ok, K, write_res, w_ptr, pid_m,
            BLOCK_K: tl.constexpr, DOT: tl.constexpr, S_IN: tl.constexpr, PRO: tl.constexpr,
            HAS_BIAS: tl.constexpr):
    """acc plus the weight tile w (columns k0 ..) times its input tile (_x_in, _mac)."""
    x = _x_in(k0, k_hi, x_ptr, stride_xs, stride_xm, b_ptr, r_ptr, r_out_ptr, nw_ptr, stride_rm,
              rstd, rm, m_ok, K, write_res, w_ptr, pid_m, BLOCK_K, DOT, S_IN, PRO, HAS_BIAS)
    return _mac(acc, w, x, DOT)


@triton.jit
def _linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_os, stride_om,
                   k_split, stride_xs, b_ptr, r_ptr, r_out_ptr, nw_ptr, stride_rm, eps,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT: tl.constexpr, ROUND: tl.constexpr, S_IN: tl.constexpr = 1,
                   PRO: tl.constexpr = 0, HAS_BIAS: tl.constexpr = False,
                   USE_PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False,
                   LINE: tl.constexpr = 64, PRE_T: tl.constexpr = 0, GLU: tl.constexpr = False):
    # GLU: the weight is [2N, K] (gate rows, then up rows); each program also reads the up
    # rows of its gate rows and stores SiLU(gate) * up in the model dtype (no split-K,
    # no preload): gpu_model.silu_mul's roundings of this config's one-plane product.
    # Row tiles vary fastest: the programs that share a weight slab run side by side, so
    # with several row tiles (a verify step's B x Q rows) the slab is read from HBM once
    # and from L2 after (with one row tile the launch order is the (n, split) order).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = split * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    n_ok = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    if GLU:
        u_rows = w_ptr + (rn + N).to(tl.int64)[:, None] * stride_wn
    if PREFETCH:  # only with USE_PDL, and only here: before the wait (rollout/pdl.py)
        _prefetch_slab(w_ptr, rn, N, stride_wn, k_lo, k_hi, LINE)
    # The first PRE_T weight tiles into registers before the wait (rollout/pdl.py: weights
    # are not written during a forward); used below in the loop's order.
    if PRE_T >= 1:
        w0 = _w_tile(w_rows, n_ok, k_lo, k_hi, BLOCK_K)
    if PRE_T >= 2:
        w1 = _w_tile(w_rows, n_ok, k_lo + BLOCK_K, k_hi, BLOCK_K)
    if PRE_T >= 3:
        w2 = _w_tile(w_rows, n_ok, k_lo + 2 * BLOCK_K, k_hi, BLOCK_K)
    if PRE_T >= 4:
        w3 = _w_tile(w_rows, n_ok, k_lo + 3 * BLOCK_K, k_hi, BLOCK_K)
    pdl_enter(USE_PDL)  # the first load of another kernel's output, the first store: rollout/pdl.py
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = rm < M
    rstd = tl.zeros([BLOCK_M], tl.float32)
    if PRO == 2:  # the whole row's mean square first (every program: the rows are short)
        ss = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            h = _residual_sum(x_ptr, stride_xs, stride_xm, b_ptr, r_ptr, stride_rm, rm, rk,
                              m_ok[:, None] & (rk < K)[None, :], w_ptr, S_IN, HAS_BIAS)
            ss += tl.sum(h * h, 1)
        rstd = tl.rsqrt(ss / K + eps)
    write_res = pid_n == 0
    if DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # products, reduced once at the end
    if GLU:
        acc_u = tl.zeros_like(acc)
    if PRE_T >= 1:
        if k_lo < k_hi:  # a split may hold fewer tiles (or none): the loop's steps exactly
            acc = _k_step(acc, w0, k_lo, k_hi, x_ptr, stride_xs, stride_xm, b_ptr, r_ptr,
                          r_out_ptr, nw_ptr, stride_rm, rstd, rm, m_ok, K, write_res, w_ptr,
                          pid_m, BLOCK_K, DOT, S_IN, PRO, HAS_BIAS)
    if PRE_T >= 2:
        if k_lo + BLOCK_K < k_hi:
            acc = _k_step(acc, w1, k_lo + BLOCK_K, k_hi, x_ptr, stride_xs, stride_xm, b_ptr,
                          r_ptr, r_out_ptr, nw_ptr, stride_rm, rstd, rm, m_ok, K, write_res,
                          w_ptr, pid_m, BLOCK_K, DOT, S_IN, PRO, HAS_BIAS)
    if PRE_T >= 3:
        if k_lo + 2 * BLOCK_K < k_hi:
            acc = _k_step(acc, w2, k_lo + 2 * BLOCK_K, k_hi, x_ptr, stride_xs, stride_xm, b_ptr,
                          r_ptr, r_out_ptr, nw_ptr, stride_rm, rstd, rm, m_ok, K, write_res,
                          w_ptr, pid_m, BLOCK_K, DOT, S_IN, PRO, HAS_BIAS)
    if PRE_T >= 4:
        if k_lo + 3 * BLOCK_K < k_hi:
            acc = _k_step(acc, w3, k_lo + 3 * BLOCK_K, k_hi, x_ptr, stride_xs, stride_xm, b_ptr,
                          r_ptr, r_out_ptr, nw_ptr, stride_rm, rstd, rm, m_ok, K, write_res,
                          w_ptr, pid_m, BLOCK_K, DOT, S_IN, PRO, HAS_BIAS)
    for k0 in range(k_lo + PRE_T * BLOCK_K, k_hi, BLOCK_K):
        w = _w_tile(w_rows, n_ok, k0, k_hi, BLOCK_K)
        if GLU:  # one input tile for the gate and the up rows
            x = _x_in(k0, k_hi, x_ptr, stride_xs, stride_xm, b_ptr, r_ptr, r_out_ptr, nw_ptr,
                      stride_rm, rstd, rm, m_ok, K, write_res, w_ptr, pid_m, BLOCK_K, DOT, S_IN,
                      PRO, HAS_BIAS)
            acc = _mac(acc, w, x, DOT)
            acc_u = _mac(acc_u, _w_tile(u_rows, n_ok, k0, k_hi, BLOCK_K), x, DOT)
        else:
            acc = _k_step(acc, w, k0, k_hi, x_ptr, stride_xs, stride_xm, b_ptr, r_ptr, r_out_ptr,
                          nw_ptr, stride_rm, rstd, rm, m_ok, K, write_res, w_ptr, pid_m, BLOCK_K,
                          DOT, S_IN, PRO, HAS_BIAS)
    if not DOT:
        acc = tl.sum(acc, 1)[None, :]  # [1, BLOCK_N]
        if GLU:
            acc_u = tl.sum(acc_u, 1)[None, :]
    if GLU:  # each product rounded as the projection's output, then silu_mul's roundings
        DT = w_ptr.dtype.element_ty
        g = acc.to(DT).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32)
        acc = a * acc_u.to(DT).to(tl.float32)
    if ROUND:  # the model dtype's rounding of the product, stored in a wider output
        acc = acc.to(w_ptr.dtype.element_ty).to(tl.float32)
    out = out_ptr + split * stride_os + rm[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def linear_partials(x: torch.Tensor,  # [M, K], last dim contiguous
                    weight: torch.Tensor,  # [N, K], last dim contiguous
                    cfg: LinearConfig,
                    ) -> torch.Tensor:  # [splits, M, N]: float32 planes, or [1, M, N] model dtype
    """x @ weight.T as partial-sum planes for a consuming kernel to add (module docstring).
    cuBLAS (and any config on CPU outside the interpreter) returns one model-dtype plane."""
    m, k = x.shape
    n = weight.shape[0]
    if cfg.kind == "cublas" or not _triton_ok(x):
        pdl.plain_launch()
        return F.linear(x, weight).unsqueeze(0)
    out = torch.empty(cfg.splits, m, n, dtype=torch.float32, device=x.device)
    _launch(x, weight, out, cfg, round_out=False, k=k)
    return out


def linear_into(x: torch.Tensor,  # [M, K]
                weight: torch.Tensor,  # [N, K]
                out: torch.Tensor,  # [M, N] (e.g. float32 logits), written in place
                cfg: LinearConfig) -> torch.Tensor:
    """out <- x @ weight.T rounded to the weight's dtype first (as F.linear's output would
    be), then stored in out's dtype. A split config is run as one split here."""
    if cfg.kind == "cublas" or not _triton_ok(x):
        pdl.plain_launch()
        return out.copy_(F.linear(x, weight))
    cfg = dataclasses.replace(cfg, splits=1)
    _launch(x, weight, out.unsqueeze(0), cfg, round_out=True, k=x.shape[1])
    return out


def _launch(x, weight, out, cfg: LinearConfig, *, round_out: bool, k: int | None = None,
            pro: int = 0, planes=None, bias=None, residual=None, residual_out=None,
            norm_weight=None, eps: float = 0.0, glu: bool = False) -> None:
    """x [M, K] (pro 0), or the prologue's inputs: `planes` [S, M, *] with pro 1 (SiLU *
    mul of gate/up planes, K = half their width) or pro 2 (RMSNorm of residual + planes).
    glu: the kernel's GLU epilogue (one split; out [1, M, N / 2] in the model dtype)."""
    if pro == 0:
        m, k = x.shape
        if x.stride(-1) != 1:
            raise ValueError("triton linear: x must be contiguous in the last dimension")
        src, stride_xs, stride_xm, s_in = x, 0, x.stride(0), 1
    else:
        s_in, m = planes.shape[0], planes.shape[1]
        if planes.stride(-1) != 1:
            raise ValueError("triton linear: the prologue's planes must be contiguous in the last dimension")
        src, stride_xs, stride_xm = planes, planes.stride(0), planes.stride(1)
    n = weight.shape[0] // 2 if glu else weight.shape[0]
    if glu and (cfg.splits != 1 or weight.shape[0] % 2):
        raise ValueError(f"triton linear: the GLU epilogue takes one split and an even number "
                         f"of weight rows, got {cfg.splits} splits, weight {tuple(weight.shape)}")
    if weight.stride(-1) != 1:
        raise ValueError("triton linear: the weight must be contiguous in the last dimension")
    if weight.shape[1] != k:
        raise ValueError(f"triton linear: input width {k} and weight {tuple(weight.shape)} disagree on K")
    dot = cfg.kind == "dot"
    if not dot and m != 1:
        raise ValueError(f"triton linear: fma configs serve one row, got {m} rows")
    block_m = cfg.block_m if dot else 1
    k_split = -(-k // (cfg.splits * cfg.block_k)) * cfg.block_k
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, cfg.block_n), cfg.splits)
    res = residual if residual is not None else weight
    _linear_kernel[grid](src, weight, out, m, n, k, stride_xm, weight.stride(0),
                         out.stride(0), out.stride(1), k_split, stride_xs,
                         bias if bias is not None else weight, res,
                         residual_out if residual_out is not None else weight,
                         norm_weight if norm_weight is not None else weight,
                         res.stride(0) if residual is not None else 0, float(eps),
                         BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT=dot,
                         ROUND=round_out, S_IN=s_in, PRO=pro, HAS_BIAS=bias is not None,
                         PREFETCH=not glu and weight.numel() * weight.element_size() <= pdl.prefetch_limit(),
                         LINE=max(1, 128 // weight.element_size()),
                         PRE_T=0 if glu else preload_tiles(cfg, k_split, weight.element_size()),
                         GLU=glu,
                         num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.kwargs())


def preload_tiles(cfg: LinearConfig, k_split: int, elt: int) -> int:
    """Weight tiles a program loads before its PDL wait: as many of its split's tiles as
    fit pdl.preload_limit() bytes, at most 4 (0 outside PDL or with the limit 0)."""
    limit = pdl.preload_limit()
    if limit <= 0:
        return 0
    return max(0, min(4, -(-k_split // cfg.block_k), limit // (cfg.block_n * cfg.block_k * elt)))


def glu_linear(x: torch.Tensor,  # [M, K], last dim contiguous
               weight: torch.Tensor,  # [2 I, K]: gate rows, then up rows
               cfg: LinearConfig,  # a Triton config of one split
               ) -> torch.Tensor:  # [M, I] in the weight's dtype
    """SiLU(x @ gate.T) * (x @ up.T) in one launch (the projection's GLU epilogue): bit for
    bit gpu_model.silu_mul(linear_partials(x, weight, cfg)), one kernel fewer."""
    m, k = x.shape
    out = torch.empty(1, m, weight.shape[0] // 2, dtype=weight.dtype, device=x.device)
    _launch(x, weight, out, cfg, round_out=False, k=k, glu=True)
    return out[0]


def silu_linear_partials(gate_up: torch.Tensor,  # [S, M, 2 * I] planes (gate, then up columns)
                         weight: torch.Tensor,  # [N, I]
                         cfg: LinearConfig) -> torch.Tensor:  # [splits, M, N] float32
    """down(silu(gate) * up) with the SiLU * mul in the GEMV's prologue (a dot or fma config):
    the same roundings as gpu_model.silu_mul followed by linear_partials."""
    s, m, two_i = gate_up.shape
    out = torch.empty(cfg.splits, m, weight.shape[0], dtype=torch.float32, device=gate_up.device)
    _launch(None, weight, out, cfg, round_out=False, k=two_i // 2, pro=1, planes=gate_up)
    return out


def norm_linear_partials(h: torch.Tensor,  # [S, M, K] planes of the previous projection
                         residual: torch.Tensor,  # [M, K] model dtype (read only)
                         norm_weight: torch.Tensor,  # [K]
                         eps: float,
                         weight: torch.Tensor,  # [N, K]
                         cfg: LinearConfig,
                         bias: torch.Tensor | None = None,  # [K]: the previous projection's
                         ) -> tuple[torch.Tensor, torch.Tensor]:  # planes [splits, M, N], residual'
    """linear(RMSNorm(residual + h)) with the residual add and the norm in the GEMV's
    prologue (a dot or fma config): the same roundings as gpu_model.rms_norm (its mean square is
    summed in BLOCK_K chunks, so rstd may differ in the last bit). Returns the planes and
    the new residual (a new tensor: the programs read the old one while it is written)."""
    s, m, k = h.shape
    out = torch.empty(cfg.splits, m, weight.shape[0], dtype=torch.float32, device=h.device)
    new_res = torch.empty_like(residual)
    _launch(None, weight, out, cfg, round_out=False, k=k, pro=2, planes=h, bias=bias,
            residual=residual, residual_out=new_res, norm_weight=norm_weight, eps=eps)
    return out, new_res


_MAX_TRITON_ROWS = int(os.environ.get("MEGATRON_TLT_TRITON_ROWS", "256"))
"""Rows up to which Triton configs are timed against cuBLAS: decode batches, and the
verify forward's B x Q rows (batch 32 at Q = 5: 160, where cuBLAS read the 1.5B
weights at ~2 TB/s in session 17's profile: ~1.3 of the verify forward's 2.4 ms).
MEGATRON_TLT_TRITON_ROWS (read at import) sets it; 64 was the limit before session 19."""
_FMA_PROLOGUES = os.environ.get("MEGATRON_TLT_FMA_PROLOGUES", "1") != "0"
"""Whether the planner times fma configs with the SiLU / RMSNorm prologues (read at
import; 0: dot configs only, as before session 19)."""
_ONE_TILE_ROWS = 64
_FUSED_ROWS = int(os.environ.get("MEGATRON_TLT_FUSED_ROWS", "8"))
"""Rows up to which the planner times the SiLU / RMSNorm prologues (read at import; 1 was
the limit before session 19): a speculative verify at batch 1 has Q = 5-8 rows, and
whether re-reading them in every program beats a separate launch is the timing's call."""


_GLU = int(os.environ.get("MEGATRON_TLT_GLU", "0"))
"""The gate/up projection's GLU epilogue (glu_linear: SiLU * up stored by the projection,
no silu_mul launch): 0 off (default), 1 where the planner times it faster than the
projection's plan + silu_mul, 2 wherever a one-split Triton config runs (its fastest).
Read at import; bench rollout --compare-attr megatron_tlt.rollout.triton_linear:_GLU=N.
Session 32's ablation (tools/ablate_decode.py, H100): leaving silu_mul out of the 7B
batch-32 graph saved 12.7 us a layer against its 2.3 us alone. Timed over whole steps
(session 33, H100, bench rollout --compare-attr, benchmarks/results/gpu_2026-12-06_session33):
_GLU=1 ran at 0.927x-1.001x of the default's speed at the 1.5B and 7B shapes, batch 1 / 8 /
32 (slower exactly where the planner timed the epilogue faster alone), _GLU=2 at
0.924x-1.004x; hence off by default."""
if _GLU not in (0, 1, 2):
    raise ValueError(f"MEGATRON_TLT_GLU={_GLU}: 0 (off), 1 (where timed faster) or 2 (always)")

FMA_WIDE = False
"""Opt-in (session 37, until timed over whole steps): for one row the planner also times fma
configs of 2-warp programs over 256-column K tiles and of 4-warp programs over 1024-column
ones. tools/linear_sweep.py timed them alone on an H100 (benchmarks/results/gpu_2026-12-07_session37):
the 1.5B shape's QKV and O projections 1.11x-1.13x faster than the planner's best
(fma:m1n4k256s4w2p3), its down projection 1.05x (fma:m1n2k1024s4w4p3), the 7B shape's
1.01x-1.02x. Over whole steps (session 38, H100, bench rollout --compare-attr,
benchmarks/results/gpu_2026-12-07_session38): 0.986x at the 1.5B shape, batch 1, 1.001x at
7B, so it stays off; its configs pass the GPU test against the float32 product
(test_fma_wide_configs_match_float32_product). Plans made with it carry the tag _FMA_WIDE in
their key (read at planning: bench rollout --compare-attr
megatron_tlt.rollout.triton_linear:FMA_WIDE=True)."""
_FMA_WIDE = "fma_wide"

CUBLAS_MARGIN = 1.0
"""Opt-in (session 37, until timed over whole steps; 1.0: off): the planner takes cuBLAS only
where its time times this factor still beats every Triton config. Timing alone misses
what a cuBLAS projection costs inside the step's chain of PDL launches (why exactly is not
pinned down). Session 37's H100 run: at the 7B shape, batch 32, the planner took cuBLAS for
the gate/up projection by 1% alone (98.03 against 98.89 us) and the step ran 6.233 ms,
against 5.959 ms in session 36 where it had taken the Triton config; every projection on
cuBLAS ran 6.067 ms. Session 38 (H100, benchmarks/results/gpu_2026-12-07_session38): 1.05
ran batch-32 steps 0.972x as fast at the 1.5B shape (its gate/up projection went from
cuBLAS, 23.72 us, to a Triton config, 24.27 us) and 1.001x at 7B (nothing changed plan), so
it stays 1.0. Plans made with a margin carry it in their key (read at planning: bench
rollout --compare-attr megatron_tlt.rollout.triton_linear:CUBLAS_MARGIN=1.05)."""

_ROW_LOCAL = "row_local"
"""The last entry of a plan key timed without cuBLAS (LinearPlanner.config's row_local)."""


def _row_bucket(m: int) -> int:
    """The row count a plan is timed at: the power of two >= m up to 64, then the multiple
    of 32 >= m (a verify forward's B x Q: 160 rows are timed as 160, not as 256)."""
    if m <= _ONE_TILE_ROWS:
        return 1 << max(0, (m - 1).bit_length())
    return -(-m // 32) * 32


def candidate_configs(m: int, n: int, k: int) -> list[LinearConfig]:
    """The configs the planner times for an [m, k] x [n, k] product (cuBLAS first). Every
    shape up to MEGATRON_TLT_TRITON_ROWS rows has single-split Triton configs (a row_local
    plan needs one; short K only loses split-K)."""
    out = [CUBLAS]
    if m > _MAX_TRITON_ROWS:
        return out
    if m > _ONE_TILE_ROWS:
        # Several row tiles of 64 or 128 (tensor-core tiles of Hopper's warpgroup MMA), a
        # weight slab shared by the row tiles through L2 (the grid runs them side by side).
        for block_m in (64, 128):
            for block_n in (64, 128):
                for splits in (1, 2, 4):
                    if splits > 1 and k // splits < 256:
                        continue
                    out.append(LinearConfig("dot", block_m=block_m, block_n=block_n, block_k=64,
                                            splits=splits, num_warps=8 if block_m * block_n > 8192 else 4,
                                            num_stages=4))
        return out
    block_m = max(16, 1 << (m - 1).bit_length())
    for block_n in (16, 32, 64):
        for splits in (1, 2, 4, 8):
            if splits > 1 and k // splits < 256:
                continue
            out.append(LinearConfig("dot", block_m=block_m, block_n=block_n, block_k=128,
                                    splits=splits, num_warps=4, num_stages=4))
    if m == 1:
        for block_n in (4, 8, 16):
            for splits in (1, 2, 4):
                if splits > 1 and k // splits < 512:
                    continue
                out.append(LinearConfig("fma", block_m=1, block_n=block_n, block_k=512,
                                        splits=splits, num_warps=4, num_stages=3))
        if FMA_WIDE:
            for block_n in (4, 8):
                for splits in (1, 2, 4, 8):
                    if splits == 1 or k // splits >= 256:
                        out.append(LinearConfig("fma", block_m=1, block_n=block_n, block_k=256,
                                                splits=splits, num_warps=2, num_stages=3))
            for block_n in (2, 4):
                for splits in (1, 2, 4):
                    if splits == 1 or k // splits >= 1024:
                        out.append(LinearConfig("fma", block_m=1, block_n=block_n, block_k=1024,
                                                splits=splits, num_warps=4, num_stages=3))
    return out


def _wide_tag(m: int) -> tuple:
    """The plan key's tag for a candidate set widened by FMA_WIDE (one row only)."""
    return (_FMA_WIDE,) if FMA_WIDE and m == 1 else ()


def _margin_tag() -> tuple:
    """The plan key's tag for a cuBLAS margin other than 1 (CUBLAS_MARGIN)."""
    return (f"cublas_x{CUBLAS_MARGIN:g}",) if CUBLAS_MARGIN != 1.0 else ()


class LinearPlanner(PlanCache):
    """Fastest config per (M, N, K, dtype), timed once on the device and cached.

    Must not be asked for a new shape during CUDA graph capture (timing synchronises):
    the decode runner's warm-up pass, which runs every bucket eagerly before capturing
    it, fills the cache. `fixed` forces one config everywhere (tests, A/B benchmarks).
    Engines take `LinearPlanner.shared(device)`, so that every engine of a process runs
    the same kernels (linear_plans.py); `plan_file` also reads and extends a file of plans.
    """

    def __init__(self, *, fixed: LinearConfig | None = None, fixed_fused: bool = False,
                 iters: int = 16, plan_file: PlanFile | None = None):
        """fixed_fused: with `fixed`, also run the prologue-fused projections with it."""
        self.fixed = fixed
        self.fixed_fused = fixed_fused
        self.iters = iters
        self.timings: dict[tuple, dict[str, float]] = {}
        """(m, n, k, dtype, split) -> {str(config): microseconds} of every candidate timed."""
        super().__init__(plan_file)

    def config(self, x: torch.Tensor, weight: torch.Tensor, *, split: bool = True,
               rows: int | None = None, row_local: bool = False) -> LinearConfig:
        """split=False: only single-plane configs (for `linear_into`). rows: plan for this
        many rows (at least x's): a caller whose row count varies (the EAGLE drafter's eager
        levels against its graphs' padded buckets) gets one config. row_local: only Triton
        configs, whose rows are computed alike whatever the row count (cuBLAS picks its
        kernel, and with it the summation order, per shape: an fp32 row of 5 live rows and
        the same row in an 8-row bucket came out different on the H200, session 20); up to
        MEGATRON_TLT_TRITON_ROWS rows, cuBLAS beyond."""
        if self.fixed is not None:
            return self.fixed
        m = max(x.shape[0], rows or 0)
        if x.device.type != "cuda" or m > _MAX_TRITON_ROWS:
            return CUBLAS
        return self._plan(x, weight, m, split, row_local)[0]

    def _plan(self, x, weight, m: int, split: bool, row_local: bool) -> tuple[LinearConfig, float]:
        """(config, us) of the plan for m rows, timed at first use."""
        # Row counts are planned per bucket (_row_bucket; a verify step's B * Q takes many
        # values); a bucket's config serves every row count up to it.
        key = (_row_bucket(m), weight.shape[0], weight.shape[1], weight.dtype, split)
        if row_local:
            key += (_ROW_LOCAL,)
        key += _wide_tag(key[0]) + _margin_tag()
        return self._choose(self.plans, key, lambda: self._tune(x, weight, key))

    def fused_config(self, kind: str,  # "norm" | "silu"
                     planes: torch.Tensor,  # [S, M, *] the prologue's input planes
                     weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
                     eps: float = 1e-6, rows: int | None = None,
                     row_local: bool = False) -> LinearConfig | None:
        """The config to run `kind`'s kernel fused into this projection's prologue with, or
        None when the separate kernel + projection is at least as fast (always None above
        _FUSED_ROWS rows: every program re-reads its rows' inputs, and for the norm the
        whole row; `rows` as in `config`, planned per row bucket; row_local: timed against
        the unfused projection's row-local plan, which is what runs when this is None)."""
        if self.fixed is not None:
            return self.fixed if self.fixed_fused and self.fixed.kind != "cublas" else None
        m = max(planes.shape[1], rows or 0)
        if planes.device.type != "cuda" or m > _FUSED_ROWS:
            return None
        m = _row_bucket(m)
        key = (kind, m, weight.shape[0], weight.shape[1], planes.shape[0], weight.dtype)
        if row_local:
            key += (_ROW_LOCAL,)
        key += _wide_tag(m)
        return self._choose(self.fused, key, lambda: self._tune_fused(
            kind, planes, weight, norm_weight, eps, m, row_local=row_local))[0]

    def glu_config(self, x: torch.Tensor,  # [M, K]: the projection's input (its rows)
                   weight: torch.Tensor,  # [2 I, K] gate rows, then up rows
                   ) -> LinearConfig | None:
        """The one-split config to run this gate/up projection with its GLU epilogue
        (glu_linear), or None for the projection's plan + silu_mul (_GLU says when)."""
        if _GLU <= 0:
            return None
        if self.fixed is not None:  # tests: the fixed config, where it can take the epilogue
            one = self.fixed.kind != "cublas" and self.fixed.splits == 1
            return self.fixed if one else None
        if x.device.type != "cuda":
            return None
        m = max(x.shape[0], 1)
        if m > _MAX_TRITON_ROWS:
            return None
        m = _row_bucket(m)
        key = ("glu" if _GLU == 1 else "glu-any", m, weight.shape[0], weight.shape[1], 1, weight.dtype)
        return self._choose(self.fused, key, lambda: self._tune_glu(x, weight, m))[0]

    def _tune_glu(self, x, weight, m):
        from megatron_tlt.rollout.gpu_model import silu_mul
        n2, k = weight.shape
        dt = weight.dtype
        xs = torch.randn(m, k, dtype=dt, device=x.device)
        cfg, proj_us = self._plan(xs, weight, m, True, False)  # the unfused projection's plan
        planes = linear_partials(xs, weight, cfg)
        unfused = _time_us(lambda i: silu_mul(planes, dtype=dt), self.iters) + proj_us
        ws = _weight_copies(weight)
        best, best_us = self._fastest(
            [c for c in candidate_configs(m, n2 // 2, k) if c.kind != "cublas" and c.splits == 1],
            lambda cfg, i: glu_linear(xs, ws[i % len(ws)], cfg), unfused if _GLU == 1 else float("inf"))
        return best, best_us, unfused

    def _fastest(self, configs, run, bound_us: float) -> tuple[LinearConfig | None, float]:
        """The config of `configs` whose run(config, i) times fastest and under bound_us, and
        its time; (None, bound_us) when none does. A config that does not compile on this
        device is skipped."""
        best, best_us = None, bound_us
        for cfg in configs:
            try:
                us = _time_us(lambda i: run(cfg, i), self.iters)  # noqa: B023
            except Exception:  # a config that does not compile on this device
                continue
            if us < best_us:
                best, best_us = cfg, us
        return best, best_us

    def _tune_fused(self, kind, planes, weight, norm_weight, eps, m, *, row_local=False):
        from megatron_tlt.rollout.gpu_model import rms_norm, silu_mul
        s_in = planes.shape[0]
        n, k = weight.shape
        dev, dt = planes.device, weight.dtype
        p = torch.randn(s_in, m, planes.shape[2], dtype=planes.dtype, device=dev)
        res = torch.randn(m, k, dtype=dt, device=dev)
        nw = norm_weight if norm_weight is not None else torch.ones(k, dtype=dt, device=dev)
        _, proj_us = self._plan(torch.randn(m, k, dtype=dt, device=dev), weight, m, True,
                                row_local)  # the unfused projection's plan
        ws = _weight_copies(weight)
        if kind == "norm":
            consumer = lambda i: rms_norm(p, nw, eps, residual=res)  # noqa: E731
        else:
            consumer = lambda i: silu_mul(p, dtype=dt)  # noqa: E731
        unfused = _time_us(consumer, self.iters) + proj_us
        if kind == "norm":
            run = lambda cfg, i: norm_linear_partials(p, res, nw, eps, ws[i % len(ws)], cfg)  # noqa: E731
        else:
            run = lambda cfg, i: silu_linear_partials(p, ws[i % len(ws)], cfg)  # noqa: E731
        best, best_us = self._fastest(
            [c for c in candidate_configs(m, n, k)
             if c.kind != "cublas" and (c.kind != "fma" or _FMA_PROLOGUES)], run, unfused)
        return best, best_us, unfused

    def _tune(self, x, weight, key) -> tuple[LinearConfig, float]:
        m, n, k = key[:3]
        xs = torch.randn(m, k, dtype=x.dtype, device=x.device)
        ws = _weight_copies(weight)
        times: dict[str, float] = {}
        best, best_score = (CUBLAS, float("inf")), float("inf")
        row_local = _ROW_LOCAL in key[5:]
        for cfg in candidate_configs(m, n, k):
            if (cfg.splits > 1 and not key[4]) or (row_local and cfg.kind == "cublas"):
                continue
            try:
                us = _time_us(lambda i: linear_partials(xs, ws[i % len(ws)], cfg),  # noqa: B023
                              self.iters)
            except Exception as e:  # a config that does not compile on this device
                times[str(cfg)] = float("nan")
                if cfg.kind == "cublas":
                    raise RuntimeError(f"cuBLAS linear failed for {key[:3]}: {e}") from e
                continue
            times[str(cfg)] = us
            score = us * CUBLAS_MARGIN if cfg.kind == "cublas" else us
            if score < best_score:
                best, best_score = (cfg, us), score
        self.timings[key] = times
        return best


def _weight_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """The weight and random copies of it worth > 2x the L2 cache: timing cycles through
    them, as a decode step does (the other layers' weights evict this one between uses)."""
    nbytes = weight.numel() * weight.element_size()
    return [weight] + [torch.empty_like(weight).normal_() for _ in range(min(15, (256 << 20) // nbytes))]


def _time_us(call, n: int) -> float:
    """Median microseconds of call(i), i = 0..n-1, replayed as one CUDA graph: kernel time
    without the Python launch overhead (which would otherwise dominate a 3 us kernel and
    favour whichever library launches fastest)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile / initialise outside the capture
        call(0)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        for i in range(n):
            call(i)
    graph.replay()
    ts = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / n)
    del graph
    ts.sort()
    return ts[len(ts) // 2]
