"""The sampler's Exp(1) noise in one Triton kernel: `sampling.exponential_noise` fused.

Why: the reference builds the noise from torch elementwise ops on int64 tensors
(SplitMix64 twice, shifts, masks, a float64 log): about 35 kernels per call, each
reading and writing a [rows, n] int64 plane. A sampled decode step draws [batch, 151936]
of it (1.2 MB of int64 per row per pass), a verify step [batch x tokens, vocab], and a
drafted chain level [batch, draft vocab]: in a CUDA graph at batch 1 that is ~35 launches
of a few microseconds each per draw, and at batch 32 ~35 passes over 39 MB.

Same numbers: every integer step is the reference's (uint64 arithmetic wraps modulo 2^64
exactly as torch's int64 does; right shifts of uint64 are logical, which the reference
emulates with a mask), the 53-bit integer converts to float64 exactly, and the float64
`log` is CUDA's libdevice log, the function torch's CUDA `log` compiles to. The GPU test
(tests/gpu/test_engine_gpu.py) checks `torch.equal` against the reference on the device;
the interpreter test checks the bits exactly and the float32 values within one ulp
(NumPy's log stands in for CUDA's there).

Imported only where triton is (CUDA paths, interpreter tests); `sampling.exponential_noise`
dispatches here for CUDA tensors unless MEGATRON_TLT_FUSED_NOISE=0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_BLOCK = 1024


@triton.jit
def _mix64(z, M1, M2):
    z = (z ^ (z >> 30)) * M1
    z = (z ^ (z >> 27)) * M2
    return z ^ (z >> 31)


@triton.jit
def stream_base(keys_ptr, draws_ptr, row, GOLDEN, M1, M2):
    """The row's stream position: SplitMix64 of (key, draw), as uint64."""
    key = tl.load(keys_ptr + row).to(tl.uint64, bitcast=True)
    draw = tl.load(draws_ptr + row).to(tl.uint64, bitcast=True)
    return _mix64(key + (draw + 1) * GOLDEN, M1, M2)


@triton.jit
def exp_noise_at(base, idx, GOLDEN, M1, M2, TINY):
    """Exp(1) noise of indices `idx` of the stream at `base` (float32): the reference's
    bits, the float64 log, the rounding and the clamp (module docstring). Shared with the
    fused sampler (triton_sample.py), so both draw the same numbers."""
    bits = _mix64(base + (idx.to(tl.uint64) + 1) * GOLDEN, M1, M2)
    u = ((bits >> 11).to(tl.float64) + 0.5) * 1.1102230246251565e-16  # 2^-53
    e = (-tl.log(u)).to(tl.float32)
    return tl.maximum(e, TINY)


@triton.jit
def _exp_noise_kernel(keys_ptr, draws_ptr, out_ptr, n, stride_out, GOLDEN, M1, M2, TINY,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0)
    blk = tl.program_id(1)
    base = stream_base(keys_ptr, draws_ptr, row, GOLDEN, M1, M2)
    idx = blk * BLOCK + tl.arange(0, BLOCK)
    e = exp_noise_at(base, idx, GOLDEN, M1, M2, TINY)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + idx, e, mask=idx < n)


def exponential_noise_fused(keys: torch.Tensor,  # [B] int64, on the output's device
                            draws: torch.Tensor,  # [B] int64
                            n: int) -> torch.Tensor:  # [B, n] float32
    """`sampling.exponential_noise(keys, draws, n, keys.device)` in one launch."""
    if keys.dtype != torch.int64 or draws.dtype != torch.int64 or keys.shape != draws.shape \
            or keys.dim() != 1:
        raise ValueError(f"exponential_noise_fused: keys and draws must be [B] int64, got "
                         f"{keys.dtype}{tuple(keys.shape)} / {draws.dtype}{tuple(draws.shape)}")
    keys, draws = keys.contiguous(), draws.contiguous()
    out = torch.empty(keys.shape[0], n, dtype=torch.float32, device=keys.device)
    if keys.shape[0] == 0 or n == 0:
        return out
    grid = (keys.shape[0], triton.cdiv(n, _BLOCK))
    _exp_noise_kernel[grid](keys, draws, out, n, out.stride(0), _GOLDEN, _MIX1, _MIX2,
                            torch.finfo(torch.float32).tiny, BLOCK=_BLOCK)
    return out
