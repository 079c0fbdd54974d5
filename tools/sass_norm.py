"""The decode RMSNorm kernel's sm_90 memory and barrier instructions, compiled without a GPU.

    python tools/sass_norm.py [--columns 1536] [--planes 2] [--bias] [--early] [--warps N]

Compiles gpu_model._rms_norm_kernel as a decode step launches it under PDL (residual add,
`--planes` split-K partial-sum planes in, `--early`: NORM_EARLY_WEIGHT's load order, the
default since session 36; without it the order before) for an H100/H200 with Triton's
bundled ptxas and cuobjdump (tools/sass_attention.py's compile_sm90), and prints its
instruction count and, in program order, its global loads and stores, the PDL wait
(ACQBULK), the trigger (PREEXIT) and the barriers: where the weight's load sits against the
wait and the reduction's barriers. Counting, not timing.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_attention import compile_sm90, opcode, sass_of  # noqa: E402

from megatron_tlt.rollout import gpu_model  # noqa: E402

_SHOWN = ("LDG", "STG", "BAR", "ACQBULK", "PREEXIT")


def compile_norm(columns: int, planes: int, bias: bool, early: bool, warps: int | None):
    """`warps` None: what rms_norm launches with (gpu_model.norm_warps)."""
    block = max(16, gpu_model._next_pow2(columns))  # rms_norm's row padding
    const = dict(N=columns, BLOCK=block, S=planes,
                 HAS_RESIDUAL=True, HAS_BIAS=bias, RES_READ=True, USE_PDL=True, EARLY_W=early)
    # the planes are float32, the rest the model's bf16
    pointers = {"x_ptr": "*fp32", "res_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16",
                "out_ptr": "*bf16"}
    return compile_sm90(const, warps or gpu_model.norm_warps(block), 1,
                        fn=gpu_model._rms_norm_kernel, pointers=pointers, floats=("eps",))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--columns", type=int, default=1536, help="hidden size (7B shape: 3584)")
    p.add_argument("--planes", type=int, default=2, help="split-K partial-sum planes read")
    p.add_argument("--bias", action="store_true", help="the projection's bias added too")
    p.add_argument("--early", action="store_true", help="NORM_EARLY_WEIGHT's load order")
    p.add_argument("--warps", type=int, default=None, help="default: rms_norm's (16 at these widths)")
    a = p.parse_args()
    kernel = compile_norm(a.columns, a.planes, a.bias, a.early, a.warps)
    warps = kernel.metadata.num_warps
    with tempfile.TemporaryDirectory() as d:
        sass = sass_of(kernel.asm["cubin"], os.path.join(d, "norm.cubin"))
    print(f"_rms_norm_kernel, {a.columns} columns, {a.planes} planes, bias {a.bias}, "
          f"early weight {a.early}, {warps} warps: {len(sass)} instructions")
    for addr, ins in sass:
        if opcode(ins) in _SHOWN:
            print(f"  {addr:#06x}  {ins}")


if __name__ == "__main__":
    main()
