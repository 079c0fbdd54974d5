"""The decode-shaped Triton linear (triton_linear.py) and its split-K partial-sum planes,
consumed by the fused small kernels, == their PyTorch references; float32 on CPU through
Triton's interpreter (the compiled kernels and bf16 run in tests/gpu/test_engine_gpu.py).
"""

import pytest
import torch

from rollout_testutil import triton_interpreter  # noqa: E402

pytestmark = triton_interpreter()

import torch.nn.functional as F  # noqa: E402

from megatron_tlt.rollout.gpu_model import DecodeModel, qkv_rope_write_kv, rms_norm, silu_mul  # noqa: E402
from megatron_tlt.rollout.kv_cache import PagedKVCache  # noqa: E402
from megatron_tlt.rollout.model import InferenceModel, rope_table  # noqa: E402
from megatron_tlt.rollout.attention import AttentionMetadata  # noqa: E402
from megatron_tlt.rollout.triton_linear import (LinearConfig, LinearPlanner, candidate_configs,  # noqa: E402
                                                glu_linear, linear_into, linear_partials,
                                                norm_linear_partials, silu_linear_partials)
from tests.unit.rollout.test_triton_attention_interp import _arch, _weights  # noqa: E402

CONFIGS = [LinearConfig("dot", block_m=16, block_n=16, block_k=32, splits=1),
           LinearConfig("dot", block_m=16, block_n=32, block_k=64, splits=2),  # several row tiles at m=17
           LinearConfig("dot", block_m=32, block_n=32, block_k=64, splits=3),
           LinearConfig("fma", block_m=1, block_n=4, block_k=64, splits=2),
           LinearConfig("fma", block_m=1, block_n=8, block_k=128, splits=1)]


