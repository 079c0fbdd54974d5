"""Programmatic dependent launch (PDL) for the decode forward's Triton kernels.

On Hopper and later a kernel launched with PDL may start while the kernel before it in
the stream is still finishing: its programs get resident and wait at `griddepcontrol.wait`
(Triton's `gdc_wait`) until the previous grid has completed and its writes are visible,
instead of the launch starting only after that grid has drained. The decode step of a
small model is a chain of ~250 short kernels (1.5B shape, batch 1: 1.60 ms per step
against a 0.72 ms HBM roofline, session 3), so the gap between kernels is a large share
of the step; PDL is the hardware's way to shrink it, inside CUDA graphs too.

Safety: every kernel that takes `USE_PDL` waits before its first store, and before its
first load of anything the kernel launched right before it may have written, and then lets
its own dependents launch. Only index arithmetic, the linear kernel's L2 prefetch below,
RMSNorm's loads of its weight and bias with gpu_model.NORM_EARLY_WEIGHT (the default;
weights: written only outside a forward), and the fused decode attention's loads of its
inputs and of the keys/values already in the cache come earlier
(gpu_model._rope_attention_kernel: DecodeModel launches it right after the QKV
projection, which writes none of them), and so does the decode split merge's load
of the context lengths (triton_attention._combine_kernel, launched right after the
attention kernel whose partials it merges, which does not write them). Because every PDL
kernel waits for its predecessor to complete, completion is transitive along the stream
(a kernel never runs ahead of one two launches back), so what such early loads read was
written by a kernel that has completed. Kernels without
the flag (cuBLAS, torch ops) are ordinary launches: they start after the previous kernel
completes, and a PDL kernel after them waits for them to complete (no trigger: the
implicit one at their end); the kernel right after a cuBLAS projection is itself launched
the ordinary way (PLAIN_AFTER_CUBLAS, below), its wait then returning at once. One kernel
triggers before it waits: rollout/l2_prefetch.py's (launched right after the attention),
which loads and stores nothing and waits before it exits, so it completes only after its
predecessor did and the chain stays ordered.

Weight prefetch: what a projection kernel can do while it waits is ask L2 for its own
weight slab (`prefetch.global.L2`, triton_linear._prefetch_slab), so the HBM reads of the
next projection start under the tail of the kernel before it. Weights are never written
during a forward, and a prefetch reads nothing into registers (L2 is the device's point
of coherence), so it cannot change a result. Opt-in: MEGATRON_TLT_PDL_PREFETCH_MB=32
prefetches for projections of at most 32 MB of weights (so the slabs asked for early fit
in L2 beside the running kernel's); 0, the default, off. Timed side by side in session 26
(H100, bench rollout --compare-attr env:MEGATRON_TLT_PDL_PREFETCH_MB=N, 1.5B / 7B shapes,
batch 1 / 8 / 32): 16 MB 0.99x-1.00x, 32 MB 0.94x-1.00x, 64 MB 0.91x-1.00x of the speed
without, so it stays off.

Weight preload: MEGATRON_TLT_PDL_PRELOAD_KB=N (opt-in, default 0) goes further: a
projection program loads the first of its weight tiles, up to 4 and N KB, into registers
before the wait (triton_linear._linear_kernel's PRE_T), then runs the same products in
the same order as without (same bits), the first ones on those registers. Weights are
written only outside a forward, so a load before the wait reads what one after it would.
Timed slower (session 25, H100, `bench rollout --compare-preload 64`): 0.88x-0.99x of
PDL without it at every shape and batch, so it stays off.

On by default on devices of compute capability 9.0 or later since session 25
(MEGATRON_TLT_PDL=0 turns it off): the whole GPU suite passed with it on an H100 (353
tests: tests/gpu/test_engine_gpu.py 141, the speculative and EAGLE graph files 63, the
rest 149; benchmarks/results/gpu_2026-12-06_session25), the tokens unchanged
(`tests/gpu/test_engine_gpu.py::test_pdl_decode_equals_plain_decode`), and it was faster
in every decode timing so far: H200 session 23, 1.5B batch 1 1.541 -> 1.453 ms, 7B 4.106
-> 3.998 ms; H100 session 25, 1.07x at 1.5B batch 1 (1.797 -> 1.673 ms), 1.005x-1.08x at
1.5B / 7B, batch 1 / 8 / 32. `DecodeModel.pdl` holds the choice per model.
Kernel wrappers read the flag of the innermost `launches` context: `kwargs()` gives their
launch keywords.
"""

from __future__ import annotations

import contextlib
import os

PDL_ENV = "MEGATRON_TLT_PDL"
PREFETCH_ENV = "MEGATRON_TLT_PDL_PREFETCH_MB"
PRELOAD_ENV = "MEGATRON_TLT_PDL_PRELOAD_KB"

