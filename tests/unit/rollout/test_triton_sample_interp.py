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


def _torch_advance(logits, meta, n, page):
    """bench.py's device loop step in torch ops (FUSED_ADVANCE off)."""
    from megatron_tlt.rollout import cuda_graphs as cg

    ids, pos, slot, ctx, tab = (meta[:n, cg._ID], meta[:n, cg._POS], meta[:n, cg._SLOT],
                                meta[:n, cg._CTX], meta[:n, cg._NCOL:])
    ids.copy_(torch.argmax(logits[:n], dim=-1))
    pos.add_(1)
    ctx.add_(1)
    p = pos.long()
    blk = tab.gather(1, (p // page)[:, None])[:, 0].long()
    slot.copy_(blk * page + p % page)


@pytest.mark.parametrize("v", [1, 7, 2048, 2049, 5000])
def test_greedy_advance_equals_the_torch_ops(v):
    """DecodeRunner.advance_greedy's kernel == the torch ops it replaces, every column of the
    input buffer, torch.equal: ties (lowest id, across the kernel's 2048-column parts), NaN
    rows (the first NaN, in the first or the last part), all -inf rows, rows past n
    untouched, positions crossing a block boundary; a second launch on the same work
    buffer (its tickets set back by the first) advances again."""
    from megatron_tlt.rollout import cuda_graphs as cg
    from megatron_tlt.rollout.triton_sample import greedy_advance, greedy_advance_work

    g = torch.Generator().manual_seed(v)
    n, bucket, page, width = 6, 8, 4, 5
    logits = torch.randn(bucket, v, generator=g)
    logits[1] = torch.randint(0, 3, (v,), generator=g).float()  # ties
    if v > 3:
        logits[2, [v // 3, 2, v - 1]] = float("nan")
    logits[3] = float("-inf")
    logits[4, -1] = 50.0  # the last column
    logits[5, -1] = float("nan")  # the only NaN, in the last part
    meta = torch.zeros(bucket, cg._NCOL + width, dtype=torch.int32)
    meta[:, cg._NCOL:] = torch.randperm(bucket * width, generator=g).view(bucket, width).int()
    positions = torch.tensor([0, 3, 7, 10, 14, 2, 5, 6], dtype=torch.int32)  # 3 -> 4, 7 -> 8: new blocks
    meta[:, cg._POS], meta[:, cg._CTX] = positions, positions + 1
    want = meta.clone()
    _torch_advance(logits, want, n, page)
    got = meta.clone()
    work = greedy_advance_work(bucket, v, "cpu")
    kw = dict(id_col=cg._ID, pos_col=cg._POS, slot_col=cg._SLOT, ctx_col=cg._CTX,
              table_col=cg._NCOL, work=work)
    greedy_advance(logits[:n], got, page, **kw)
    assert torch.equal(got, want), (got, want)
    assert torch.equal(got[n:], meta[n:])
    if v > 3:
        assert int(got[2, cg._ID]) == 2  # the first NaN
    assert int(got[3, cg._ID]) == 0  # all -inf: torch.argmax's 0
    assert int(got[5, cg._ID]) == v - 1
    assert not work[:, 0].any()  # the tickets are back at 0
    logits[0, 0] = 1e9
    _torch_advance(logits, want, n, page)
    greedy_advance(logits[:n], got, page, **kw)
    assert torch.equal(got, want) and int(got[0, cg._ID]) == 0


def test_greedy_advance_refuses_a_short_work_buffer():
    from megatron_tlt.rollout import cuda_graphs as cg
    from megatron_tlt.rollout.triton_sample import greedy_advance, greedy_advance_work

    meta = torch.zeros(2, cg._NCOL + 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="work must be"):
        greedy_advance(torch.zeros(2, 5000), meta, 4, id_col=cg._ID, pos_col=cg._POS,
                       slot_col=cg._SLOT, ctx_col=cg._CTX, table_col=cg._NCOL,
                       work=greedy_advance_work(2, 4000, "cpu"))


def test_greedy_advance_negative_control():
    """A different token in one row must show (the comparison above can fail)."""
    from megatron_tlt.rollout import cuda_graphs as cg
    from megatron_tlt.rollout.triton_sample import greedy_advance

    logits = torch.zeros(2, 10)
    logits[0, 3], logits[1, 5] = 1.0, 1.0
    meta = torch.zeros(2, cg._NCOL + 2, dtype=torch.int32)
    want = meta.clone()
    _torch_advance(logits, want, 2, 4)
    logits[1, 6] = 2.0
    got = meta.clone()
    greedy_advance(logits, got, 4, id_col=cg._ID, pos_col=cg._POS, slot_col=cg._SLOT,
                   ctx_col=cg._CTX, table_col=cg._NCOL)
    assert not torch.equal(got, want) and int(got[1, cg._ID]) == 6
