"""The Triton side of rollout/pdl.py (kept apart: pdl.py imports without Triton), and a
fix for Triton's interpreter that kernels with scalar loop bounds need on CPU (the modules
of the decode forward's kernels, triton_linear, triton_attention and gpu_model, import this
one; triton_linear alone under the interpreter failed without it)."""

import os

import triton
import triton.language as tl


def _interpreter_compat() -> None:
    """Under TRITON_INTERPRET=1 (CPU runs of these kernels), scalars are 1-element numpy
    arrays, which numpy >= 2.x refuses to turn into loop bounds through `__index__`;
    make the interpreter take their single element. No effect on compiled kernels."""
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_tlt_compat", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__",
                       lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._tlt_compat = True
    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_compat()


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """A decode kernel's first statement: with USE_PDL, wait for the previous grid to
    complete (its writes visible), then let the next grid launch (rollout/pdl.py says why
    this order keeps every kernel behind its predecessors). Nothing without it."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
