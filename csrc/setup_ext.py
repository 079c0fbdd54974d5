"""Build description of the csrc/ extension `megatron_tlt._C`.

setup.py loads this file by path and calls `get_extensions()` and `get_cmdclass()`.
The JIT loader (megatron_tlt/spec/_ops.py) and the CI compile check
(tests/unit/spec/test_cuda_compiles.py) load it too, so the source lists and flags
live in one place.

- Always built: the CPU ops (`TORCH_LIBRARY(megatron_tlt, ...)` + CPU kernels).
- With CUDA: when torch is a CUDA build (`torch.version.cuda`) and nvcc is found, the
  same module is a CUDAExtension that also holds the CUDA kernels (verify_cuda.cu) and
  their torch glue (verify_cuda_glue.cpp, compiled only then, with -DWITH_CUDA).
  Otherwise one line says why: "megatron_tlt: CUDA kernels not built (<reason>)".
  TLT_CPU_ONLY_EXT=1 forces the CPU-only build.

verify_cuda.cu never includes torch, so `nvcc -c` compiles it on a machine whose torch
is a CPU build: `nvcc_check_command()` is that command.

Flags: no fused multiply-add anywhere (-ffp-contract=off, --fmad=false), because the
CPU and CUDA kernels must agree with the PyTorch reference bit for bit (see
csrc/verify_common.h). The C++ standard is left to torch (C++20 for torch >= 2.10); the
.cu itself is C++17-clean.
"""

from __future__ import annotations

import os
import shutil

CSRC = os.path.dirname(os.path.abspath(__file__))
EXT_NAME = "megatron_tlt._C"

CPU_SOURCES = ["module.cpp", "verify_cpu.cpp"]
CUDA_SOURCES = ["verify_cuda.cu", "verify_cuda_glue.cpp"]
CU_FILES = [s for s in CUDA_SOURCES if s.endswith(".cu")]

CXX_FLAGS = ["-O3", "-ffp-contract=off"]
NVCC_FLAGS = ["-O3", "--fmad=false", "-Xcompiler", "-ffp-contract=off"]


def _paths(names: list[str]) -> list[str]:
    return [os.path.join(CSRC, n) for n in names]


def find_nvcc() -> str | None:
    """nvcc from CUDA_HOME/CUDA_PATH, else from PATH."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def cuda_skip_reason() -> str | None:
    """Why the CUDA kernels will not be built, or None if they will be."""
    import torch

    if os.environ.get("TLT_CPU_ONLY_EXT") == "1":
        return "TLT_CPU_ONLY_EXT=1"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is not a CUDA build"
    if find_nvcc() is None:
        return "nvcc not found: set CUDA_HOME or put nvcc on PATH"
    return None


def get_extensions() -> list:
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    reason = cuda_skip_reason()
    if reason is not None:
        print(f"megatron_tlt: CUDA kernels not built ({reason})")
        return [
            CppExtension(
                EXT_NAME,
                sources=_paths(CPU_SOURCES),
                include_dirs=[CSRC],
                extra_compile_args={"cxx": CXX_FLAGS},
            )
        ]
    return [
        CUDAExtension(
            EXT_NAME,
            sources=_paths(CPU_SOURCES + CUDA_SOURCES),
            include_dirs=[CSRC],
            define_macros=[("WITH_CUDA", None)],
            extra_compile_args={"cxx": CXX_FLAGS, "nvcc": NVCC_FLAGS},
        )
    ]


def get_cmdclass() -> dict:
    from torch.utils.cpp_extension import BuildExtension

    return {"build_ext": BuildExtension}


def nvcc_check_command(cu_file: str, nvcc: str | None = None) -> list[str]:
    """A compile of one .cu file to nowhere: fails on any CUDA syntax/type error.

    Needs only nvcc and the CUDA headers (no torch, no GPU).
    """
    nvcc = nvcc or find_nvcc() or "nvcc"
    return [
        nvcc,
        "-std=c++17",
        *NVCC_FLAGS,
        "-Wno-deprecated-gpu-targets",
        "-Werror",
        "all-warnings",
        "-I",
        CSRC,
        "-c",
        os.path.join(CSRC, cu_file),
        "-o",
        os.devnull,
    ]
