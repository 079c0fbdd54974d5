"""EAGLE chain drafting replayed from CUDA graphs (spec/eagle_graph.py) on CUDA (skipped
without a GPU): the replayed drafts equal the eager batched path's bit for bit (tokens,
draft distributions, noise positions), across drafter weight updates, and whole
generate calls give the same tokens with and without the graphs."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "unit", "spec"))

from spec_testutil import VOCAB, make_hf_model, random_eagle, requests, tokens  # noqa: E402
from test_eagle_graph import GROWS, _run as draft_steps  # noqa: E402

from megatron_tlt.rollout import RolloutEngine, load_hf  # noqa: E402
from megatron_tlt.spec.decode import SpecDecoder  # noqa: E402
from megatron_tlt.spec.eagle import EagleProposer  # noqa: E402
from megatron_tlt.spec.tree import Strategy  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("eagle_graph_gpu"))
    make_hf_model("qwen2", d, vocab_size=VOCAB["qwen2"], seed=41, tie=False)
    return d


def _engine(model_dir, dtype, **kw):
    arch, weights = load_hf(model_dir, dtype=dtype, device="cuda")
    return RolloutEngine(arch, weights, device="cuda", dtype=dtype, max_num_seqs=kw.pop("max_num_seqs", 8),
                         block_size=4, num_blocks=kw.pop("num_blocks", 64), **kw)


def _assert_same_drafts(eager, draws_e, n_e, graph, draws_g, n_g):
    """draft_steps' outputs of the eager path and of the graphs: every step on its path
    (the first step's long pending caught up, EagleProposer._catch_up), the same noise
    draws, tokens, fallbacks and (torch.equal) draft distributions."""
    assert n_e == 0 and n_g == len(GROWS)
    assert draws_g == draws_e
    for step, (te, tg) in enumerate(zip(eager, graph)):
        for i, (a, b) in enumerate(zip(te, tg)):
            assert a[0] == b[0] and a[3] == b[3], (step, i, a[0], b[0])
            if a[2] is not None:
                assert torch.equal(a[2], b[2]), (step, i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature, draft_vocab", [(0.0, None), (0.9, 48), (0.7, None)])
def test_graph_drafts_equal_eager_drafts(model_dir, dtype, temperature, draft_vocab):
    e = _engine(model_dir, dtype)
    d = random_eagle(e, seed=4, draft_vocab=draft_vocab)
    temps, lengths, caps = [temperature] * 5, [3, 11, 6, 20, 8], [4, 2, 4, 3, 1]
    eager, draws_e, n_e = draft_steps(d, temps, lengths, caps, static=False)
    graph, draws_g, n_g = draft_steps(d, temps, lengths, caps, static=None)  # None: graphs on CUDA
    _assert_same_drafts(eager, draws_e, n_e, graph, draws_g, n_g)


def test_graphs_replay_and_follow_in_place_weight_updates(model_dir):
    """Graphs are captured per (bucket, depth, setting) and replayed; after an in-place
    update of the target's head (reduced vocabulary: the gathered head is refreshed in
    place) and of the drafter's weights, no graph is invalidated and replayed drafts
    still equal eager drafts."""
    e = _engine(model_dir, torch.float32)
    d = random_eagle(e, seed=4, draft_vocab=48)
    reqs = requests(VOCAB["qwen2"], [5, 11, 3, 8], n=2, temperature=0.9, max_new_tokens=24, seed=3)
    prop = EagleProposer(d)
    e.spec_decoder = SpecDecoder(prop, Strategy(depth=3), verify_impl="kernel")
    e.generate(reqs)
    cg = prop.chain_graphs()
    assert cg.num_replays > 0 and cg.num_captures > 0
    invalidations, replays = cg.num_invalidations, cg.num_replays
    with torch.no_grad():
        e.weights.lm_head.mul_(1.5)
        d.fc.weight.mul_(0.9)
    res_g = e.generate(reqs)
    assert cg.num_replays > replays
    assert cg.num_invalidations == invalidations, "in-place updates must not invalidate the graphs"
    prop.static_chains = False
    prop._chain_graphs = None
    res_e = e.generate(reqs)
    assert tokens(res_g) == tokens(res_e)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_generate_with_draft_graphs_equals_eager_drafting(model_dir, temperature):
    reqs = requests(VOCAB["qwen2"], [5, 11, 3, 8], n=2, temperature=temperature, max_new_tokens=32, seed=5)
    out = {}
    for static in (None, False):
        for kw in ({}, {"num_blocks": 12}):
            e = _engine(model_dir, torch.bfloat16, **kw)
            prop = EagleProposer(random_eagle(e, seed=2))
            prop.static_chains = static
            e.spec_decoder = SpecDecoder(prop, Strategy(depth=4), verify_impl="kernel")
            out[(static, bool(kw))] = (e.generate(reqs), prop)
    for pre in (False, True):
        (rg, pg), (re_, pe) = out[(None, pre)], out[(False, pre)]
        assert pg.chain_graphs().num_replays > 0 and pe.chain_graphs() is None
        assert tokens(rg) == tokens(re_), pre
        assert [r.logprobs for r in rg] == [r.logprobs for r in re_]


def test_drafter_fast_products_and_norms_match_the_invariant_path(model_dir):
    """On a CUDA engine (not batch-invariant) the drafter runs fused products (QKV, gate/up,
    joint RoPE) and torch's fused RMSNorm; q, k, v and the layer output stay within bf16
    rounding of the batch-invariant
    reference path (16-row tiles, composite norm), and a SpecDecoder binds that setting."""
    e = _engine(model_dir, torch.bfloat16, attention_backend="triton", cuda_graphs=True)
    d = random_eagle(e, seed=4)
    prop = EagleProposer(d)
    d = prop.drafter
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens_ = torch.randint(0, VOCAB["qwen2"], (20,), device="cuda", generator=g)
    feats = torch.randn(20, d.arch.hidden_size, device="cuda", generator=g).to(torch.bfloat16)
    pos = torch.arange(1, 21, device="cuda")
    out = {}
    d.fused_products = None  # the default on CUDA: the fused path
    with torch.no_grad():  # rollout: the fused QKV / gate-up products and joint RoPE
        for inv in (True, False):
            d.batch_invariant = inv
            x, q, k, v = d.layer_qkv(tokens_, feats, pos)
            out[inv] = (q, k, v, d.layer_out(x, q))  # q stands in for the attention output
    assert "qkv" in d._fused and "gate_up" in d._fused
    for a, b in zip(out[True], out[False]):
        err = (b.float() - a.float()).abs().max() / a.float().abs().max()
        assert err < 3e-2, float(err)
    reqs = requests(VOCAB["qwen2"], [5, 11, 3, 8], max_new_tokens=12)
    e.spec_decoder = SpecDecoder(prop, Strategy(depth=3))
    e.generate(reqs)
    assert d.batch_invariant is False  # bound to the engine


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_admissions_under_continuous_batching_stay_on_the_graphs(model_dir, temperature):
    """bf16, at most 2 of 6 requests running, prompts longer than a query tile: every
    admission brings ~20 pending drafter pairs into a running batch; with the catch-up
    (EagleProposer._catch_up) no proposal goes eager and the tokens and logprobs equal
    the eager drafter's (which catches up the same way)."""
    reqs = requests(VOCAB["qwen2"], [21, 19, 23, 18, 25, 20], prompt_seed=5, max_new_tokens=24,
                    temperature=temperature, seed=3)
    out = {}
    for static in (None, False):
        e = _engine(model_dir, torch.bfloat16, max_num_seqs=2)
        prop = EagleProposer(random_eagle(e, seed=2))
        prop.static_chains = static
        e.spec_decoder = SpecDecoder(prop, Strategy(depth=4), verify_impl="kernel")
        out[static] = (e.generate(reqs), prop)
    (rg, pg), (re_, pe) = out[None], out[False]
    assert pg.chain_graphs().num_replays > 6 and pg.num_eager_steps == 0
    assert pe.num_eager_steps > 0
    assert tokens(rg) == tokens(re_)
    assert [r.logprobs for r in rg] == [r.logprobs for r in re_]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature, draft_vocab", [(0.0, None), (0.9, 48)])
