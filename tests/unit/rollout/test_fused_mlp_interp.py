"""The one-launch MLP of a one-row decode step (gpu_model.FUSED_MLP: triton_linear.mlp_barrier,
a grid barrier between its phases) == its PyTorch reference; float32 on CPU through
Triton's interpreter, where mlp_barrier runs its phases as two launches (bf16, the
compiled kernel and its barrier run in tests/gpu/test_fused_mlp_gpu.py)."""

import pytest
import torch

from rollout_testutil import triton_interpreter  # noqa: E402

pytestmark = triton_interpreter()

import torch.nn.functional as F  # noqa: E402

from megatron_tlt.rollout.attention import AttentionMetadata  # noqa: E402
from megatron_tlt.rollout.gpu_model import DecodeModel, rms_norm  # noqa: E402
from megatron_tlt.rollout.kv_cache import PagedKVCache  # noqa: E402
from megatron_tlt.rollout.model import InferenceModel  # noqa: E402
from megatron_tlt.rollout.triton_linear import LinearConfig, LinearPlanner, mlp_barrier  # noqa: E402
from tests.unit.rollout.test_triton_attention_interp import _arch, _weights  # noqa: E402


def _mlp_ref(x, gate_up, down):
    """float64 down(SiLU(gate) * up) of a float32 row (float32 rounds nothing here)."""
    i = down.shape[1]
    gu = x.double() @ gate_up.double().T
    return (F.silu(gu[:, :i]) * gu[:, i:]) @ down.double().T


def _rel(out, ref):
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max())


@pytest.mark.parametrize("h,i,programs,max_block_i,block_k,block_kd",
                         [(64, 96, 4, 32, 32, 64), (48, 200, 7, 16, 16, 32), (80, 130, 3, 8, 64, 128)])
def test_mlp_barrier_equals_the_two_projections(h, i, programs, max_block_i, block_k, block_kd):
    g = torch.Generator().manual_seed(h * i)
    x = torch.randn(1, h, generator=g)
    gate_up = 0.2 * torch.randn(2 * i, h, generator=g)
    down = 0.2 * torch.randn(h, i, generator=g)
    counter = torch.zeros(1, dtype=torch.int64)
    kw = dict(programs=programs, block_k=block_k, block_kd=block_kd, num_warps=4, max_block_i=max_block_i)
    out, res = mlp_barrier(x, gate_up, down, counter, **kw)
    assert res is None and out.shape == (1, 1, h) and out.dtype == torch.float32
    assert _rel(out[0], _mlp_ref(x, gate_up, down)) < 1e-5
    bad, _ = mlp_barrier(x, gate_up, down.flip(1), counter, **kw)  # control
    assert _rel(bad[0], _mlp_ref(x, gate_up, down)) > 0.1
    # the norm prologue: rms_norm's residual exactly, the output of rms_norm's row
    planes = torch.randn(2, 1, h, generator=g)
    res0, nw, bias = torch.randn(1, h, generator=g), torch.randn(h, generator=g), torch.randn(h, generator=g)
    out2, new_res = mlp_barrier(planes, gate_up, down, counter, residual=res0, norm_weight=nw,
                                eps=1e-6, bias=bias, **kw)
    r = res0.clone()
    y = rms_norm(planes, nw, 1e-6, residual=r, bias=bias)
    assert torch.equal(new_res, r)
    assert _rel(out2[0], _mlp_ref(y, gate_up, down)) < 1e-5


def test_mlp_barrier_rejects_bad_arguments():
    x, gu, down = torch.zeros(1, 8), torch.zeros(12, 8), torch.zeros(8, 6)
    bkw = dict(programs=2, block_k=8, block_kd=8, num_warps=4)
    with pytest.raises(ValueError, match="one int64"):
        mlp_barrier(x, gu, down, torch.zeros(2, dtype=torch.int64), **bkw)
    with pytest.raises(ValueError, match="disagree"):
        mlp_barrier(x, gu, torch.zeros(8, 5), torch.zeros(1, dtype=torch.int64), **bkw)
    with pytest.raises(ValueError, match=r"\[1, 8\]"):
        mlp_barrier(torch.zeros(2, 8), gu, down, torch.zeros(1, dtype=torch.int64), **bkw)


@pytest.mark.parametrize("prologue,qkv_fused", [(True, False), (False, False), (True, True)],
                         ids=["norm-prologue", "rms-norm-first", "qkv-norm-prologue-reads-it"])
def test_decode_model_fused_mlp_matches_inference_model(prologue, qkv_fused, monkeypatch):
    """FUSED_MLP on: a one-row step runs the fused MLP once a layer (no silu_mul) and its
    logits match the reference forward (the next layer's QKV reads its plane through
    rms_norm, or through its own norm prologue with qkv_fused); a two-row step keeps the
    separate kernels."""
    import megatron_tlt.rollout.gpu_model as gm
    monkeypatch.setattr(gm, "FUSED_MLP", True)
    monkeypatch.setattr(gm, "MLP_NORM_PROLOGUE", prologue)
    fn = "mlp_barrier"
    calls = {fn: 0, "silu_mul": 0}

    def counted(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped
    monkeypatch.setattr(gm, fn, counted(fn, getattr(gm, fn)))
    monkeypatch.setattr(gm, "silu_mul", counted("silu_mul", gm.silu_mul))
    arch = _arch("qwen2", True)
    w = _weights(arch, seed=1)
    ref_model = InferenceModel(arch, w, max_positions=64, batch_invariant=False)
    fma = LinearConfig("fma", block_m=1, block_n=8, block_k=32, splits=2)
    i32 = lambda t: t.to(torch.int32)  # noqa: E731
    for ids, pos, bt in ((torch.tensor([3]), torch.tensor([5]), torch.tensor([[2, 5, 0]])),
                         (torch.tensor([3, 7]), torch.tensor([5, 2]), torch.tensor([[2, 5, 0], [1, 0, 0]]))):
        cfg = fma if len(ids) == 1 else LinearConfig("dot", block_m=16, block_n=16, block_k=32)
        fast = DecodeModel(arch, w, ref_model.cos, ref_model.sin,
                           planner=LinearPlanner(fixed=cfg, fixed_fused=qkv_fused))
        caches = [PagedKVCache(num_layers=2, num_kv_heads=2, head_dim=16, num_blocks=8, block_size=4)
                  for _ in range(2)]
        slots = torch.stack([bt[b, p // 4] * 4 + p % 4 for b, p in enumerate(pos.tolist())])
        meta = AttentionMetadata(slot_mapping=slots, query_start=torch.arange(len(ids) + 1),
                                 context_lens=pos + 1, block_tables=bt)
        ref = ref_model.forward(ids, pos, caches[0], meta).logits
        before = dict(calls)
        out = fast.forward(i32(ids), i32(pos), i32(slots), i32(bt), i32(pos + 1), caches[1], num_splits=2)
        used = {k: calls[k] - before[k] for k in calls}
        layers = arch.num_layers
        assert used == ({fn: layers, "silu_mul": 0} if len(ids) == 1
                        else {fn: 0, "silu_mul": 0 if qkv_fused else layers}), used
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
