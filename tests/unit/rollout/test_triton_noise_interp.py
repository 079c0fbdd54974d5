"""rollout/triton_noise.py under Triton's interpreter (TRITON_INTERPRET=1): the fused
Exp(1) noise == sampling.exponential_noise's torch ops on CPU. The noise is computed from
integer bits that must match exactly; NumPy's float64 log stands in for CUDA's in the
interpreter, so the float32 values are compared to the bit here (they agree on these
draws; the GPU test compares against torch's CUDA log with torch.equal).

Skipped without triton (CI) and on CUDA machines (tests/gpu covers the compiled kernel).
"""

import pytest
import torch

from rollout_testutil import triton_interpreter  # noqa: E402

pytestmark = triton_interpreter()

from megatron_tlt.rollout.sampling import exponential_noise  # noqa: E402
from megatron_tlt.rollout.triton_noise import exponential_noise_fused  # noqa: E402


def test_fused_noise_equals_the_reference():
    g = torch.Generator().manual_seed(0)
    keys = torch.cat([torch.tensor([0, -1, (1 << 63) - 1, -(1 << 63)]),
                      torch.randint(-(1 << 63), (1 << 63) - 1, (4,), generator=g)])
    draws = torch.cat([torch.tensor([0, 1, 1 << 40, (1 << 62) + 5]),
                       torch.randint(0, 1 << 20, (4,), generator=g)])
    for n in (1, 129, 1500):
        ref = exponential_noise(keys, draws, n, "cpu")
        out = exponential_noise_fused(keys, draws, n)
        assert torch.equal(out, ref), n
    # negative control: the draw number is part of the stream position
    assert not torch.equal(exponential_noise_fused(keys, draws + 1, 129), exponential_noise(keys, draws, 129, "cpu"))


def test_fused_noise_rejects_bad_inputs():
    with pytest.raises(ValueError, match="int64"):
        exponential_noise_fused(torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="int64"):
        exponential_noise_fused(torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), 4)
