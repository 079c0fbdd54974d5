"""Host-side helpers of the per-step bookkeeping (this code runs on every engine step,
while the device waits for its inputs)."""

from __future__ import annotations

import contextlib
import gc
import logging
import os

import numpy as np
import torch

logger = logging.getLogger(__name__)

HOST_THREADS_ENV = "MEGATRON_TLT_HOST_THREADS"


def limit_host_threads() -> int:
    """One intra-op CPU thread for a process whose engine runs on a GPU, unless
    MEGATRON_TLT_HOST_THREADS (a number; 0 = leave torch's setting) or OMP_NUM_THREADS says
    otherwise; returns the thread count in force. Why: the engine's per-step host work is
    hundreds of tiny CPU tensor ops and copies, for which torch's thread pool (one thread
    per core by default) only adds wake-ups and spinning; on the H200 machine (16 cores)
    the speculative step's own host time fell from 1.71 to 1.24 ms at batch 1 with one
    thread (tools/host_timeline.py, benchmarks/results/gpu_2026-12-03_session10). The
    same as vLLM's workers, which set one OpenMP thread unless told otherwise."""
    raw = os.environ.get(HOST_THREADS_ENV)
    if raw is None and "OMP_NUM_THREADS" in os.environ:
        return torch.get_num_threads()
    n = 1 if raw is None else int(raw) if raw.isdigit() else -1
    if n < 0:
        from megatron_tlt.errors import ConfigError
        raise ConfigError(f"{HOST_THREADS_ENV} must be a number of threads (0: leave torch's), got {raw!r}")
    if n and torch.get_num_threads() != n:
        logger.info("torch intra-op CPU threads %d -> %d for the GPU engine's host work "
                    "(%s / OMP_NUM_THREADS to change)", torch.get_num_threads(), n, HOST_THREADS_ENV)
        torch.set_num_threads(n)
    return torch.get_num_threads()


def int64_tensor(values) -> torch.Tensor:
    """`torch.tensor(values, dtype=torch.int64)` for a list (or a rectangular list of lists)
    of Python ints: the same CPU tensor, built through numpy, about 3-4x faster on the
    hundreds to thousands of values of a step's int tables (torch.tensor converts element
    by element)."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A CPU tensor on `device`. To a CUDA device through pinned memory, without blocking
    the host: torch synchronises the stream after a copy from pageable memory, so a plain
    .to("cuda") waits for every kernel queued before it (a speculative step's verify inputs
    would wait for the drafter's replay that was launched to overlap them). The pinned
    staging block comes from torch's caching host allocator, which does not hand it out
    again until the copy has run. A tensor already on a device takes plain .to()."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.contiguous().pin_memory().to(device, non_blocking=True)  # pin_memory rejects expanded views


@contextlib.contextmanager
def graph_capture(graph, pool=None):
    """`torch.cuda.graph(graph, pool=pool)` with Python's garbage collector paused for the
    capture. Why: torch no longer collects before a capture (force_cudagraph_gc is off),
    so a collection triggered by the capture's own allocations could free unreachable
    objects that own CUDA graphs (an engine or decoder dropped in a reference cycle), and
    destroying a graph while a stream captures invalidates the capture ("operation not
    permitted when stream is capturing (function reset)", seen in the H200 GPU tests when
    engines of an earlier test were collected mid-capture). Collection resumes after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        if enabled:
            gc.enable()
