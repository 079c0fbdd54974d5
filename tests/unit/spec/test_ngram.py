"""Model-free n-gram drafter: suffix matching over the sequence, its group and a
per-prompt store; chains and small trees; deterministic; lossless in the engine."""

import os
import sys
import types

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from spec_testutil import VOCAB, make_engine, one_thread, requests, run, spec_models  # noqa: E402,F401

from megatron_tlt.errors import ConfigError  # noqa: E402
from megatron_tlt.spec.decode import SpecDecoder  # noqa: E402
from megatron_tlt.spec.ngram import NgramDrafter, SuffixIndex  # noqa: E402
from megatron_tlt.spec.tree import Strategy  # noqa: E402

_ids = iter(range(10**6))


def seq(tokens, prompt_len=3, prompt_id="p", finish=None):
    return types.SimpleNamespace(seq_id=next(_ids), token_ids=list(tokens), prompt_len=prompt_len,
                                 request=types.SimpleNamespace(prompt_id=prompt_id),
                                 finish_reason=finish)


def test_suffix_index():
    idx = SuffixIndex(1, 3)
    idx.extend([1, 2, 3, 1, 2, 4, 1, 2])
    assert idx.continuations((1, 2), 2, 5) == [[4, 1], [3, 1]]  # newest first; not the tail itself
    assert idx.continuations((2, 3, 1), 9, 5) == [[2, 4, 1, 2]]
    assert idx.continuations((7,), 2, 5) == []
    idx.sync([1, 2, 3, 1, 2, 4, 1, 2, 5])
    assert idx.continuations((1, 2), 1, 1) == [[5]]


def test_chain_prefers_longest_suffix_and_own_sequence():
    d = NgramDrafter(max_ngram=3)
    s = seq([9, 1, 2, 3, 8, 8, 2, 3, 5, 1, 2, 3])
    (tree,) = d.propose([s], Strategy(depth=3), [3], [s])
    assert tree.tokens == [3, 8, 8, 2]  # "1 2 3" matched at 1..3, not "2 3" at 6..7
    assert tree.draft_probs is None
    (tree,) = d.propose([s], Strategy(depth=5, num_verify_tokens=3), [5], [s])
    assert tree.tokens == [3, 8, 8]  # num_verify_tokens caps the chain
    (tree,) = d.propose([s], Strategy(depth=5), [1], [s])
    assert tree.tokens == [3, 8]  # depth cap from the budget
    lonely = seq([4, 5, 6, 7])
    (tree,) = d.propose([lonely], Strategy(depth=3), [3], [lonely])
    assert tree.num_drafts == 0


def test_group_members_and_store():
    d = NgramDrafter(max_ngram=2)
    prompt = [4, 5, 6]
    ahead = seq(prompt + [10, 11, 12, 13, 14])
    behind = seq(prompt + [10, 11])
    stranger = seq([1, 1, 1, 10, 11, 99], prompt_id="other")
    (tree,) = d.propose([behind], Strategy(depth=3), [3], [ahead, behind, stranger])
    assert tree.tokens == [11, 12, 13, 14]  # from the group member, not the other prompt
    # Same prompt_id with a different prompt is another group.
    impostor = seq([7, 7, 7, 10, 11])
    (tree,) = d.propose([impostor], Strategy(depth=3), [3], [ahead, impostor])
    assert tree.num_drafts == 0
    # Finished responses feed the per-prompt store, which outlives the sequences.
    ahead.finish_reason = "stop"
    d.finish(ahead)
    d.reset()  # a new generate call: no live sequences
    later = seq(prompt + [10])
    (tree,) = d.propose([later], Strategy(depth=2), [2], [later])
    assert tree.tokens == [10, 11, 12]
    d.clear_store()
    (tree,) = d.propose([later], Strategy(depth=2), [2], [later])
    assert tree.num_drafts == 0


def test_tree_of_distinct_continuations():
    d = NgramDrafter(max_ngram=2)
    s = seq([1, 2, 7, 8, 0, 1, 2, 7, 9, 0, 1, 2, 5, 0, 1, 2])
    (tree,) = d.propose([s], Strategy(depth=2, topk=3, num_verify_tokens=6), [2], [s])
    # newest first: "5 0", "7 9", "7 8" merged into a prefix tree
    assert tree.tokens == [2, 5, 0, 7, 9, 8] and tree.parents == [-1, 0, 1, 0, 3, 3]
    again, = d.propose([s], Strategy(depth=2, topk=3, num_verify_tokens=6), [2], [s])
    assert again.tokens == tree.tokens  # deterministic


def test_bad_config():
    with pytest.raises(ConfigError, match="1 <= min_ngram"):
        NgramDrafter(max_ngram=2, min_ngram=3)


def test_store_speeds_up_repeated_prompts(spec_models):
    """GRPO-like: the same prompts again (a later step) draft from earlier responses."""
    d = spec_models["llama"]
    engine = make_engine(d)
    engine.spec_decoder = SpecDecoder(NgramDrafter(max_ngram=3), Strategy(depth=4))
    reqs = requests(VOCAB["llama"], [5, 7], max_new_tokens=24)
    first = engine.generate(reqs)
    m1 = engine.spec_decoder.metrics.summary()["total"]
    engine.spec_decoder.metrics.reset()
    second = engine.generate(reqs)
    m2 = engine.spec_decoder.metrics.summary()["total"]
    assert [r.token_ids for r in first] == [r.token_ids for r in second]
    base, _ = run(d, reqs)
    assert [r.token_ids for r in base] == [r.token_ids for r in first]
    assert m2["acceptance_length"] > max(2.5, m1["acceptance_length"] or 1.0), (m1, m2)


def test_store_state_replays_sampled_tokens_after_a_restart(spec_models):
    """At temperature 1 the n-gram drafts decide which coins test which tokens, so the
    store changes the tokens (still the target's distribution): a second generate call of
    the same requests and seeds differs from the first. A fresh engine (a resumed run)
    whose drafter loads the first engine's store (state_dict through torch.save) samples
    the second call's tokens exactly; without it, the first call's (the negative control:
    what a resumed RL run replayed before its store was checkpointed)."""
    import io

    import torch

    d = spec_models["llama"]

    def engine():
        e = make_engine(d)
        e.spec_decoder = SpecDecoder(NgramDrafter(max_ngram=3), Strategy(depth=4))
        return e

    reqs = requests(VOCAB["llama"], [5, 7], n=2, temperature=1.0, max_new_tokens=32, seed=7)
    first_engine = engine()
    first = [r.token_ids for r in first_engine.generate(reqs)]
    buf = io.BytesIO()
    torch.save(first_engine.spec_decoder.drafter.state_dict(), buf)
    second = [r.token_ids for r in first_engine.generate(reqs)]
    assert second != first
    resumed = engine()
    buf.seek(0)
    resumed.spec_decoder.drafter.load_state_dict(torch.load(buf, weights_only=True))
    assert [r.token_ids for r in resumed.generate(reqs)] == second
    assert [r.token_ids for r in engine().generate(reqs)] == first
    with pytest.raises(ValueError, match="not an NgramDrafter state"):
        resumed.spec_decoder.drafter.load_state_dict({"store": []})