@pytest.mark.parametrize("m,n,k", [(1, 40, 300), (3, 33, 512), (17, 20, 130), (40, 24, 260)])
@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_linear_partials_sum_to_the_product(m, n, k, cfg):
    if cfg.kind == "fma" and m != 1:
        with pytest.raises(ValueError, match="one row"):
            linear_partials(torch.zeros(m, k), torch.zeros(n, k), cfg)
        return
    g = torch.Generator().manual_seed(m * n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    planes = linear_partials(x, w, cfg)
    assert planes.shape == (cfg.splits, m, n) and planes.dtype == torch.float32
    torch.testing.assert_close(planes.sum(0), x @ w.T, atol=5e-5, rtol=1e-5)
    out = torch.full((m, n), float("nan"))
    torch.testing.assert_close(linear_into(x, w, out, cfg), x @ w.T, atol=5e-5, rtol=1e-5)
    # negative control: the weight with its K order reversed does not give the product
    bad = linear_partials(x, w.flip(1), cfg)
    assert (bad.sum(0) - x @ w.T).abs().max() > 1e-2


@pytest.mark.parametrize("k", [130, 64])
@pytest.mark.parametrize("tiles", [1, 2, 3, 4])
@pytest.mark.parametrize("cfg", [CONFIGS[1], CONFIGS[2], CONFIGS[3]], ids=str)
def test_weight_tiles_loaded_before_the_wait_give_the_same_bits(cfg, tiles, k, monkeypatch):
    """The PDL weight preload (MEGATRON_TLT_PDL_PRELOAD_KB: a program's first 1-4 weight
    tiles loaded before its wait, pdl.py) runs the same steps in the same order: the same
    planes bit for bit, for plain inputs and both prologues, also where a split holds fewer
    tiles than are preloaded (K = 130 over 3 splits of 64: the last split has 1 tile; K = 64
    over 3 splits of 64: two hold none); a preloaded tile paired with another tile's input
    would change the planes. Control: the same preloaded run over the weight with its
    first tile zeroed differs."""
    from megatron_tlt.rollout import pdl
    from megatron_tlt.rollout import triton_linear as tlin
    m = 1 if cfg.kind == "fma" else 3
    g = torch.Generator().manual_seed(tiles)
    x, w = torch.randn(m, k, generator=g), torch.randn(20, k, generator=g)
    gu = torch.randn(2, m, 2 * k, generator=g)
    h, res = torch.randn(3, m, k, generator=g), torch.randn(m, k, generator=g)
    nw = 1 + 0.1 * torch.randn(k, generator=g)
    calls = [lambda w_: linear_partials(x, w_, cfg), lambda w_: silu_linear_partials(gu, w_, cfg),
             lambda w_: norm_linear_partials(h, res, nw, 1e-6, w_, cfg)[0]]
    plain = [c(w) for c in calls]
    tile_bytes = cfg.block_n * cfg.block_k * 4
    monkeypatch.setattr(pdl, "preload_limit", lambda: tiles * tile_bytes)
    k_split = -(-k // (cfg.splits * cfg.block_k)) * cfg.block_k
    assert tlin.preload_tiles(cfg, k_split, 4) == min(tiles, -(-k_split // cfg.block_k))
    for c, ref in zip(calls, plain):
        assert torch.equal(c(w), ref)
    zeroed = w.clone()
    zeroed[:, :cfg.block_k] = 0
    assert not torch.equal(calls[0](zeroed), plain[0])


def test_consumers_add_planes_and_bias_before_rounding():
    """rms_norm, silu_mul and qkv_rope_write_kv given 3 planes == given their sum."""
    g = torch.Generator().manual_seed(0)
    planes = torch.randn(3, 4, 40, generator=g)
    w = 1 + 0.1 * torch.randn(40, generator=g)
    b = torch.randn(40, generator=g)
    res = torch.randn(4, 40, generator=g)
    r1, r2 = res.clone(), res.clone()
    torch.testing.assert_close(rms_norm(planes, w, 1e-6, residual=r1, bias=b),
                               rms_norm(planes.sum(0) + b, w, 1e-6, residual=r2), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(r1, r2, atol=1e-6, rtol=1e-6)
    gu = torch.randn(2, 3, 2 * 70, generator=g)
    torch.testing.assert_close(silu_mul(gu), silu_mul(gu.sum(0)), atol=1e-6, rtol=1e-6)
    heads, kvh, d = 6, 2, 16
    cos, sin = rope_table(64, d, 10000.0)
    qkv = torch.randn(2, 3, (heads + 2 * kvh) * d, generator=g)
    bias = torch.randn((heads + 2 * kvh) * d, generator=g)
    pos, slots = torch.tensor([0, 17, 63]), torch.tensor([5, -1, 9])
    caches = [(torch.zeros(4, 4, kvh, d), torch.zeros(4, 4, kvh, d)) for _ in range(2)]
    qa = qkv_rope_write_kv(qkv, pos, slots, cos, sin, *caches[0], num_heads=heads, num_kv_heads=kvh,
                           head_dim=d, bias=bias)
    qb = qkv_rope_write_kv(qkv.sum(0) + bias, pos, slots, cos, sin, *caches[1], num_heads=heads,
                           num_kv_heads=kvh, head_dim=d)
    torch.testing.assert_close(qa, qb, atol=1e-6, rtol=1e-6)
    for x, y in zip(caches[0], caches[1]):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)


def test_rms_norm_sum_out_starts_a_residual_stream():
    """sum_out: the planes' sum + bias is stored (what a zero residual would become) and
    the norm is that of the zero-residual call; residual and sum_out together are refused."""
    g = torch.Generator().manual_seed(1)
    planes = torch.randn(2, 3, 40, generator=g)
    w = 1 + 0.1 * torch.randn(40, generator=g)
    b = torch.randn(40, generator=g)
    zero, start = torch.zeros(3, 40), torch.full((3, 40), float("nan"))
    ref = rms_norm(planes, w, 1e-6, residual=zero, bias=b)
    assert torch.equal(rms_norm(planes, w, 1e-6, bias=b, sum_out=start), ref)
    assert torch.equal(start, zero)
    with pytest.raises(ValueError, match="not both"):
        rms_norm(planes, w, 1e-6, residual=zero, sum_out=start)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_early_weight_is_bit_for_bit(dtype, monkeypatch):
    """NORM_EARLY_WEIGHT (the default since session 36: the weight and bias loaded before
    the PDL wait) gives the same bits as the order before (loaded after the reduction),
    with planes, bias and residual; the residual too. A weight nudged in one column (one
    float32 ulp; 1% in bfloat16) changes the output (the comparison can fail)."""
    from megatron_tlt.rollout import gpu_model
    g = torch.Generator().manual_seed(3)
    planes = torch.randn(3, 5, 96, generator=g)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    r0 = torch.randn(5, 96, generator=g).to(dtype)

    def run(weight, early):
        monkeypatch.setattr(gpu_model, "NORM_EARLY_WEIGHT", early)
        r = r0.clone()
        return rms_norm(planes, weight, 1e-6, residual=r, bias=b), r

    (a, ra), (e, re) = run(w, False), run(w, True)
    assert torch.equal(a, e) and torch.equal(ra, re) and not torch.equal(ra, r0)
    w1 = w.clone()
    w1[7] = torch.nextafter(w1[7].float(), torch.tensor(9.0)).to(dtype) if dtype == torch.float32 \
        else (w1[7].float() * 1.01).to(dtype)
    assert not torch.equal(run(w1, True)[0], a)


@pytest.mark.parametrize("cfg", [LinearConfig("dot", block_m=16, block_n=16, block_k=32, splits=3),
                                 LinearConfig("fma", block_m=1, block_n=8, block_k=32, splits=2)], ids=str)
def test_fused_prologues_equal_the_separate_kernels(cfg):
    """SiLU * mul and residual add + RMSNorm (+ the previous projection's bias) computed in
    the projection's prologue == the separate kernel then the projection; the residual
    passed in is left as it was, the new one returned equals rms_norm's in-place update.
    One row, so the fma configs (one-row GEMV) take the prologues too."""
    g = torch.Generator().manual_seed(0)
    gu = torch.randn(2, 1, 2 * 70, generator=g)
    w = torch.randn(20, 70, generator=g)
    torch.testing.assert_close(silu_linear_partials(gu, w, cfg), linear_partials(silu_mul(gu), w, cfg),
                               atol=1e-6, rtol=1e-6)
    h = torch.randn(3, 1, 40, generator=g)
    res = torch.randn(1, 40, generator=g)
    nw, bias = 1 + 0.1 * torch.randn(40, generator=g), torch.randn(40, generator=g)
    wq = torch.randn(24, 40, generator=g)
    before = res.clone()
    planes, new_res = norm_linear_partials(h, res, nw, 1e-6, wq, cfg, bias=bias)
    assert torch.equal(res, before)
    ref_res = res.clone()
    ref = linear_partials(rms_norm(h, nw, 1e-6, residual=ref_res, bias=bias), wq, cfg)
    torch.testing.assert_close(planes, ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(new_res, ref_res, atol=0, rtol=0)
    # negative control: without the bias the product differs
    assert (norm_linear_partials(h, res, nw, 1e-6, wq, cfg)[0] - ref).abs().max() > 1e-2


@pytest.mark.parametrize("m,cfg", [(1, CONFIGS[0]), (3, CONFIGS[0]), (17, CONFIGS[0]),
                                   (1, CONFIGS[4]),
                                   (5, LinearConfig("dot", block_m=16, block_n=32, block_k=64))], ids=str)
def test_glu_epilogue_equals_the_projection_then_silu_mul(m, cfg):
    """glu_linear (SiLU(gate) * up stored by the gate/up projection) == the same one-split
    projection's plane then silu_mul, bit for bit (I = 35: a partial last column tile; K =
    130: a partial last K tile); the negative control swaps the gate and up rows."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(m, 130, generator=g)
    w = torch.randn(70, 130, generator=g)
    out = glu_linear(x, w, cfg)
    assert out.shape == (m, 35) and out.dtype == w.dtype
    assert torch.equal(out, silu_mul(linear_partials(x, w, cfg)))
    swapped = torch.cat([w[35:], w[:35]])
    assert not torch.equal(glu_linear(x, swapped, cfg), out)
    with pytest.raises(ValueError, match="one split"):
        glu_linear(x, w, CONFIGS[1])


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[4]], ids=str)
def test_decode_model_glu_epilogue_gives_the_same_logits(cfg, monkeypatch):
    """triton_linear._GLU on: every layer's gate/up projection stores SiLU * up itself (one
    glu_linear per layer, no silu_mul), and the step's logits equal those with it off."""
    import megatron_tlt.rollout.gpu_model as gm
    import megatron_tlt.rollout.triton_linear as tl_mod
    arch = _arch("qwen2", True)
    w = _weights(arch, seed=1)
    ref = InferenceModel(arch, w, max_positions=64, batch_invariant=False)
    i32 = lambda t: t.to(torch.int32)  # noqa: E731
    calls = {"glu_linear": 0, "silu_mul": 0}

    def counted(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped
    monkeypatch.setattr(gm, "glu_linear", counted("glu_linear", gm.glu_linear))
    monkeypatch.setattr(gm, "silu_mul", counted("silu_mul", gm.silu_mul))
    out = {}
    for glu in (0, 2):
        monkeypatch.setattr(tl_mod, "_GLU", glu)
        model = DecodeModel(arch, w, ref.cos, ref.sin, planner=LinearPlanner(fixed=cfg))
        cache = PagedKVCache(num_layers=arch.num_layers, num_kv_heads=arch.num_kv_heads,
                             head_dim=arch.head_dim, num_blocks=8, block_size=4)
        before = dict(calls)
        out[glu] = model.forward(i32(torch.tensor([3])), i32(torch.tensor([5])), i32(torch.tensor([21])),
                                 i32(torch.tensor([[2, 5, 0]])), i32(torch.tensor([6])), cache, num_splits=2)
        used = {k: calls[k] - before[k] for k in calls}
        assert used == ({"glu_linear": 0, "silu_mul": arch.num_layers} if glu == 0
                        else {"glu_linear": arch.num_layers, "silu_mul": 0}), used
    assert torch.equal(out[2], out[0])
    # a split config cannot take the epilogue: the planner keeps the separate SiLU
    monkeypatch.setattr(tl_mod, "_GLU", 2)
    x = torch.zeros(1, 8)
    assert LinearPlanner(fixed=CONFIGS[1]).glu_config(x, torch.zeros(6, 8)) is None
    assert LinearPlanner().glu_config(x, torch.zeros(6, 8)) is None  # CPU: no timing


@pytest.mark.parametrize("cfg,fused", [(CONFIGS[1], False), (CONFIGS[1], True), (CONFIGS[3], False),
                                       (CONFIGS[3], True)],
                         ids=["dot", "dot-fused-prologues", "fma", "fma-fused-prologues"])
def test_decode_model_with_triton_linears_matches_inference_model(cfg, fused):
    arch = _arch("qwen2", True)
    w = _weights(arch, seed=1)
    ref_model = InferenceModel(arch, w, max_positions=64, batch_invariant=False)
    fast = DecodeModel(arch, w, ref_model.cos, ref_model.sin,
                       planner=LinearPlanner(fixed=cfg, fixed_fused=fused))
    caches = [PagedKVCache(num_layers=2, num_kv_heads=2, head_dim=16, num_blocks=8, block_size=4)
              for _ in range(2)]
    ids, pos = torch.tensor([3]), torch.tensor([5])
    bt = torch.tensor([[2, 5, 0]])
    slots = torch.tensor([5 * 4 + 1])
    meta = AttentionMetadata(slot_mapping=slots, query_start=torch.arange(2), context_lens=pos + 1,
                             block_tables=bt)
    ref = ref_model.forward(ids, pos, caches[0], meta).logits
    i32 = lambda t: t.to(torch.int32)  # noqa: E731
    out = fast.forward(i32(ids), i32(pos), i32(slots), i32(bt), i32(pos + 1), caches[1], num_splits=2)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(caches[1].k[1], caches[0].k[1], atol=1e-5, rtol=1e-5)


def test_candidate_configs_and_cpu_planner():
    cands = candidate_configs(1, 2048, 1536)
    assert cands[0].kind == "cublas" and any(c.kind == "fma" for c in cands)
    assert all(c.kind != "fma" for c in candidate_configs(8, 2048, 1536))
    from megatron_tlt.rollout.triton_linear import _row_bucket
    assert [_row_bucket(m) for m in (1, 3, 33, 64, 65, 160, 161, 256)] == [1, 4, 64, 64, 96, 160, 192, 256]
    many = candidate_configs(160, 2048, 1536)  # a verify step's rows: several row tiles
    assert many[0].kind == "cublas" and len(many) > 1
    assert all(c.kind == "dot" and c.block_m in (64, 128) for c in many[1:])
    assert candidate_configs(257, 2048, 1536) == [candidate_configs(257, 2048, 1536)[0]]
    x, w = torch.zeros(1, 8), torch.zeros(4, 8)
    assert LinearPlanner().config(x, w).kind == "cublas"  # no timing on CPU
    assert F.linear(x, w).shape == linear_partials(x, w, LinearPlanner().config(x, w))[0].shape


def test_row_local_plans_never_take_cublas(monkeypatch):
    """A row_local plan (the EAGLE drafter's kernel path: eager live rows and a graph's
    padded bucket must compute a row alike) skips cuBLAS even where cuBLAS timed fastest,
    and has a Triton config even for a short K (a reduced draft head of a tiny model)."""
    import megatron_tlt.rollout.triton_linear as tl_mod
    small_k = candidate_configs(4, 48, 64)
    assert small_k[0].kind == "cublas" and [c.splits for c in small_k[1:]] == [1, 1, 1]
    assert all(c.splits == 1 for c in candidate_configs(1, 48, 64)[1:])
    dot = LinearConfig("dot", block_m=16, block_n=16, block_k=32)
    monkeypatch.setattr(tl_mod, "candidate_configs", lambda m, n, k: [tl_mod.CUBLAS, dot])
    times = iter([1.0, 2.0, 2.0])  # cuBLAS fastest wherever it is timed
    monkeypatch.setattr(tl_mod, "_time_us", lambda call, n: next(times))
    p = LinearPlanner()
    x, w = torch.zeros(4, 64), torch.zeros(48, 64)
    assert p._tune(x, w, (4, 48, 64, torch.float32, True)) == (tl_mod.CUBLAS, 1.0)
    assert p._tune(x, w, (4, 48, 64, torch.float32, True, tl_mod._ROW_LOCAL)) == (dot, 2.0)
    assert "cublas" not in p.timings[(4, 48, 64, torch.float32, True, tl_mod._ROW_LOCAL)]


def test_fma_wide_adds_one_row_configs_and_tags_their_plans(monkeypatch):
    """triton_linear.FMA_WIDE (opt-in): one row's candidates gain 2-warp fma configs over
    256-column tiles and 4-warp ones over 1024-column tiles (split K kept >= the tile),
    rows > 1 nothing; the plans made with them carry the tag in their key, so a process
    that times both sets (bench rollout --compare-attr) never reuses one for the other, and
    a row-local key with the tag still skips cuBLAS. The new configs compute the product
    (interpreter, float32; the GPU compiles them in tools/linear_sweep.py)."""
    import megatron_tlt.rollout.triton_linear as tl_mod
    base1, base8 = candidate_configs(1, 2048, 1536), candidate_configs(8, 2048, 1536)
    monkeypatch.setattr(tl_mod, "FMA_WIDE", True)
    wide1 = candidate_configs(1, 2048, 1536)
    new = [c for c in wide1 if c not in base1]
    assert wide1[:len(base1)] == base1 and candidate_configs(8, 2048, 1536) == base8
    assert {(c.block_k, c.num_warps) for c in new} == {(256, 2), (1024, 4)}
    assert all(c.kind == "fma" and (c.splits == 1 or 1536 // c.splits >= c.block_k) for c in new)
    assert tl_mod._wide_tag(1) == (tl_mod._FMA_WIDE,) and tl_mod._wide_tag(2) == ()
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(1, 2304, generator=g), torch.randn(24, 2304, generator=g)
    for cfg in [c for c in candidate_configs(1, 24, 2304) if c.block_k in (256, 1024)][::3]:
        torch.testing.assert_close(linear_partials(x, w, cfg).sum(0), x @ w.T, atol=2e-4,
                                   rtol=1e-5, msg=str(cfg))
    seen = []
    monkeypatch.setattr(LinearPlanner, "_choose",
                        lambda self, plans, key, tune: seen.append(key) or (tl_mod.CUBLAS, 1.0))
    p = LinearPlanner()
    p._plan(torch.zeros(1, 8), torch.zeros(4, 8), 1, True, False)
    p._plan(torch.zeros(1, 8), torch.zeros(4, 8), 1, True, True)
    p._plan(torch.zeros(3, 8), torch.zeros(4, 8), 3, True, False)
    with monkeypatch.context() as mp:  # fused_config plans on CUDA tensors only
        mp.setattr(torch.Tensor, "device", property(lambda t: torch.device("cuda")))
        p.fused_config("silu", torch.zeros(2, 1, 16), torch.zeros(4, 8))
    assert [k[5:] for k in seen] == [(tl_mod._FMA_WIDE,), (tl_mod._ROW_LOCAL, tl_mod._FMA_WIDE), (),
                                     (torch.float32, tl_mod._FMA_WIDE)]
    dot = LinearConfig("dot", block_m=16, block_n=16, block_k=32)
    monkeypatch.setattr(tl_mod, "candidate_configs", lambda m, n, k: [tl_mod.CUBLAS, dot])
    monkeypatch.setattr(tl_mod, "_time_us", lambda call, n: 2.0)
    key = (1, 48, 64, torch.float32, True, tl_mod._ROW_LOCAL, tl_mod._FMA_WIDE)
    q = LinearPlanner()
    assert q._tune(torch.zeros(1, 64), torch.zeros(48, 64), key) == (dot, 2.0)
    assert "cublas" not in q.timings[key]  # row-local with the tag: cuBLAS never timed


def test_cublas_margin_prefers_triton_within_it_and_tags_the_plan(monkeypatch):
    """triton_linear.CUBLAS_MARGIN (opt-in): cuBLAS is taken only where its time times the
    margin beats every Triton config (the returned time is still its own); 1.0 keeps the
    plain fastest (negative control); a margin other than 1 tags the plan key."""
    import megatron_tlt.rollout.triton_linear as tl_mod
    dot = LinearConfig("dot", block_m=16, block_n=16, block_k=32)
    monkeypatch.setattr(tl_mod, "candidate_configs", lambda m, n, k: [tl_mod.CUBLAS, dot])
    x, w = torch.zeros(4, 64), torch.zeros(48, 64)
    key = (4, 48, 64, torch.float32, True)
    for margin, cublas_us, want in ((1.0, 9.8, tl_mod.CUBLAS), (1.05, 9.8, dot), (1.05, 9.0, tl_mod.CUBLAS)):
        monkeypatch.setattr(tl_mod, "CUBLAS_MARGIN", margin)
        times = iter([cublas_us, 10.0])
        monkeypatch.setattr(tl_mod, "_time_us", lambda call, n: next(times))  # noqa: B023
        cfg, us = LinearPlanner()._tune(x, w, key)
        assert (cfg, us) == (want, cublas_us if want is tl_mod.CUBLAS else 10.0), (margin, cublas_us)
    assert tl_mod._margin_tag() == ("cublas_x1.05",)
    monkeypatch.setattr(tl_mod, "CUBLAS_MARGIN", 1.0)
    assert tl_mod._margin_tag() == ()


def test_decode_step_launch_count_with_every_fusion(monkeypatch):
    """With the fused choices taken (fma GEMVs with the RMSNorm / SiLU prologues, RoPE +
    K/V write in the attention kernel) and the split-K merge in the attention kernel, a
    decode step launches 5 Triton kernels per layer (QKV, RoPE + attention, O, gate_up,
    down) plus 3 (the first layer's input norm, the final norm, the head): 143 for 28
    layers against 282 without them. Counted at the launcher, so a change that adds a
    launch per layer fails here; and the fused attention is launched right after the QKV
    projection (what its loads before the PDL wait rely on)."""
    from triton.runtime.interpreter import InterpretedFunction

    from megatron_tlt.rollout import triton_attention as ta
    counts = []
    run = InterpretedFunction.run

    def counting(self, *args, **kwargs):
        counts.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    arch = _arch("qwen2", True)
    w = _weights(arch, seed=1)
    ref = InferenceModel(arch, w, max_positions=64, batch_invariant=False)
    fma = LinearConfig("fma", block_m=1, block_n=8, block_k=128, splits=2)
    i32 = lambda t: t.to(torch.int32)  # noqa: E731
    launches, seqs = {}, {}
    for fused in (True, False):
        monkeypatch.setattr(ta, "_MERGE", fused)
        model = DecodeModel(arch, w, ref.cos, ref.sin, planner=LinearPlanner(fixed=fma, fixed_fused=fused))
        model.fused_rope = fused
        cache = PagedKVCache(num_layers=arch.num_layers, num_kv_heads=arch.num_kv_heads,
                             head_dim=arch.head_dim, num_blocks=8, block_size=4)
        counts.clear()
        monkeypatch.setattr(InterpretedFunction, "run", counting)
        model.forward(i32(torch.tensor([3])), i32(torch.tensor([5])), i32(torch.tensor([21])),
                      i32(torch.tensor([[2, 5, 0]])), i32(torch.tensor([6])), cache, num_splits=2)
        monkeypatch.setattr(InterpretedFunction, "run", run)
        launches[fused] = len(counts)
        seqs[fused] = list(counts)
    layers = arch.num_layers
    assert launches[True] == 5 * layers + 3, counts
    # the control: separate norm, RoPE, SiLU and combine kernels
    assert launches[False] == 10 * layers + 2
    # PDL safety (rollout/pdl.py): the fused decode attention loads its inputs and cached
    # keys before its wait, so the kernel launched right before it must be the QKV
    # projection (which writes none of them). Control: the separate kernels' attention
    # follows the RoPE kernel, so the check can fail.
    def attention_after_projection(seq):
        at = [i for i, k in enumerate(seq) if k in ("_rope_attention_kernel", "_paged_attention_kernel")]
        return len(at) == layers and all(seq[i - 1] == "_linear_kernel" for i in at)
    assert attention_after_projection(seqs[True]), seqs[True]
    assert not attention_after_projection(seqs[False])

