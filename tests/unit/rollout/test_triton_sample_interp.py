"""rollout/triton_sample.py under Triton's interpreter (TRITON_INTERPRET=1): the fused
decode sampler against the reference sampler (`sampling.sample` with
`sampling.exponential_noise`), on CPU.

What must be exact: greedy tokens (comparisons only), the tie and NaN rules (lowest id,
a NaN wins, as torch.argmax), and a row's results whatever else is in the batch. What is
within rounding: the logprobs (the kernels sum Z in their own order; NumPy's exp/log
stand in for libdevice's here); sampled tokens equal the reference's on these seeded
inputs (they could differ only where two race scores lie within that rounding).

Skipped without triton (CI) and on CUDA machines (tests/gpu/test_triton_sample_gpu.py
runs the compiled kernels against torch's CUDA ops).
"""

import pytest
import torch

from rollout_testutil import triton_interpreter  # noqa: E402

pytestmark = triton_interpreter()

from megatron_tlt.rollout.sampling import exponential_noise, sample  # noqa: E402
from megatron_tlt.rollout.triton_sample import _CHUNK, sample_fused  # noqa: E402


def _inputs(b, v, seed, greedy_every=3):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, v, generator=g) * 3
    temps = torch.rand(b, generator=g) + 0.3
    temps[::greedy_every] = 0.0
    keys = torch.randint(-(1 << 62), 1 << 62, (b,), generator=g)
    draws = torch.randint(0, 1 << 20, (b,), generator=g)
    return logits, temps, keys, draws


def _reference(logits, temps, keys, draws):
    return sample(logits, temps, None, None, exponential_noise(keys, draws, logits.shape[1], "cpu"))


@pytest.mark.parametrize("b,v", [(5, 300), (4, 3 * _CHUNK + 7), (3, 151936)])
def test_fused_sampler_equals_the_reference(b, v):
    logits, temps, keys, draws = _inputs(b, v, seed=b * 1000 + v)
    tok, lp, plp = sample_fused(logits, temps, keys, draws)
    ref = _reference(logits, temps, keys, draws)
    assert torch.equal(tok, ref.token_ids)
    torch.testing.assert_close(lp, ref.logprobs, rtol=1e-5, atol=2e-5)
    greedy = temps <= 0
    assert torch.equal(plp[greedy], torch.zeros(int(greedy.sum())))
    assert torch.equal(plp[~greedy], lp[~greedy])
    # negative control: another draw of the same streams samples other tokens
    tok2, _, _ = sample_fused(logits, temps, keys, draws + 1)
    assert torch.equal(tok2[greedy], tok[greedy])
    assert not torch.equal(tok2[~greedy], tok[~greedy])


def test_many_draws_equal_the_reference_sampler():
    """2,000 sampled rows over a 16-token vocabulary: every token the reference sampler's
    (which tests/unit/spec proves exact in distribution), so the fused one samples the
    same distribution draw for draw."""
    b, v = 2000, 16
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(1, v, generator=g) * 2).expand(b, v).contiguous()
    temps = torch.full((b,), 0.9)
    keys = torch.full((b,), 12345, dtype=torch.int64)
    draws = torch.arange(b, dtype=torch.int64)
    tok, _, _ = sample_fused(logits, temps, keys, draws)
    ref = _reference(logits, temps, keys, draws)
    assert torch.equal(tok, ref.token_ids)
    assert len(set(tok.tolist())) > 8  # a draw per row, not one draw for all


def test_a_row_does_not_depend_on_the_batch():
    logits, temps, keys, draws = _inputs(6, 2 * _CHUNK + 100, seed=3)
    full = sample_fused(logits, temps, keys, draws)
    for i in range(6):
        one = sample_fused(logits[i:i + 1], temps[i:i + 1], keys[i:i + 1], draws[i:i + 1])
        for a, r in zip(full, one):
            assert torch.equal(a[i:i + 1], r), i
    # a strided view of the rows (the decode runner's padded logits buffer) reads the same
    wide = torch.zeros(6, 2 * _CHUNK + 300)
    wide[:, :logits.shape[1]] = logits
    view = wide[:, :logits.shape[1]]
    for a, r in zip(full, sample_fused(view, temps, keys, draws)):
        assert torch.equal(a, r)


def test_ties_nan_and_degenerate_rows_follow_torch_argmax():
    v = 3 * _CHUNK + 11
    rows = torch.randn(8, v, generator=torch.Generator().manual_seed(1))
    rows[0, [_CHUNK + 5, 17, 17 + 1024, 2 * _CHUNK + 3]] = 50.0  # greedy ties in a lane, across parts: lowest id
    rows[1, [2 * _CHUNK + 9, _CHUNK + 1]] = float("nan")  # greedy with NaNs: the first NaN
    rows[2] = float("-inf")  # greedy, nothing finite: id 0
    rows[3] = float("-inf")  # sampled, nothing finite: id 0, NaN logprob (log_softmax's)
    rows[4] = float("-inf")
    rows[4, 2 * _CHUNK + 1] = 0.0  # sampled one-hot: that id, logprob 0
    rows[5, 3 * _CHUNK + 2] = float("inf")  # sampled with +inf: NaN distribution -> id 0
    rows[6, _CHUNK - 1] = 40.0  # greedy, max at a part's last column
    rows[7, 0] = float("nan")  # sampled with a NaN: id 0
    temps = torch.tensor([0.0, 0.0, 0.0, 0.7, 0.7, 1.0, 0.0, 1.3])
    keys = torch.arange(8, dtype=torch.int64) * 977
    draws = torch.arange(8, dtype=torch.int64)
    tok, lp, plp = sample_fused(rows, temps, keys, draws)
    ref = _reference(rows, temps, keys, draws)
    assert tok.tolist() == [17, _CHUNK + 1, 0, 0, 2 * _CHUNK + 1, 0, _CHUNK - 1, 0]
    assert torch.equal(tok, ref.token_ids)
    assert torch.equal(lp.isnan(), ref.logprobs.isnan())
    assert lp[4].item() == 0.0 and plp[4].item() == 0.0
    finite = ~ref.logprobs.isnan()
    torch.testing.assert_close(lp[finite], ref.logprobs[finite], rtol=1e-5, atol=2e-5)


def test_rejects_bad_inputs():
    x = torch.zeros(2, 10)
    t = torch.ones(2)
    k = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="float32"):
        sample_fused(x.double(), t, k, k)
    with pytest.raises(ValueError, match="contiguous"):
        sample_fused(torch.zeros(10, 2).t(), t, k, k)
    with pytest.raises(ValueError, match="temperature"):
        sample_fused(x, t.double(), k, k)
    with pytest.raises(ValueError, match="draws"):
        sample_fused(x, t, k, k[:1])
    out = sample_fused(torch.zeros(0, 10), torch.ones(0), k[:0], k[:0])
    assert all(o.shape == (0,) for o in out)
