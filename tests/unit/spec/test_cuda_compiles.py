"""CUDA sources compile on a machine without a GPU (and with a CPU-only torch).

- Every csrc/*.cu is compiled by nvcc to /dev/null (warnings are errors): a CUDA syntax
  or type error fails CI even though no GPU runs the kernels here. The .cu files include
  no torch header, so plain nvcc suffices.
- The torch glue of the CUDA kernels (verify_cuda_glue.cpp, built only with CUDA) gets a
  host-compiler syntax check against torch's headers and the CUDA headers. A CPU build of
  torch lacks one generated header (c10/cuda/impl/cuda_cmake_macros.h); a one-line
  stand-in is supplied for the check.
Skipped when nvcc (or, for the glue, a C++ compiler or the CUDA headers) is missing.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import subprocess

import pytest
import torch

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "csrc")
TIMEOUT_S = 300


def setup_ext():
    spec = importlib.util.spec_from_file_location("megatron_tlt_setup_ext", os.path.join(CSRC, "setup_ext.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, f"{' '.join(cmd)}\nexit {result.returncode}\n{result.stdout}\n{result.stderr}"


def nvcc_or_skip() -> str:
    nvcc = setup_ext().find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    return nvcc


CU_FILES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(CSRC, "*.cu")))


def test_every_cu_file_is_built():
    assert CU_FILES, "no .cu files found in csrc/"
    assert sorted(setup_ext().CU_FILES) == CU_FILES, "setup_ext.CUDA_SOURCES must list every csrc/*.cu"


@pytest.mark.parametrize("cu_file", CU_FILES)
def test_cu_file_compiles_with_nvcc(cu_file):
    nvcc = nvcc_or_skip()
    run(setup_ext().nvcc_check_command(cu_file, nvcc))


def cuda_include_dir(nvcc: str) -> str | None:
    """The CUDA headers nvcc itself uses (parsed from its dry run)."""
    probe = os.path.join(CSRC, CU_FILES[0])
    dry = subprocess.run([nvcc, "--dryrun", "-c", probe, "-o", os.devnull], capture_output=True, text=True, timeout=60)
    candidates = re.findall(r'-I"?([^" ]+)"?', dry.stdout + dry.stderr)
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    for d in candidates + [os.path.join(home, "include")]:
        if os.path.isfile(os.path.join(d, "cuda_runtime.h")):
            return d
    return None


def test_cuda_glue_passes_a_syntax_check(tmp_path):
    nvcc = nvcc_or_skip()
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler ({cxx})")
    cuda_include = cuda_include_dir(nvcc)
    if cuda_include is None:
        pytest.skip("CUDA headers not found")
    torch_include = os.path.join(os.path.dirname(torch.__file__), "include")
    if not os.path.isfile(os.path.join(torch_include, "c10", "cuda", "CUDAStream.h")):
        pytest.skip("this torch ships no c10/cuda headers")
    shim = tmp_path / "shim"
    macros = shim / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    if not os.path.isfile(os.path.join(torch_include, "c10", "cuda", "impl", "cuda_cmake_macros.h")):
        macros.parent.mkdir(parents=True)
        macros.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    run(
        [
            cxx, "-std=c++20", "-fsyntax-only", "-DWITH_CUDA",
            "-I", str(shim), "-I", torch_include, "-I", os.path.join(torch_include, "torch", "csrc", "api", "include"),
            "-I", cuda_include, "-I", CSRC,
            os.path.join(CSRC, "verify_cuda_glue.cpp"),
        ]
    )
