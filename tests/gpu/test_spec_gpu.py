"""Speculative decoding on CUDA (skipped without a GPU): greedy SD emits the plain tokens,
with the compiled verify kernels, for EAGLE (reduced vocabulary too), n-gram and the
target as drafter; sampling is seeded; a trained-and-saved drafter reloads on GPU."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "unit", "spec"))

from spec_testutil import DRAFTERS, VOCAB, make_hf_model, requests, tokens  # noqa: E402

from megatron_tlt.rollout import RolloutEngine, load_hf  # noqa: E402
from megatron_tlt.spec.decode import SpecDecoder  # noqa: E402
from megatron_tlt.spec.tree import Strategy  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("spec_gpu"))
    make_hf_model("qwen2", d, vocab_size=VOCAB["qwen2"], seed=41, tie=False)
    return d


def _run(model_dir, reqs, drafter=None, strategy=None, **kw):
    arch, weights = load_hf(model_dir, device="cuda")
    # batch_invariant: a token's logits must not depend on how many tokens share the
    # forward (verify runs Q tokens where plain decoding runs one).
    engine = RolloutEngine(arch, weights, device="cuda", max_num_seqs=8, num_blocks=kw.pop("num_blocks", 64),
                           block_size=4, batch_invariant=True, **kw)
    if drafter is not None:
        engine.spec_decoder = SpecDecoder(DRAFTERS[drafter](engine), strategy, verify_impl="kernel")
    return engine.generate(reqs), engine


@pytest.mark.parametrize("drafter", ["eagle", "eagle_small_vocab", "ngram", "target"])
@pytest.mark.parametrize("strategy", [Strategy(depth=3), Strategy(depth=3, topk=2, num_verify_tokens=6)],
                         ids=["chain", "tree"])
def test_greedy_spec_equals_plain_on_gpu(model_dir, drafter, strategy):
    reqs = requests(VOCAB["qwen2"], [5, 11, 3, 8], prompt_seed=1, max_new_tokens=16)
    base, _ = _run(model_dir, reqs)
    for kw in ({}, {"num_blocks": 10}):
        res, engine = _run(model_dir, reqs, drafter, strategy, **kw)
        assert tokens(res) == tokens(base), (drafter, kw)
        for a, b in zip(res, base):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
        assert engine.spec_decoder.metrics.summary()["total"]["num_drafts"] > 0


@pytest.mark.parametrize("drafter", ["eagle", "ngram"])
def test_sampling_is_seeded_on_gpu(model_dir, drafter):
    reqs = requests(VOCAB["qwen2"], [5, 11, 3, 8], n=2, temperature=0.8, top_p=0.9, max_new_tokens=16, seed=4)
    r1, _ = _run(model_dir, reqs, drafter, Strategy(depth=3))
    r2, _ = _run(model_dir, reqs, drafter, Strategy(depth=3))
    assert tokens(r1) == tokens(r2)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_spec_with_verify_graphs_equals_eager_verify(model_dir, temperature):
    """fp32, EAGLE chains: an engine whose verify forwards replay CUDA graphs (Triton
    backend, not batch-invariant) gives the tokens of the same engine verifying eagerly
    (same seeds; the two differ only in the attention's split-K factor)."""
    reqs = requests(VOCAB["qwen2"], [5, 11, 3, 8], n=2, temperature=temperature, max_new_tokens=24, seed=3)
    out = {}
    for graphs in (True, False):
        arch, weights = load_hf(model_dir, device="cuda")
        engine = RolloutEngine(arch, weights, device="cuda", max_num_seqs=8, num_blocks=64, block_size=4,
                               attention_backend="triton", cuda_graphs=graphs)
        engine.spec_decoder = SpecDecoder(DRAFTERS["eagle"](engine), Strategy(depth=3), verify_impl="kernel")
        out[graphs] = (engine.generate(reqs), engine)
    (res_g, eng_g), (res_e, eng_e) = out[True], out[False]
    assert eng_g.decode_runner.num_verify_replays > 0 and eng_e.decode_runner.num_verify_replays == 0
    assert eng_g.spec_decoder.metrics.summary()["total"]["num_drafts"] > 0
    assert tokens(res_g) == tokens(res_e)
    for a, b in zip(res_g, res_e):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


# ---- the verification fast path (spec/decode.py VerifyMath) on CUDA ---------------------

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "unit"))

