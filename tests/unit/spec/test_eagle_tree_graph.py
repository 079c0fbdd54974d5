"""The static-buffer tree drafter (spec/eagle_tree_graph.py; CUDA graphs on a GPU, run
eagerly on the same static buffers here) builds the trees the per-sequence tree path
builds: same tokens and parents (its attention differs in rounding only, over the slot
plus the tree's own keys instead of exactly each node's keys), same fallbacks; and whole
generate calls with static trees emit exactly plain decoding's greedy tokens."""

import os
import sys
from unittest import mock

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from spec_testutil import (VOCAB, make_engine, one_thread, random_eagle, requests, run,  # noqa: E402,F401
                           spec_models, tokens)
from test_eagle_graph import GROWS, growing  # noqa: E402

from megatron_tlt.spec import eagle_tree_graph  # noqa: E402
from megatron_tlt.spec.eagle import EagleProposer  # noqa: E402
from megatron_tlt.spec.tree import Strategy, TreeBuilder  # noqa: E402


@pytest.fixture(scope="module")
def engines(spec_models):
    return {k: make_engine(v) for k, v in spec_models.items()}


def _close(a: list[list[float]], b: list[list[float]], tol: float = 1e-5) -> bool:
    """The candidates' cumulative log-probabilities agree (both paths' -inf alike)."""
    return len(a) == len(b) and all(
        len(x) == len(y) and torch.allclose(torch.tensor(x), torch.tensor(y), rtol=tol, atol=tol)
        for x, y in zip(a, b))


def _run(d, temps, lengths, caps, strategy, *, static, seed=1, top_k=0, prepare=None):
    """Propose steps over sequences growing by GROWS tokens in between (as
    test_eagle_graph._run). Returns (trees per step as (tokens, parents, fallback), static
    steps, eager steps); `_run.scores` then holds every builder's candidate scores before
    the selection, in the order built. prepare(proposer), if given, runs right after the
    proposer is built."""
    built = _run.scores = []
    result = TreeBuilder.result

    def recording(self, *a, **k):
        built.append(list(self.scores))
        return result(self, *a, **k)
    prop = EagleProposer(d, min_kv_capacity=128)
    prop.static_trees = static
    if prepare is not None:
        prepare(prop)
    steps = []
    for seqs in growing(prop, d, lengths, temps, seed):
        for s in seqs:
            s.request.sampling_params.top_k = top_k
        with torch.no_grad(), mock.patch.object(TreeBuilder, "result", recording):
            trees = prop.propose(seqs, strategy, caps, seqs)
        assert all(t.draft_probs is None for t in trees)  # trees are one-hot proposals
        steps.append([(t.tokens, t.parents, t.fallback_reason) for t in trees])
    tg = prop._tree_graphs
    return steps, 0 if tg is None else tg.num_steps, prop.num_eager_steps


CASES = [("qwen2", 0.0, None, Strategy(depth=3, topk=2)),
         ("qwen2", 0.9, 48, Strategy(depth=4, topk=3, num_verify_tokens=9)),
         ("llama", 0.7, None, Strategy(depth=2, topk=4)),
         ("qwen3", 0.0, 48, Strategy(depth=4, topk=2, num_verify_tokens=6))]


@pytest.mark.parametrize("family, temperature, draft_vocab, strategy", CASES)
def test_static_trees_equal_eager_trees(engines, family, temperature, draft_vocab, strategy):
    """5 sequences (bucket 8: three padding rows), caps 4/2/4/3/1, six steps: the same
    trees (tokens, parents) as the per-sequence path, every candidate's score within 1e-5,
    every step on the static path."""
    d = random_eagle(engines[family], seed=4, draft_vocab=draft_vocab)
    temps, lengths, caps = [temperature] * 5, [3, 11, 6, 20, 8], [4, 2, 4, 3, 1]
    eager, n_se, n_ee = _run(d, temps, lengths, caps, strategy, static=False)
    scores_e = _run.scores
    static, n_ss, n_es = _run(d, temps, lengths, caps, strategy, static=True)
    assert _close(_run.scores, scores_e)
    assert (n_se, n_ee) == (0, len(GROWS)) and (n_ss, n_es) == (len(GROWS), 0)
    sizes = set()
    for step, (te, ts) in enumerate(zip(eager, static)):
        for i, (a, b) in enumerate(zip(te, ts)):
            assert a == b, (step, i, a, b)
            assert b[2] is None
            sizes.add(len(b[0]))
    assert max(sizes) == strategy.num_draft_nodes + 1  # full trees where the cap allows
    assert min(sizes) <= strategy.topk + 1  # the cap-1 sequence: one level


def test_static_trees_top_k_and_negative_control(engines, monkeypatch):
    """A sampling top_k below the tree's width leaves -inf candidates (fewer frontier
    nodes): still the eager trees. Negative control: static lanes that do not see their
    tree ancestors give other candidate scores than the eager path (the score comparison
    can fail; the trees' tokens, ranked on those scores, here happen not to move)."""
    d = random_eagle(engines["qwen2"], seed=5)
    temps, lengths, caps, st = [0.8] * 3, [5, 9, 4], [4, 4, 4], Strategy(depth=4, topk=3)
    eager, _, _ = _run(d, temps, lengths, caps, st, static=False, top_k=2)
    scores_e = _run.scores
    static, n, _ = _run(d, temps, lengths, caps, st, static=True, top_k=2)
    assert n == len(GROWS) and static == eager and _close(_run.scores, scores_e)
    assert all(t[1].count(0) == 2 for step in static for t in step)  # 2 of 3 at depth 1

    real = eagle_tree_graph.attend_tree

    def blind(q, sk, sv, ss, tk, tv, seen, scale):
        eye = torch.zeros_like(seen)
        k = seen.shape[1]
        lvl = int(seen.sum(-1).max()) - 1  # this level's lanes see lvl ancestors and themselves
        eye[:, torch.arange(k), lvl * k + torch.arange(k)] = True
        return real(q, sk, sv, ss, tk, tv, eye, scale)
    monkeypatch.setattr(eagle_tree_graph, "attend_tree", blind)
    _run(d, [0.0] * 3, lengths, caps, st, static=False)
    scores_e = _run.scores
    _run(d, [0.0] * 3, lengths, caps, st, static=True)
    assert not _close(_run.scores, scores_e)


