"""Weights into L2 while the attention runs (rollout/pdl.py's PDL needed).

A decode step of a small batch alternates kernels that stream weights from HBM (the
projections) with kernels that read almost nothing (RMSNorm, the split merge) or little
(the attention over a short context: 0.22 MB of keys and values a layer at the 1.5B
shape, batch 1, in about 6.5 us on an H100; 13.9 MB in about 18 us at the 7B shape, batch
32). While those run, HBM idles. `l2_prefetch` launches, right after the attention kernel,
a kernel that asks L2 for byte ranges of the weights used next (the output projection's,
then the head of the gate/up projection's), one `prefetch.global.L2` per 128-byte line,
so those projections find part of their weights in L2 instead of starting their HBM
reads only when they launch.

Ordering under PDL (pdl.py): this kernel lets its dependents launch first, issues its
prefetches, then waits for the attention grid to complete before it exits, so the kernel
after it (which waits for this grid) still runs only after the attention completed, as
completion stays transitive along the stream. A prefetch reads nothing into registers
and writes nothing; weights are not written during a forward, and L2 is the device's point
of coherence, so it cannot change a result. Without PDL it would only run between the
attention and the next kernel, serialised, so nothing is launched then.

Timed in session 29 (H100, bench rollout --compare-attr side by side, 1.5B / 7B shapes,
batch 1 / 8 / 32; benchmarks/results/gpu_2026-12-06_session29): 4 MB a layer 1.000x-1.007x
of the step without it (every cell at or above 1), 8 MB 0.999x-1.018x, 16 MB 0.986x-1.013x,
32 MB 0.982x-1.000x; session 39 (same card model) 8 MB 1.011x / 1.009x of 4 MB at the 1.5B
shape, batch 1, in two runs, hence 8 MB for one-row forwards
(gpu_model.ATTN_L2_PREFETCH_MB_FEW) and 4 elsewhere. Hopper's bulk
`cp.async.bulk.prefetch.L2` instead was slower at every size (2 MB 0.905x-1.002x, 8-64 MB
0.914x-1.002x): its programs stay on the step's critical path until the copies finish, so
it was dropped.

GPU only: the CPU interpreter cannot run inline PTX, and a prefetch has nothing to show
on a CPU, so `l2_prefetch` launches nothing there (it returns 0: no bytes asked for).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_tlt.rollout import pdl

LINE = 128  # bytes per prefetch.global.L2
BLOCK = 1024  # lines per program


@triton.jit
def _l2_prefetch_kernel(a_ptr, a_bytes, b_ptr, b_bytes, LINE: tl.constexpr,
                        BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Program p asks L2 for lines p * BLOCK .. of the byte ranges a then b. Module
    docstring: why the trigger comes first and the wait last."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    n_a = tl.cdiv(a_bytes, LINE)
    n_b = tl.cdiv(b_bytes, LINE)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_a = (i < n_a) | (n_b == 0)  # past both ranges: a's last line (never outside them)
    ia = tl.minimum(i, n_a - 1).to(tl.int64) * LINE
    ib = tl.minimum(tl.maximum(i - n_a, 0), tl.maximum(n_b - 1, 0)).to(tl.int64) * LINE
    ptr = tl.where(in_a, a_ptr + ia, b_ptr + ib)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptr],
                              dtype=tl.int32, is_pure=False, pack=1)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


def prefetch_ranges(first: torch.Tensor, second: torch.Tensor | None,
                    budget: int) -> tuple[tuple[torch.Tensor, int], tuple[torch.Tensor, int]]:
    """((bytes a, count), (bytes b, count)) that l2_prefetch asks for: `first` from its
    start, then `second` with what is left of `budget`, as uint8 views. A tensor that is
    not contiguous is skipped (the hint only); a lone range comes first, and an empty second
    range is the first's bytes with count 0 (the kernel takes one pointer type)."""
    ranges, left = [], max(0, int(budget))
    for t in (first, second):
        if t is not None and t.numel() and t.is_contiguous() and left > 0:
            flat = t.view(-1).view(torch.uint8)
            ranges.append((flat, min(left, flat.numel())))
            left -= ranges[-1][1]
    if not ranges:
        return (first, 0), (first, 0)
    return ranges[0], ranges[1] if len(ranges) > 1 else (ranges[0][0], 0)


def l2_prefetch(first: torch.Tensor, second: torch.Tensor | None, budget: int) -> int:
    """Ask L2 for up to `budget` bytes: `first` from its start, then `second` from its
    start with what is left (prefetch_ranges). Launched only on a CUDA device under PDL
    (module docstring); returns the bytes asked for (0 when nothing was launched)."""
    if budget <= 0 or first.device.type != "cuda" or not pdl.active():
        return 0
    (a, na), (b, nb) = prefetch_ranges(first, second, budget)
    if na == 0:
        return 0
    lines = -(-na // LINE) + -(-nb // LINE)
    _l2_prefetch_kernel[(-(-lines // BLOCK),)](a, na, b, nb, LINE=LINE, BLOCK=BLOCK, num_warps=4,
                                               **pdl.kwargs())
    return na + nb
