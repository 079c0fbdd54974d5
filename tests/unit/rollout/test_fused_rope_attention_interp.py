"""decode_rope_attention (RoPE + K/V write folded into the decode attention kernel) ==
qkv_rope_write_kv followed by paged_attention, bit for bit, on CPU through Triton's
interpreter; and the decode forward with MEGATRON_TLT_FUSED_ROPE=1 == without it.

float32 (the interpreter's bf16 is not faithful); the compiled bf16 kernels are compared
the same way on the GPU (tests/gpu/test_engine_gpu.py). Skipped without triton (CI) and on
CUDA machines, like every interpreter test.
"""

import pytest
import torch

from rollout_testutil import scattered_blocks, triton_interpreter  # noqa: E402

pytestmark = triton_interpreter()

from megatron_tlt.models.arch import ModelArch  # noqa: E402
from megatron_tlt.rollout import EngineWeights  # noqa: E402
from megatron_tlt.rollout.gpu_model import (FUSED_ROPE_ENV, DecodeModel,  # noqa: E402
                                            decode_rope_attention, qkv_rope_write_kv)
from megatron_tlt.rollout.kv_cache import PagedKVCache  # noqa: E402
from megatron_tlt.rollout.model import rope_table  # noqa: E402
from megatron_tlt.rollout.triton_attention import paged_attention  # noqa: E402


