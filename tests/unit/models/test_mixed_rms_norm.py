"""The actor's local-spec norms (models/mcore.MixedRMSNorm): float32 weights under bf16
activations in one fused call, the same outputs and gradients as torch's composite
rms_norm, which the mismatched dtypes otherwise select (with a warning)."""

import warnings

import pytest
import torch

from megatron_tlt.models.mcore import MixedRMSNorm


@pytest.mark.parametrize("shape", [(3, 1536), (2, 5, 64)])
def test_mixed_rms_norm_equals_the_composite(shape):
    g = torch.Generator().manual_seed(0)
    n = shape[-1]
    ref = torch.nn.RMSNorm(n, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(1 + 0.1 * torch.randn(n, generator=g))
    mixed = torch.nn.RMSNorm(n, eps=1e-6)
    mixed.load_state_dict(ref.state_dict())
    mixed.__class__ = MixedRMSNorm
    x = (3 * torch.randn(shape, generator=g)).bfloat16()
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = mixed(xb)
    assert not [w for w in seen if "Mismatch dtype" in str(w.message)]
    want = ref(xa)  # torch's composite path (the dtypes differ)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    gy = torch.randn(shape, generator=g).bfloat16()
    want.backward(gy)
    out.backward(gy)
    torch.testing.assert_close(xb.grad.float(), xa.grad.float(), rtol=0, atol=2 * 2.0 ** -7 * xa.grad.abs().max().item())
    torch.testing.assert_close(mixed.weight.grad, ref.weight.grad, rtol=1e-4, atol=1e-4)
    # same dtypes: the plain module's path, bit for bit
    x32 = torch.randn(shape, generator=g)
    assert torch.equal(mixed(x32), ref(x32))
    # control: without the cast back the output would be float32
    assert torch.nn.functional.rms_norm(x.float(), (n,), ref.weight, 1e-6).dtype == torch.float32


def test_actor_norms_are_mixed():
    """An actor built in bfloat16 (the local spec on CPU): every RMSNorm is a MixedRMSNorm
    with its float32 weight (state dict keys as before), and a forward raises no
    mismatched-dtype warning (the composite path's)."""
    from megatron_tlt.models import mcore
    from megatron_tlt.models.actor import Actor
    from megatron_tlt.models.arch import ModelArch

    mcore.init_parallel(1, 1, seed=5)
    arch = ModelArch(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64, qk_norm=True)
    actor = Actor(arch, dtype="bfloat16", init_seed=11)
    norms = [m for m in actor.model.modules() if isinstance(m, torch.nn.RMSNorm)]
    assert len(norms) == 2 * 2 + 1 + 2 * 2  # two per layer, the final one, q/k per layer
    assert all(type(m) is MixedRMSNorm and m.weight.dtype == torch.float32 for m in norms)
    assert "decoder.final_layernorm.weight" in actor.model.state_dict()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        logits = actor.logits(torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1)))
    assert logits.shape == (2, 6, 64) and bool(torch.isfinite(logits).all())
    assert not [w for w in seen if "Mismatch dtype" in str(w.message)]
