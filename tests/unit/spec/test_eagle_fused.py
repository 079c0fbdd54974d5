"""The EAGLE drafter's fused path (one QKV and one gate/up product, RoPE on q and k at once),
taken where the drafter is neither batch-invariant nor being trained (rollout on a CUDA
engine: on by default for a CUDA drafter, off on CPU unless forced with
MEGATRON_TLT_DRAFTER_FUSED=1 or fused_products=True). On CPU in float32: the fused path against the reference path; the joint RoPE
bit for bit against apply_rope; the cached fused weights follow in-place updates at the
same address; training (grad enabled) never takes the fused path."""

import pytest
import torch

from megatron_tlt.models.arch import ModelArch
from megatron_tlt.rollout.model import apply_rope
from megatron_tlt.spec.eagle import DrafterConfig, EagleDrafter


def _drafter(family: str, seed: int = 0) -> EagleDrafter:
    arch = ModelArch(family=family, vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64,
                     qkv_bias=family == "qwen2", qk_norm=family == "qwen3")
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(97, 64, generator=g)
    head = torch.randn(97, 64, generator=g)
    d = EagleDrafter(DrafterConfig(arch=arch), embed, head)
    d.reset_parameters(seed=seed, std=0.2)
    d.fused_products = True  # forced on, as MEGATRON_TLT_DRAFTER_FUSED=1 does on CPU
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name.endswith(".bias") or name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (name.endswith("norm.weight")))
    return d


def _inputs(d, t=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, d.arch.vocab_size, (t,), generator=g)
    feats = torch.randn(t, d.arch.hidden_size, generator=g)
    pos = torch.randint(0, 60, (t,), generator=g)
    return tokens, feats, pos


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fused_path_matches_the_reference_path(family):
    d = _drafter(family)
    tokens, feats, pos = _inputs(d)
    out = {}
    with torch.no_grad():
        for inv in (True, False):
            d.batch_invariant = inv
            x, q, k, v = d.layer_qkv(tokens, feats, pos)
            out[inv] = (x, q, k, v, d.layer_out(x, q))
    assert set(k for k in d._fused if not k.startswith("rope")) == (
        {"qkv", "gate_up"} | ({"qkv_bias"} if family == "qwen2" else set()))
    for a, b in zip(out[True], out[False]):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_joint_rope_is_apply_rope_bit_for_bit():
    d = _drafter("llama")
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        qk = torch.randn(9, 6, 16, generator=g).to(dtype)
        pos = torch.randint(0, 64, (9,), generator=g)
        cs = d._rope_table(dtype).index_select(0, pos)
        joint = qk * cs[:, :1] + qk.roll(8, dims=-1) * cs[:, 1:]
        ref = apply_rope(qk, d.rope_cos[pos], d.rope_sin[pos])
        assert torch.equal(joint, ref), dtype
        # negative control: without the sign fold it is a different rotation
        wrong = qk * cs[:, :1] + qk.roll(8, dims=-1) * d.rope_sin[pos][:, None].to(dtype)
        assert not torch.equal(wrong, ref)


def test_fused_weights_follow_in_place_updates_at_the_same_address():
    d = _drafter("qwen2")
    d.batch_invariant = False
    tokens, feats, pos = _inputs(d)
    with torch.no_grad():
        d.refresh_fused()
        w = d._fused["qkv"][1]
        ptr, before = w.data_ptr(), w.clone()
        d.layers[0].self_attn.k_proj.weight.add_(1.0)  # an in-place policy/drafter update
        assert torch.equal(w, before)  # stale until refreshed (control)
        d.refresh_fused()
        assert d._fused["qkv"][1].data_ptr() == ptr
        att = d.layers[0].self_attn
        assert torch.equal(w, torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]))
        _, _, k_fused, _ = d.layer_qkv(tokens, feats, pos)
        d.batch_invariant = True
        _, _, k_ref, _ = d.layer_qkv(tokens, feats, pos)
    torch.testing.assert_close(k_fused, k_ref, rtol=1e-5, atol=1e-5)


def test_fused_path_is_off_on_cpu_by_default(monkeypatch):
    monkeypatch.delenv("MEGATRON_TLT_DRAFTER_FUSED", raising=False)
    d = _drafter("llama")
    d.fused_products = EagleDrafter(d.config, d.target_embed, d.target_lm_head).fused_products
    assert d.fused_products is None  # auto: on for a CUDA drafter only
    d.batch_invariant = False
    with torch.no_grad():
        d.layer_qkv(*_inputs(d))
        d.refresh_fused()
    assert not d._fused
    monkeypatch.setenv("MEGATRON_TLT_DRAFTER_FUSED", "0")
    assert EagleDrafter(d.config, d.target_embed, d.target_lm_head).fused_products is False
    monkeypatch.setenv("MEGATRON_TLT_DRAFTER_FUSED", "1")
    assert EagleDrafter(d.config, d.target_embed, d.target_lm_head).fused_products is True


def test_training_never_takes_the_fused_path():
    d = _drafter("llama")
    d.batch_invariant = False
    tokens, feats, pos = _inputs(d)
    x, q, k, v = d.layer_qkv(tokens, feats, pos)
    (q.sum() + k.sum() + v.sum() + d.layer_out(x, q).sum()).backward()
    att, mlp = d.layers[0].self_attn, d.layers[0].mlp
    for p in (att.q_proj.weight, att.k_proj.weight, att.v_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0
    assert not d._fused
