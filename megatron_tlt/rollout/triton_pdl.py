"""The Triton side of rollout/pdl.py (kept apart: pdl.py imports without Triton)."""

import triton
import triton.language as tl


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """A decode kernel's first statement: with USE_PDL, wait for the previous grid to
    complete (its writes visible), then let the next grid launch (rollout/pdl.py says why
    this order keeps every kernel behind its predecessors). Nothing without it."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
