"""Programmatic dependent launch (PDL) for the decode forward's Triton kernels.

On Hopper and later a kernel launched with PDL may start while the kernel before it in
the stream is still finishing: its programs get resident and wait at `griddepcontrol.wait`
(Triton's `gdc_wait`) until the previous grid has completed and its writes are visible,
instead of the launch starting only after that grid has drained. The decode step of a
small model is a chain of ~250 short kernels (1.5B shape, batch 1: 1.60 ms per step
against a 0.72 ms HBM roofline, session 3), so the gap between kernels is a large share
of the step; PDL is the hardware's way to shrink it, inside CUDA graphs too.

Safety: every kernel that takes `USE_PDL` waits at its very first instruction, before
any load or store, and then lets its own dependents launch. So nothing a kernel does
overlaps its predecessor's work, and because every PDL kernel waits for its predecessor
to complete, completion is transitive along the stream (a kernel never runs ahead of one
two launches back). Kernels without the flag (cuBLAS, torch ops) are ordinary launches:
they start after the previous kernel completes, and a PDL kernel after them waits for
them to complete (no trigger: the implicit one at their end).

Off unless MEGATRON_TLT_PDL=1 (not yet timed on a GPU); `DecodeModel.pdl` turns it on per
model, and only on devices of compute capability 9.0 or later. Kernel wrappers read the
flag of the innermost `launches` context: `kwargs()` gives their launch keywords.
"""

from __future__ import annotations

import contextlib
import os

PDL_ENV = "MEGATRON_TLT_PDL"

_active = False


def requested() -> bool:
    """MEGATRON_TLT_PDL=1."""
    return os.environ.get(PDL_ENV, "0") == "1"


def supported(device) -> bool:
    """PDL needs a CUDA device of compute capability 9.0 or later (Hopper)."""
    import torch
    dev = torch.device(device)
    return dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 9


@contextlib.contextmanager
def launches(flag: bool):
    """Kernels launched inside take PDL when `flag` (restored on exit, nesting allowed)."""
    global _active
    prev, _active = _active, bool(flag)
    try:
        yield
    finally:
        _active = prev


def active() -> bool:
    return _active


def kwargs() -> dict:
    """Launch keywords for a kernel with a `USE_PDL: tl.constexpr` parameter: the
    constexpr, and Triton's `launch_pdl` launch option when on."""
    return {"USE_PDL": True, "launch_pdl": True} if _active else {"USE_PDL": False}