import test_verify_fast as vf  # noqa: E402

from megatron_tlt.rollout.sampling import noise_bits, uniform_noise  # noqa: E402
from megatron_tlt.spec.verify_math import MATH_MAX_ROWS, VerifyMath  # noqa: E402
from megatron_tlt.spec.tree import DraftTree  # noqa: E402


def test_coins_drawn_on_gpu_equal_cpu():
    """The fast path draws the coins on the device, the general path on the CPU: same bits
    (integer SplitMix64), same float32 coins."""
    keys = torch.arange(512, dtype=torch.int64) * 1_000_003 + 2**61
    draws = torch.arange(512, dtype=torch.int64) % 7
    assert torch.equal(noise_bits(keys, draws, 2048, "cuda").cpu(), noise_bits(keys, draws, 2048, "cpu"))
    assert torch.equal(uniform_noise(keys, draws, 2048, "cuda").cpu(), uniform_noise(keys, draws, 2048, "cpu"))


def _to_cuda(trees):
    return [DraftTree(t.tokens, t.parents, None if t.draft_probs is None else t.draft_probs.cuda())
            for t in trees]


@pytest.mark.parametrize("mode", ["greedy", "sampled", "one_hot"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_verify_math_graphs_equal_eager(mode, tree):
    """Synthetic steps: graph replay == the same math eager on the same static buffers, bit
    for bit (every output); == the general path on CUDA in tokens and accepted paths
    (its unpadded reductions may round the floats differently in the last bit).
    Passes 1 and 2: the logits sit in one static buffer (as the decode runner's), read in
    place; pass 2 (same shapes, other draw numbers) replays pass 1's graphs with new
    inputs and captures nothing. Pass 3: batches that are not buckets in fresh tensors,
    copied into VerifyMath's own buffer (other graphs)."""
    vocab = 4099
    graph = VerifyMath("cuda", vocab, use_graphs=True, impl="kernel")
    eager = VerifyMath("cuda", vocab, use_graphs=False, impl="kernel")
    assert graph.use_graphs and not eager.use_graphs
    for m in (graph, eager):
        m._reserve(MATH_MAX_ROWS)  # no buffer growth (it would drop graphs) mid-test
    static = torch.zeros(MATH_MAX_ROWS, vocab, device="cuda")
    batches = [3, 1, 6, 5, 8, 3, 2, 7, 3, 1]
    captures = []
    for rep in range(3):
        for step, batch in enumerate(batches):
            if rep == 2 and batch & (batch - 1) == 0:
                continue
            seqs, trees, logits = vf.make_step(batch, vocab, mode, seed=step, tree=tree)
            trees, logits = _to_cuda(trees), logits.cuda()
            if rep < 2:
                static[:logits.shape[0]] = logits
                logits = static[:logits.shape[0]]
            s_g, s_e, s_ref = (vf.copy_seqs(seqs, draw_offset=5 * rep) for _ in range(3))
            _, got_g, gidx_g = vf.fast_path(graph, s_g, trees, logits, vocab)
            _, got_e, gidx_e = vf.fast_path(eager, s_e, trees, logits, vocab)
            for k in got_e:
                assert torch.equal(got_g[k], got_e[k]), (rep, step, k)
            assert torch.equal(gidx_g, gidx_e)
            want = vf.general_path(s_ref, trees, logits, vocab, impl="kernel")
            w = want["accept_index"].shape[1]
            for k in ("accept_index", "accept_length", "tokens"):
                assert torch.equal(want[k], got_e[k] if k == "accept_length" else got_e[k][:, :w]), (rep, step, k)
            for k in ("logprobs", "processed_logprobs"):
                torch.testing.assert_close(got_e[k][:, :w], want[k], rtol=0, atol=1e-5)
        captures.append(graph.num_captures)
    assert 0 < captures[0] == captures[1] < captures[2], captures
    assert graph.num_replays == graph.num_steps == eager.num_steps and eager.num_captures == 0


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_verify_math_graphs_with_a_ban_equal_eager(mode):
    """min_new_tokens bans (stop ids 1 and 2 at depths 0 and 1, their logits raised):
    graph replay == the eager math on the same buffers bit for bit, == the general path
    in tokens and accepted paths; no stop id is emitted at a banned node."""
    vocab = 4099
    graph = VerifyMath("cuda", vocab, use_graphs=True, impl="kernel")
    eager = VerifyMath("cuda", vocab, use_graphs=False, impl="kernel")
    for step, batch in enumerate([3, 6, 1, 5, 3]):
        seqs, trees, logits = vf.make_step(batch, vocab, mode, seed=60 + step, tree=step % 2 == 1,
                                           min_new_tokens=6, max_new_tokens=20)
        logits[:, 1] += 6.0
        logits[:, 2] += 5.0
        trees, logits = _to_cuda(trees), logits.cuda()
        s_g, s_e, s_ref = (vf.copy_seqs(seqs) for _ in range(3))
        plan, got_g, _ = vf.fast_path(graph, s_g, trees, logits, vocab)
        _, got_e, _ = vf.fast_path(eager, s_e, trees, logits, vocab)
        assert plan.ban == 2
        for k in got_e:
            assert torch.equal(got_g[k], got_e[k]), (step, k)
        want = vf.general_path(s_ref, trees, logits, vocab, impl="kernel")
        w = want["accept_index"].shape[1]
        for k in ("accept_index", "accept_length", "tokens"):
            assert torch.equal(want[k], got_e[k] if k == "accept_length" else got_e[k][:, :w]), (step, k)
        # output j of a row is output number 4 + j: banned below 6
        assert not bool(torch.isin(got_e["tokens"][:, :2], torch.tensor([1, 2])).any())
    assert graph.num_captures > 0 and graph.num_replays == graph.num_steps


def _spec_engine(model_dir, dtype, decoder_kw, **engine_kw):
    arch, weights = load_hf(model_dir, dtype=dtype, device="cuda")
    opts = dict(max_num_seqs=8, num_blocks=64, block_size=4)
    opts.update(engine_kw)
    engine = RolloutEngine(arch, weights, device="cuda", dtype=dtype, **opts)
    # The verify-ahead (on by default) grows KV tables a step early: in this tight pool
    # that can move a preemption, and the bf16 re-prefill rounds differently, so the
    # on/off comparisons of other features keep it off unless they ask for it
    # (test_verify_ahead_on_gpu runs it in a pool with room).
    decoder_kw = {"verify_ahead": False, **decoder_kw}
    engine.spec_decoder = SpecDecoder(DRAFTERS["eagle"](engine), Strategy(depth=4), verify_impl="kernel",
                                      **decoder_kw)
    return engine


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_generate_verify_math_graphs_equal_eager(model_dir, dtype, temperature):
    """Whole generate calls (Triton engine with decode/verify graphs: the verify math reads
    the runner's static logits in place): verify-math graphs == the same math eager, bit
    for bit (tokens, logprobs, processed logprobs); == the general path in tokens."""
    reqs = requests(VOCAB["qwen2"], [5, 11, 3, 8], n=2, temperature=temperature, max_new_tokens=32, seed=7)
    out = {}
    for name, kw in (("graphs", dict(verify_graphs=True)), ("eager", dict(verify_graphs=False)),
                     ("general", dict(fast_verify=False))):
        e = _spec_engine(model_dir, dtype, kw, attention_backend="triton", cuda_graphs=True)
        out[name] = (e.generate(reqs), e.spec_decoder)
    (rg, dg), (re_, de), (rr, dr) = out["graphs"], out["eager"], out["general"]
    assert dg._math.num_replays > 0 and dg._math.num_captures > 0 and de._math.num_captures == 0
    assert de._math.num_steps > 0 and dr._math is None
    assert any(k[3] is not None for k in dg._math._graphs), "no graph read the logits in place"
    assert dg.metrics.summary()["total"]["num_drafts"] > 0
    assert tokens(rg) == tokens(re_) == tokens(rr)
    assert [r.logprobs for r in rg] == [r.logprobs for r in re_]
    assert [r.processed_logprobs for r in rg] == [r.processed_logprobs for r in re_]
    for a, b in zip(rg, rr):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("strategy", [Strategy(depth=3), Strategy(depth=3, topk=2, num_verify_tokens=6)],
                         ids=["chain", "tree"])
def test_greedy_spec_with_verify_math_graphs_equals_plain(model_dir, strategy):
    """Greedy SD through the verify-math graphs (batch-invariant engine: the verify
    forward's logits are fresh tensors, copied into the static buffer or read in place)
    emits exactly the plain decode's tokens."""
    reqs = requests(VOCAB["qwen2"], [5, 11, 3, 8, 6], prompt_seed=3, max_new_tokens=24)
    base, _ = _run(model_dir, reqs)
    res, engine = _run(model_dir, reqs, "eagle", strategy)
    m = engine.spec_decoder._math
    assert m is not None and m.use_graphs and m.num_replays > 0
    assert tokens(res) == tokens(base)
    for a, b in zip(res, base):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def _on_off_on_gpu(model_dir, key: str, temperature: float, nan: bool, new: int, **engine_kw):
    """((results, decoder) with SpecDecoder(key=True), the same with key=False): bf16
    Triton engine with every graph on (decode, verify, verify math, drafter chains), 4
    prompts x 2, optionally a non-finite drafter; asserts the two runs' tokens, logprobs,
    processed logprobs and fallbacks are equal bit for bit."""
    reqs = requests(VOCAB["qwen2"], [5, 11, 3, 8], n=2, temperature=temperature, max_new_tokens=new, seed=5)
    out = {}
    for on in (True, False):
        e = _spec_engine(model_dir, torch.bfloat16, {key: on}, attention_backend="triton", cuda_graphs=True,
                         **engine_kw)
        if nan:
            with torch.no_grad():
                e.spec_decoder.drafter.drafter.fc.weight[0, 0] = float("nan")
        out[on] = (e.generate(reqs), e.spec_decoder)
    (r_on, _), (r_off, _) = out[True], out[False]
    assert tokens(r_on) == tokens(r_off)
    assert [r.logprobs for r in r_on] == [r.logprobs for r in r_off]
    assert [r.processed_logprobs for r in r_on] == [r.processed_logprobs for r in r_off]
    assert [r.spec_stats["fallbacks"] for r in r_on] == [r.spec_stats["fallbacks"] for r in r_off]
    return out[True], out[False]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("nan", [False, True], ids=["finite", "nan_drafter"])
def test_deferred_drafts_equal_read_back_on_gpu(model_dir, temperature, nan):
    """Verifying the drafts on the device (SpecDecoder._deferred, the default) gives bit
    for bit the tokens, logprobs and processed logprobs of reading them back first
    (defer_drafts=False); with a non-finite drafter every deferred row falls back to a
    plain step exactly as on the read-back path."""
    (r_on, d_on), (_, d_off) = _on_off_on_gpu(model_dir, "defer_drafts", temperature, nan, 32)
    assert d_on.num_deferred > 0 and d_off.num_deferred == 0
    assert d_on.drafter._chain_graphs.num_replays > 0
    fb = [r.spec_stats["fallbacks"] for r in r_on]
    assert (min(fb) > 0) if nan else (max(fb) == 0)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("nan", [False, True], ids=["finite", "nan_drafter"])
def test_draft_ahead_on_gpu(model_dir, temperature, nan):
    """The draft-ahead (the next chain replayed from the verification's device outputs
    before the host reads them; the results' copy to pinned memory queued ahead of it)
    gives bit for bit the results of drafting after the read; draft-aheads are adopted
    (none with a non-finite drafter)."""
    (_, d_on), (_, d_off) = _on_off_on_gpu(model_dir, "draft_ahead", temperature, nan, 48)
    assert d_on.num_ahead > 0 and d_off.num_ahead == 0
    assert (d_on.num_adopted == 0) if nan else (d_on.num_adopted > 0), (d_on.num_adopted, d_on.num_ahead)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("nan", [False, True], ids=["finite", "nan_drafter"])
def test_verify_ahead_on_gpu(model_dir, temperature, nan):
    """The verify-ahead (the next verify forward replayed from its graph after the
    draft-ahead, its inputs built on the device from the verification's outputs) gives bit
    for bit the results of launching it after the host's bookkeeping; verify-aheads are
    queued and used (none with a non-finite drafter, whose draft-aheads are dropped). A
    pool with room for every sequence: the verify-ahead grows KV tables a step early, and
    where that moved a preemption, the bf16 re-prefill would round differently (exactness
    under preemption is tested on CPU, tests/unit/spec/test_verify_ahead_interp.py)."""
    (_, d_on), (_, d_off) = _on_off_on_gpu(model_dir, "verify_ahead", temperature, nan, 48, num_blocks=160)
    assert d_off.num_verify_ahead == 0
    if nan:
        assert d_on.num_verify_adopted == 0
    else:
        assert d_on.num_verify_ahead > 0 and d_on.num_verify_adopted > 0, \
            (d_on.num_verify_adopted, d_on.num_verify_ahead, d_on.num_adopted)


def test_depth_schedule_on_gpu(model_dir):
    """A depth schedule (spec.decode.depth_policy "1:4,4:2"): greedy SD through the
    kernels on a batch-invariant engine, four sequences at depth 2 and then the fifth alone
    at depth 4, emits the plain tokens and drafts at each bucket's depth; on the Triton
    engine with graphs at T=0.9, the drafter's chain graphs are captured per depth and the
    verify-math graphs equal the same math eager bit for bit."""
    from megatron_tlt.spec.decode import depth_policy

    def engine(dtype=torch.float32, **kw):
        arch, weights = load_hf(model_dir, dtype=dtype, device="cuda")
        return RolloutEngine(arch, weights, device="cuda", dtype=dtype, max_num_seqs=4, num_blocks=64,
                             block_size=4, **kw)
    reqs = requests(VOCAB["qwen2"], [5, 11, 3, 8, 6], prompt_seed=3, max_new_tokens=24)
    base = engine(batch_invariant=True).generate(reqs)
    e = engine(batch_invariant=True)
    e.spec_decoder = SpecDecoder(DRAFTERS["eagle"](e), policy=depth_policy("1:4,4:2"), verify_impl="kernel")
    res = e.generate(reqs)
    assert tokens(res) == tokens(base)
    by = e.spec_decoder.metrics.summary()["by_batch_size"]
    assert by["2-4"]["num_drafts"] > 0 and by["2-4"]["drafted"] <= 2 * by["2-4"]["num_drafts"]
    assert by["1"]["num_drafts"] > 0 and by["1"]["drafted"] > 2 * by["1"]["num_drafts"]

    sampled = requests(VOCAB["qwen2"], [5, 11, 3, 8, 6], temperature=0.9, max_new_tokens=24, seed=7)
    out = {}
    for graphs in (True, False):
        g = engine(torch.bfloat16, attention_backend="triton", cuda_graphs=True)
        g.spec_decoder = SpecDecoder(DRAFTERS["eagle"](g), policy=depth_policy("1:4,4:2"),
                                     verify_impl="kernel", verify_graphs=graphs)
        out[graphs] = (g.generate(sampled), g.spec_decoder)
    (rg, dg), (re_, _) = out[True], out[False]
    assert dg._math.num_replays > 0
    depths = {key[1] for key in dg.drafter._chain_graphs._graphs}
    assert 2 in depths and depths <= {2, 4}, depths
    assert tokens(rg) == tokens(re_)
    assert [r.logprobs for r in rg] == [r.logprobs for r in re_]
