"""Draft trees: strategy checks, masks and positions, EAGLE-2 reranking, tree building."""

import pytest
import torch

from megatron_tlt.errors import ConfigError
from megatron_tlt.spec.tree import (DraftTree, Strategy, TreeBatch, TreeBuilder, ancestor_mask,
                                    chain, node_depths, select_top_nodes, trie)


def test_strategy_checks_and_sizes():
    assert Strategy(depth=4).num_draft_nodes == 4
    assert Strategy(depth=4, num_verify_tokens=3).num_draft_nodes == 2
    assert Strategy(depth=3, topk=2).num_draft_nodes == 6
    assert Strategy(depth=3, topk=2, num_verify_tokens=100).num_draft_nodes == 2 + 2 * 4
    assert Strategy(depth=2, topk=3, num_verify_tokens=5).as_dict() == \
        {"depth": 2, "topk": 3, "num_verify_tokens": 5}
    with pytest.raises(ConfigError, match="spec depth must be an integer >= 1, got 0"):
        Strategy(depth=0)
    with pytest.raises(ConfigError, match="spec topk must be"):
        Strategy(topk=1.5)
    with pytest.raises(ConfigError, match="num_verify_tokens must be an integer >= 2"):
        Strategy(num_verify_tokens=1)


def test_masks_depths_and_padding():
    # root 0; 1, 2 children of 0; 3 child of 1; 4 child of 3; 5 child of 2
    t = DraftTree([9, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 3, 2])
    c = chain(7, [8])
    batch = TreeBatch.pack([t, c], [10, 4], vocab=16)
    assert batch.parents[1].tolist() == [-1, 0, -1, -1, -1, -1]
    assert batch.draft_tokens[1].tolist() == [7, 8, -1, -1, -1, -1]
    assert batch.query_tokens[1].tolist() == [7, 8, 0, 0, 0, 0]
    assert batch.positions.tolist() == [[10, 11, 11, 12, 13, 12], [4, 5, 4, 4, 4, 4]]
    assert batch.max_depth == 3 and batch.num_nodes == [6, 2]
    m = batch.tree_mask
    assert m[0, 4].tolist() == [True, True, False, True, True, False]
    assert m[0, 5].tolist() == [True, False, True, False, False, True]
    assert m[1, 3].tolist() == [False, False, False, True, False, False]  # padding: itself only
    assert torch.equal(ancestor_mask(batch.parents), m)
    assert node_depths(batch.parents)[0].tolist() == [0, 1, 1, 2, 3, 2]
    assert batch.draft_probs is None


def test_pack_mixes_sampled_and_one_hot():
    probs = torch.zeros(3, 5)
    probs[1] = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    probs[2] = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0])
    sampled = DraftTree([0, 3, 2], [-1, 0, 1], probs)
    one_hot = chain(1, [4])
    b = TreeBatch.pack([sampled, one_hot], [0, 0], vocab=5)
    assert torch.equal(b.draft_probs[0], probs)
    assert b.draft_probs[1, 1].tolist() == [0, 0, 0, 0, 1] and b.draft_probs[1, 0].sum() == 0


def test_select_top_nodes_is_closed_under_ancestors():
    scores = [0.0, -0.1, -2.0, -0.1, -0.3, -2.5]  # node 3 (child of 1) ties its parent
    parents = [-1, 0, 0, 1, 3, 2]
    assert select_top_nodes(scores, parents, 3) == [1, 3, 4]
    assert select_top_nodes(scores, parents, 1) == [1]
    # A (malformed) score that would orphan a node pulls its ancestors in.
    assert select_top_nodes([0.0, -5.0, -0.1], [-1, 0, 1], 1) == [1, 2]


def test_trie_merges_shared_prefixes():
    t = trie(5, [[1, 2, 3], [1, 2, 4], [7]], max_nodes=10)
    assert t.tokens == [5, 1, 2, 3, 4, 7] and t.parents == [-1, 0, 1, 2, 2, 0]
    t = trie(5, [[1, 2, 3], [9, 9]], max_nodes=4)
    assert t.tokens == [5, 1, 2, 3, 9] and t.num_drafts == 4
    assert trie(5, [], 4).num_drafts == 0


def test_truncate_depth():
    t = DraftTree([9, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 3, 2])
    u = t.truncate_depth(1)
    assert u.tokens == [9, 1, 2] and u.parents == [-1, 0, 0]
    assert t.truncate_depth(2).tokens == [9, 1, 2, 3, 5]
    assert t.truncate_depth(5) is t


def test_tree_builder():
    v = 6
    b = TreeBuilder(0, Strategy(depth=2, topk=2, num_verify_tokens=4), max_depth=5)
    assert b.frontier == [0]
    b.expand_topk(torch.log(torch.tensor([[0.05, 0.5, 0.3, 0.05, 0.05, 0.05]])))
    assert b.tokens == [0, 1, 2] and b.frontier == [1, 2]
    b.expand_topk(torch.log(torch.tensor([[0.9, 0.1, 0, 0, 0, 0], [0.0, 0.0, 0.5, 0.5, 0, 0]])))
    # candidates: 1->0 (0.45), 1->1 (0.05), 2->2 (0.15), 2->3 (0.15): ties keep order
    assert b.tokens[3:] == [0, 2, 3, 1] and b.done
    r = b.result(v)
    assert r.tokens == [0, 1, 2, 0] and r.parents == [-1, 0, 0, 1]  # best 3 of 6 candidates
    c = TreeBuilder(4, Strategy(depth=3), max_depth=2)
    for _ in range(2):
        c.expand_sampled(3, torch.full((v,), 1 / v))
    assert c.done and c.result(v).tokens == [4, 3, 3] and c.result(v).draft_probs.shape == (3, v)
    # topk beyond a (reduced) draft vocabulary: every token a child (an IndexError before,
    # which took the engine's whole batch down)
    t = TreeBuilder(0, Strategy(depth=1, topk=3, num_verify_tokens=4), max_depth=5)
    t.expand_topk(torch.log(torch.tensor([[0.25, 0.75]])), lambda ids: ids + 10)
    assert t.tokens == [0, 11, 10] and t.done
    f = TreeBuilder(4, Strategy(depth=3), max_depth=2)
    f.fail("nan")
    assert f.done and f.result(v).fallback_reason == "nan" and f.result(v).num_drafts == 0


def test_make_dummy_shapes():
    b = TreeBatch.make_dummy(batch=3, depth=2, topk=2)
    assert b.parents.shape == (3, 7) and b.tree_mask.shape == (3, 7, 7)
    assert bool(b.tree_mask.diagonal(dim1=1, dim2=2).all())
