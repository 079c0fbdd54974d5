"""rollout/l2_prefetch.py on the GPU: the weight prefetch launched after the attention
(gpu_model.ATTN_L2_PREFETCH_MB, on by default under PDL) changes no token and no logprob
bit in graph decode."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="the prefetch runs under programmatic dependent launch: compute capability 9.0")

from test_engine_gpu import graph_decode_both_ways, small_model  # noqa: E402

from megatron_tlt.rollout import gpu_model, l2_prefetch, pdl  # noqa: E402


def test_l2_prefetch_kernel_runs():
    """The kernel launches over two ranges (the second cut to the budget) and over one;
    nothing outside PDL or on the CPU, nothing of a tensor that is not contiguous. Control:
    the bytes asked for are the budget's."""
    a = torch.randn(300, 256, dtype=torch.bfloat16, device="cuda")  # 153600 B
    b = torch.randn(1000, 512, dtype=torch.bfloat16, device="cuda")
    with pdl.launches(True):
        assert l2_prefetch.l2_prefetch(a, b, 200_000) == 200_000
        assert l2_prefetch.l2_prefetch(a, None, 1 << 30) == 153600
        assert l2_prefetch.l2_prefetch(a, b, 1000) == 1000
        # a tensor that is not contiguous is skipped (the hint only), the other one asked
        assert l2_prefetch.l2_prefetch(b.t(), a, 1 << 20) == 153600
        assert l2_prefetch.l2_prefetch(a, b.t(), 1 << 20) == 153600
        assert l2_prefetch.l2_prefetch(b.t(), None, 1 << 20) == 0
    torch.cuda.synchronize()
    with pdl.launches(False):
        assert l2_prefetch.l2_prefetch(a, b, 1 << 20) == 0
    with pdl.launches(True):
        assert l2_prefetch.l2_prefetch(a.cpu(), b.cpu(), 1 << 20) == 0


class PrefetchSwitch:
    """graph_decode_both_ways' configure: PDL on for both runs, the prefetch on for one;
    counts the bytes each run asked for."""

    def __init__(self, mb: float, monkeypatch):
        self.mb, self.on, self.asked = mb, False, {False: 0, True: 0}
        real = gpu_model.l2_prefetch

        def counting(*a, **kw):
            n = real(*a, **kw)
            self.asked[self.on] += n
            return n
        monkeypatch.setattr(gpu_model, "l2_prefetch", counting)
        self.monkeypatch = monkeypatch

    def __call__(self, model, on: bool) -> None:
        model.pdl = True
        self.on = on
        self.monkeypatch.setattr(gpu_model, "ATTN_L2_PREFETCH_MB", self.mb if on else 0)
        # one-row steps' budget too (the ragged batch ends with one row)
        self.monkeypatch.setattr(gpu_model, "ATTN_L2_PREFETCH_MB_FEW", self.mb if on else 0)


@pytest.mark.parametrize("mb", [4, 64])
def test_l2_prefetch_decode_same_bits(mb, monkeypatch):
    """Graph decode with the prefetch after every layer's attention (4 MB, the default, or
    64 MB: either way the output projection and all of the gate/up weights here) gives the same tokens and bit-identical
    logprobs as without it (bf16, batch 7 ragged, greedy and T=0.9 rows, 40 steps: a
    kernel that let the next one run ahead of the attention's output would show).
    Control: the prefetch run asked for bytes, the other none."""
    dtype = torch.bfloat16
    arch, w = small_model(dtype, seed=5)
    switch = PrefetchSwitch(mb, monkeypatch)
    outs = graph_decode_both_ways(arch, w, dtype, 6, switch)
    assert switch.asked[False] == 0 and switch.asked[True] > 0, switch.asked
    assert outs[True] == outs[False]
