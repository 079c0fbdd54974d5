"""The decode runner's sampled fast path (`DecodeRunner.sample_fast`: static buffers, one
copy each way, a CUDA graph per bucket on a GPU) == the engine's generic sampling path,
bit for bit.

The first tests need no Triton (they run in CI): the per-row invariance the fast path
rests on — it samples all [bucket] rows of the padded logits and draws noise for every
row, the generic path samples [n] rows and draws noise for its sampled rows only. The
others drive the runner eagerly (use_graphs=False, the same function a graph captures) on
CPU through Triton's interpreter, as tests/unit/rollout/test_triton_attention_interp.py
does: skipped without triton (CI) and on CUDA machines, where tests/gpu/test_engine_gpu.py
covers the graph replay.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():  # the runner's kernels run interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

from megatron_tlt.models.arch import ModelArch  # noqa: E402
from megatron_tlt.rollout import EngineWeights, Request, RolloutEngine, SamplingParams  # noqa: E402
from megatron_tlt.rollout.sampling import exponential_noise, sample  # noqa: E402

VOCAB = 300


# ---------------------------------------------------------------- no Triton needed


def _generic_noise(keys, draws, temps, vocab):
    """The engine's generic path: ones, with noise drawn for the sampled rows only."""
    rows = [i for i, t in enumerate(temps.tolist()) if t > 0]
    noise = torch.ones(len(temps), vocab)
    if rows:
        noise[torch.tensor(rows)] = exponential_noise(keys[rows], draws[rows], vocab, "cpu")
    return noise