def test_kernel_path_graph_drafts_equal_eager_drafts(model_dir, dtype, temperature, draft_vocab):
    """The drafter's Triton kernel path (spec/drafter_kernels.py, the default for a CUDA
    engine's drafter), projections planned by the shared LinearPlanner: the graphs' padded
    buckets draft what the eager path's live rows draft, bit for bit (the configs are
    planned per step bucket, every kernel row-local); the kernel path ran."""
    from megatron_tlt.spec import drafter_kernels

    e = _engine(model_dir, dtype)
    d = random_eagle(e, seed=4, draft_vocab=draft_vocab)
    temps, lengths, caps = [temperature] * 5, [3, 11, 6, 20, 8], [4, 2, 4, 3, 1]

    def bound(p):  # as bind() to a CUDA engine leaves it: not batch-invariant, kernels by default
        p.drafter.batch_invariant = False
        with torch.no_grad():
            assert p.drafter.kernel_layers is None and p.drafter.kernels_on(p.kv.k)

    calls = []
    layer = drafter_kernels.layer
    drafter_kernels.layer = lambda *a, **k: calls.append(1) or layer(*a, **k)
    try:
        eager, draws_e, n_e = draft_steps(d, temps, lengths, caps, static=False, prepare=bound)
        n_eager = len(calls)
        graph, draws_g, n_g = draft_steps(d, temps, lengths, caps, static=None, prepare=bound)
    finally:
        drafter_kernels.layer = layer
    assert n_eager > 0 and len(calls) > n_eager  # (graph replays call nothing: captures do)
    _assert_same_drafts(eager, draws_e, n_e, graph, draws_g, n_g)


