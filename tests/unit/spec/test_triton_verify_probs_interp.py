"""spec/triton_verify_probs.py under Triton's interpreter (TRITON_INTERPRET=1): the split
softmax kernels against their torch reference and torch.softmax, the logprobs gathered
from their row statistics against log_softmax, non-finite rows, the part split, and
VerifyMath's sampled fast path with the kernels (forced on CPU) against the torch ops:
the same accepted paths and tokens, logprobs within float32 rounding. Negative controls:
a temperature applied to the wrong sequence, and the part statistics combined without
rescaling to the row's max, are detected.

Skipped without triton (CI) and on CUDA machines (tests/gpu covers the compiled kernels).
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from spec_testutil import one_thread  # noqa: E402,F401  (puts rollout_testutil on the path)
from rollout_testutil import triton_interpreter  # noqa: E402

pytestmark = triton_interpreter()

import test_verify_fast as vf  # noqa: E402

from megatron_tlt.spec import triton_verify_probs as tvp  # noqa: E402
from megatron_tlt.spec.verify_math import VerifyMath  # noqa: E402


def _case(b, q, v, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, q, v, generator=g) * 4, torch.rand(b, generator=g) * 1.5 + 0.2


@pytest.mark.parametrize("b, q, v", [(1, 1, 1), (2, 3, 7), (4, 5, 1000), (3, 2, 4099), (1, 3, 151936)])
def test_probs_match_reference_and_softmax(b, q, v):
    x, t = _case(b, q, v, seed=v)
    probs, m, lz = tvp.verify_probs(x, t)
    rp, rm, rlz = tvp.verify_probs_reference(x, t)
    assert torch.equal(m, rm)  # a max is exact whatever the order
    torch.testing.assert_close(lz, rlz, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(probs, rp, rtol=2e-5, atol=1e-10)
    torch.testing.assert_close(probs, torch.softmax(x / t[:, None, None], -1), rtol=2e-5, atol=1e-10)
    torch.testing.assert_close(probs.double().sum(-1), torch.ones(b, q, dtype=torch.float64), rtol=0, atol=1e-5)
    # logprobs of some tokens from the statistics == log_softmax there
    g = torch.Generator().manual_seed(1)
    rows = torch.arange(b)[:, None].expand(b, q)
    node = torch.randint(0, q, (b, q), generator=g)
    tok = torch.randint(0, v, (b, q), generator=g)
    lp = tvp.token_logprobs(x, t, m, lz, rows, node, tok)
    want = torch.log_softmax(x / t[:, None, None], -1)[rows, node, tok]
    torch.testing.assert_close(lp, want, rtol=1e-6, atol=2e-6)


def test_strided_rows_and_rejected_layouts():
    """A [B, Q, V] view of a larger buffer (the decode runner's static logits, read in
    place) is read where it is; other layouts and dtypes are refused."""
    x, t = _case(2, 3, 300, seed=3)
    big = torch.zeros(8, 300)
    big[:6] = x.view(6, 300)
    view = big.as_strided((2, 3, 300), (900, 300, 1))
    assert torch.equal(tvp.verify_probs(view, t)[0], tvp.verify_probs(x.clone(), t)[0])
    # size-1 dimensions with any stride (what contiguous() leaves of a slice of one)
    one = big.as_strided((1, 2, 300), (7777, 300, 1))
    assert torch.equal(tvp.verify_probs(one, t[:1])[0], tvp.verify_probs(x[:1, :2].clone(), t[:1])[0])
    col = big.as_strided((2, 1, 300), (900, 5, 1))
    assert torch.equal(tvp.verify_probs(col, t)[0][:, 0], tvp.verify_probs(x[:, :1].clone(), t)[0][:, 0])
    with pytest.raises(ValueError, match="float32"):
        tvp.verify_probs(x.double(), t)
    with pytest.raises(ValueError, match="stride"):
        tvp.verify_probs(x.transpose(0, 1), t)
    with pytest.raises(ValueError, match="temperature"):
        tvp.verify_probs(x, t[:1])


def test_non_finite_rows():
    """-inf entries (a banned id) get probability 0 and the rest a distribution; a NaN
    or an all -inf row gives NaN probabilities in that row only (softmax's behaviour)."""
    x, t = _case(1, 4, 2500, seed=5)
    x[0, 0, 17] = float("-inf")
    x[0, 1, 2000] = float("nan")
    x[0, 2] = float("-inf")
    probs, m, lz = tvp.verify_probs(x, t)
    assert float(probs[0, 0, 17]) == 0.0
    torch.testing.assert_close(probs[0, 0].double().sum(), torch.tensor(1.0, dtype=torch.float64), atol=1e-5, rtol=0)
    assert bool(probs[0, 1].isnan().all()) and bool(probs[0, 2].isnan().all())
    ref = torch.softmax(x / t[:, None, None], -1)
    torch.testing.assert_close(probs[0, 3], ref[0, 3], rtol=2e-5, atol=1e-10)
    assert bool(ref[0, 1].isnan().all()) and bool(ref[0, 2].isnan().all())


@pytest.mark.parametrize("rows, v", [(1, 1), (1, 1024), (1, 1025), (7, 151936), (160, 151936), (512, 151936), (3, 50)])
def test_parts_cover_the_row(rows, v):
    parts, chunk = tvp._parts(rows, v)
    assert chunk % tvp._BLOCK == 0 and 1 <= parts <= tvp._MAX_PARTS
    assert (parts - 1) * chunk < v <= parts * chunk  # no empty part, the row covered


def test_negative_controls_are_detected():
    """The comparisons above catch a temperature applied to the wrong sequence and part
    statistics summed without rescaling to the row's max."""
    x, t = _case(2, 2, 4099, seed=9)
    probs = tvp.verify_probs(x, t)[0]
    wrong_t = tvp.verify_probs_reference(x, t.flip(0))[0]
    with pytest.raises(AssertionError):
        torch.testing.assert_close(probs, wrong_t, rtol=2e-5, atol=1e-10)
    # the parts' sums added as they are (each relative to its own max): not a distribution
    s = x / t[:, None, None]
    parts, chunk = tvp._parts(4, 4099)
    assert parts > 1
    pieces = s.split(chunk, -1)
    z_bad = sum(torch.exp(p - p.amax(-1, keepdim=True)).sum(-1) for p in pieces)
    bad = torch.exp(s - s.amax(-1, keepdim=True)) / z_bad[..., None]
    with pytest.raises(AssertionError):
        torch.testing.assert_close(probs, bad, rtol=2e-5, atol=1e-10)


@pytest.mark.parametrize("mode", ["sampled", "one_hot"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_fast_path_with_the_kernels_equals_torch_ops(mode, tree):
    """VerifyMath's sampled math with the kernels (forced on CPU) == with the torch ops in
    accepted paths and tokens over 12 steps on the same buffers (the probabilities differ
    by float32 roundings only: a decision could flip only on a coin within ~1e-7 of its
    threshold); logprobs and processed logprobs within 1e-5. Under a ban the kernels are
    not used (bit for bit the torch ops)."""
    vocab = 3001
    fused = VerifyMath("cpu", vocab, use_graphs=False, fused_probs=True)
    plain = VerifyMath("cpu", vocab, use_graphs=False, fused_probs=False)
    assert fused.fused_probs and not plain.fused_probs
    for step, batch in enumerate([3, 1, 6, 5, 8, 3, 2, 7, 3, 1, 4, 6]):
        seqs, trees, logits = vf.make_step(batch, vocab, mode, seed=100 + step, tree=tree)
        _, got, gidx = vf.fast_path(fused, vf.copy_seqs(seqs), trees, logits, vocab)
        _, want, gidx_w = vf.fast_path(plain, vf.copy_seqs(seqs), trees, logits, vocab)
        for k in ("accept_index", "accept_length", "tokens"):
            assert torch.equal(got[k], want[k]), (step, k)
        assert torch.equal(gidx, gidx_w)
        for k in ("logprobs", "processed_logprobs"):
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5)
    seqs, trees, logits = vf.make_step(4, vocab, "sampled", seed=7, min_new_tokens=8, max_new_tokens=20)
    plan, got, _ = vf.fast_path(fused, vf.copy_seqs(seqs), trees, logits, vocab)
    _, want, _ = vf.fast_path(plain, vf.copy_seqs(seqs), trees, logits, vocab)
    assert plan.ban > 0 and not vf.mismatches(want, got)


def test_default_is_off_on_cpu():
    assert not VerifyMath("cpu", 11, use_graphs=False).fused_probs