PLAIN_AFTER_CUBLAS = True
"""The PDL kernel launched right after a cuBLAS projection takes an ordinary launch (its
USE_PDL code unchanged: its wait then returns at once, the predecessor having completed
before it started); False launches it with PDL as every other. A cuBLAS kernel may trigger
its dependents early, and a PDL kernel's programs then sit resident on its SMs, waiting.
Session 37 (H100, bench rollout --compare-attr, benchmarks/results/gpu_2026-12-07_session37):
where the planner had taken cuBLAS for the 7B batch-32 gate/up projection the step ran
1.016x faster with this; in the seven other cells (1.5B and 7B shapes, batch 1 / 8 / 16 /
32), where no projection ran on cuBLAS and it changes nothing, 0.993x-1.001x (that run's
noise). Same kernels, same order, same bits either way
(tests/gpu/test_engine_gpu.py::test_plain_after_cublas_decode_equals_default, passed on
the H100). On by default since session 37. Session 38 (H100, same A/B at batch 32,
benchmarks/results/gpu_2026-12-07_session38): off ran 0.982x as fast at the 7B shape (its
QKV and gate/up projections on cuBLAS) and 1.005x at 1.5B (gate/up on cuBLAS). A/B: bench
rollout --compare-attr megatron_tlt.rollout.pdl:PLAIN_AFTER_CUBLAS=False."""

_active = False
_plain_next = False  # the next kwargs() of this context hands out an ordinary launch
_prefetch = 0  # the innermost `launches` context's prefetch limit (bytes)
_preload = 0  # the innermost `launches` context's preload limit (bytes per program)


def requested() -> bool:
    """Unless MEGATRON_TLT_PDL=0 (on by default; `supported` decides per device)."""
    return os.environ.get(PDL_ENV, "1") != "0"


def prefetch_bytes() -> int:
    """The largest projection (weight bytes) whose kernel prefetches its slab into L2 before
    its PDL wait: MEGATRON_TLT_PDL_PREFETCH_MB (default 0: off)."""
    return _env_bytes(PREFETCH_ENV, "megabytes", 2 ** 20)


def preload_bytes() -> int:
    """The most weight bytes per program a projection kernel loads into registers before
    its PDL wait: MEGATRON_TLT_PDL_PRELOAD_KB (default 0: off)."""
    return _env_bytes(PRELOAD_ENV, "kilobytes", 1024)


def _env_bytes(name: str, unit: str, scale: int) -> int:
    raw = os.environ.get(name, "0")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number of {unit}") from None
    return int(value * scale)


def supported(device) -> bool:
    """PDL needs a CUDA device of compute capability 9.0 or later (Hopper)."""
    import torch
    dev = torch.device(device)
    return dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 9


@contextlib.contextmanager
def launches(flag: bool, prefetch: int = 0, preload: int = 0):
    """Kernels launched inside take PDL when `flag`, projections of at most `prefetch`
    weight bytes prefetch their slab, and projection programs load as many of their first
    weight tiles as fit in `preload` bytes (at most 4) before the wait (read once per
    context, not per launch: a forward passes `prefetch_bytes()`, `preload_bytes()`); all
    restored on exit, nesting allowed."""
    global _active, _prefetch, _preload, _plain_next
    prev = _active, _prefetch, _preload, _plain_next
    _active, _plain_next = bool(flag), False
    _prefetch, _preload = (int(prefetch), int(preload)) if flag else (0, 0)
    try:
        yield
    finally:
        _active, _prefetch, _preload, _plain_next = prev


def active() -> bool:
    return _active


def prefetch_limit() -> int:
    """The innermost `launches` context's prefetch limit in bytes (0 outside PDL)."""
    return _prefetch


def preload_limit() -> int:
    """The innermost `launches` context's preload limit in bytes per program (0 outside PDL)."""
    return _preload


def plain_launch() -> None:
    """A kernel without PDL (a cuBLAS projection) was just launched: with PLAIN_AFTER_CUBLAS
    the next `kwargs()` of this context gives an ordinary launch."""
    global _plain_next
    _plain_next = _active and PLAIN_AFTER_CUBLAS


def kwargs() -> dict:
    """Launch keywords for a kernel with a `USE_PDL: tl.constexpr` parameter: the
    constexpr, and Triton's `launch_pdl` launch option when on (not for the launch after a
    `plain_launch()` with PLAIN_AFTER_CUBLAS: the same code, launched the ordinary way).
    Called once per launch."""
    global _plain_next
    if not _active:
        return {"USE_PDL": False}
    if _plain_next:
        _plain_next = False
        return {"USE_PDL": True}
    return {"USE_PDL": True, "launch_pdl": True}