def test_static_trees_fallbacks_and_eligibility(engines):
    """A non-finite drafter fails the trees exactly where the per-sequence path does;
    mixed temperatures and more than MAX_TREE_BUCKET sequences take the eager path."""
    bad = random_eagle(engines["qwen2"], seed=4)
    with torch.no_grad():
        bad.fc.weight[0, 0] = float("nan")
    st = Strategy(depth=3, topk=2)
    lengths, caps = [5, 9, 4], [3, 3, 3]
    e_steps, _, _ = _run(bad, [0.9] * 3, lengths, caps, st, static=False)
    s_steps, n, _ = _run(bad, [0.9] * 3, lengths, caps, st, static=True)
    assert n == len(GROWS) and all(t[2] is not None for t in s_steps[-1])
    assert [[t[2] for t in step] for step in s_steps] == [[t[2] for t in step] for step in e_steps]
    d = random_eagle(engines["qwen2"], seed=4)
    _, n_mixed, e_mixed = _run(d, [0.0, 0.9, 0.9], lengths, caps, st, static=True)
    assert (n_mixed, e_mixed) == (0, len(GROWS))
    many = eagle_tree_graph.MAX_TREE_BUCKET + 1
    _, n_many, e_many = _run(d, [0.0] * many, [5] * many, [3] * many, st, static=True)
    assert (n_many, e_many) == (0, len(GROWS))


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_generate_greedy_static_trees_equal_plain(spec_models, family):
    """Whole generate calls (4 prompts x 2 samples, trees of depth 3 x top-2, then with
    forced preemption): greedy tokens equal plain decoding's, the static path drafted
    and accepted draft tokens."""
    def make(e):
        p = EagleProposer(random_eagle(e, seed=2), min_kv_capacity=128)
        p.static_trees = True
        return p

    reqs = requests(VOCAB[family], [5, 11, 3, 8], n=2, prompt_seed=3, max_new_tokens=14)
    for kw in ({}, {"num_blocks": 12}):
        plain, _ = run(spec_models[family], reqs, **kw)
        spec, engine = run(spec_models[family], reqs, make, Strategy(depth=3, topk=2), **kw)
        assert tokens(spec) == tokens(plain), kw
        drafter = engine.spec_decoder.drafter
        assert drafter._tree_graphs.num_steps > 0
        assert drafter.num_eager_steps == 0 or kw
        if kw:
            assert sum(r.num_preemptions for r in spec) > 0


def test_generate_sampled_static_trees_equal_eager_trees(spec_models):
    """Sampled (T = 0.8): the static and the per-sequence tree paths propose the same
    trees, so generate emits the same tokens with either (the verification's draws do not
    depend on the drafting path)."""
    def make(static):
        def f(e):
            p = EagleProposer(random_eagle(e, seed=2), min_kv_capacity=128)
            p.static_trees = static
            return p
        return f

    reqs = requests(VOCAB["llama"], [5, 11, 3, 8], n=2, prompt_seed=4, max_new_tokens=14, temperature=0.8)
    eager, _ = run(spec_models["llama"], reqs, make(False), Strategy(depth=3, topk=3))
    static, engine = run(spec_models["llama"], reqs, make(True), Strategy(depth=3, topk=3))
    assert tokens(static) == tokens(eager)
    assert engine.spec_decoder.drafter._tree_graphs.num_steps > 0
    assert engine.spec_decoder.drafter.num_eager_steps == 0


def test_schedule_of_trees_and_chains_equals_plain(spec_models):
    """--spec-depth 1:3x2,8:2: top-2 trees while one sequence runs, chains above, both on
    their static paths; responses of different lengths shrink the batch to one, so one
    generate call switches between them (and drops the chains' draft-aheads); greedy
    tokens equal plain decoding's."""
    from megatron_tlt.rollout import Request, SamplingParams
    from megatron_tlt.spec.decode import SpecDecoder, depth_policy
    from spec_testutil import prompts

    reqs = [Request(prompt_id=i, sample_index=0, prompt_token_ids=p,
                    sampling_params=SamplingParams(temperature=0.0, max_new_tokens=4 + 6 * i))
            for i, p in enumerate(prompts(VOCAB["qwen2"], [5, 11, 3, 8], seed=3))]
    plain = make_engine(spec_models["qwen2"]).generate(reqs)
    engine = make_engine(spec_models["qwen2"])
    prop = EagleProposer(random_eagle(engine, seed=2), min_kv_capacity=128)
    prop.static_trees = prop.static_chains = True
    engine.spec_decoder = SpecDecoder(prop, policy=depth_policy("1:3x2,8:2"))
    spec = engine.generate(reqs)
    assert tokens(spec) == tokens(plain)
    assert prop._tree_graphs.num_steps > 0 and prop._chain_graphs.num_steps > 0
    assert prop.num_eager_steps == 0
