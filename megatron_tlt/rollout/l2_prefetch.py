"""Weights into L2 while the decode attention runs (opt-in; rollout/pdl.py's PDL needed).

A decode step of a small batch alternates kernels that stream weights from HBM (the
projections) with kernels that read almost nothing (RMSNorm, the split merge) or little
(the attention over a short context: 0.22 MB of keys and values a layer at the 1.5B
shape, batch 1, in about 6.5 us on an H100; 13.9 MB in about 18 us at the 7B shape, batch
32). While those run, HBM idles. `l2_prefetch` launches, right after the attention kernel,
a kernel that asks L2 for byte ranges of the weights used next (the output projection's,
then the head of the gate/up projection's), so those projections find part of their
weights in L2 instead of starting their HBM reads only when they launch.

Ordering under PDL (pdl.py): this kernel lets its dependents launch first, issues its
prefetches, then waits for the attention grid to complete before it exits, so the kernel
after it (which waits for this grid) still runs only after the attention completed, as
completion stays transitive along the stream. A prefetch reads nothing into registers
and writes nothing; weights are not written during a forward, and L2 is the device's point
of coherence, so it cannot change a result. Without PDL it would only run between the
attention and the next kernel, serialised, so the caller launches it only under PDL.

Two instructions: `cp.async.bulk.prefetch.L2.global` (Hopper's bulk copy engine: one
instruction per CHUNK bytes, BULK) or `prefetch.global.L2` (one per 128-byte line).
GPU only: the CPU interpreter cannot run inline PTX, and a prefetch has nothing to show
on a CPU, so `l2_prefetch` launches nothing there (it returns 0: no bytes asked for).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_tlt.rollout import pdl

BULK_CHUNK = 1 << 16  # bytes per bulk prefetch instruction
LINE = 128  # bytes per prefetch.global.L2


@triton.jit
def _l2_prefetch_kernel(a_ptr, a_bytes, b_ptr, b_bytes, CHUNK: tl.constexpr,
                        BLOCK: tl.constexpr, BULK: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Program p asks L2 for chunks p * BLOCK .. of the byte ranges a then b (CHUNK bytes
    each, the last of a range cut to its end). Module docstring: why the trigger comes
    first and the wait last."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    n_a = tl.cdiv(a_bytes, CHUNK)
    n_b = tl.cdiv(b_bytes, CHUNK)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_a = (i < n_a) | (n_b == 0)  # past both ranges: a's last chunk (never outside them)
    ia = tl.minimum(i, n_a - 1).to(tl.int64) * CHUNK
    ib = tl.minimum(tl.maximum(i - n_a, 0), tl.maximum(n_b - 1, 0)).to(tl.int64) * CHUNK
    ptr = tl.where(in_a, a_ptr + ia, b_ptr + ib)
    if BULK:
        size = tl.where(in_a, tl.minimum(a_bytes - ia, CHUNK), tl.minimum(b_bytes - ib, CHUNK))
        size = tl.where(i < n_a + n_b, size, 0).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; }"
            " // $0", "=r,l,r", [ptr, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        # a chunk past the end repeats the range's last line (asked twice: costs nothing)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptr],
                                  dtype=tl.int32, is_pure=False, pack=1)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


def _bytes_of(t: torch.Tensor, limit: int) -> tuple[torch.Tensor, int]:
    """t as bytes (contiguous storage required) and its first min(limit, size) bytes, a
    multiple of 16 (the bulk instruction's unit)."""
    if not t.is_contiguous():
        raise ValueError("l2_prefetch: weights must be contiguous")
    flat = t.view(-1).view(torch.uint8)
    return flat, max(0, min(int(limit), flat.numel())) // 16 * 16


def l2_prefetch(first: torch.Tensor, second: torch.Tensor | None, budget: int, *,
                bulk: bool = True) -> int:
    """Ask L2 for up to `budget` bytes: `first` from its start, then `second` from its
    start with what is left. Launched only on a CUDA device under PDL (module docstring);
    returns the bytes asked for (0 when nothing was launched)."""
    if budget <= 0 or first.device.type != "cuda" or not pdl.active():
        return 0
    a, na = _bytes_of(first, budget)
    b, nb = (a, 0) if second is None else _bytes_of(second, budget - na)
    if na + nb == 0:
        return 0
    chunk = BULK_CHUNK if bulk else LINE
    block = 32 if bulk else 1024
    chunks = -(-na // chunk) + -(-nb // chunk)
    _l2_prefetch_kernel[(-(-chunks // block),)](
        a, na, b, nb, CHUNK=chunk, BLOCK=block, BULK=bulk,
        num_warps=1 if bulk else 4, **pdl.kwargs())
    return na + nb
