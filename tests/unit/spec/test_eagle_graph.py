"""The static-buffer chain drafter (spec/eagle_graph.py, replayed from CUDA graphs on a
GPU) drafts exactly what the eager batched path drafts: tokens, draft distributions,
fallbacks and noise-stream positions. On CPU it runs eagerly on the same static buffers
and padded shapes (the GPU tests replay the graphs)."""

import dataclasses
import os
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from spec_testutil import (VOCAB, make_engine, one_thread, random_eagle, requests, run,  # noqa: E402,F401
                           spec_models, tokens)

from megatron_tlt.rollout.sampling import SamplingParams, make_noise_stream  # noqa: E402
from megatron_tlt.spec.eagle import EagleProposer  # noqa: E402
from megatron_tlt.spec.tree import Strategy  # noqa: E402

GROWS = (0, 1, 3, 2, 1, 1)


@pytest.fixture(scope="module")
def engines(spec_models):
    return {k: make_engine(v) for k, v in spec_models.items()}


def _seq(seq_id, tokens, temperature, seed=7):
    req = types.SimpleNamespace(sampling_params=SamplingParams(temperature=temperature, max_new_tokens=64),
                                prompt_id=seq_id)
    return types.SimpleNamespace(seq_id=seq_id, token_ids=list(tokens), request=req,
                                 rng=make_noise_stream(seed, seq_id, 0))


def growing(prop, d, lengths, temps, seed):
    """Sequences of random tokens and features (prompt lengths `lengths`, temperatures
    `temps`), observed by `prop`; yields them before each of len(GROWS) propose steps,
    grown by GROWS[i] tokens (with their features) first."""
    g = torch.Generator().manual_seed(seed)
    full, feats = [], []
    for n in lengths:
        full.append(torch.randint(d.arch.vocab_size, (n + sum(GROWS) + 1,), generator=g).tolist())
        feats.append(torch.randn(n + sum(GROWS), d.arch.hidden_size, generator=g))
    seqs = [_seq(i, full[i][:n], t) for i, (n, t) in enumerate(zip(lengths, temps))]
    for s, f in zip(seqs, feats):
        prop.observe(s, 0, f[:len(s.token_ids) - 1])
    for grow in GROWS:
        for s, f, toks in zip(seqs, feats, full):
            if grow:
                n0 = len(s.token_ids)
                s.token_ids = toks[:n0 + grow]
                prop.observe(s, n0 - 1, f[n0 - 1:n0 - 1 + grow])
        yield seqs


def _run(d, temps, lengths, caps, *, static, seed=1, depth=4, perturb_draws=False, prepare=None):
    """Propose steps over sequences growing by GROWS tokens in between (ragged pending
    pairs, the first step with more pairs than a query tile). Returns (trees per step,
    draws per sequence, static steps taken). prepare(proposer), if given, runs right after
    the proposer is built."""
    prop = EagleProposer(d, min_kv_capacity=128)
    prop.static_chains = static
    if prepare is not None:
        prepare(prop)
    steps = []
    for seqs in growing(prop, d, lengths, temps, seed):
        if perturb_draws:
            for s in seqs:
                s.rng.draws += 1
        with torch.no_grad():
            trees = prop.propose(seqs, Strategy(depth=depth), caps, seqs)
        steps.append([(t.tokens, t.parents, None if t.draft_probs is None else t.draft_probs.clone(),
                       t.fallback_reason) for t in trees])
    cg = prop._chain_graphs
    return steps, [s.rng.draws for s in seqs], 0 if cg is None else cg.num_steps


@pytest.mark.parametrize("family, temperature, draft_vocab",
                         [("qwen2", 0.0, None), ("qwen2", 0.9, 48), ("llama", 0.7, None), ("qwen3", 0.0, 48)])
