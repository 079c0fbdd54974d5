"""Loads the compiled verify ops (torch.ops.megatron_tlt.*) and registers their fake impls.

Order of attempts, first success wins:
1. the installed extension `megatron_tlt._C` (built by setup.py from csrc/setup_ext.py);
2. a JIT build of the same sources with torch.utils.cpp_extension.load into a cache dir
   (`$MEGATRON_TLT_EXT_CACHE`, default ~/.cache/megatron_tlt/ext/<torch>), so a plain
   source checkout works; CPU kernels, plus the CUDA kernels when torch is a CUDA build and
   nvcc is found. The first build takes ~1 min; later loads reuse it (rebuilt when the
   sources or flags change). MEGATRON_TLT_NO_JIT=1 disables this step.

`load()` returns True/False and never raises; `require()` raises RuntimeError with the
reason (no compiler, build error, ...). The fake (meta) implementations let the ops trace
under torch.compile and be captured in CUDA graphs: the ops only mutate their outputs.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import shutil
import threading

import torch

logger = logging.getLogger(__name__)

OP_NAMES = ("verify_tree_greedy", "verify_tree_rejection")

_lock = threading.Lock()
_state: dict[str, object] = {"loaded": False, "error": None, "source": None}


def _ops_registered() -> bool:
    try:
        return all(hasattr(torch.ops.megatron_tlt, name) for name in OP_NAMES)
    except (AttributeError, RuntimeError):
        return False


def _csrc_dir() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "csrc")


def _load_setup_ext():
    path = os.path.join(_csrc_dir(), "setup_ext.py")
    if not os.path.isfile(path):
        raise RuntimeError(f"csrc/ sources not found at {_csrc_dir()} (not a source checkout)")
    spec = importlib.util.spec_from_file_location("megatron_tlt_setup_ext", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cache_dir(variant: str) -> str:
    root = os.environ.get("MEGATRON_TLT_EXT_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "megatron_tlt", "ext"
    )
    path = os.path.join(root, f"torch{torch.__version__.replace('+', '_')}", variant)
    os.makedirs(path, exist_ok=True)
    return path


def _jit_build() -> str:
    if os.environ.get("MEGATRON_TLT_NO_JIT") == "1":
        raise RuntimeError("megatron_tlt._C is not installed and MEGATRON_TLT_NO_JIT=1")
    ext = _load_setup_ext()
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(
            f"megatron_tlt._C is not installed and no C++ compiler ({cxx!r}) is on PATH to "
            "build it: install g++ (or set CXX), or `pip install --no-build-isolation -e .`"
        )
    from torch.utils import cpp_extension

    sources = list(ext.CPU_SOURCES)
    cuda_flags: list[str] = []
    cflags = list(ext.CXX_FLAGS)
    variant = "cpu"
    reason = ext.cuda_skip_reason()
    if reason is None:
        sources += ext.CUDA_SOURCES
        cflags.append("-DWITH_CUDA")
        cuda_flags = list(ext.NVCC_FLAGS)
        variant = f"cu{torch.version.cuda}"
    else:
        logger.info("megatron_tlt: JIT build without CUDA kernels (%s)", reason)
    name = f"megatron_tlt_C_{variant.replace('.', '')}"
    cpp_extension.load(
        name=name,
        sources=[os.path.join(ext.CSRC, s) for s in sources],
        extra_cflags=cflags,
        extra_cuda_cflags=cuda_flags or None,
        extra_include_paths=[ext.CSRC],
        build_directory=_cache_dir(variant),
        is_python_module=True,
        verbose=os.environ.get("MEGATRON_TLT_EXT_VERBOSE") == "1",
    )
    return f"JIT build {name}"


def _register_fakes() -> None:
    # The ops write their outputs in place and return nothing: under FakeTensor/meta
    # tracing there is nothing to compute. The checks mirror the shape checks of the
    # C++ bindings so torch.compile reports shape bugs at trace time.
    def _check_common(parents, draft_tokens, target_probs, accept_index, accept_length, output_tokens):
        torch._check(target_probs.dim() == 3, lambda: "target_probs must be [batch, num_nodes, vocab]")
        batch, num_nodes = target_probs.shape[0], target_probs.shape[1]
        torch._check(parents.shape == (batch, num_nodes), lambda: "parents must be [batch, num_nodes]")
        torch._check(draft_tokens.shape == (batch, num_nodes), lambda: "draft_tokens must be [batch, num_nodes]")
        torch._check(accept_index.dim() == 2 and accept_index.shape[0] == batch, lambda: "bad accept_index")
        torch._check(accept_length.shape == (batch,), lambda: "accept_length must be [batch]")
        torch._check(output_tokens.shape == accept_index.shape, lambda: "bad output_tokens")

    @torch.library.register_fake("megatron_tlt::verify_tree_greedy")
    def _greedy_fake(parents, draft_tokens, target_probs, accept_index, accept_length, output_tokens):
        _check_common(parents, draft_tokens, target_probs, accept_index, accept_length, output_tokens)

    @torch.library.register_fake("megatron_tlt::verify_tree_rejection")
    def _rejection_fake(
        parents, draft_tokens, target_probs, draft_probs, coins, exp_noise,
        accept_index, accept_length, output_tokens,
    ):
        _check_common(parents, draft_tokens, target_probs, accept_index, accept_length, output_tokens)


def load() -> bool:
    """Make torch.ops.megatron_tlt.* available; True on success (idempotent, never raises)."""
    with _lock:
        if _state["loaded"]:
            return True
        if _state["error"] is not None:
            return False
        errors = []
        if not _ops_registered():
            try:
                importlib.import_module("megatron_tlt._C")
                _state["source"] = "megatron_tlt._C"
            except ImportError as e:  # absent, or built against another torch
                if not (isinstance(e, ModuleNotFoundError) and e.name == "megatron_tlt._C"):
                    errors.append(f"megatron_tlt._C failed to import: {e}")
            if not _ops_registered():
                try:
                    _state["source"] = _jit_build()
                except Exception as e:  # noqa: BLE001 - reported by require()
                    errors.append(f"{type(e).__name__}: {e}".strip())
        else:
            _state["source"] = "already registered"
        if not _ops_registered():
            _state["error"] = "; ".join(errors) or "unknown error"
            logger.warning("megatron_tlt: compiled verify ops unavailable: %s", _state["error"])
            return False
        try:
            _register_fakes()
        except RuntimeError as e:  # registered by whoever registered the ops
            if "already" not in str(e):
                raise
        _state["loaded"] = True
        return True


def require() -> None:
    """Like load(), but raises RuntimeError saying why the ops are unavailable."""
    if not load():
        raise RuntimeError(f"megatron_tlt: compiled verify ops unavailable: {_state['error']}")


def source() -> str | None:
    """Where the ops came from (after a successful load)."""
    return _state["source"]  # type: ignore[return-value]


def unavailable_reason() -> str | None:
    return _state["error"]  # type: ignore[return-value]


def has_kernel(device_type: str) -> bool:
    """Whether the loaded ops have a kernel for this device type ('cpu', 'cuda')."""
    if not load():
        return False
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    if key is None:
        return False
    try:
        return all(
            torch._C._dispatch_has_kernel_for_dispatch_key(f"megatron_tlt::{n}", key) for n in OP_NAMES
        )
    except (AttributeError, RuntimeError):  # private API moved: assume CPU only
        return key == "CPU"
