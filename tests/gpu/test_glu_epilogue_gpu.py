"""triton_linear.glu_linear (the gate/up projection storing SiLU(gate) * up itself,
triton_linear._GLU) on the GPU: bf16, compiled, bit for bit the same one-split projection's
plane then gpu_model.silu_mul, with and without programmatic dependent launch; and graph
decode with the epilogue on gives the tokens and logprobs of graph decode with it off."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from test_engine_gpu import graph_decode_both_ways, small_model  # noqa: E402

from megatron_tlt.rollout import pdl  # noqa: E402
from megatron_tlt.rollout import triton_linear as tl_mod  # noqa: E402
from megatron_tlt.rollout.gpu_model import silu_mul  # noqa: E402
from megatron_tlt.rollout.triton_linear import LinearConfig, LinearPlanner, candidate_configs  # noqa: E402


@pytest.mark.parametrize("m,i,k", [(1, 8960, 1536), (32, 8960, 1536), (8, 18944, 3584), (3, 35, 130)])
@pytest.mark.parametrize("use_pdl", [False, True])
def test_glu_linear_equals_projection_then_silu_mul(m, i, k, use_pdl):
    if use_pdl and not pdl.supported(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    g = torch.Generator(device="cuda").manual_seed(m + i)
    x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(2 * i, k, generator=g, device="cuda") * k ** -0.5).to(torch.bfloat16)
    cfgs = [c for c in candidate_configs(m, i, k) if c.kind != "cublas" and c.splits == 1]
    assert cfgs, "no one-split Triton config to take the epilogue"
    with pdl.launches(use_pdl):
        for cfg in cfgs:
            out = tl_mod.glu_linear(x, w, cfg)
            ref = silu_mul(tl_mod.linear_partials(x, w, cfg), dtype=torch.bfloat16)
            assert torch.equal(out, ref), cfg
    # control: the up half's rows shifted by one
    bad = torch.cat([w[:i], w[i:].roll(1, 0)])
    with pdl.launches(use_pdl):
        assert not torch.equal(tl_mod.glu_linear(x, bad, cfgs[0]), tl_mod.glu_linear(x, w, cfgs[0]))


def test_graph_decode_with_glu_epilogue_gives_the_same_tokens(monkeypatch):
    """Both runs take one dot config of one split for every projection; the second captures
    its graphs with _GLU=2 (every layer's gate/up projection through glu_linear)."""
    import megatron_tlt.rollout.gpu_model as gm
    arch, w = small_model(torch.bfloat16)
    fixed = LinearConfig("dot", block_m=16, block_n=32, block_k=128)
    calls = []
    real = gm.glu_linear
    monkeypatch.setattr(gm, "glu_linear", lambda *a, **k: calls.append(1) or real(*a, **k))

    def configure(model, on):
        monkeypatch.setattr(tl_mod, "_GLU", 2 if on else 0)
        model.planner = LinearPlanner(fixed=fixed)
    outs = graph_decode_both_ways(arch, w, torch.bfloat16, 5, configure)
    assert calls, "the epilogue was never used"
    assert [t for t, _ in outs[True]] == [t for t, _ in outs[False]]
    assert [lp for _, lp in outs[True]] == [lp for _, lp in outs[False]]