def test_static_chains_equal_eager_batched_chains(engines, family, temperature, draft_vocab):
    """5 sequences (bucket 8: three padding rows), caps 4/2/4/3/1, six steps: the static
    path's trees equal the eager path's bit for bit (tokens, parents, torch.equal draft
    distributions) and the noise streams end at the same draw; it served every step, the
    first too (its 19 pending pairs, more than a query tile, are caught up by an eager
    extend of all but the newest first, on both paths: EagleProposer._catch_up)."""
    d = random_eagle(engines[family], seed=4, draft_vocab=draft_vocab)
    temps, lengths, caps = [temperature] * 5, [3, 11, 6, 20, 8], [4, 2, 4, 3, 1]
    eager, draws_e, n_e = _run(d, temps, lengths, caps, static=False)
    static, draws_s, n_s = _run(d, temps, lengths, caps, static=True)
    assert n_e == 0 and n_s == len(GROWS)
    assert draws_s == draws_e
    for step, (te, ts) in enumerate(zip(eager, static)):
        for i, (a, b) in enumerate(zip(te, ts)):
            assert a[0] == b[0] and a[1] == b[1] and a[3] == b[3], (step, i, a[0], b[0])
            assert len(b[0]) == caps[i] + 1
            assert (a[2] is None) == (b[2] is None) == (temperature == 0.0)
            if a[2] is not None:
                assert torch.equal(a[2], b[2]), (step, i)


def test_static_chains_negative_control_and_fallback_rules(engines):
    """Shifting every noise stream by one draw changes the sampled chains (the comparison
    above can fail); mixed temperatures take the eager path, more pending pairs than a
    query tile do not (caught up first); a non-finite drafter fails the tree exactly as the
    eager path does."""
    d = random_eagle(engines["qwen2"], seed=4)
    temps, lengths, caps = [0.9] * 3, [5, 9, 4], [4, 4, 4]
    base, _, _ = _run(d, temps, lengths, caps, static=True)
    shifted, _, _ = _run(d, temps, lengths, caps, static=True, perturb_draws=True)
    assert any(a[0] != b[0] for sa, sb in zip(base[1:], shifted[1:]) for a, b in zip(sa, sb))
    _, _, n_mixed = _run(d, [0.0, 0.9, 0.9], lengths, caps, static=True)
    assert n_mixed == 0
    _, _, n_long = _run(d, temps, [30, 30, 30], caps, static=True)
    assert n_long == len(GROWS)  # the first step's 29 pairs: caught up, then static
    bad = random_eagle(engines["qwen2"], seed=4)
    with torch.no_grad():
        bad.fc.weight[0, 0] = float("nan")
    e_steps, e_draws, _ = _run(bad, temps, lengths, caps, static=False)
    s_steps, s_draws, n = _run(bad, temps, lengths, caps, static=True)
    assert n == len(GROWS) and s_draws == e_draws  # pending pairs 4, 8, 3: every step static
    assert all(t[3] is not None for t in s_steps[-1])
    assert [[t[3] for t in st] for st in s_steps] == [[t[3] for t in st] for st in e_steps]


@pytest.mark.parametrize("params", [dict(temperature=0.8), dict(temperature=0.8, top_k=40, top_p=0.95),
                                    dict(temperature=0.0)])
def test_generate_with_static_chains_equals_eager_chains(spec_models, params):
    """Whole generate calls (4 prompts x 2 samples, chains of depth 3, forced preemption
    in the second pair of runs): same tokens and logprobs with the static path as with
    the eager batched path, and the static path drafted."""
    from megatron_tlt.spec.eagle import EagleProposer

    def factory(static):
        def make(e):
            p = EagleProposer(random_eagle(e, seed=2), min_kv_capacity=128)
            p.static_chains = static
            return p
        return make

    reqs = requests(VOCAB["qwen2"], [5, 11, 3, 8], n=2, prompt_seed=3, max_new_tokens=14, **params)
    for kw in ({}, {"num_blocks": 12}):
        eager, _ = run(spec_models["qwen2"], reqs, factory(False), Strategy(depth=3), **kw)
        static, engine = run(spec_models["qwen2"], reqs, factory(True), Strategy(depth=3), **kw)
        assert tokens(static) == tokens(eager), kw
        assert [r.logprobs for r in static] == [r.logprobs for r in eager]
        assert engine.spec_decoder.drafter._chain_graphs.num_steps > 0
        if kw:
            assert sum(r.num_preemptions for r in static) > 0


