"""The EAGLE drafter's layer through the decode model's Triton kernels (spec/drafter_kernels.py)
under Triton's interpreter (float32, CPU; skipped without triton, i.e. in CI; the compiled
kernels and bf16 run in tests/gpu/test_eagle_graph_gpu.py):

- one forward == the torch path (layer_qkv, SlotKV.write, attention, layer_out, logits)
  within float32 rounding, K/V written at the same slots and nothing else touched, for
  every family (Qwen2 biases, Llama, Qwen3 q/k norm), a reduced draft vocabulary, split-K
  planes and SiLU * up in the down projection's prologue; a control (two rows' slots
  swapped) does not match;
- the static-buffer chains equal the eager chains bit for bit on the kernel path (the
  graphs' padded buckets and the eager path's live rows compute the same bits);
- whole generate calls: greedy speculative decoding with the kernel path gives the
  tokens of plain decoding, sampled runs give the same tokens and logprobs on the static
  and eager paths, and a non-finite drafter falls back at every step without changing
  the output."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from spec_testutil import (VOCAB, make_engine, one_thread, random_eagle, requests, run,  # noqa: E402,F401
                           spec_models, tokens)
from rollout_testutil import triton_interpreter  # noqa: E402

pytestmark = triton_interpreter()

from megatron_tlt.rollout.triton_linear import CUBLAS, LinearConfig, LinearPlanner  # noqa: E402
from megatron_tlt.spec import drafter_kernels  # noqa: E402
from megatron_tlt.spec.drafter_kv import SlotKV  # noqa: E402
from megatron_tlt.spec.eagle import EagleProposer  # noqa: E402
from megatron_tlt.spec.tree import Strategy  # noqa: E402
from test_eagle_graph import _run as draft_steps  # noqa: E402

SPLIT = LinearConfig("dot", block_m=16, block_n=16, block_k=32, splits=2)


def _planner(kind: str) -> LinearPlanner:
    if kind == "cublas":
        return LinearPlanner(fixed=CUBLAS)
    return LinearPlanner(fixed=SPLIT, fixed_fused=True)  # split planes; SiLU in down's prologue


@pytest.fixture(scope="module")
def engines(spec_models):
    return {k: make_engine(v) for k, v in spec_models.items()}


def _kernel_drafter(engine, *, seed=3, draft_vocab=None, planner="split"):
    """A random drafter on the kernel path, its biases and norm weights random too
    (random_eagle leaves them 0 and 1, where a dropped bias or a swapped norm would pass)."""
    d = random_eagle(engine, seed=seed, draft_vocab=draft_vocab)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
    d.kernel_layers = True
    d.planner = _planner(planner)
    return d


def _filled_kv(d, slots: int, cap: int, seed: int) -> SlotKV:
    a = d.arch
    kv = SlotKV(a.num_kv_heads, a.head_dim, torch.float32, "cpu", min_capacity=cap)
    for _ in range(slots):
        kv.acquire()
    g = torch.Generator().manual_seed(seed)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    return kv


def _reference(d, tokens_, g, slots, index, kv, query):
    x, q, k, v = d.layer_qkv(tokens_, g, index + 1)
    kv.write(slots, index, k, v)
    o = kv.attend_one(q[query], slots[query], index[query], d.scale)
    f = d.layer_out(x[query], o)
    return f, d.logits(f)


@pytest.mark.parametrize("family, draft_vocab, planner", [("qwen2", None, "split"), ("qwen2", 48, "cublas"),
                                                          ("llama", None, "split"), ("qwen3", 48, "split")])
def test_layer_equals_the_torch_path(engines, family, draft_vocab, planner):
    d = _kernel_drafter(engines[family], draft_vocab=draft_vocab, planner=planner)
    a = d.arch
    g = torch.Generator().manual_seed(11)
    slots = torch.tensor([0, 1, 2, 1, 0])
    index = torch.tensor([3, 7, 0, 8, 4])  # row 3 sees row 1's K/V (same slot, written first)
    tok = torch.randint(a.vocab_size, (5,), generator=g)
    feat = torch.randn(5, a.hidden_size, generator=g)
    with torch.no_grad():
        for query in (None, torch.tensor([4, 1])):
            rows = torch.arange(5) if query is None else query
            kv, kv_ref = _filled_kv(d, 3, 16, seed=5), _filled_kv(d, 3, 16, seed=5)
            f, lg = drafter_kernels.layer(d, tok, feat, index + 1, kv, slots, index, rows=8, query=query)
            f_ref, lg_ref = _reference(d, tok, feat, slots, index, kv_ref, rows)
            assert lg.dtype == torch.float32 and lg.shape == (len(rows), d.config.head_size)
            torch.testing.assert_close(f, f_ref, atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(lg, lg_ref, atol=2e-5, rtol=1e-5)
            written = torch.zeros(kv.k.shape[:2], dtype=torch.bool)
            written[slots, index] = True
            for got, ref in ((kv.k, kv_ref.k), (kv.v, kv_ref.v)):
                torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
                assert torch.equal(got[~written], ref[~written])  # nothing else touched
        # control: rows 0 and 2 swap slots, so they write and read other slots
        kv, kv_ref = _filled_kv(d, 3, 16, seed=5), _filled_kv(d, 3, 16, seed=5)
        swapped = torch.tensor([2, 1, 0, 1, 0])
        _, lg_bad = drafter_kernels.layer(d, tok, feat, index + 1, kv, swapped, index, rows=8)
        _, lg_ref = _reference(d, tok, feat, slots, index, kv_ref, torch.arange(5))
        assert (lg_bad - lg_ref).abs().max() > 1e-3


@pytest.mark.parametrize("family, temperature, draft_vocab",
                         [("qwen2", 0.0, None), ("qwen2", 0.9, 48), ("qwen3", 0.7, None)])
def test_static_chains_equal_eager_chains_on_the_kernel_path(engines, family, temperature, draft_vocab,
                                                             monkeypatch):
    """The harness of test_eagle_graph (5 sequences in bucket 8, caps 4/2/4/3/1, six steps
    of ragged growth): bit-equal trees, draft distributions and noise positions, every
    drafter forward on the kernel path."""
    calls = []
    layer = drafter_kernels.layer
    monkeypatch.setattr(drafter_kernels, "layer", lambda *a, **k: calls.append(k["rows"]) or layer(*a, **k))
    d = _kernel_drafter(engines[family], seed=4, draft_vocab=draft_vocab)
    temps, lengths, caps = [temperature] * 5, [3, 11, 6, 20, 8], [4, 2, 4, 3, 1]
    eager, draws_e, n_e = draft_steps(d, temps, lengths, caps, static=False)
    n_eager_calls = len(calls)
    static, draws_s, n_s = draft_steps(d, temps, lengths, caps, static=True)
    assert n_e == 0 and n_s == 6 and n_eager_calls > 0 and len(calls) > n_eager_calls
    assert draws_s == draws_e
    for step, (te, ts) in enumerate(zip(eager, static)):
        for i, (a, b) in enumerate(zip(te, ts)):
            assert a[0] == b[0] and a[1] == b[1] and a[3] == b[3], (step, i, a[0], b[0])
            if a[2] is not None:
                assert torch.equal(a[2], b[2]), (step, i)
    # and the kernel path drafts what the torch path drafts (float32: no greedy tie moves)
    ref = _kernel_drafter(engines[family], seed=4, draft_vocab=draft_vocab)
    ref.kernel_layers = False
    torch_steps, _, _ = draft_steps(ref, temps, lengths, caps, static=False)
    if temperature == 0.0:
        assert [[t[0] for t in st] for st in torch_steps] == [[t[0] for t in st] for st in eager]


def _proposer(static: bool, *, nan: bool = False, seed: int = 2):
    def make(e):
        d = _kernel_drafter(e, seed=seed)
        if nan:
            with torch.no_grad():
                d.fc.weight[0, 0] = float("nan")
        p = EagleProposer(d, min_kv_capacity=128)
        p.static_chains = static
        return p
    return make


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=0.8)])
def test_generate_on_the_kernel_path(spec_models, params, monkeypatch):
    """4 prompts x 2 samples, depth-3 chains: greedy == plain decoding; sampled: the static
    and eager paths give the same tokens and logprobs."""
    calls = []
    layer = drafter_kernels.layer
    monkeypatch.setattr(drafter_kernels, "layer", lambda *a, **k: calls.append(1) or layer(*a, **k))
    reqs = requests(VOCAB["qwen2"], [5, 11, 3, 8], n=2, prompt_seed=3, max_new_tokens=10, **params)
    eager, _ = run(spec_models["qwen2"], reqs, _proposer(False), Strategy(depth=3))
    n_eager = len(calls)
    static, engine = run(spec_models["qwen2"], reqs, _proposer(True), Strategy(depth=3))
    assert engine.spec_decoder.drafter._chain_graphs.num_steps > 0
    assert n_eager > 0 and len(calls) > n_eager
    assert tokens(static) == tokens(eager)
    assert [r.logprobs for r in static] == [r.logprobs for r in eager]
    if params["temperature"] == 0.0:
        plain, _ = run(spec_models["qwen2"], reqs)
        assert tokens(static) == tokens(plain)


def test_non_finite_drafter_falls_back_on_the_kernel_path(spec_models):
    reqs = requests(VOCAB["qwen2"], [5, 11, 3], prompt_seed=3, max_new_tokens=8)
    plain, _ = run(spec_models["qwen2"], reqs)
    for static in (False, True):
        res, engine = run(spec_models["qwen2"], reqs, _proposer(static, nan=True), Strategy(depth=3))
        assert tokens(res) == tokens(plain)
        total = engine.spec_decoder.metrics.summary()["total"]
        assert total["fallbacks"] > 0 and total["drafted"] == 0, total
