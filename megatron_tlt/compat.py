"""Megatron-Core on a CPU: every workaround for its CUDA assumptions, in one place.

Megatron-Core 0.16.1 assumes CUDA in a handful of places that the CPU path (tests,
the tiny default, CI) reaches. We do not fork or vendor it; instead each assumption
gets one small, reversible patch below, applied only when CUDA is unavailable (where
the original code would raise anyway), so GPU runs are untouched. Each patch has a
test in tests/unit/test_compat.py showing the Megatron call fails without it.

| name            | what Megatron does                                            | our patch |
|-----------------|---------------------------------------------------------------|-----------|
| current_device  | `torch.cuda.current_device()` as an allocation device (RoPE    | returns `torch.device("cpu")` |
|                 | inv_freq, GlobalMemoryBuffer.get_tensor, p2p shape exchange)  |           |
| cuda_synchronize| dist-checkpoint save calls `torch.cuda.synchronize()`        | a no-op (nothing to wait for) |
| causal_mask     | `get_default_causal_mask` builds the mask with device="cuda"  | same mask on the CPU |
| schedules_cuda  | pipeline schedules create `total_num_tokens` on "cuda"        | "cuda" tensors of that module go to the CPU |
| tied_embedding  | tied embeddings with PP>1: `weight.data.cuda()` before the    | `Tensor.cuda` is the identity |
|                 | first/last-stage all-reduce                                   | inside that one method |
| rng_tracker     | `model_parallel_cuda_manual_seed` seeds CUDA generators       | `CPURNGStatesTracker`: same names, CPU generator states |

Not patched but required on CPU (set by `models/mcore.py`): `batch_p2p_sync=False`
(it calls `torch.cuda.synchronize`), `clip_grad=0` for Megatron's DDP, and our own
optimizer (Megatron's distributed optimizer refuses CPU tensors) — see `models/optim.py`.
Sequence parallelism needs TE or apex norms: GPU only.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Callable

import torch

_APPLIED: dict[str, Callable[[], None]] = {}  # name -> undo


def cuda_available() -> bool:
    return torch.cuda.is_available()


# ---- current_device --------------------------------------------------------------

def _patch_current_device() -> Callable[[], None]:
    original = torch.cuda.current_device

    def current_device():  # a device object is accepted everywhere Megatron passes it
        return torch.device("cpu")

    torch.cuda.current_device = current_device

    def undo():
        torch.cuda.current_device = original

    return undo


# ---- cuda_synchronize ------------------------------------------------------------

def _patch_synchronize() -> Callable[[], None]:
    # dist-checkpointing's writer (filesystem_async.preload_tensors) synchronizes
    # before handing tensors to its writer processes; with no CUDA there is nothing to wait for.
    original = torch.cuda.synchronize

    def synchronize(device=None):
        return None

    torch.cuda.synchronize = synchronize

    def undo():
        torch.cuda.synchronize = original

    return undo


# ---- causal_mask -----------------------------------------------------------------

@functools.lru_cache(maxsize=32)
def _cpu_causal_mask(sq: int) -> torch.Tensor:
    # True = masked (Megatron's convention): strictly upper triangle.
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _patch_causal_mask() -> Callable[[], None]:
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.utils as tutils

    originals = (fused_softmax.get_default_causal_mask, tutils.get_default_causal_mask)
    fused_softmax.get_default_causal_mask = _cpu_causal_mask
    tutils.get_default_causal_mask = _cpu_causal_mask

    def undo():
        fused_softmax.get_default_causal_mask, tutils.get_default_causal_mask = originals

    return undo


# ---- tied_embedding ---------------------------------------------------------------

def _patch_tied_embedding() -> Callable[[], None]:
    # With tied embeddings and PP>1, LanguageModule.setup_embeddings_and_output_layer
    # moves the last stage's copy to CUDA (`weight.data.cuda()`) before all-reducing it
    # with the first stage's. On CPU, `Tensor.cuda` is the identity for that call only.
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer

    @functools.wraps(original)
    def setup_embeddings_and_output_layer(self, *args, **kwargs):
        tensor_cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *a, **k: t
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = tensor_cuda

    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer

    def undo():
        LanguageModule.setup_embeddings_and_output_layer = original

    return undo


# ---- schedules_cuda --------------------------------------------------------------

class _CudaToCpuTorch:
    """A view of the torch module whose factory functions map device="cuda" to CPU.

    Installed as `schedules.torch` only, so only the pipeline schedules see it.
    """

    _FACTORIES = ("zeros", "ones", "empty", "tensor", "full")

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        attr = getattr(self._real, name)
        if name in self._FACTORIES:
            @functools.wraps(attr)
            def factory(*args, **kwargs):
                dev = kwargs.get("device")
                if dev == "cuda" or (isinstance(dev, torch.device) and dev.type == "cuda"):
                    kwargs["device"] = "cpu"
                return attr(*args, **kwargs)
            return factory
        return attr


def _patch_schedules() -> Callable[[], None]:
    import megatron.core.pipeline_parallel.schedules as schedules

    original = schedules.torch
    schedules.torch = _CudaToCpuTorch(original)

    def undo():
        schedules.torch = original

    return undo


# ---- rng_tracker -----------------------------------------------------------------

class CPURNGStatesTracker:
    """Drop-in for Megatron's CudaRNGStatesTracker backed by CPU generator states.

    Megatron forks the tracker around dropout and TP-sharded initialisation; on a CPU
    those draw from the global CPU generator, so `fork` swaps its state in and out.
    """

    def __init__(self):
        self.reset()

    def reset(self):
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self):
        return self._is_initialized

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self.states_ = dict(states)
        self._is_initialized = True

    def add(self, name, seed):
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        gen = torch.Generator()
        gen.manual_seed(seed)
        self.states_[name] = gen.get_state()
        self.seeds_.add(seed)
        self._is_initialized = True

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        original = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(original)


def _patch_rng_tracker() -> Callable[[], None]:
    import megatron.core.tensor_parallel.random as mrandom

    saved = (mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    mrandom._CUDA_RNG_STATE_TRACKER = CPURNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    def undo():
        mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved

    return undo


def model_parallel_seed(seed: int) -> None:
    """Seed every generator Megatron uses, on CPU or GPU.

    GPU: Megatron's own `model_parallel_cuda_manual_seed`. CPU: the same tracker names
    and seed offsets as Megatron (tensor-parallel state = seed + 2718 + tp_rank), on
    CPU generator states.
    """
    import megatron.core.tensor_parallel.random as mrandom
    from megatron.core import parallel_state as ps

    torch.manual_seed(seed)
    if cuda_available():
        mrandom.model_parallel_cuda_manual_seed(seed)
        return
    tracker = mrandom.get_cuda_rng_tracker()
    if not isinstance(tracker, CPURNGStatesTracker):
        raise RuntimeError("megatron_tlt.compat.apply() must run before model_parallel_seed on CPU")
    tracker.reset()
    tp_rank = ps.get_tensor_model_parallel_rank()
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ps.get_expert_model_parallel_rank())


# ---- apply / disable -------------------------------------------------------------

PATCHES: dict[str, Callable[[], Callable[[], None]]] = {
    "current_device": _patch_current_device,
    "cuda_synchronize": _patch_synchronize,
    "causal_mask": _patch_causal_mask,
    "schedules_cuda": _patch_schedules,
    "tied_embedding": _patch_tied_embedding,
    "rng_tracker": _patch_rng_tracker,
}


def apply(force: bool = False) -> list[str]:
    """Apply every CPU workaround (idempotent). A no-op when CUDA is available unless
    `force` (tests). Returns the names applied now."""
    if cuda_available() and not force:
        return []
    # For tests that show a workaround is needed (in subprocesses): names to leave out.
    skip = {n for n in os.environ.get("MEGATRON_TLT_COMPAT_DISABLE", "").split(",") if n}
    done = []
    for name, patch in PATCHES.items():
        if name not in _APPLIED and name not in skip:
            _APPLIED[name] = patch()
            done.append(name)
    return done


def applied() -> list[str]:
    return list(_APPLIED)


@contextlib.contextmanager
def disabled(name: str):
    """Temporarily undo one workaround (for the tests that show it is needed)."""
    if name not in _APPLIED:
        yield
        return
    _APPLIED.pop(name)()
    try:
        yield
    finally:
        _APPLIED[name] = PATCHES[name]()
