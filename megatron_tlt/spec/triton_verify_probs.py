"""The sampled verification's target probabilities in two Triton kernels (VerifyMath's
CUDA fast path).

Why: the torch ops of the sampled fast path (logits / T, softmax, the renormalising sum
and division, and a log_softmax over every row for the reported logprobs) are five full
passes over [bucket x Q, vocab] float32 with one thread block per row. On the H200 at
batch 32, Q = 5 and a 151,936 vocabulary (160 rows: 97 MB per pass) they took ~0.38 ms of
the math graph's 0.56 ms (torch.profiler, benchmarks/results/gpu_2026-12-04_session17):
a softmax with 160 blocks cannot use the device's bandwidth. Here each row is split over
several programs: one kernel writes each part's running max and sum of exp, a second
combines a row's parts (every program the same way, so the same values) and writes the
probabilities, and each row's max M and log of its sum log Z. The logprob of a token is
then (x / T - M) - log Z, gathered for the emitted tokens only: no log_softmax pass.
Two reads and one write of the logits in place of about ten.

What it computes, per row r of sequence b (temperature T_b > 0; top-k, top-p off):
    s = x / T_b (float32, IEEE-rounded: torch's quotient);  M = max s;  Z = sum exp(s - M)
    probs[r, i] = exp(s_i - M) / Z
These are the kernels' own roundings, not process_logits' bits (its softmax reduces in
another order, then renormalises): within a few float32 ulps of it
(tests/unit/spec/test_triton_verify_probs_interp.py, tests/gpu). Lossless all the same:
the rejection sampler reads exactly these probabilities as the target distribution. A
row's values depend on how many parts it is split into (`_parts`: the row count), as a
torch reduction's already depend on the batch shape; the graph replay and the eager math
of one shape agree bit for bit. A row with a NaN or +inf logit gets NaN probabilities (as
softmax gives; -inf entries get 0). CPU keeps the torch ops (the exact reference path of
the CPU tests). Kill switch: MEGATRON_TLT_FUSED_VERIFY_PROBS=0.

Imported only where triton is (CUDA paths, interpreter tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_tlt.rollout.triton_sample import combine_stats, part_stats

_BLOCK = 1024
_PROGRAMS = 512
"""Programs to aim for over all rows (a few per streaming multiprocessor of an H200)."""
_MAX_PARTS = 64


# One compiled binary per kernel whatever the batch: the split (CHUNK, NPARTS) and Q change
# with the rows, and a new specialisation compiled inside a timed run would cost a second.
@triton.jit(do_not_specialize=["stride_t", "Q", "CHUNK"])
def _part_stats_kernel(x_ptr, stride_x, temp_ptr, stride_t, Q, pm_ptr, pz_ptr, V, CHUNK,
                       BLOCK: tl.constexpr, SPLIT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    t = tl.load(temp_ptr + (row // Q) * stride_t).to(tl.float32)
    mx, zz = part_stats(x_ptr + row * stride_x, t, part * CHUNK, CHUNK, V, BLOCK, False)
    tl.store(pm_ptr + row * SPLIT + part, mx)
    tl.store(pz_ptr + row * SPLIT + part, zz)


@triton.jit(do_not_specialize=["stride_t", "Q", "NPARTS", "CHUNK"])
def _probs_kernel(x_ptr, stride_x, temp_ptr, stride_t, Q, pm_ptr, pz_ptr, p_ptr, stride_p, m_ptr, lz_ptr,
                  V, NPARTS, CHUNK, BLOCK: tl.constexpr, SPLIT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    mx, zz = combine_stats(pm_ptr + row * SPLIT, pz_ptr + row * SPLIT, NPARTS, SPLIT, False)
    t = tl.load(temp_ptr + (row // Q) * stride_t).to(tl.float32)
    src = x_ptr + row * stride_x
    dst = p_ptr + row * stride_p
    for off in range(0, CHUNK, BLOCK):
        idx = part * CHUNK + off + tl.arange(0, BLOCK)
        ok = idx < V
        s = tl.math.div_rn(tl.load(src + idx, mask=ok, other=0.0).to(tl.float32), t)
        tl.store(dst + idx, tl.math.div_rn(tl.exp(s - mx), zz), mask=ok)
    if part == 0:
        tl.store(m_ptr + row, mx)
        tl.store(lz_ptr + row, tl.log(zz))


def _parts(rows: int, v: int) -> tuple[int, int]:
    """(parts per row, columns per part) for `rows` rows of v columns: about _PROGRAMS
    programs in all, at most _MAX_PARTS per row, parts of whole BLOCKs, none empty."""
    want = max(1, min(_MAX_PARTS, -(-_PROGRAMS // max(rows, 1)), -(-v // _BLOCK)))
    chunk = -(-(-(-v // want)) // _BLOCK) * _BLOCK
    return -(-v // chunk), chunk


def verify_probs(logits: torch.Tensor,  # [B, Q, V] float32, rows contiguous (any row stride)
                 temperature: torch.Tensor,  # [B] float32 (any stride), > 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probs [B, Q, V] float32, M [B, Q] float32, log Z [B, Q] float32) of
    softmax(logits / T) (module doc): two launches, no host sync (capturable)."""
    # rows b * Q + j at a fixed stride (a size-1 dimension's stride is free: contiguous()
    # leaves it as it was)
    if logits.dim() == 3:
        row_stride = logits.stride(1) if logits.shape[1] > 1 else logits.stride(0)
    if logits.dim() != 3 or logits.dtype != torch.float32 or logits.stride(-1) != 1 \
            or (logits.shape[0] > 1 and logits.stride(0) != logits.shape[1] * row_stride):
        raise ValueError(f"verify_probs: logits must be [B, Q, V] float32 with rows of stride "
                         f"(Q * S, S, 1), got {logits.dtype}{tuple(logits.shape)} strides {logits.stride()}")
    b, q, v = logits.shape
    if temperature.shape != (b,) or temperature.dtype != torch.float32:
        raise ValueError(f"verify_probs: temperature must be [{b}] float32, got "
                         f"{temperature.dtype}{tuple(temperature.shape)}")
    rows, dev = b * q, logits.device
    probs = torch.empty(b, q, v, dtype=torch.float32, device=dev)
    shift = torch.empty(b, q, dtype=torch.float32, device=dev)
    logz = torch.empty(b, q, dtype=torch.float32, device=dev)
    if rows == 0 or v == 0:
        return probs, shift, logz
    parts, chunk = _parts(rows, v)
    pm = torch.empty(rows, _MAX_PARTS, dtype=torch.float32, device=dev)
    pz = torch.empty(rows, _MAX_PARTS, dtype=torch.float32, device=dev)
    stride, st = row_stride, temperature.stride(0)
    _part_stats_kernel[(rows, parts)](logits, stride, temperature, st, q, pm, pz, v, chunk,
                                      BLOCK=_BLOCK, SPLIT=_MAX_PARTS, num_warps=4)
    _probs_kernel[(rows, parts)](logits, stride, temperature, st, q, pm, pz, probs, v, shift, logz,
                                 v, parts, chunk, BLOCK=_BLOCK, SPLIT=_MAX_PARTS, num_warps=4)
    return probs, shift, logz


def verify_probs_reference(logits: torch.Tensor, temperature: torch.Tensor,
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' math in torch ops (the tests' reference): (probs, M, log Z)."""
    s = logits.float() / temperature[:, None, None]
    m = s.amax(-1)
    e = torch.exp(s - m[..., None])
    z = e.sum(-1)
    return e / z[..., None], m, torch.log(z)


def token_logprobs(logits: torch.Tensor,  # [B, Q, V] float32
                   temperature: torch.Tensor,  # [B] float32
                   shift: torch.Tensor, logz: torch.Tensor,  # [B, Q] from verify_probs
                   rows: torch.Tensor, node: torch.Tensor, tok: torch.Tensor,  # [B, W] int64
                   ) -> torch.Tensor:  # [B, W] float32
    """log_softmax(logits[b, node] / T)[tok] from the kernels' row statistics: gathers
    B x W logits, no pass over the vocabulary."""
    x = logits[rows, node, tok] / temperature[:, None]
    return (x - shift[rows, node]) - logz[rows, node]
