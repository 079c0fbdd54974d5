"""The sampled verification's target probabilities in two Triton kernels
(spec/triton_verify_probs.py) compiled on CUDA (skipped without a GPU): against their torch
reference and torch.softmax on the device at the benchmark's shapes (151,936 vocabulary),
the logprobs gathered from their row statistics against log_softmax, NaN rows, and
VerifyMath's fast path with them (the CUDA default) against the torch ops (the same
accepted paths and tokens, graphs == eager bit for bit, logprobs within 1e-5), with a
negative control. Their draws are the rejection sampler's: the lossless tests of the
sampler hold for any valid distribution it is given."""

import os
import sys

import pytest
import torch

pytest.importorskip("triton")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "unit"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "unit", "spec"))

import test_verify_fast as vf  # noqa: E402

from megatron_tlt.spec import triton_verify_probs as tvp  # noqa: E402
from megatron_tlt.spec.tree import DraftTree  # noqa: E402
from megatron_tlt.spec.verify_math import VerifyMath  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("b, q, v", [(1, 1, 1), (1, 7, 151936), (32, 5, 151936), (64, 8, 151936), (5, 3, 4099)])
def test_probs_match_softmax_on_the_device(b, q, v):
    g = torch.Generator(device="cuda").manual_seed(b * 131 + q)
    x = torch.randn(b, q, v, device="cuda", generator=g) * 4
    t = torch.rand(b, device="cuda", generator=g) * 1.5 + 0.2
    probs, m, lz = tvp.verify_probs(x, t)
    rp, rm, rlz = tvp.verify_probs_reference(x, t)
    assert torch.equal(m, rm)
    torch.testing.assert_close(lz, rlz, rtol=1e-6, atol=2e-6)
    torch.testing.assert_close(probs, rp, rtol=2e-5, atol=1e-10)
    soft = torch.softmax(x / t[:, None, None], -1)
    torch.testing.assert_close(probs, soft, rtol=2e-5, atol=1e-10)
    # negative control: another sequence's temperature is out of these tolerances
    if b > 1 and v > 1:
        with pytest.raises(AssertionError):
            torch.testing.assert_close(probs, tvp.verify_probs_reference(x, t.roll(1))[0], rtol=2e-5, atol=1e-10)
    rows = torch.arange(b, device="cuda")[:, None].expand(b, q)
    node = torch.randint(0, q, (b, q), device="cuda", generator=g)
    tok = torch.randint(0, v, (b, q), device="cuda", generator=g)
    lp = tvp.token_logprobs(x, t, m, lz, rows, node, tok)
    want = torch.log_softmax(x / t[:, None, None], -1)[rows, node, tok]
    torch.testing.assert_close(lp, want, rtol=1e-6, atol=4e-6)
    # the same call twice: the same bits (no atomics, a fixed split)
    assert torch.equal(tvp.verify_probs(x, t)[0], probs)


def test_nan_rows_on_the_device():
    x = torch.randn(2, 3, 151936, device="cuda")
    x[0, 1, 99999] = float("nan")
    x[1, 2, 5] = float("inf")
    probs = tvp.verify_probs(x, torch.ones(2, device="cuda"))[0]
    bad = probs.isnan().all(-1)
    assert bad.tolist() == [[False, True, False], [False, False, True]]
    assert not bool(probs[~bad].isnan().any())


def _to_cuda(trees):
    return [DraftTree(t.tokens, t.parents, None if t.draft_probs is None else t.draft_probs.cuda())
            for t in trees]


@pytest.mark.parametrize("mode", ["sampled", "one_hot"])
def test_fast_path_with_the_kernels_on_the_device(mode):
    """VerifyMath on CUDA takes the kernels by default (graphs and eager, bit for bit the
    same); against the torch ops (fused_probs=False): the same accepted paths and tokens
    over 40 steps, logprobs within 1e-5."""
    vocab = 151936
    graph = VerifyMath("cuda", vocab, use_graphs=True, impl="kernel")
    eager = VerifyMath("cuda", vocab, use_graphs=False, impl="kernel")
    torch_ops = VerifyMath("cuda", vocab, use_graphs=True, impl="kernel", fused_probs=False)
    assert graph.fused_probs and eager.fused_probs and not torch_ops.fused_probs
    accepted = 0
    for step in range(40):
        batch = [1, 3, 8, 32, 5][step % 5]
        seqs, trees, logits = vf.make_step(batch, vocab, mode, seed=300 + step, depth=4)
        trees, logits = _to_cuda(trees), logits.cuda()
        out = [vf.fast_path(m, vf.copy_seqs(seqs), trees, logits, vocab)[1] for m in (graph, eager, torch_ops)]
        for k in out[0]:
            assert torch.equal(out[0][k], out[1][k]), (step, k)
        for k in ("accept_index", "accept_length", "tokens"):
            assert torch.equal(out[0][k], out[2][k]), (step, k)
        for k in ("logprobs", "processed_logprobs"):
            torch.testing.assert_close(out[0][k], out[2][k], rtol=0, atol=1e-5)
        accepted += int(out[0]["accept_length"].sum())
    assert accepted > 0 and graph.num_captures > 0 and graph.num_replays == graph.num_steps


def _compiled(fn) -> int:
    """Binaries Triton holds for a jitted function (its per-device caches)."""
    caches = getattr(fn, "device_caches", None)
    if not isinstance(caches, dict):
        pytest.skip("this Triton keeps its kernel cache elsewhere")
    return sum(len(c[0]) for c in caches.values())


def test_one_binary_for_every_batch_shape():
    """The split and Q change with the rows; none of them is a specialisation, so a batch
    shape first seen inside a timed run compiles nothing (a compile costs ~1 s)."""
    x = torch.randn(64, 8, 151936, device="cuda")
    t = torch.full((64,), 0.9, device="cuda")
    tvp.verify_probs(x[:1, :2].contiguous(), t[:1])
    base = (_compiled(tvp._part_stats_kernel), _compiled(tvp._probs_kernel))
    for b, q in ((1, 7), (3, 5), (32, 5), (64, 8), (2, 3)):
        tvp.verify_probs(x[:b, :q].contiguous(), t[:b])
    assert (_compiled(tvp._part_stats_kernel), _compiled(tvp._probs_kernel)) == base
