"""MEGATRON_TLT_SDPA_ATTENTION=1 (models/sdpa_attention.py): the actor with SDPA core
attention == the actor with Megatron-Core's unfused DotProductAttention, same weights:
logits of packed rows with the block mask and of plain causal rows (None mask), and the
parameter gradients of one backward, float32 on CPU."""

import pytest
import torch

from megatron_tlt.data.packing import TokenizedSample, pack


def _actor(monkeypatch, sdpa: bool):
    from megatron_tlt.models import mcore
    from megatron_tlt.models.actor import Actor
    from megatron_tlt.models.arch import ModelArch
    from megatron_tlt.models.sdpa_attention import SDPADotProductAttention

    monkeypatch.setenv("MEGATRON_TLT_SDPA_ATTENTION", "1" if sdpa else "0")
    mcore.init_parallel(1, 1, seed=5)
    arch = ModelArch(family="qwen2", vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128, qkv_bias=True)
    actor = Actor(arch, init_seed=11)
    cores = [m for m in actor.model.modules() if type(m).__name__.endswith("DotProductAttention")]
    assert len(cores) == 2 and all(isinstance(m, SDPADotProductAttention) == sdpa for m in cores)
    return actor


def _run(actor, tokens, position_ids, mask):
    """Logits [b, s, V] and the gradient of sum(logits * fixed weights) for every parameter."""
    from megatron_tlt.models import mcore
    actor.model.zero_grad(set_to_none=True)
    actor.model.train()
    logits = mcore.gather_logits(actor.model(tokens, position_ids, mask), actor.arch)
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3))
    (logits * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in actor.model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def test_sdpa_attention_equals_unfused(monkeypatch):
    g = torch.Generator().manual_seed(1)
    samples = [TokenizedSample(tuple(torch.randint(4, 100, (n,), generator=g).tolist()), 3) for n in (9, 14, 6)]
    rows, _ = pack(samples.__getitem__, 0, 1, 32, 0, limit=3)
    cases = [(rows.tokens, rows.position_ids, rows.attention_mask()),
             (rows.tokens, torch.arange(32)[None], None)]
    out = {}
    for sdpa in (False, True):
        actor = _actor(monkeypatch, sdpa)
        out[sdpa] = [_run(actor, *c) for c in cases]
    for (la, ga), (lb, gb) in zip(out[False], out[True]):
        torch.testing.assert_close(lb, la, rtol=0, atol=1e-5)
        assert ga.keys() == gb.keys() and len(ga) > 10
        for n in ga:
            torch.testing.assert_close(gb[n], ga[n], rtol=1e-4, atol=1e-5, msg=n)
    # Control: the two cases differ (the block mask matters), so equal logits above are not vacuous.
    assert (out[True][0][0] - out[True][1][0]).abs().max() > 1e-2


def test_sdpa_env_must_be_0_or_1(monkeypatch):
    from megatron_tlt.models.sdpa_attention import sdpa_enabled
    monkeypatch.setenv("MEGATRON_TLT_SDPA_ATTENTION", "yes")
    with pytest.raises(ValueError, match="MEGATRON_TLT_SDPA_ATTENTION"):
        sdpa_enabled()
