import torch

from megatron_tlt.models import hf_mapping
from megatron_tlt.models.arch import ModelArch
from megatron_tlt.testing.tiny_models import tiny_hf_config


def _arch(family="llama", **kw):
    return ModelArch.from_hf_config(tiny_hf_config(family, **kw).to_dict())


def test_qkv_grouping_roundtrip_and_layout():
    arch = _arch(num_heads=4, num_kv_heads=2)
    d, h = arch.head_dim, arch.hidden_size
    q = torch.arange(arch.q_size * h, dtype=torch.float32).reshape(arch.q_size, h)
    k = -torch.arange(arch.kv_size * h, dtype=torch.float32).reshape(arch.kv_size, h) - 1
    v = torch.rand(arch.kv_size, h)
    fused = hf_mapping.fuse_qkv(arch, q, k, v)
    # group 0 = q heads 0,1 then k head 0 then v head 0
    assert torch.equal(fused[: 2 * d], q[: 2 * d])
    assert torch.equal(fused[2 * d: 3 * d], k[:d])
    assert torch.equal(fused[3 * d: 4 * d], v[:d])
    assert torch.equal(fused[4 * d: 6 * d], q[2 * d:])
    q2, k2, v2 = hf_mapping.split_qkv(arch, fused)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


def test_bias_grouping_roundtrip():
    arch = _arch("qwen2")
    q, k, v = torch.rand(arch.q_size), torch.rand(arch.kv_size), torch.rand(arch.kv_size)
    out = hf_mapping.split_qkv(arch, hf_mapping.fuse_qkv(arch, q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(out, (q, k, v)))


def test_name_maps_are_inverse():
    for family in ("llama", "qwen2", "qwen3"):
        for tie in (False, True):
            arch = _arch(family, tie_word_embeddings=tie)
            shapes = hf_mapping.hf_shapes(arch)
            g = torch.Generator().manual_seed(0)
            hf = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
            mc = {n: hf_mapping.hf_to_mcore(arch, n, hf.__getitem__) for n in hf_mapping.mcore_names(arch)}
            assert mc["embedding.word_embeddings.weight"].shape[0] == arch.padded_vocab_size
            assert torch.count_nonzero(mc["embedding.word_embeddings.weight"][arch.vocab_size:]) == 0
            back = dict(hf_mapping.mcore_to_hf(arch, mc.__getitem__))
            assert set(back) == set(hf)
            assert all(torch.equal(back[n], hf[n]) for n in hf)


def test_te_names():
    n = "decoder.layers.3.input_layernorm.weight"
    assert hf_mapping.te_name(n) == "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"
    assert hf_mapping.local_name(hf_mapping.te_name(n)) == n
    m = "decoder.layers.0.pre_mlp_layernorm.weight"
    assert hf_mapping.te_name(m) == "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
