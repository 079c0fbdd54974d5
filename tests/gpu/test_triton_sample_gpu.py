"""The fused decode sampler (rollout/triton_sample.py) compiled on CUDA (skipped without a
GPU): against the reference sampler's torch ops on the device with the same noise
(greedy tokens exactly, sampled tokens equal on these seeded inputs, logprobs within
float32 rounding), a row's results independent of the batch (torch.equal), the dispatch
of `sampling.sample_streams` (rows with top-k / top-p / a ban through the torch ops bit
for bit, the others through the kernels bit for bit; the kill switch), and its draws
against the softmax they sample (chi-square, with a negative control that must fail)."""

import pytest
import torch

pytest.importorskip("triton")

from scipy.stats import chisquare  # noqa: E402

from megatron_tlt.rollout.sampling import exponential_noise, sample, sample_streams  # noqa: E402
from megatron_tlt.rollout.triton_sample import sample_fused  # noqa: E402

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def _inputs(b, v, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(b, v, device=CUDA, generator=g) * 3
    temps = torch.rand(b, device=CUDA, generator=g) + 0.3
    temps[::4] = 0.0
    keys = torch.randint(-(1 << 62), 1 << 62, (b,), device=CUDA, generator=g)
    draws = torch.randint(0, 1 << 20, (b,), device=CUDA, generator=g)
    return logits, temps, keys, draws


@pytest.mark.parametrize("b,v", [(1, 151936), (7, 32000), (64, 151936), (3, 100)])
def test_fused_sampler_matches_torch_on_the_device(b, v):
    logits, temps, keys, draws = _inputs(b, v, seed=b + v)
    tok, lp, plp = sample_fused(logits, temps, keys, draws)
    ref = sample(logits, temps, None, None, exponential_noise(keys, draws, v, CUDA))
    greedy = temps <= 0
    assert torch.equal(tok[greedy], ref.token_ids[greedy])
    assert torch.equal(tok, ref.token_ids)
    torch.testing.assert_close(lp, ref.logprobs, rtol=2e-6, atol=2e-6)
    assert torch.equal(plp[greedy], torch.zeros_like(plp[greedy]))
    assert torch.equal(plp[~greedy], lp[~greedy])
    assert bool(((tok >= 0) & (tok < v)).all())
    tok2, _, _ = sample_fused(logits, temps, keys, draws + 1)  # negative control
    assert not torch.equal(tok2[~greedy], tok[~greedy]) or int((~greedy).sum()) == 0


def test_rows_do_not_depend_on_the_batch():
    logits, temps, keys, draws = _inputs(32, 151936, seed=5)
    full = sample_fused(logits, temps, keys, draws)
    for i in (0, 1, 13, 31):
        one = sample_fused(logits[i:i + 1], temps[i:i + 1], keys[i:i + 1], draws[i:i + 1])
        for a, r in zip(full, one):
            assert torch.equal(a[i:i + 1], r), i


def test_sample_streams_routes_filtered_rows_through_torch(monkeypatch):
    b, v = 8, 151936
    logits, temps, keys, draws = _inputs(b, v, seed=11)
    top_k = torch.tensor([0, 50, 0, 0, 0, 0, 0, -1], device=CUDA)
    top_p = torch.tensor([1.0, 1.0, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0], device=CUDA)
    banned = torch.zeros(b, v, dtype=torch.bool, device=CUDA)
    banned[3, [7, 9]] = True
    filt = torch.tensor([False, True, True, True, False, False, False, False], device=CUDA)
    out = sample_streams(logits, temps, keys, draws, top_k=top_k, top_p=top_p, banned=banned)
    ref = sample(logits, temps, top_k, top_p, exponential_noise(keys, draws, v, CUDA), banned)
    fused = sample_fused(logits, temps, keys, draws)
    for o, r, f in zip((out.token_ids, out.logprobs, out.processed_logprobs),
                       (ref.token_ids, ref.logprobs, ref.processed_logprobs), fused):
        assert torch.equal(o[filt], r[filt])
        assert torch.equal(o[~filt], f[~filt])
    plain = sample_streams(logits, temps, keys, draws)
    assert torch.equal(plain.token_ids, fused[0]) and torch.equal(plain.logprobs, fused[1])
    monkeypatch.setenv("MEGATRON_TLT_FUSED_SAMPLE", "0")  # the kill switch: torch ops throughout
    off = sample_streams(logits, temps, keys, draws)
    ref = sample(logits, temps, None, None, exponential_noise(keys, draws, v, CUDA))
    assert torch.equal(off.token_ids, ref.token_ids) and torch.equal(off.logprobs, ref.logprobs)


def test_draws_follow_the_softmax():
    """200,000 draws at T = 0.8 over 16 tokens (one row per draw, one stream): chi-square
    p > 1e-4 and total variation < 0.01 against softmax(x / 0.8); the same draws against
    softmax(x / 1.0) (a wrong temperature) must fail (p < 1e-4). Power: at this N the
    statistic's noise is ~sqrt(2 * 15); the temperature error shifts it by far more."""
    n, v = 200_000, 16
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(v, device=CUDA, generator=g) * 1.5
    logits = x.expand(n, v).contiguous()
    keys = torch.full((n,), 99, dtype=torch.int64, device=CUDA)
    draws = torch.arange(n, dtype=torch.int64, device=CUDA)
    tok, _, _ = sample_fused(logits, torch.full((n,), 0.8, device=CUDA), keys, draws)
    counts = torch.bincount(tok, minlength=v).double().cpu()
    p = torch.softmax(x.double() / 0.8, -1).cpu()
    assert chisquare(counts.numpy(), (p * n).numpy()).pvalue > 1e-4
    assert 0.5 * (counts / n - p).abs().sum().item() < 0.01
    wrong = torch.softmax(x.double() / 1.0, -1).cpu()
    assert chisquare(counts.numpy(), (wrong * n).numpy()).pvalue < 1e-4


@pytest.mark.parametrize("n,v", [(1, 151936), (8, 151936), (5, 32001)])
def test_greedy_advance_equals_the_torch_ops_on_the_device(n, v):
    """triton_sample.greedy_advance (bench.FUSED_ADVANCE's kernel) == the torch ops it
    replaces, the whole input buffer torch.equal: ties, a NaN row, an all -inf row,
    positions crossing a block boundary; a changed logit changes a token (negative control)."""
    from megatron_tlt.rollout import cuda_graphs as cg
    from megatron_tlt.rollout.triton_sample import greedy_advance, greedy_advance_work

    g = torch.Generator(device="cuda").manual_seed(n + v)
    page, width = 16, 12
    logits = torch.randn(n, v, device=CUDA, generator=g)
    if n > 1:
        logits[1] = torch.randint(0, 3, (v,), device=CUDA, generator=g).float()
    if n > 2:
        logits[2, [v // 3, 5, v - 1]] = float("nan")
    if n > 3:
        logits[3] = float("-inf")
    meta = torch.zeros(n, cg._NCOL + width, dtype=torch.int32, device=CUDA)
    meta[:, cg._NCOL:] = torch.randperm(n * width, device=CUDA, generator=g).view(n, width).int()
    pos = torch.arange(n, dtype=torch.int32, device=CUDA) * 13 + 15  # 15 -> 16: a new block
    meta[:, cg._POS], meta[:, cg._CTX] = pos, pos + 1

    def reference(m):
        m = m.clone()
        m[:, cg._ID].copy_(torch.argmax(logits, dim=-1))
        m[:, cg._POS].add_(1)
        m[:, cg._CTX].add_(1)
        p = m[:, cg._POS].long()
        blk = m[:, cg._NCOL:].gather(1, (p // page)[:, None])[:, 0].long()
        m[:, cg._SLOT].copy_(blk * page + p % page)
        return m

    want = reference(meta)
    got = meta.clone()
    work = greedy_advance_work(n, v, CUDA)  # shared by both launches: its tickets reset
    kw = dict(id_col=cg._ID, pos_col=cg._POS, slot_col=cg._SLOT, ctx_col=cg._CTX,
              table_col=cg._NCOL, work=work)
    greedy_advance(logits, got, page, **kw)
    assert torch.equal(got, want)
    assert not work[:, 0].any()
    logits[0, (int(want[0, cg._ID]) + 1) % v] = 1e9
    again = meta.clone()
    greedy_advance(logits, again, page, **kw)
    assert not torch.equal(again, want)
