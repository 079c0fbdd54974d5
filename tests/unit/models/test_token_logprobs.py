"""actor.token_logprobs: Megatron's vocab-parallel cross entropy over [b, s, v] rows directly
(no [s, b] transposed copies) == the transposed form it replaced and == log_softmax, bit for
bit in float32; the caller's logits are left as they were (the cross entropy subtracts the
row max in place); gradients equal too."""

import pytest
import torch


@pytest.fixture(scope="module", params=[250, 256], ids=["padded-vocab", "unpadded-vocab"])
def arch(request):
    """Vocabulary 250 is padded (its padded columns masked on a copy), 256 is not."""
    from megatron_tlt.models import mcore
    from megatron_tlt.models.arch import ModelArch

    mcore.init_parallel(1, 1, seed=5)
    a = ModelArch(family="qwen2", vocab_size=request.param, hidden_size=32, intermediate_size=64, num_layers=1,
                  num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64, qkv_bias=True)
    assert (a.padded_vocab_size > a.vocab_size) == (request.param == 250)
    return a


def _transposed(logits, labels, arch, temperature):
    """The former form: [s, b] transposed copies in and out."""
    from megatron.core import tensor_parallel
    from megatron_tlt.models.actor import mask_padded_vocab

    x = logits.float()
    if temperature > 0 and temperature != 1.0:
        x = x / temperature
    x = mask_padded_vocab(x, arch)
    ce = tensor_parallel.vocab_parallel_cross_entropy(x.transpose(0, 1).contiguous(),
                                                      labels.transpose(0, 1).contiguous())
    return -ce.transpose(0, 1)


@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_token_logprobs_rows_equal_the_transposed_form(arch, b, temperature):
    from megatron_tlt.models.actor import token_logprobs

    g = torch.Generator().manual_seed(b)
    v = arch.padded_vocab_size
    logits = (4 * torch.randn(b, 7, v, generator=g)).requires_grad_()
    labels = torch.randint(0, arch.vocab_size, (b, 7), generator=g)
    before = logits.detach().clone()
    lp = token_logprobs(logits, labels, arch, temperature)
    assert torch.equal(logits.detach(), before)  # not modified in place
    ref_in = logits.detach().clone().requires_grad_()
    ref = _transposed(ref_in, labels, arch, temperature)
    assert lp.shape == (b, 7) and torch.equal(lp, ref)
    t = temperature if temperature > 0 else 1.0
    want = torch.log_softmax(logits.detach()[..., :arch.vocab_size] / t, -1).gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(lp.detach(), want, rtol=1e-5, atol=1e-5)
    w = torch.randn(b, 7, generator=g)
    (lp * w).sum().backward()
    (ref * w).sum().backward()
    assert torch.equal(logits.grad, ref_in.grad)