def _deferred_runs(spec_models, drafter_seed, params, defer, *, nan=False, ahead=False, new=14,
                   **engine_kw):
    """One generate call (4 prompts x 2 samples, depth-3 chains on the static path), with
    or without verification on the device's drafts (and the draft-ahead): (results,
    decoder)."""
    from megatron_tlt.spec.decode import SpecDecoder

    def make(e):
        d = random_eagle(e, seed=drafter_seed)
        if nan:  # non-finite at every level: every step falls back
            with torch.no_grad():
                d.fc.weight[0, 0] = float("nan")
        p = EagleProposer(d, min_kv_capacity=128)
        p.static_chains = True
        return p

    reqs = requests(VOCAB["qwen2"], [5, 11, 3, 8], n=2, prompt_seed=3, max_new_tokens=new, **params)
    engine = make_engine(spec_models["qwen2"], **engine_kw)
    engine.spec_decoder = SpecDecoder(make(engine), Strategy(depth=3), defer_drafts=defer,
                                      draft_ahead=ahead)
    return engine.generate(reqs), engine.spec_decoder


@pytest.mark.parametrize("params", [dict(temperature=0.8), dict(temperature=0.0)])
@pytest.mark.parametrize("engine_kw", [{}, {"num_blocks": 12}])
def test_draft_ahead_equals_drafting_after_the_read(spec_models, params, engine_kw):
    """The draft-ahead (the next step's chain drafted from the verification's outputs on
    the device, before the host reads them) gives the tokens, logprobs and acceptance
    counts of drafting after the bookkeeping, with and without forced preemption; most
    steps adopt it, and the steps near max_new_tokens queue none."""
    on, dec_on = _deferred_runs(spec_models, 2, params, True, ahead=True, new=24, **engine_kw)
    off, dec_off = _deferred_runs(spec_models, 2, params, True, new=24, **engine_kw)
    assert dec_off.num_ahead == 0 and dec_on.num_ahead > 0
    assert dec_on.num_adopted > 0.5 * dec_on.num_ahead, (dec_on.num_adopted, dec_on.num_ahead)
    assert dec_on.num_ahead < dec_on.num_deferred  # none in the last steps
    assert tokens(on) == tokens(off)
    assert [r.logprobs for r in on] == [r.logprobs for r in off]
    assert [r.spec_stats["accepted"] for r in on] == [r.spec_stats["accepted"] for r in off]
    if engine_kw:
        assert sum(r.num_preemptions for r in on) > 0


def test_draft_ahead_negative_control(spec_models, monkeypatch):
    """The comparison above sees the draft-ahead's inputs: features taken from the wrong
    rows of the verify forward's hidden states (the root's for every new pair) change the
    drafts, hence the sampled tokens and the acceptance counts."""
    from megatron_tlt.spec import eagle_graph
    base, _ = _deferred_runs(spec_models, 2, dict(temperature=0.8), True, new=24)
    real = eagle_graph.ChainGraphs.launch_ahead

    def wrong_rows(self, launched, verify_out, gidx, hidden):
        return real(self, launched, verify_out, gidx[:, :1].expand_as(gidx).contiguous(), hidden)

    monkeypatch.setattr(eagle_graph.ChainGraphs, "launch_ahead", wrong_rows)
    broken, dec = _deferred_runs(spec_models, 2, dict(temperature=0.8), True, ahead=True, new=24)
    assert dec.num_adopted > 0
    assert tokens(broken) != tokens(base)


@pytest.mark.parametrize("temperature", [0.8, 0.0])
def test_draft_ahead_nan_drafter(spec_models, temperature):
    """Every row failing (non-finite drafter): draft-aheads are queued but none is adopted
    (a failed row decodes plainly), and tokens, logprobs and fallbacks equal the run without."""
    on, dec_on = _deferred_runs(spec_models, 2, dict(temperature=temperature), True, nan=True,
                                ahead=True, new=24)
    off, _ = _deferred_runs(spec_models, 2, dict(temperature=temperature), True, nan=True, new=24)
    assert dec_on.num_ahead > 0 and dec_on.num_adopted == 0
    assert tokens(on) == tokens(off)
    assert [r.logprobs for r in on] == [r.logprobs for r in off]
    assert [r.spec_stats["fallbacks"] for r in on] == [r.spec_stats["fallbacks"] for r in off]


