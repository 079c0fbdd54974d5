"""EAGLE-2 tree drafting replayed from CUDA graphs (spec/eagle_tree_graph.py) on CUDA
(skipped without a GPU): the replays build the trees the same static body builds without
graphs, bit for bit (tokens, parents, float64 candidate scores); in fp32 the trees equal
the per-sequence path's; whole generate calls give the same tokens with and without the
graphs and never draft eagerly."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "unit", "spec"))

from spec_testutil import VOCAB, random_eagle, requests, tokens  # noqa: E402
from test_eagle_graph import GROWS  # noqa: E402
from test_eagle_tree_graph import _close, _run as tree_steps  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_eagle_graph_gpu import _engine, model_dir  # noqa: E402,F401 (the fixture)

from megatron_tlt.spec.decode import SpecDecoder  # noqa: E402
from megatron_tlt.spec.eagle import EagleProposer  # noqa: E402
from megatron_tlt.spec.eagle_tree_graph import TreeGraphs  # noqa: E402
from megatron_tlt.spec.tree import Strategy  # noqa: E402

pytestmark = pytest.mark.gpu


def _no_graphs(prop):
    prop._tree_graphs = TreeGraphs(prop, use_graphs=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature, draft_vocab, strategy",
                         [(0.0, None, Strategy(depth=3, topk=2)),
                          (0.9, 48, Strategy(depth=4, topk=3, num_verify_tokens=9))])
def test_tree_graphs_equal_the_unreplayed_body(model_dir, dtype, temperature, draft_vocab, strategy):
    e = _engine(model_dir, dtype)
    d = random_eagle(e, seed=4, draft_vocab=draft_vocab)
    temps, lengths, caps = [temperature] * 5, [3, 11, 6, 20, 8], [4, 2, 4, 3, 1]
    body, n_b, e_b = tree_steps(d, temps, lengths, caps, strategy, static=True, prepare=_no_graphs)
    scores_b = tree_steps.scores
    graph, n_g, e_g = tree_steps(d, temps, lengths, caps, strategy, static=None)  # None: graphs on CUDA
    scores_g = tree_steps.scores
    assert (n_b, e_b) == (n_g, e_g) == (len(GROWS), 0)
    assert graph == body and scores_g == scores_b
    if dtype == torch.float32:  # the per-sequence path: same trees, scores within 1e-4
        eager, n_e, e_e = tree_steps(d, temps, lengths, caps, strategy, static=False)
        assert (n_e, e_e) == (0, len(GROWS))
        assert graph == eager and _close(scores_g, tree_steps.scores, tol=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_generate_with_tree_graphs_equals_the_unreplayed_body(model_dir, temperature):
    """bf16, 4 prompts x 2 samples, top-2 trees of depth 4, then with forced preemption:
    the same tokens and logprobs with the graphs as without; no eager drafting without
    preemption."""
    reqs = requests(VOCAB["qwen2"], [5, 11, 3, 8], n=2, temperature=temperature, max_new_tokens=32, seed=5)
    for kw in ({}, {"num_blocks": 12}):
        out = {}
        for graphs in (True, False):
            e = _engine(model_dir, torch.bfloat16, **kw)
            prop = EagleProposer(random_eagle(e, seed=2))
            if not graphs:
                _no_graphs(prop)
            e.spec_decoder = SpecDecoder(prop, Strategy(depth=4, topk=2), verify_impl="kernel")
            out[graphs] = (e.generate(reqs), prop)
        (rg, pg), (rb, pb) = out[True], out[False]
        assert pg.tree_graphs().num_replays > 0 and pb.tree_graphs().num_replays == 0
        assert pg.num_eager_steps == pb.num_eager_steps  # the same steps on each path
        assert pg.num_eager_steps == 0 or kw  # re-admissions after preemption may go eager
        assert tokens(rg) == tokens(rb), kw
        assert [r.logprobs for r in rg] == [r.logprobs for r in rb]
        if kw:
            assert sum(r.num_preemptions for r in rg) > 0