def test_kernel_path_layer_matches_the_torch_path(model_dir):
    """bf16: the kernel path's f and logits within bf16 rounding of the torch fast path's
    (layer_qkv, SlotKV.write, attend_one, layer_out, logits) on the same slot contents."""
    from megatron_tlt.spec import drafter_kernels
    from megatron_tlt.spec.drafter_kv import SlotKV

    e = _engine(model_dir, torch.bfloat16)
    prop = EagleProposer(random_eagle(e, seed=4))
    d = prop.drafter
    d.batch_invariant = False
    a = d.arch
    g = torch.Generator(device="cuda").manual_seed(0)
    kvs = []
    for _ in range(2):
        kv = SlotKV(a.num_kv_heads, a.head_dim, torch.bfloat16, "cuda", min_capacity=32)
        for _ in range(3):
            kv.acquire()
        kvs.append(kv)
    kvs[0].k.copy_(torch.randn(kvs[0].k.shape, device="cuda", generator=g))
    kvs[0].v.copy_(torch.randn(kvs[0].v.shape, device="cuda", generator=g))
    kvs[1].k.copy_(kvs[0].k)
    kvs[1].v.copy_(kvs[0].v)
    slots = torch.tensor([0, 1, 2, 1, 0], device="cuda")
    index = torch.tensor([3, 7, 0, 8, 4], device="cuda")
    tok = torch.randint(0, a.vocab_size, (5,), device="cuda", generator=g)
    feat = torch.randn(5, a.hidden_size, device="cuda", generator=g).to(torch.bfloat16)
    with torch.no_grad():
        f, lg = drafter_kernels.layer(d, tok, feat, index + 1, kvs[0], slots, index, rows=8)
        x, q, k, v = d.layer_qkv(tok, feat, index + 1)
        kvs[1].write(slots, index, k, v)
        f_ref = d.layer_out(x, kvs[1].attend_one(q, slots, index, d.scale))
        lg_ref = d.logits(f_ref)
    for got, ref in ((f, f_ref), (lg, lg_ref), (kvs[0].k, kvs[1].k), (kvs[0].v, kvs[1].v)):
        err = (got.float() - ref.float()).abs().max() / ref.float().abs().max()
        assert err < 3e-2, float(err)
