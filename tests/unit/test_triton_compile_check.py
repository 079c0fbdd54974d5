"""tools/triton_compile_check.py: launches recorded under Triton's interpreter compile for
sm_90 without a GPU, and a kernel the interpreter runs but the compiler rejects (a plain
global read inside the kernel) is reported as a failure (the negative control).

Skipped without triton (CI installs the CPU torch only)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[2]

KERNELS = textwrap.dedent('''
    import triton
    import triton.language as tl

    GOOD = tl.constexpr(3)
    BAD = 3  # a plain global: the interpreter reads it, the compiler refuses it

    @triton.jit
    def good_kernel(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * GOOD, mask=i < n)

    @triton.jit
    def bad_kernel(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * BAD, mask=i < n)
''')

LAUNCH = textwrap.dedent('''
    import sys, torch
    sys.path.insert(0, sys.argv[1])
    sys.path.insert(0, sys.argv[2])
    from triton_compile_check import install_recorder
    install_recorder(sys.argv[3])
    import tcc_kernels as k
    x = torch.ones(8)
    k.good_kernel[(1,)](x, 8, BLOCK=8)
    k.bad_kernel[(1,)](x, 8, BLOCK=8, num_warps=2)
    assert x.tolist() == [9.0] * 8, x  # both ran under the interpreter
''')


def test_records_launches_and_reports_what_does_not_compile(tmp_path):
    (tmp_path / "tcc_kernels.py").write_text(KERNELS)
    records = tmp_path / "k.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", LAUNCH, str(tmp_path), str(REPO / "tools"), str(records)],
                   check=True, env=env, timeout=300)
    assert len(records.read_text().splitlines()) == 2
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, str(REPO / "tools" / "triton_compile_check.py"), str(records)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 1, out.stdout + out.stderr  # one launch failed
    assert "ok   tcc_kernels.good_kernel: 1/1" in out.stdout, out.stdout
    assert "FAIL tcc_kernels.bad_kernel: 0/1" in out.stdout and "BAD" in out.stdout, out.stdout