@pytest.mark.parametrize("params", [dict(temperature=0.8), dict(temperature=0.0)])
@pytest.mark.parametrize("engine_kw", [{}, {"num_blocks": 12}])
def test_deferred_drafts_equal_read_back_drafts(spec_models, params, engine_kw):
    """Verifying the chains on the device (SpecDecoder._deferred: placeholder trees, the
    drafts written into the verify inputs on the device) gives the tokens, logprobs and
    acceptance counts of reading them back first, with and without forced preemption."""
    on, dec_on = _deferred_runs(spec_models, 2, params, True, **engine_kw)
    off, dec_off = _deferred_runs(spec_models, 2, params, False, **engine_kw)
    assert dec_on.num_deferred > 0 and dec_off.num_deferred == 0
    assert tokens(on) == tokens(off)
    assert [r.logprobs for r in on] == [r.logprobs for r in off]
    assert [r.spec_stats["accepted"] for r in on] == [r.spec_stats["accepted"] for r in off]
    read_back = sum(b.steps for b in dec_on.metrics.buckets.values()) - dec_on.num_deferred
    assert read_back > 0  # the prefill step at least
    if engine_kw:
        assert sum(r.num_preemptions for r in on) > 0


@pytest.mark.parametrize("temperature", [0.8, 0.0])
def test_chains_near_max_new_tokens_stay_full_depth(spec_models, temperature):
    """A long tail of max_new_tokens (20, 25, ..., 55): chains are not capped by a
    sequence's remaining tokens, so every step after the prefill verifies deferred
    full-depth chains (capped by max_new_tokens, 18 of 55 greedy steps read their drafts
    back), and the tokens past max_new_tokens an accepted path held are dropped: each
    response is exactly max_new_tokens long, with one logprob per token; greedy, the
    tokens of plain decoding."""
    from megatron_tlt.spec.decode import SpecDecoder

    reqs = requests(VOCAB["qwen2"], [5, 11, 3, 8, 6, 9, 4, 7], prompt_seed=3, temperature=temperature,
                    logprobs=True)
    for i, r in enumerate(reqs):
        r.sampling_params = dataclasses.replace(r.sampling_params, max_new_tokens=20 + 5 * i)
    engine = make_engine(spec_models["qwen2"])
    p = EagleProposer(random_eagle(engine, seed=2), min_kv_capacity=128)
    p.static_chains = True
    engine.spec_decoder = dec = SpecDecoder(p, Strategy(depth=3), defer_drafts=True, draft_ahead=True)
    res = engine.generate(reqs)
    steps = sum(b.steps for b in dec.metrics.buckets.values())
    assert steps - dec.num_deferred == 1, (steps, dec.num_deferred)
    assert dec.num_adopted > 0
    assert [len(r.token_ids) for r in res] == [20 + 5 * i for i in range(len(reqs))]
    assert [len(r.logprobs) for r in res] == [len(r.token_ids) for r in res]
    assert all(r.finish_reason == "length" for r in res)
    if temperature == 0.0:
        assert tokens(res) == tokens(make_engine(spec_models["qwen2"]).generate(reqs))


def test_deferred_drafts_negative_control(spec_models, monkeypatch):
    """The comparison above can fail: a deferred step that forgets to move the noise
    streams past the drafts before the verification draws (ChainLaunch.advance_draws
    a no-op) changes the sampled tokens."""
    from megatron_tlt.spec import eagle_graph
    base, _ = _deferred_runs(spec_models, 2, dict(temperature=0.8), False)
    monkeypatch.setattr(eagle_graph.ChainLaunch, "advance_draws", lambda self: None)
    broken, dec = _deferred_runs(spec_models, 2, dict(temperature=0.8), True)
    assert dec.num_deferred > 0
    assert tokens(broken) != tokens(base)


@pytest.mark.parametrize("temperature", [0.8, 0.0])
def test_deferred_drafts_nan_drafter_falls_back_as_read_back(spec_models, temperature):
    """A drafter with non-finite outputs: the deferred step verifies the failed rows as a
    root alone, keeps nothing of it and decodes them plainly, so tokens, logprobs and the
    fallback counts equal the read-back path's (which never verifies them)."""
    on, dec_on = _deferred_runs(spec_models, 2, dict(temperature=temperature), True, nan=True)
    off, dec_off = _deferred_runs(spec_models, 2, dict(temperature=temperature), False, nan=True)
    assert dec_on.num_deferred > 0
    assert tokens(on) == tokens(off)
    assert [r.logprobs for r in on] == [r.logprobs for r in off]
    f_on = [r.spec_stats["fallbacks"] for r in on]
    assert f_on == [r.spec_stats["fallbacks"] for r in off] and min(f_on) > 0
    assert [r.spec_stats["accepted"] for r in on] == [0] * len(on)
    assert dec_on.metrics.buckets and sum(b.fallbacks for b in dec_on.metrics.buckets.values()) == \
        sum(b.fallbacks for b in dec_off.metrics.buckets.values())