def _case(ctx, *, heads, kvh, d, page, planes, bias, qk_norm, seed):
    """Random QKV planes, a cache with scattered blocks holding a random prefix, and the
    decode metadata of one new token per sequence (ctx counts it; slot -1 for ctx == 0
    stands for a padding row)."""
    g = torch.Generator().manual_seed(seed)
    bt, total = scattered_blocks(ctx, page, g, 2)
    kc = torch.randn(total, page, kvh, d, generator=g)
    vc = torch.randn(total, page, kvh, d, generator=g)
    width = (heads + 2 * kvh) * d
    qkv = torch.randn(planes, len(ctx), width, generator=g)
    pos = torch.tensor([max(c - 1, 0) for c in ctx])
    slots = torch.tensor([int(bt[b, (c - 1) // page]) * page + (c - 1) % page if c > 0 else -1
                          for b, c in enumerate(ctx)])
    ctx_t = torch.tensor([max(c, 1) for c in ctx])
    cos, sin = rope_table(128, d, 10000.0)
    kw = dict(num_heads=heads, num_kv_heads=kvh, head_dim=d, eps=1e-6,
              bias=torch.randn(width, generator=g) if bias else None,
              q_norm=1 + 0.1 * torch.randn(d, generator=g) if qk_norm else None,
              k_norm=1 + 0.1 * torch.randn(d, generator=g) if qk_norm else None)
    return qkv, pos, slots, cos, sin, kc, vc, bt, ctx_t, kw


def _separate(qkv, pos, slots, cos, sin, kc, vc, bt, ctx, kw, splits):
    q = qkv_rope_write_kv(qkv, pos, slots, cos, sin, kc, vc, **kw)
    return paged_attention(q, kc, vc, bt, ctx, scale=kw["head_dim"] ** -0.5, num_splits=splits)


CASES = [  # (name, ctx, heads, kv heads, head_dim, page, planes, bias, qk_norm)
    ("gqa3", [1, 7, 40, 13], 6, 2, 16, 4, 1, False, False),
    ("bias-planes", [5, 33, 70], 6, 2, 16, 8, 3, True, False),
    ("qk-norm", [2, 19, 64], 4, 2, 16, 4, 2, False, True),
    ("head-dim-24-padding-row", [9, 0, 30], 4, 4, 24, 4, 1, True, True),
    ("mha-one-seq", [45], 2, 2, 32, 8, 4, False, False),
    ("two-row-tiles", [5, 30], 66, 1, 16, 4, 1, False, False),  # 66 query heads per KV head
]


@pytest.mark.parametrize("merge", [False, True], ids=["combine-kernel", "merge-in-kernel"])
@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fused_equals_separate_kernels(case, splits, merge, monkeypatch):
    from megatron_tlt.rollout import triton_attention as ta
    monkeypatch.setattr(ta, "_MERGE", merge)
    _, ctx, heads, kvh, d, page, planes, bias, qk_norm = case
    qkv, pos, slots, cos, sin, kc, vc, bt, ctx_t, kw = _case(
        ctx, heads=heads, kvh=kvh, d=d, page=page, planes=planes, bias=bias, qk_norm=qk_norm,
        seed=len(ctx) + d)
    k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    ref = _separate(qkv, pos, slots, cos, sin, k1, v1, bt, ctx_t, kw, splits)
    out = decode_rope_attention(qkv, pos, slots, cos, sin, k2, v2, bt, ctx_t,
                                scale=d ** -0.5, num_splits=splits, **kw)
    assert not torch.equal(k1, kc) or all(c == 0 for c in ctx)  # the new K was written
    assert torch.equal(k2, k1) and torch.equal(v2, v1)
    live = [b for b, c in enumerate(ctx) if c > 0]  # a padding row's output is not used
    assert torch.equal(out[live], ref[live])
    assert not ta.merge_counters(torch.device("cpu")).any()


def test_comparison_catches_a_wrong_position_and_a_missing_write():
    """Negative controls: the same comparison fails when the fused kernel is given another
    position (RoPE differs) or told not to write one sequence's K/V (slot -1: the cache
    and that sequence's output differ, since its own new key is then stale)."""
    qkv, pos, slots, cos, sin, kc, vc, bt, ctx_t, kw = _case(
        [7, 40], heads=6, kvh=2, d=16, page=4, planes=1, bias=False, qk_norm=False, seed=5)
    k1, v1 = kc.clone(), vc.clone()
    ref = _separate(qkv, pos, slots, cos, sin, k1, v1, bt, ctx_t, kw, 3)
    k2, v2 = kc.clone(), vc.clone()
    out = decode_rope_attention(qkv, pos + 1, slots, cos, sin, k2, v2, bt, ctx_t,
                                scale=0.25, num_splits=3, **kw)
    assert not torch.equal(out, ref) and not torch.equal(k2, k1)
    assert torch.equal(v2, v1)  # V takes no RoPE
    k3, v3 = kc.clone(), vc.clone()
    no_write = torch.tensor([-1, int(slots[1])])
    out = decode_rope_attention(qkv, pos, no_write, cos, sin, k3, v3, bt, ctx_t,
                                scale=0.25, num_splits=3, **kw)
    assert not torch.equal(k3, k1) and not torch.equal(out[0], ref[0])
    assert torch.equal(out[1], ref[1])


def test_decode_rope_attention_argument_errors():
    qkv, pos, slots, cos, sin, kc, vc, bt, ctx_t, kw = _case(
        [3], heads=4, kvh=2, d=16, page=4, planes=1, bias=False, qk_norm=False, seed=0)
    with pytest.raises(ValueError, match="disagree"):
        decode_rope_attention(qkv, pos, slots, cos, sin, kc, vc, bt, ctx_t, scale=0.25,
                              **{**kw, "num_kv_heads": 4})
    with pytest.raises(ValueError, match="tokens for"):
        decode_rope_attention(qkv, pos, slots, cos, sin, kc, vc, bt.repeat(2, 1),
                              ctx_t.repeat(2), scale=0.25, **kw)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_decode_forward_fused_rope_equals_separate(family, monkeypatch):
    """DecodeModel with MEGATRON_TLT_FUSED_ROPE=1: the same logits and caches, bit for bit,
    over a few decode steps of a three-sequence batch with split-K."""
    arch = ModelArch(family=family, vocab_size=300, hidden_size=64, intermediate_size=96,
                     num_layers=2, num_heads=6, num_kv_heads=2, head_dim=16,
                     max_position_embeddings=256, tie_word_embeddings=family != "llama",
                     qkv_bias=family == "qwen2", qk_norm=family == "qwen3")
    w = EngineWeights.make_dummy(arch, seed=3)
    cos, sin = rope_table(64, 16, 10000.0)
    models = []
    for flag in ("0", "1"):
        monkeypatch.setenv(FUSED_ROPE_ENV, flag)
        models.append(DecodeModel(arch, w, cos, sin))
    assert (models[0].fused_rope, models[1].fused_rope) == (False, True)
    g = torch.Generator().manual_seed(4)
    caches = [PagedKVCache(num_layers=2, num_kv_heads=2, head_dim=16, num_blocks=10, block_size=4)
              for _ in models]
    for layer in range(2):
        k, v = torch.randn(caches[0].k[layer].shape, generator=g), torch.randn(caches[0].v[layer].shape, generator=g)
        for c in caches:
            c.k[layer].copy_(k)
            c.v[layer].copy_(v)
    bt = torch.tensor([[2, 5, 0, 8], [1, 7, 0, 8], [3, 4, 6, 9]], dtype=torch.int32)
    pos = torch.tensor([5, 0, 10], dtype=torch.int32)
    ids = torch.tensor([3, 250, 7], dtype=torch.int32)
    for _ in range(3):
        slots = torch.stack([bt[b, p // 4] * 4 + p % 4 for b, p in enumerate(pos.tolist())])
        logits = [m.forward(ids, pos, slots, bt, pos + 1, c, num_splits=2)
                  for m, c in zip(models, caches)]
        assert torch.equal(logits[0], logits[1])
        for layer in range(2):
            assert torch.equal(caches[0].k[layer], caches[1].k[layer])
            assert torch.equal(caches[0].v[layer], caches[1].v[layer])
        ids = logits[0].argmax(-1).to(torch.int32)
        pos = pos + 1