@pytest.mark.parametrize("vocab,bucket", [(300, 4), (1000, 8), (151936, 32)])
def test_sample_rows_do_not_depend_on_the_batch(vocab, bucket):
    """Row i of sample() over [bucket] rows with noise for every row == row i of sample()
    over the first n rows with the generic path's compacted noise, for every n <= bucket
    (noise, log_softmax, argmax and gather are per element or per row)."""
    g = torch.Generator().manual_seed(vocab + bucket)
    keys = torch.randint(0, 1 << 62, (bucket,), generator=g)
    draws = torch.randint(0, 100, (bucket,), generator=g)
    logits = torch.randn(bucket, vocab, generator=g)
    temps = torch.rand(bucket, generator=g) + 0.3
    temps[::3] = 0.0  # greedy rows among the sampled ones
    full = sample(logits, temps, None, None, exponential_noise(keys, draws, vocab, "cpu"))
    for n in sorted({1, 2, bucket // 2 + 1, bucket - 1, bucket}):
        ref = sample(logits[:n], temps[:n], torch.zeros(n, dtype=torch.int64), torch.ones(n),
                     _generic_noise(keys[:n], draws[:n], temps[:n], vocab))
        assert torch.equal(full.token_ids[:n], ref.token_ids), n
        assert torch.equal(full.logprobs[:n], ref.logprobs), n
        assert torch.equal(full.processed_logprobs[:n], ref.processed_logprobs), n
    # Negative control: the noise of another draw changes sampled tokens.
    stale = sample(logits, temps, None, None, exponential_noise(keys, draws - 1, vocab, "cpu"))
    sampled = temps > 0
    assert not torch.equal(stale.token_ids[sampled], full.token_ids[sampled])


def _stream_case(v, *, seed, banned_row):
    """Six rows (greedy and sampled), their streams, and filters: top-k on row 2, top-p on
    row 3, the lower half of the vocabulary banned on `banned_row`."""
    g = torch.Generator().manual_seed(seed)
    b = 6
    logits = torch.randn(b, v, generator=g) * 2
    temps = torch.tensor([0.9, 0.0, 1.2, 0.7, 0.0, 1.0])
    keys = torch.randint(0, 1 << 62, (b,), generator=g)
    draws = torch.randint(0, 50, (b,), generator=g)
    top_k, top_p = torch.tensor([0, 0, 5, 0, 0, 0]), torch.tensor([1.0, 1.0, 1.0, 0.8, 1.0, 1.0])
    banned = torch.zeros(b, v, dtype=torch.bool)
    banned[banned_row, :v // 2] = True
    return logits, temps, keys, draws, top_k, top_p, banned


def test_sample_streams_on_cpu_is_the_reference_sampler():
    """sampling.sample_streams, every engine path's entry point: on CPU the reference
    sampler with each sampled row's noise from its stream (greedy rows' keys unread), with
    or without filters; a stale draw changes sampled tokens (control)."""
    from megatron_tlt.rollout.sampling import sample_streams
    logits, temps, keys, draws, top_k, top_p, banned = _stream_case(500, seed=5, banned_row=5)
    v = logits.shape[1]
    ref = sample(logits, temps, None, None, _generic_noise(keys, draws, temps, v))
    out = sample_streams(logits, temps, keys, draws)
    filt = sample_streams(logits, temps, keys, draws, top_k=top_k, top_p=top_p, banned=banned)
    ref_f = sample(logits, temps, top_k, top_p, _generic_noise(keys, draws, temps, v), banned)
    for a, r in ((out, ref), (filt, ref_f)):
        assert torch.equal(a.token_ids, r.token_ids) and torch.equal(a.logprobs, r.logprobs)
        assert torch.equal(a.processed_logprobs, r.processed_logprobs)
    assert int(filt.token_ids[5]) >= 250 and int(filt.token_ids[2]) in logits[2].topk(5).indices.tolist()
    greedy_keys = keys.clone()
    greedy_keys[temps <= 0] += 1  # greedy rows' streams are never read
    assert torch.equal(sample_streams(logits, temps, greedy_keys, draws).token_ids, out.token_ids)
    stale = sample_streams(logits, temps, keys, draws + 1)
    sampled = temps > 0
    assert not torch.equal(stale.token_ids[sampled], out.token_ids[sampled])
    with pytest.raises(ValueError, match="both"):
        sample_streams(logits, temps, keys, draws, top_k=top_k)


def test_sample_without_filters_equals_disabled_filters():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB, generator=g)
    temps = torch.tensor([0.0, 0.9, 1.3])
    noise = exponential_noise(torch.tensor([1, 2, 3]), torch.tensor([0, 5, 9]), VOCAB, "cpu")
    a = sample(logits, temps, None, None, noise)
    b = sample(logits, temps, torch.tensor([0, -1, VOCAB]), torch.ones(3), noise)
    for x, y in zip((a.token_ids, a.logprobs, a.processed_logprobs),
                    (b.token_ids, b.logprobs, b.processed_logprobs)):
        assert torch.equal(x, y)
    with pytest.raises(ValueError, match="both"):
        sample(logits, temps, None, torch.ones(3), noise)


# ---------------------------------------------------------------- the runner (interpreted)


def _interpreted():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton interpreter is set up only on CPU-only machines")


@pytest.fixture(params=["torch", "fused"])
def sampler(request, monkeypatch):
    """Each interpreted runner test with the torch sampler (the CPU default) and with the
    fused Triton sampler forced on CPU (MEGATRON_TLT_FUSED_SAMPLE=1 under the interpreter:
    the path a GPU engine takes, rollout/triton_sample.py)."""
    monkeypatch.setenv("MEGATRON_TLT_FUSED_SAMPLE", "1" if request.param == "fused" else "0")
    return request.param


def _engine(**kw) -> RolloutEngine:
    arch = ModelArch(family="qwen2", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                     num_layers=2, num_heads=6, num_kv_heads=2, head_dim=16,
                     max_position_embeddings=256, tie_word_embeddings=True, qkv_bias=True)
    w = EngineWeights.make_dummy(arch, seed=5)
    with torch.no_grad():  # scaled so that tokens vary
        for lw in w.layers:
            for t in (lw.qkv_weight, lw.o_weight, lw.gate_up_weight, lw.down_weight):
                t.mul_(4)
    opts = dict(max_num_seqs=8, num_blocks=96, block_size=4, attention_backend="triton")
    opts.update(kw)
    return RolloutEngine(arch, w, **opts)


# (temperature, top_k, top_p) per request: greedy and sampled rows mixed, filters disabled
# in each accepted form (top_k 0, -1, >= vocab; top_p 1)
MIXED = [(0.9, 0, 1.0), (0.0, 0, 1.0), (1.3, -1, 1.0), (0.7, VOCAB, 1.0), (0.0, 0, 1.0),
         (1.0, VOCAB + 5, 1.0), (0.9, 0, 1.0), (2.0, 0, 1.0)]


def _requests(params, *, seed=0, min_new=0, max_new=40):
    g = torch.Generator().manual_seed(seed)
    return [Request(prompt_id=f"p{i}", prompt_token_ids=torch.randint(0, VOCAB, (3 + 2 * i,),
                                                                      generator=g).tolist(),
                    sampling_params=SamplingParams(temperature=t, top_k=k, top_p=p,
                                                   max_new_tokens=max_new, min_new_tokens=min_new))
            for i, (t, k, p) in enumerate(params)]


def _prefilled(eng, params, **kw):
    seqs = [eng.add_sequence(r) for r in _requests(params, **kw)]
    out = eng.forward_pending(seqs)  # prefill: not the runner's logits
    assert eng.decode_runner.sample_fast(seqs, out.logits) is None
    eng.sample_and_append(seqs, out.logits)
    return seqs


def _fast_vs_generic(eng, seqs, *, stale=False):
    """One decode step of `seqs`: the fast path's outputs and draw counters, then the generic
    path's on the same logits (draw counters rewound; its tokens are the ones appended).
    stale: the fast path is fed draw numbers one behind (a negative control)."""
    runner = eng.decode_runner
    out = eng.forward_pending(seqs)
    before = [s.rng.draws for s in seqs]
    if stale:
        for s in seqs:
            s.rng.draws -= 1
    fast = runner.sample_fast(seqs, out.logits)
    assert fast is not None
    fast_draws = [s.rng.draws + stale for s in seqs]
    for s, d in zip(seqs, before):
        s.rng.draws = d
    runner.sample_graphs = False
    tokens = eng.sample_and_append(seqs, out.logits)
    runner.sample_graphs = True
    generic = (tokens.tolist(), [s.logprobs[-1] for s in seqs],
               [s.processed_logprobs[-1] for s in seqs])
    assert fast_draws == [s.rng.draws for s in seqs]
    assert fast[1] == fast[0].tolist()
    return fast[1:], generic


@pytest.mark.parametrize("sizes", [(3, 5, 8, 1, 6, 3), (7, 2, 7, 4)])
def test_fast_path_equals_generic_path(sizes, sampler):
    """Eager static-buffer path == generic path, token for token and logprob for logprob
    (torch.equal, float32), mixed greedy and sampled rows, batches that are not buckets
    (padding rows; a smaller batch after a larger one leaves stale rows behind), and the
    draw counters advance exactly as in the generic path (one per sampled row and step)."""
    _interpreted()
    eng = _engine()
    runner = eng.decode_runner
    seqs = _prefilled(eng, MIXED)
    sampled_steps = [1 if s.request.sampling_params.temperature > 0 else 0 for s in seqs]
    for step, n in enumerate(sizes):
        fast, generic = _fast_vs_generic(eng, seqs[:n])
        for f, r in zip(fast, generic):
            assert torch.equal(torch.tensor(f, dtype=torch.float64),
                               torch.tensor(r, dtype=torch.float64)), (step, n)
        for i in range(n):
            sampled_steps[i] += seqs[i].request.sampling_params.temperature > 0
    assert [s.rng.draws for s in seqs] == sampled_steps
    assert runner.num_fast_samples == len(sizes) and runner.num_graphs == 0
    assert any(s.processed_logprobs[-1] != 0.0 for s in seqs)  # sampled rows were compared


def test_stale_draw_numbers_change_the_tokens(sampler):
    """Negative control for the comparison above: the fast path fed draw numbers one behind
    differs from the generic path (deterministic seeds: it always does)."""
    _interpreted()
    eng = _engine()
    seqs = _prefilled(eng, MIXED)
    fast, generic = _fast_vs_generic(eng, seqs, stale=True)
    sampled = [i for i, s in enumerate(seqs) if s.request.sampling_params.temperature > 0]
    assert [fast[0][i] for i in sampled] != [generic[0][i] for i in sampled]
    greedy = [i for i in range(len(seqs)) if i not in sampled]
    assert [fast[0][i] for i in greedy] == [generic[0][i] for i in greedy]  # no draw taken


@pytest.mark.parametrize("case", ["top_k", "top_p", "min_new_tokens", "not_served", "switched_off"])
def test_fast_path_falls_back(case):
    """Rows with top-k, top-p or a min_new_tokens ban, logits that are not the runner's
    decode step's, or the switch off: sample_fast returns None and takes no draw; the
    engine's generic path then samples the step."""
    _interpreted()
    eng = _engine(eos_token_ids=(7,))
    params = [(0.9, 0, 1.0), (0.0, 0, 1.0), (1.1, 0, 1.0)]
    if case == "top_k":
        params[2] = (1.1, 5, 1.0)
    elif case == "top_p":
        params[0] = (0.9, 0, 0.95)
    seqs = _prefilled(eng, params, min_new=3 if case == "min_new_tokens" else 0)
    runner = eng.decode_runner
    runner.sample_graphs = case != "switched_off"
    out = eng.forward_pending(seqs)
    logits = out.logits.clone() if case == "not_served" else out.logits
    draws = [s.rng.draws for s in seqs]
    assert runner.sample_fast(seqs, logits) is None
    assert [s.rng.draws for s in seqs] == draws
    eng.sample_and_append(seqs, logits)
    assert runner.num_fast_samples == 0
    assert [s.rng.draws for s in seqs] == [d + (s.request.sampling_params.temperature > 0)
                                           for s, d in zip(seqs, draws)]


def test_greedy_path_unaffected_by_the_switch(monkeypatch):
    """MEGATRON_TLT_SAMPLE_GRAPHS=0 turns the sampled path off, not the greedy one."""
    _interpreted()
    monkeypatch.setenv("MEGATRON_TLT_SAMPLE_GRAPHS", "0")
    eng = _engine()
    assert eng.decode_runner.sample_graphs is False
    seqs = _prefilled(eng, [(0.0, 0, 1.0), (0.0, 0, 1.0)])
    out = eng.forward_pending(seqs)
    assert eng.decode_runner.sample_greedy(seqs, out.logits) is not None
    assert eng.decode_runner.sample_fast(seqs, out.logits) is None


def test_generate_same_with_fast_path_off(monkeypatch, sampler):
    """Whole generate calls at T=0.9 (and greedy rows), with and without the fast path
    (MEGATRON_TLT_SAMPLE_GRAPHS=0 for the second engine): same tokens, logprobs and
    processed logprobs, exactly; requests finish at different lengths, so the batch
    shrinks across buckets."""
    _interpreted()
    params = [(0.9, 0, 1.0), (0.0, 0, 1.0), (0.9, 0, 1.0), (0.9, -1, 1.0), (0.9, 0, 1.0)]
    reqs = _requests(params, seed=3, max_new=6)
    for i, r in enumerate(reqs):
        r.sampling_params.max_new_tokens = 2 + i
    fast_engine = _engine()
    fast = fast_engine.generate(reqs)
    monkeypatch.setenv("MEGATRON_TLT_SAMPLE_GRAPHS", "0")
    generic_engine = _engine()
    generic = generic_engine.generate(reqs)
    assert fast_engine.decode_runner.num_fast_samples >= 4
    assert generic_engine.decode_runner.num_fast_samples == 0
    for r, a, b in zip(reqs, fast, generic):
        assert a.error is None and len(a.token_ids) == r.sampling_params.max_new_tokens
        assert a.token_ids == b.token_ids
        assert torch.equal(torch.tensor(a.logprobs, dtype=torch.float64),
                           torch.tensor(b.logprobs, dtype=torch.float64))
        assert torch.equal(torch.tensor(a.processed_logprobs, dtype=torch.float64),
                           torch.tensor(b.processed_logprobs, dtype=torch.float64))


def test_sample_streams_routes_rows_to_the_fused_sampler(monkeypatch):
    """With the fused sampler on (forced on CPU under the interpreter), sample_streams gives
    rows with top-k, top-p or a ban the reference sampler's results bit for bit and the
    other rows the fused kernels' bit for bit; the fused sampler's tokens equal the
    reference's on these rows too (its logprobs within rounding)."""
    _interpreted()
    from megatron_tlt.rollout.sampling import sample_streams
    from megatron_tlt.rollout.triton_sample import sample_fused
    monkeypatch.setenv("MEGATRON_TLT_FUSED_SAMPLE", "1")
    logits, temps, keys, draws, top_k, top_p, banned = _stream_case(700, seed=9, banned_row=4)
    v = logits.shape[1]
    filt = torch.tensor([False, False, True, True, True, False])
    out = sample_streams(logits, temps, keys, draws, top_k=top_k, top_p=top_p, banned=banned)
    ref = sample(logits, temps, top_k, top_p, exponential_noise(keys, draws, v, "cpu"), banned)
    fused = sample_fused(logits, temps, keys, draws)
    for o, r, f in zip((out.token_ids, out.logprobs, out.processed_logprobs),
                       (ref.token_ids, ref.logprobs, ref.processed_logprobs), fused):
        assert torch.equal(o[filt], r[filt])
        assert torch.equal(o[~filt], f[~filt])
    assert int(out.token_ids[4]) >= 350
    plain = sample_streams(logits, temps, keys, draws)  # no filters: every row fused
    assert torch.equal(plain.token_ids, fused[0]) and torch.equal(plain.logprobs, fused[1])
    assert torch.equal(plain.token_ids, sample(logits, temps, None, None,
                                               exponential_noise(keys, draws, v, "cpu")).token_ids)