def test_admissions_under_continuous_batching_stay_on_the_static_path(spec_models, monkeypatch):
    """6 requests with prompts longer than a query tile, at most 2 running: every admission
    brings a sequence with ~20 pending pairs into a running batch. With the catch-up
    (EagleProposer._catch_up) no proposal takes the eager path, and the tokens equal the
    eager path's; without it (control) the steps with a newcomer go eager."""
    from megatron_tlt.spec.decode import SpecDecoder

    def go(static):
        engine = make_engine(spec_models["qwen2"], max_num_seqs=2, num_blocks=96)
        prop = EagleProposer(random_eagle(engine, seed=2), min_kv_capacity=128)
        prop.static_chains = static
        engine.spec_decoder = SpecDecoder(prop, Strategy(depth=3))
        reqs = requests(VOCAB["qwen2"], [21, 19, 23, 18, 25, 20], prompt_seed=5, max_new_tokens=9,
                        temperature=0.8)
        return engine.generate(reqs), prop

    res_s, prop_s = go(True)
    res_e, prop_e = go(False)
    assert prop_s.num_eager_steps == 0 and prop_s._chain_graphs.num_steps > 6
    assert prop_e.num_eager_steps > 0
    assert tokens(res_s) == tokens(res_e)
    assert [r.logprobs for r in res_s] == [r.logprobs for r in res_e]
    monkeypatch.setattr(EagleProposer, "_catch_up", lambda self, seqs: None)
    _, prop_c = go(True)
    assert prop_c.num_eager_steps > 0


def test_deferred_drafts_batch_limit(spec_models, monkeypatch):
    """defer_drafts=N defers steps of at most N drafting sequences (8 requests running
    together: fewer deferred steps at N=4 than at N=8, same tokens); the environment's
    setting is read when defer_drafts is None, and a bad value is an error; the same for
    the draft-ahead's MEGATRON_TLT_SPEC_AHEAD."""
    from megatron_tlt.errors import ConfigError
    from megatron_tlt.spec.decode import DEFER_MAX_BATCH, SpecDecoder
    from megatron_tlt.spec.eagle import EagleProposer as P
    r4, d4 = _deferred_runs(spec_models, 2, dict(temperature=0.8), 4)
    r8, d8 = _deferred_runs(spec_models, 2, dict(temperature=0.8), 8)
    assert d4.num_deferred < d8.num_deferred
    assert tokens(r4) == tokens(r8)
    e = make_engine(spec_models["qwen2"])
    monkeypatch.delenv("MEGATRON_TLT_SPEC_DEFER", raising=False)
    assert SpecDecoder(P(random_eagle(e))).defer_max_batch == DEFER_MAX_BATCH
    monkeypatch.setenv("MEGATRON_TLT_SPEC_DEFER", "0")
    assert SpecDecoder(P(random_eagle(e))).defer_max_batch == 0
    assert SpecDecoder(P(random_eagle(e)), defer_drafts=True).defer_max_batch >= 1 << 20
    monkeypatch.setenv("MEGATRON_TLT_SPEC_DEFER", "yes")
    with pytest.raises(ConfigError, match="MEGATRON_TLT_SPEC_DEFER"):
        SpecDecoder(P(random_eagle(e)))
    # The draft-ahead and the verify-ahead: on unless MEGATRON_TLT_SPEC_AHEAD=0 /
    # MEGATRON_TLT_SPEC_VERIFY_AHEAD=0 (defaults since sessions 14 and 16's H200 benches);
    # an explicit argument wins; a bad value is an error.
    monkeypatch.delenv("MEGATRON_TLT_SPEC_DEFER", raising=False)
    for env, attr in (("MEGATRON_TLT_SPEC_AHEAD", "draft_ahead"),
                      ("MEGATRON_TLT_SPEC_VERIFY_AHEAD", "verify_ahead")):
        monkeypatch.delenv("MEGATRON_TLT_SPEC_AHEAD", raising=False)
        monkeypatch.delenv("MEGATRON_TLT_SPEC_VERIFY_AHEAD", raising=False)
        assert getattr(SpecDecoder(P(random_eagle(e))), attr) is True
        assert getattr(SpecDecoder(P(random_eagle(e)), **{attr: False}), attr) is False
        monkeypatch.setenv(env, "0")
        assert getattr(SpecDecoder(P(random_eagle(e))), attr) is False
        assert getattr(SpecDecoder(P(random_eagle(e)), **{attr: True}), attr) is True
        monkeypatch.setenv(env, "yes")
        with pytest.raises(ConfigError, match=env):
            SpecDecoder(P(random_eagle(e)))


