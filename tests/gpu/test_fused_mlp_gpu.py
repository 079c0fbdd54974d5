"""The fused MLP of one-row steps (gpu_model.FUSED_MLP: the gate/up projection, SiLU * mul
and down projection in one launch, triton_linear.mlp_barrier, a grid barrier between its
phases) on the GPU: bf16, compiled, against the separate kernels; the same bits on every
run (its programs run in any order); graph decode with it equals eager decode with it, and
with and without programmatic dependent launch."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from test_engine_gpu import engine, rel_err, small_model  # noqa: E402

from megatron_tlt.rollout import Request, SamplingParams, pdl  # noqa: E402
from megatron_tlt.rollout import gpu_model as gm  # noqa: E402
from megatron_tlt.rollout.gpu_model import mlp_barrier_config, rms_norm, silu_mul  # noqa: E402
from megatron_tlt.rollout.triton_linear import LinearConfig, linear_partials, mlp_barrier  # noqa: E402

CUDA = torch.device("cuda")


@pytest.mark.parametrize("h,i", [(1536, 8960), (3584, 18944), (256, 512)])
@pytest.mark.parametrize("use_pdl", [False, True])
def test_mlp_barrier_matches_separate_kernels_and_repeats_bit_for_bit(h, i, use_pdl):
    """The barrier kernel (one program per SM, fma products): within 1e-2 of the separate
    kernels; 50 back-to-back launches on one counter give the same plane (a program reading
    the intermediate row before every program stored its part would not); the flipped down
    weight does not match; the norm prologue's residual is rms_norm's."""
    if use_pdl and not pdl.supported(CUDA):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    g = torch.Generator(device="cuda").manual_seed(h + 1)
    bf = lambda *s, sc=1.0: (sc * torch.randn(*s, generator=g, device="cuda")).to(torch.bfloat16)  # noqa: E731
    x, gate_up, down = bf(1, h), bf(2 * i, h, sc=0.03), bf(h, i, sc=0.03)
    fma = LinearConfig("fma", block_m=1, block_n=8, block_k=512, splits=1)
    ref = linear_partials(silu_mul(linear_partials(x, gate_up, fma), dtype=torch.bfloat16), down, fma)[0]
    kw = mlp_barrier_config(CUDA)
    counter = torch.zeros(1, dtype=torch.int64, device=CUDA)
    with pdl.launches(use_pdl, 0, 0):
        runs = [mlp_barrier(x, gate_up, down, counter, **kw)[0] for _ in range(50)]
    torch.cuda.synchronize()
    assert int(counter) == 50 * min(kw["programs"], h, i)
    assert rel_err(runs[0][0], ref) < 1e-2
    assert all(torch.equal(r, runs[0]) for r in runs[1:])
    bad, _ = mlp_barrier(x, gate_up, down.flip(1), counter, **kw)
    assert rel_err(bad[0], ref) > 0.1
    planes = torch.randn(2, 1, h, generator=g, device="cuda")
    res, nw, bias = bf(1, h), bf(h, sc=0.1) + 1, bf(h)
    out, new_res = mlp_barrier(planes, gate_up, down, counter, residual=res, norm_weight=nw,
                               eps=1e-6, bias=bias, **kw)
    r = res.clone()
    y = rms_norm(planes, nw, 1e-6, residual=r, bias=bias)
    assert torch.equal(new_res, r)
    assert rel_err(out[0], mlp_barrier(y, gate_up, down, counter, **kw)[0][0]) < 1e-2


def _one_at_a_time(eng, arch, seed=2):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate([1, 40, 130]):
        req = Request(prompt_id=f"p{i}", prompt_token_ids=torch.randint(0, arch.vocab_size, (n,), generator=g).tolist(),
                      sampling_params=SamplingParams(temperature=0.9 if i % 2 else 0.0, seed=i,
                                                     max_new_tokens=24, min_new_tokens=24))
        (r,) = eng.generate([req])
        assert r.error is None and len(r.token_ids) == 24
        out.append((r.token_ids, r.logprobs))
    return out


def test_fused_mlp_graph_decode_equals_eager_and_plain_launches(monkeypatch):
    """FUSED_MLP on, one sequence at a time (the only row count it serves): graph decode ==
    eager decode, tokens and logprobs bit for bit; with PDL == without (a fused MLP running
    ahead of its inputs would differ). Control: the fused MLP ran, once
    per layer per step, in every engine."""
    dtype = torch.bfloat16
    arch, w = small_model(dtype, seed=7)
    calls = {"n": 0}
    fn = "mlp_barrier"
    real = getattr(gm, fn)

    def counted(*a, **k):
        calls["n"] += 1
        return real(*a, **k)
    monkeypatch.setattr(gm, fn, counted)
    monkeypatch.setattr(gm, "FUSED_MLP", True)
    outs = {}
    for name, graphs, use_pdl in (("eager", False, True), ("graph", True, True), ("graph-plain", True, False)):
        before = calls["n"]
        eng = engine(arch, w, dtype, attention_backend="triton", cuda_graphs=graphs)
        eng.decode_runner.model.pdl = use_pdl and eng.decode_runner.model.pdl
        outs[name] = _one_at_a_time(eng, arch)
        ran = calls["n"] - before  # eager: each layer of each of 3 x 23 decode steps;
        assert ran >= (arch.num_layers if graphs else arch.num_layers * 3 * 23), (name, ran)  # graphs: at capture
    assert outs["graph"] == outs["eager"]
    assert outs["graph-plain"] == outs["graph"]
