"""spec/triton_pick.py under Triton's interpreter (TRITON_INTERPRET=1): the one-kernel
sampled chain pick against its torch reference (chain_pick_reference), its draws against
the distribution it writes (seeded chi-square with a negative control), non-finite rows,
and the drafting paths that take it (the static chain buffers and the eager chain, forced
onto the kernel on CPU) agreeing bit for bit.

Skipped without triton (CI) and on CUDA machines (tests/gpu covers the compiled kernel).
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from spec_testutil import one_thread, spec_models  # noqa: E402,F401  (puts rollout_testutil on the path)
from rollout_testutil import triton_interpreter  # noqa: E402

pytestmark = triton_interpreter()

from scipy.stats import chisquare  # noqa: E402

from megatron_tlt.spec.triton_pick import chain_pick, chain_pick_reference, greedy_pick  # noqa: E402


def _case(b, v, vocab, ids, seed):
    g = torch.Generator().manual_seed(seed)
    lg = torch.randn(b, v, generator=g) * 3
    temp = torch.rand(b, generator=g) * 1.5 + 0.2
    keys = torch.randint(-(1 << 62), 1 << 62, (b,), generator=g)
    draws = torch.randint(0, 1 << 20, (b,), generator=g)
    return lg, temp, keys, draws


def _pick(lg, temp, keys, draws, off, ids, vocab, ok=None):
    b = lg.shape[0]
    probs = torch.zeros(b, vocab)
    out = torch.full((2, b), -7, dtype=torch.int64)
    chain_pick(lg, temp, keys, draws, off, ids, probs, out[0], out[1], ok)
    return out[0], out[1], probs


@pytest.mark.parametrize("v, vocab, reduced", [(1, 1, False), (7, 7, False), (128, 3000, True), (1500, 1500, False)])
def test_pick_matches_reference(v, vocab, reduced):
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))[:v].sort().values if reduced else None
    lg, temp, keys, draws = _case(6, v, vocab, ids, seed=v)
    tok, flag, probs = _pick(lg, temp, keys, draws, 3, ids, vocab)
    rtok, rflag, rprobs = chain_pick_reference(lg, temp, keys, draws, 3, ids, vocab)
    assert torch.equal(flag, rflag.long())
    torch.testing.assert_close(probs, rprobs, rtol=2e-6, atol=1e-9)
    assert torch.equal(probs == 0, rprobs == 0)  # zero exactly outside the draft vocabulary
    assert torch.equal(tok, rtok)
    assert int(tok.min()) >= 0 and int(tok.max()) < vocab
    if v > 1:  # negative control: the draw number is part of the noise-stream position
        flat = lg[:1].repeat(64, 1) / 6
        k64 = torch.arange(64, dtype=torch.int64) * 104729
        t64, z64 = torch.ones(64), torch.zeros(64, dtype=torch.int64)
        a, _, _ = _pick(flat, t64, k64, z64, 0, ids, vocab)
        b, _, _ = _pick(flat, t64, k64, z64, 1, ids, vocab)
        assert torch.equal(a, chain_pick_reference(flat, t64, k64, z64, 0, ids, vocab)[0])
        assert not torch.equal(a, b)


def test_pick_non_finite_rows_and_ok_mask():
    lg, temp, keys, draws = _case(4, 33, 33, None, seed=5)
    lg[1, 4] = float("nan")
    lg[2, 0] = float("inf")
    ok = torch.tensor([True, True, True, False])
    tok, flag, _ = _pick(lg, temp, keys, draws, 0, None, 33, ok)
    assert flag.tolist() == [1, 0, 0, 0]
    assert int(tok.min()) >= 0 and int(tok.max()) < 33


@pytest.mark.parametrize("v, reduced", [(1, False), (33, False), (128, True), (2500, False)])
def test_greedy_pick_is_the_lowest_argmax(v, reduced):
    """greedy_pick: the argmax of the logits, lowest id on ties (ties placed within one
    block and across blocks of 1024), mapped to target ids; control: the highest-id
    argmax differs on the tie rows."""
    vocab = 3000
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(2))[:v].sort().values if reduced else None
    g = torch.Generator().manual_seed(v)
    lg = torch.randn(6, v, generator=g) * 3
    if v > 2:
        lg[1, [2, v - 1]] = 50.0  # a tie: 2 wins
        lg[2, [0, v // 2]] = 50.0
    if v > 2048:
        lg[3, [1500, 2400]] = 60.0  # a tie across blocks
    out = torch.full((2, 6), -7, dtype=torch.int64)
    greedy_pick(lg, ids, out[0], out[1])
    want = lg.argmax(-1)  # torch: the first maximal index
    m = lg.max(-1, keepdim=True).values
    last = (v - 1) - (lg == m).flip(-1).int().argmax(-1)
    if ids is not None:
        want, last = ids[want], ids[last]
    assert torch.equal(out[0], want) and bool(out[1].all())
    if v > 2:
        assert not torch.equal(out[0], last)  # control: the ties are real and resolved low


def test_greedy_pick_non_finite_rows_and_ok_mask():
    g = torch.Generator().manual_seed(9)
    lg = torch.randn(5, 40, generator=g)
    lg[1, 4] = float("nan")
    lg[2, 0] = float("inf")
    lg[3, :] = float("-inf")
    ok = torch.tensor([True, True, True, True, False])
    out = torch.full((2, 5), -7, dtype=torch.int64)
    greedy_pick(lg, None, out[0], out[1], ok)
    assert out[1].tolist() == [1, 0, 0, 0, 0]
    assert int(out[0].min()) >= 0 and int(out[0].max()) < 40
    assert int(out[0][2]) == 0 and int(out[0][3]) == 0 and int(out[0][0]) == int(lg[0].argmax())


def test_pick_draws_follow_the_written_distribution():
    """4000 rows of one logit vector, each its own noise key: the tokens' histogram
    against the q the kernel wrote (chi-square p > 1e-4; seeded, so the outcome is fixed),
    and against q at twice the temperature (the negative control, must fail: p < 1e-4).
    Power: the control's TV distance is 0.17; with 4000 draws over 8 cells the test
    rejects such a difference with probability > 0.999."""
    n, v = 4000, 8
    lg = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]]).repeat(n, 1)
    temp = torch.full((n,), 0.9)
    keys = torch.arange(n, dtype=torch.int64) * 7919 + 11
    draws = torch.zeros(n, dtype=torch.int64)
    tok, flag, probs = _pick(lg, temp, keys, draws, 0, None, v)
    assert bool(flag.all())
    counts = torch.bincount(tok, minlength=v).double()
    q = probs[0].double()
    q = q / q.sum()
    assert chisquare(counts.numpy(), (q * n).numpy()).pvalue > 1e-4
    q_hot = torch.softmax(lg[0].double() / 1.8, -1)
    q_hot = q_hot / q_hot.sum()
    assert chisquare(counts.numpy(), (q_hot * n).numpy()).pvalue < 1e-4
    assert 0.5 * float((q - q_hot).abs().sum()) > 0.15


def test_attend_one_paged_matches_slot_attention(monkeypatch):
    """SlotKV.attend_one on the paged kernel (each slot one page) against the masked
    attention over the whole slot: the same outputs within float32 rounding."""
    import megatron_tlt.spec.drafter_kv as drafter_kv
    g = torch.Generator().manual_seed(3)
    kv = drafter_kv.SlotKV(2, 16, torch.float32, "cpu", min_capacity=64)
    slots = [kv.acquire() for _ in range(5)]
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    q = torch.randn(4, 8, 16, generator=g)
    sl = torch.tensor([slots[3], slots[0], slots[4], slots[0]])
    last = torch.tensor([0, 17, 63, 40])
    ref = kv.attend_one(q, sl, last, 0.25)  # CPU: the torch path
    monkeypatch.setattr(drafter_kv, "paged_levels", lambda q: True)
    out = kv.attend_one(q, sl, last, 0.25)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(kv.attend_one(q, sl, last - 1, 0.25), ref)  # negative control


@pytest.fixture()
def kernel_on_cpu(monkeypatch):
    """fused_pick and the paged level attention without their CUDA condition: the CPU
    drafting paths take the kernels."""
    import megatron_tlt.spec.drafter_kv as drafter_kv
    import megatron_tlt.spec.eagle as eagle
    import megatron_tlt.spec.eagle_graph as eagle_graph
    monkeypatch.setattr(drafter_kv, "paged_levels", lambda q: True)

    def cpu_fused_pick(lg, top_ks, top_ps):
        v = lg.shape[-1]
        return all(k <= 0 or k >= v for k in top_ks) and all(p >= 1 for p in top_ps)
    monkeypatch.setattr(eagle, "fused_pick", cpu_fused_pick)
    monkeypatch.setattr(eagle_graph, "fused_pick", cpu_fused_pick)


@pytest.mark.parametrize("draft_vocab", [None, 48])
def test_static_and_eager_chains_agree_on_the_kernel(kernel_on_cpu, spec_models, draft_vocab):
    """The static chain buffers and the eager batched chain, both on the kernel, draft the
    same trees bit for bit (tokens, torch.equal draft distributions, noise positions); the
    distributions stay within float32 rounding of the torch-op path's."""
    from spec_testutil import make_engine, random_eagle
    from test_eagle_graph import _run
    d = random_eagle(make_engine(spec_models["qwen2"]), seed=4, draft_vocab=draft_vocab)
    temps, lengths, caps = [0.9] * 5, [3, 11, 6, 20, 8], [4, 2, 4, 3, 1]
    eager, draws_e, _ = _run(d, temps, lengths, caps, static=False)
    static, draws_s, n_s = _run(d, temps, lengths, caps, static=True)
    assert n_s == 6 and draws_s == draws_e  # every step static (the first caught up: _catch_up)
    for te, ts in zip(eager, static):
        for a, b in zip(te, ts):
            assert a[0] == b[0] and a[1] == b[1] and a[3] == b[3]
            assert torch.equal(a[2], b[2])
            assert abs(float(a[2][1:].sum(-1).sub(1).abs().max())) < 1e-5  # rows are distributions