def test_draft_ahead_under_continuous_batching(spec_models):
    """At most 2 of 6 requests running, ragged lengths and 12 of the 300 ids as stop
    tokens, so sequences finish at steps the draft-ahead could not foresee and newcomers
    join: draft-aheads whose batch changed are dropped, and tokens and logprobs equal the
    run without draft-aheads."""
    from megatron_tlt.spec.decode import SpecDecoder

    def go(ahead):
        engine = make_engine(spec_models["qwen2"], max_num_seqs=2, num_blocks=96,
                             eos_token_ids=tuple(range(12)))
        prop = EagleProposer(random_eagle(engine, seed=2), min_kv_capacity=128)
        prop.static_chains = True
        engine.spec_decoder = SpecDecoder(prop, Strategy(depth=3), draft_ahead=ahead)
        reqs = requests(VOCAB["qwen2"], [21, 19, 23, 18, 25, 20], prompt_seed=5, temperature=0.8)
        for r, m in zip(reqs, [30, 12, 25, 9, 40, 16]):  # ragged: finishes at different steps
            r.sampling_params = dataclasses.replace(r.sampling_params, max_new_tokens=m)
        return engine.generate(reqs), engine.spec_decoder

    on, dec = go(True)
    off, _ = go(False)
    assert 0 < dec.num_adopted < dec.num_ahead, (dec.num_adopted, dec.num_ahead)  # some dropped
    assert len({len(r.token_ids) for r in on}) > 3  # finished at different lengths
    assert tokens(on) == tokens(off)
    assert [r.logprobs for r in on] == [r.logprobs for r in off]


@pytest.mark.parametrize("temperature", [0.8, 0.0])
def test_static_chains_up_to_max_position(spec_models, temperature):
    """Sequences that grow to the drafter's last RoPE position (prompt + new tokens =
    max_position_embeddings = max_model_len): the static path's padding rows (tile rows
    past a sequence's pairs, chain levels past its cap) stay inside the RoPE table, and
    tokens and logprobs equal the eager path's (with the draft-ahead on: it stops before
    the end). Before the positions were clamped this raised an IndexError on CPU (a
    device-side assert on a GPU) a query tile before the end."""
    from megatron_tlt.spec.decode import SpecDecoder

    def go(static):
        engine = make_engine(spec_models["qwen2"], max_num_seqs=2, num_blocks=96)
        top = engine.arch.max_position_embeddings
        assert engine.max_model_len == top
        prop = EagleProposer(random_eagle(engine, seed=2), min_kv_capacity=256)
        prop.static_chains = static
        engine.spec_decoder = SpecDecoder(prop, Strategy(depth=4), draft_ahead=static)
        reqs = requests(VOCAB["qwen2"], [9, 14], prompt_seed=6, temperature=temperature)
        for r in reqs:
            r.sampling_params = dataclasses.replace(r.sampling_params,
                                                    max_new_tokens=top - len(r.prompt_token_ids))
        return engine.generate(reqs), prop

    res_s, prop_s = go(True)
    res_e, _ = go(False)
    assert prop_s._chain_graphs.num_steps > 0 and prop_s.num_eager_steps == 0
    assert all(r.error is None for r in res_s)
    assert [len(r.token_ids) for r in res_s] == [128 - 9, 128 - 14]  # to the last position
    assert tokens(res_s) == tokens(res_e)
    assert [r.logprobs for r in res_s] == [r.logprobs for r in res_e]


