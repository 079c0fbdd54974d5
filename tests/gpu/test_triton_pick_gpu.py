"""The one-kernel sampled chain pick (spec/triton_pick.py) compiled on CUDA (skipped
without a GPU): against its torch reference on the device (the same Exp(1) noise bits,
q within float32 rounding, the same tokens except at near-ties of the race, which the
test bounds), its draws against the q it writes (chi-square with a negative control),
and the drafting paths that take it: the chain graphs replay exactly what the eager
chain drafts (tests/gpu/test_eagle_graph_gpu.py covers that path end to end). The greedy
pick of argmax chains: the lowest maximal id, non-finite rows flagged."""

import pytest
import torch

pytest.importorskip("triton")

from scipy.stats import chisquare  # noqa: E402

from megatron_tlt.spec.triton_pick import chain_pick, chain_pick_reference, greedy_pick  # noqa: E402

pytestmark = pytest.mark.gpu


def _pick(lg, temp, keys, draws, off, ids, vocab, ok=None):
    b = lg.shape[0]
    probs = torch.zeros(b, vocab, device=lg.device)
    out = torch.full((2, b), -7, dtype=torch.int64, device=lg.device)
    chain_pick(lg, temp, keys, draws, off, ids, probs, out[0], out[1], ok)
    return out[0], out[1], probs


@pytest.mark.parametrize("b", [1, 7, 64])
@pytest.mark.parametrize("v, vocab, reduced", [(1, 1, False), (128, 151936, True), (4096, 4096, False),
                                               (32768, 151936, True)])
def test_pick_matches_reference_on_the_device(b, v, vocab, reduced):
    g = torch.Generator(device="cuda").manual_seed(b * 7 + v)
    ids = (torch.randperm(vocab, device="cuda", generator=g)[:v].sort().values if reduced else None)
    lg = torch.randn(b, v, device="cuda", generator=g) * 2
    temp = torch.rand(b, device="cuda", generator=g) + 0.3
    keys = torch.randint(-(1 << 62), 1 << 62, (b,), device="cuda", generator=g)
    draws = torch.randint(0, 1 << 20, (b,), device="cuda", generator=g)
    tok, flag, probs = _pick(lg, temp, keys, draws, 2, ids, vocab)
    rtok, rflag, rprobs = chain_pick_reference(lg, temp, keys, draws, 2, ids, vocab)
    assert torch.equal(flag, rflag.long())
    torch.testing.assert_close(probs, rprobs, rtol=1e-5, atol=1e-9)
    assert torch.equal(probs == 0, rprobs == 0)
    assert int(tok.min()) >= 0 and int(tok.max()) < vocab
    differ = (tok != rtok).nonzero().flatten().tolist()
    if differ:  # only where the reference's two best race scores nearly tie
        from megatron_tlt.rollout.sampling import exponential_noise
        q = torch.softmax(lg / temp[:, None], -1)
        score = q / exponential_noise(keys, draws + 2, v, "cuda")
        top2 = score.topk(2, dim=-1).values
        for r in differ:
            assert float(top2[r, 0] - top2[r, 1]) <= 1e-5 * float(top2[r, 0]), r
    assert len(differ) <= max(1, b // 16)


def test_pick_draws_follow_the_written_distribution_on_the_device():
    """200000 rows of one logit vector (own noise keys): histogram vs the written q
    (chi-square p > 1e-4) and vs q at temperature 1.8 (negative control: p < 1e-4;
    TV 0.17, far beyond what 200000 draws resolve)."""
    n = 200000
    lg = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]], device="cuda").repeat(n, 1)
    temp = torch.full((n,), 0.9, device="cuda")
    keys = torch.arange(n, dtype=torch.int64, device="cuda") * 7919 + 11
    draws = torch.zeros(n, dtype=torch.int64, device="cuda")
    tok, flag, probs = _pick(lg, temp, keys, draws, 0, None, 8)
    assert bool(flag.all())
    counts = torch.bincount(tok, minlength=8).double().cpu()
    q = probs[0].double().cpu()
    q = q / q.sum()
    assert chisquare(counts.numpy(), (q * n).numpy()).pvalue > 1e-4
    q_hot = torch.softmax(lg[0].double().cpu() / 1.8, -1)
    q_hot = q_hot / q_hot.sum()
    assert chisquare(counts.numpy(), (q_hot * n).numpy()).pvalue < 1e-4


def test_pick_flags_non_finite_rows_on_the_device():
    lg = torch.randn(4, 33, device="cuda")
    lg[1, 4] = float("nan")
    lg[2, 0] = float("-inf")
    ok = torch.tensor([True, True, True, False], device="cuda")
    tok, flag, _ = _pick(lg, torch.ones(4, device="cuda"), torch.arange(4, device="cuda"),
                         torch.zeros(4, dtype=torch.int64, device="cuda"), 0, None, 33, ok)
    assert flag.tolist() == [1, 0, 0, 0]
    assert int(tok.min()) >= 0 and int(tok.max()) < 33


@pytest.mark.parametrize("b", [1, 7, 64])
@pytest.mark.parametrize("v, reduced", [(128, True), (4096, False), (151936, False)])
def test_greedy_pick_is_the_lowest_argmax_on_the_device(b, v, reduced):
    vocab = 151936
    ids = (torch.randperm(vocab, device="cuda")[:v].sort().values if reduced else None)
    lg = torch.randn(b, v, device="cuda") * 3
    lg[0, [1, v - 1]] = 50.0  # a tie (across blocks for v > 1024): 1 wins
    if b > 1:
        lg[1, 4] = float("nan")
    out = torch.full((2, b), -7, dtype=torch.int64, device="cuda")
    greedy_pick(lg, ids, out[0], out[1])
    want = torch.where(lg.isnan(), float("-inf"), lg).argmax(-1)
    if ids is not None:
        want = ids[want]
    assert torch.equal(out[0], want)
    assert out[1].tolist() == [1] + [0] * (b > 1) + [1] * max(0, b - 2)