@pytest.mark.parametrize("temperature, one_hot", [(0.0, False), (0.9, True)])
def test_static_and_eager_argmax_chains_agree_on_the_greedy_kernel(kernel_on_cpu, spec_models, monkeypatch,
                                                                     temperature, one_hot):
    """Argmax chains (greedy targets; sampled targets with one_hot_chains) on the greedy
    pick kernel: the static buffers and the eager chain draft the same tokens, and on
    these float32 logits the same as the torch ops' argmax of log_softmax; the kernel ran."""
    import megatron_tlt.spec.triton_pick as triton_pick
    from spec_testutil import make_engine, random_eagle
    from test_eagle_graph import _run
    calls = []
    kernel = triton_pick.greedy_pick
    monkeypatch.setattr(triton_pick, "greedy_pick", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    d = random_eagle(make_engine(spec_models["qwen2"]), seed=4, draft_vocab=48)
    temps, lengths, caps = [temperature] * 5, [3, 11, 6, 20, 8], [4, 2, 4, 3, 1]

    def prep(p):
        p.one_hot_chains = one_hot
    eager, draws_e, _ = _run(d, temps, lengths, caps, static=False, prepare=prep)
    n_eager = len(calls)
    static, draws_s, n_s = _run(d, temps, lengths, caps, static=True, prepare=prep)
    assert n_eager > 0 and len(calls) > n_eager and n_s == 6 and draws_s == draws_e
    assert [[(t[0], t[1], t[3]) for t in st] for st in static] == [[(t[0], t[1], t[3]) for t in st] for st in eager]
    monkeypatch.setattr(triton_pick, "greedy_pick", None)  # the torch ops now (fused_pick says no)
    monkeypatch.setattr("megatron_tlt.spec.eagle.fused_pick", lambda lg, ks, ps: False)
    torch_ops, _, _ = _run(d, temps, lengths, caps, static=False, prepare=prep)
    assert [[t[0] for t in st] for st in torch_ops] == [[t[0] for t in st] for st in eager]