def test_draft_ahead_deeper_than_a_tile_queues_nothing(spec_models):
    """A chain of depth QUERY_TILE could bring QUERY_TILE + 1 new pairs to the next step,
    more than the static extend takes: no draft-ahead is queued (none raised), and the
    tokens equal the run without."""
    from megatron_tlt.spec.decode import SpecDecoder
    from megatron_tlt.spec.drafter_kv import QUERY_TILE

    def go(ahead):
        engine = make_engine(spec_models["qwen2"], max_num_seqs=2, num_blocks=96)
        prop = EagleProposer(random_eagle(engine, seed=2), min_kv_capacity=256)
        prop.static_chains = True
        engine.spec_decoder = SpecDecoder(prop, Strategy(depth=QUERY_TILE), draft_ahead=ahead)
        reqs = requests(VOCAB["qwen2"], [7, 12], prompt_seed=6, temperature=0.8, max_new_tokens=60)
        return engine.generate(reqs), engine.spec_decoder

    on, dec = go(True)
    off, _ = go(False)
    assert dec.num_deferred > 0 and dec.num_ahead == 0
    assert tokens(on) == tokens(off)


@pytest.mark.parametrize("defer", [0, 64], ids=["read_back", "deferred"])
def test_one_hot_chains(spec_models, defer, monkeypatch):
    """EagleProposer.one_hot_chains at T=0.8: the static path drafts argmax chains (its
    graphs are the greedy ones, no draft distributions) and gives the tokens and logprobs
    of the eager batched path; deferred verification (the drafts read where they are)
    gives those of reading them back; the drafts are verified as one-hot proposals (the
    fast path's one_hot math). Control: the sampled chains of the
    same drafter emit other texts (they draw the drafts from the stream, the verification
    other draws)."""
    from megatron_tlt.spec.decode import SpecDecoder

    def make(static, one_hot=True):
        def f(e):
            p = EagleProposer(random_eagle(e, seed=2), min_kv_capacity=128)
            p.static_chains, p.one_hot_chains = static, one_hot
            return p
        return f

    from megatron_tlt.spec.eagle_graph import ChainGraphs
    settings = []
    run_graph = ChainGraphs._run
    monkeypatch.setattr(ChainGraphs, "_run", lambda self, b, depth, setting, buf:
                        settings.append(setting) or run_graph(self, b, depth, setting, buf))
    from megatron_tlt.spec.verify_math import VerifyMath
    modes = []
    plan = VerifyMath.plan
    monkeypatch.setattr(VerifyMath, "plan", staticmethod(lambda *a: modes.append(plan(*a)) or modes[-1]))
    reqs = requests(VOCAB["qwen2"], [5, 11, 3, 8], n=2, prompt_seed=3, max_new_tokens=14, temperature=0.8)
    out = {}
    for name, static, one_hot, d in (("static", True, True, defer), ("eager", False, True, 0),
                                     ("sampled", True, False, defer)):
        engine = make_engine(spec_models["qwen2"])
        engine.spec_decoder = SpecDecoder(make(static, one_hot)(engine), Strategy(depth=3), defer_drafts=d)
        out[name] = (engine.generate(reqs), engine.spec_decoder, modes[:], settings[:])
        settings.clear()
        modes.clear()
    (rs, ds, ms, ss), (re_, de, _, _), (rsm, _, _, ssm) = out["static"], out["eager"], out["sampled"]
    assert tokens(rs) == tokens(re_) and [r.logprobs for r in rs] == [r.logprobs for r in re_]
    assert ds.drafter._chain_graphs.num_steps > 0 and set(ss) == {("greedy",)}
    assert ssm and all(x[0] == "sampled" for x in ssm)
    assert ms and {m.mode for m in ms if m is not None} == {"one_hot"}
    assert ds.metrics.summary()["total"]["drafted"] > 0  # (a random drafter's argmax is
    # rarely accepted by this flat target: the one-hot rule's acceptance is tested in
    # test_lossless / test_verify_fast with the n-gram drafter's one-hot proposals)
    if defer:
        assert ds.num_deferred > 0
    assert tokens(rsm) != tokens(rs)
