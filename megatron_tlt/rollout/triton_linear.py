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

`LinearPlanner` picks, per (M, N, K, dtype), the fastest of cuBLAS and a few Triton
configs by timing them once on the device (outside any CUDA graph capture); the choice
is cached for the process. On CPU it always answers cuBLAS (`F.linear`).
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def _triton_ok(x: torch.Tensor) -> bool:
    """Triton runs on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1 (tests)."""
    return x.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_os, stride_om,
                   k_split,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT: tl.constexpr, ROUND: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = rn < N
    m_ok = rm < M
    k_lo = split * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    if DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < k_hi
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    else:  # BLOCK_M == 1
        prod = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < k_hi
            x = tl.load(x_ptr + pid_m * stride_xm + rk, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            prod += w.to(tl.float32) * x[None, :]
        acc = tl.sum(prod, 1)[None, :]  # [1, BLOCK_N]
    if ROUND:  # the model dtype's rounding of the product, stored in a wider output
        acc = acc.to(w_ptr.dtype.element_ty).to(tl.float32)
    out = out_ptr + split * stride_os + rm[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@dataclasses.dataclass(frozen=True)
class LinearConfig:
    """How one projection runs: `cublas` (F.linear) or a Triton config."""

    kind: str = "cublas"  # "cublas" | "dot" | "fma"
    block_m: int = 16
    block_n: int = 32
    block_k: int = 256
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __str__(self) -> str:
        if self.kind == "cublas":
            return "cublas"
        return (f"{self.kind}:m{self.block_m}n{self.block_n}k{self.block_k}s{self.splits}"
                f"w{self.num_warps}p{self.num_stages}")


CUBLAS = LinearConfig()


def linear_partials(x: torch.Tensor,  # [M, K], last dim contiguous
                    weight: torch.Tensor,  # [N, K], last dim contiguous
                    cfg: LinearConfig,
                    ) -> torch.Tensor:  # [splits, M, N]: float32 planes, or [1, M, N] model dtype
    """x @ weight.T as partial-sum planes for a consuming kernel to add (module docstring).
    cuBLAS (and any config on CPU outside the interpreter) returns one model-dtype plane."""
    m, k = x.shape
    n = weight.shape[0]
    if cfg.kind == "cublas" or not _triton_ok(x):
        return F.linear(x, weight).unsqueeze(0)
    out = torch.empty(cfg.splits, m, n, dtype=torch.float32, device=x.device)
    _launch(x, weight, out, cfg, round_out=False)
    return out


def linear_into(x: torch.Tensor,  # [M, K]
                weight: torch.Tensor,  # [N, K]
                out: torch.Tensor,  # [M, N] (e.g. float32 logits), written in place
                cfg: LinearConfig) -> torch.Tensor:
    """out <- x @ weight.T rounded to the weight's dtype first (as F.linear's output would
    be), then stored in out's dtype. A split config is run as one split here."""
    if cfg.kind == "cublas" or not _triton_ok(x):
        return out.copy_(F.linear(x, weight))
    cfg = dataclasses.replace(cfg, splits=1)
    _launch(x, weight, out.unsqueeze(0), cfg, round_out=True)
    return out


def _launch(x, weight, out, cfg: LinearConfig, *, round_out: bool) -> None:
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("triton linear: x and weight must be contiguous in the last dimension")
    if weight.shape[1] != k:
        raise ValueError(f"triton linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} disagree on K")
    dot = cfg.kind == "dot"
    if not dot and m != 1:
        raise ValueError(f"triton linear: fma configs serve one row, got {m}")
    block_m = cfg.block_m if dot else 1
    k_split = -(-k // (cfg.splits * cfg.block_k)) * cfg.block_k
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, block_m), cfg.splits)
    _linear_kernel[grid](x, weight, out, m, n, k, x.stride(0), weight.stride(0),
                         out.stride(0), out.stride(1), k_split,
                         BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT=dot,
                         ROUND=round_out, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def candidate_configs(m: int, n: int, k: int) -> list[LinearConfig]:
    """The configs the planner times for an [m, k] x [n, k] product (cuBLAS first)."""
    out = [CUBLAS]
    if m > 64:
        return out
    block_m = max(16, 1 << (m - 1).bit_length())
    for block_n in (16, 32, 64):
        for splits in (1, 2, 4, 8):
            if k // splits < 256:
                continue
            out.append(LinearConfig("dot", block_m=block_m, block_n=block_n, block_k=128,
                                    splits=splits, num_warps=4, num_stages=4))
    if m == 1:
        for block_n in (4, 8, 16):
            for splits in (1, 2, 4):
                if k // splits < 512:
                    continue
                out.append(LinearConfig("fma", block_m=1, block_n=block_n, block_k=512,
                                        splits=splits, num_warps=4, num_stages=3))
    return out


class LinearPlanner:
    """Fastest config per (M, N, K, dtype), timed once on the device and cached.

    Must not be asked for a new shape during CUDA graph capture (timing synchronises):
    the decode runner's warm-up pass, which runs every bucket eagerly before capturing
    it, fills the cache. `fixed` forces one config everywhere (tests, A/B benchmarks).
    """

    def __init__(self, *, fixed: LinearConfig | None = None, iters: int = 16):
        self.fixed = fixed
        self.iters = iters
        self.plans: dict[tuple, tuple[LinearConfig, float]] = {}
        """(m, n, k, dtype, split) -> (config, microseconds per call)."""
        self.timings: dict[tuple, dict[str, float]] = {}
        """(m, n, k, dtype, split) -> {str(config): microseconds} of every candidate timed."""

    def config(self, x: torch.Tensor, weight: torch.Tensor, *, split: bool = True) -> LinearConfig:
        """split=False: only single-plane configs (for `linear_into`)."""
        if self.fixed is not None:
            return self.fixed
        if x.device.type != "cuda":
            return CUBLAS
        key = (x.shape[0], weight.shape[0], weight.shape[1], weight.dtype, split)
        if key not in self.plans:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"LinearPlanner: shape {key[:3]} first seen during CUDA graph "
                                   "capture; run the bucket eagerly first")
            self.plans[key] = self._tune(x, weight, key)
        return self.plans[key][0]

    def _tune(self, x, weight, key) -> tuple[LinearConfig, float]:
        m, n, k = key[:3]
        xs = torch.randn(m, k, dtype=x.dtype, device=x.device)
        # Cycle through copies of the weight worth > 2x the L2 cache, as a decode step
        # does (the other layers' weights evict this one between its uses).
        nbytes = weight.numel() * weight.element_size()
        ws = [weight] + [torch.empty_like(weight).normal_() for _ in range(min(15, (256 << 20) // nbytes))]
        times: dict[str, float] = {}
        best = (CUBLAS, float("inf"))
        for cfg in candidate_configs(m, n, k):
            if cfg.splits > 1 and not key[4]:
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
            if us < best[1]:
                best = (cfg, us)
        self.timings[key] = times
        return best


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
    with torch.cuda.graph(graph):
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
