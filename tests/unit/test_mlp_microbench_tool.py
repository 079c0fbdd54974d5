"""tools/mlp_microbench.py is GPU only: without CUDA it says so and exits 2 (not a
traceback, not a silent 0)."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_mlp_microbench_without_cuda_exits_2_with_a_message():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "mlp_microbench.py")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "mlp_microbench: needs a CUDA GPU" in r.stderr
