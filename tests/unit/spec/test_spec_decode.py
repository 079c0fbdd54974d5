"""Speculative decoding in the rollout engine: greedy SD emits exactly the plain tokens
(every family, drafter, chain and tree, preemption, mixed lengths, stops), a perfect
drafter is always accepted, a broken drafter falls back without corrupting output."""

import dataclasses
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from spec_testutil import (FAMILIES, VOCAB, one_thread, requests, run,  # noqa: E402,F401
                           spec_models, tokens)

from megatron_tlt.spec.tree import Strategy  # noqa: E402

CHAIN = Strategy(depth=3)
TREE = Strategy(depth=3, topk=2, num_verify_tokens=6)
LENGTHS = [5, 11, 3, 8]


@pytest.mark.parametrize("family", list(FAMILIES) + ["tied"])
def test_greedy_spec_equals_plain(spec_models, family):
    d = spec_models[family]
    reqs = requests(VOCAB[family], LENGTHS, prompt_seed=1, max_new_tokens=14)
    base, _ = run(d, reqs)
    cases = [(dr, st) for dr in ("eagle", "ngram", "target") for st in (CHAIN, TREE)]
    cases += [("eagle_small_vocab", TREE), ("eagle_static", CHAIN)]
    for drafter, strategy in cases:
        for kw in ({}, {"num_blocks": 10}):  # 10 blocks of 4: forced preemption
            res, engine = run(d, reqs, drafter, strategy, **kw)
            what = f"{family} {drafter} {strategy} {kw}"
            assert tokens(res) == tokens(base), what
            for a, b in zip(res, base):
                assert a.logprobs == b.logprobs, what  # exactly: same logits rows
                assert a.finish_reason == b.finish_reason
            summary = engine.spec_decoder.metrics.summary()["total"]
            assert summary["num_drafts"] > 0, what
            if kw:
                assert sum(r.num_preemptions for r in res) > 0, what


def test_target_drafter_is_always_accepted(spec_models):
    d = spec_models["qwen2"]
    reqs = requests(VOCAB["qwen2"], LENGTHS, max_new_tokens=16)
    base, _ = run(d, reqs)
    res, engine = run(d, reqs, "target", Strategy(depth=4))
    assert tokens(res) == tokens(base)
    for r in res:
        s = r.spec_stats
        assert s["accepted"] == s["drafted"] > 0 and s["acceptance_rate"] == 1.0
        # 1 prefill token, then 3 steps of 4 drafts + 1 bonus = 15 more tokens.
        assert s["num_drafts"] == 3 and s["acceptance_length"] == 5.0
    # Full trees (every candidate verified) hold the argmax path: depth drafts accepted
    # per step. (Reranked trees may drop it: a low-probability argmax child scores below
    # other candidates.)
    res, _ = run(d, reqs, "target", Strategy(depth=2, topk=3, num_verify_tokens=13))
    assert tokens(res) == tokens(base)
    for r in res:
        assert r.spec_stats["accepted"] == 2 * r.spec_stats["num_drafts"]


def test_non_finite_drafter_falls_back(spec_models):
    d = spec_models["llama"]
    reqs = requests(VOCAB["llama"], LENGTHS, max_new_tokens=8)
    base, _ = run(d, reqs)
    from spec_testutil import random_eagle
    from megatron_tlt.spec.eagle import EagleProposer

    for bad in (float("nan"), float("inf")):
        def factory(engine, bad=bad):
            dr = random_eagle(engine)
            with torch.no_grad():
                dr.layers[0].mlp.down_proj.weight[0, 0] = bad
            return EagleProposer(dr)
        for strategy in (CHAIN, TREE):
            res, engine = run(d, reqs, factory, strategy)
            assert tokens(res) == tokens(base)
            assert [r.logprobs for r in res] == [r.logprobs for r in base]
            for r in res:
                # every decode step after the prefill tried to speculate and fell back (the
                # last one too: chains are not capped by the token budget left)
                assert r.spec_stats["fallbacks"] == len(r.token_ids) - 1 > 0
                assert r.spec_stats["num_drafts"] == 0
            assert engine.spec_decoder.metrics.summary()["total"]["fallbacks"] == 4 * 7
    # Sampling too: output is that of plain decoding with the same seed (fallback steps
    # are plain steps, drawing the same noise).
    reqs = requests(VOCAB["llama"], LENGTHS, max_new_tokens=8, temperature=0.9, prompt_seed=3, seed=3)
    base, _ = run(d, reqs)
    res, _ = run(d, reqs, factory, CHAIN)
    assert tokens(res) == tokens(base)


def test_stops_and_budget_truncate(spec_models):
    """eos / stop strings / min_new_tokens / max_new_tokens inside an accepted chain."""
    d = spec_models["qwen3"]
    vocab = VOCAB["qwen3"]
    reqs = requests(vocab, LENGTHS, max_new_tokens=20)
    base, _ = run(d, reqs)
    # Pick stop tokens that occur mid-output in the plain run.
    eos = [base[0].token_ids[5], base[2].token_ids[7]]
    detok = lambda ids: " ".join(f"t{i}" for i in ids)  # noqa: E731
    stop_str = f"t{base[1].token_ids[4]} t{base[1].token_ids[5]}"
    for params in (dict(max_new_tokens=19), dict(max_new_tokens=20, min_new_tokens=9),
                   dict(max_new_tokens=20, stop_strings=(stop_str,))):
        reqs = requests(vocab, LENGTHS, **params)
        base, _ = run(d, reqs, eos_token_ids=eos, detokenize=detok)
        if "min_new_tokens" in params:  # the eos at index 5 of request 0 is banned
            assert all(len(r.token_ids) >= 9 for r in base)
        else:
            assert any(r.finish_reason == "stop" for r in base)
        for drafter in ("target", "ngram"):
            for strategy in (Strategy(depth=5), TREE):
                res, _ = run(d, reqs, drafter, strategy, eos_token_ids=eos, detokenize=detok)
                assert tokens(res) == tokens(base), (params, drafter, strategy)
                assert [(r.finish_reason, r.stop_reason) for r in res] == \
                    [(r.finish_reason, r.stop_reason) for r in base]


def test_hidden_states_match_plain(spec_models):
    """Also when a stop token ends a verified path early: one row per position fed, as
    plain decoding returns (SD returned the whole accepted path's rows before session 20:
    10 rows for a 4-token prompt and 6 tokens, against plain's 9)."""
    d = spec_models["llama"]
    for kind in ("final", "pre_norm"):
        reqs = requests(VOCAB["llama"], [4, 9], max_new_tokens=12)
        for r in reqs:
            r.return_hidden_states = kind
        first, _ = run(d, reqs)
        eos = [first[0].token_ids[5], first[1].token_ids[4]]
        for stops in ({}, dict(eos_token_ids=eos)):
            base, _ = run(d, reqs, **stops)
            res, _ = run(d, reqs, "target", Strategy(depth=5), **stops)
            assert tokens(res) == tokens(base)
            if stops:
                assert [r.finish_reason for r in res] == ["stop", "stop"]
            for a, b, r in zip(res, base, reqs):
                assert b.hidden_states.shape[0] == len(r.prompt_token_ids) + len(b.token_ids) - 1
                assert a.hidden_states.shape == b.hidden_states.shape
                torch.testing.assert_close(a.hidden_states, b.hidden_states, rtol=0, atol=1e-5)


def test_threshold_turns_spec_off_for_large_batches(spec_models):
    d = spec_models["llama"]
    reqs = requests(VOCAB["llama"], [4, 5, 6, 7, 8, 9], max_new_tokens=8)
    for i, r in enumerate(reqs):  # a long tail: requests finish one after another
        r.sampling_params = dataclasses.replace(r.sampling_params, max_new_tokens=3 + 3 * i)
    base, _ = run(d, reqs)
    res, engine = run(d, reqs, "target", CHAIN, threshold=3)
    assert tokens(res) == tokens(base)
    summary = engine.spec_decoder.metrics.summary()
    by = summary["by_batch_size"]
    assert by["5-8"]["num_drafts"] == 0 and by["5-8"]["steps"] > 0
    assert summary["strategy_steps"]["off"] >= by["5-8"]["steps"]
    # The long tail (<= 3 running) speculates.
    assert sum(b["num_drafts"] for k, b in by.items() if k in ("1", "2-4")) > 0
    res, engine = run(d, reqs, "target", CHAIN, threshold=0)
    assert engine.spec_decoder.metrics.summary()["total"]["num_drafts"] == 0


def test_sampled_tokens_and_batch_composition_with_and_without_a_threshold(spec_models):
    """What the README says of "same seed -> same tokens" under speculative decoding at
    temperature 1: speculating at every batch size (threshold None), each request samples
    the same tokens alone as in a batch of 6 (per-request noise streams); with a threshold
    (2 here, rollout.spec_threshold is 32 by default), whether a step speculates depends on
    how many sequences run, and SD samples other (equally distributed) tokens than plain
    decoding from the same noise, so requests alone and in the batch differ."""
    d = spec_models["llama"]
    reqs = requests(VOCAB["llama"], [4, 5, 6, 7, 8, 9], temperature=1.0, max_new_tokens=16, seed=7)
    for threshold, same in ((None, True), (2, False)):
        batch, _ = run(d, reqs, "eagle", Strategy(depth=3), threshold=threshold)
        alone = [run(d, reqs[i:i + 1], "eagle", Strategy(depth=3), threshold=threshold)[0][0]
                 for i in range(len(reqs))]
        equal = [b.token_ids == a.token_ids for b, a in zip(batch, alone)]
        assert all(equal) if same else not any(equal), (threshold, equal)


def test_per_call_strategy_override(spec_models):
    d = spec_models["llama"]
    reqs = requests(VOCAB["llama"], [6], max_new_tokens=9)
    _, engine = run(d, reqs, "target", CHAIN)
    res = engine.generate(requests(VOCAB["llama"], [6], max_new_tokens=9, prompt_seed=5),
                          spec_strategy=Strategy(depth=1))
    assert res[0].spec_stats["acceptance_length"] == 2.0


@pytest.mark.parametrize("drafter, strategy", [("eagle", CHAIN), ("eagle", TREE), ("ngram", TREE),
                                               ("eagle_small_vocab", CHAIN)])
def test_sampling_is_seeded_and_logprobs_are_the_targets(spec_models, drafter, strategy):
    """Same seed -> same tokens; other seeds differ; reported logprobs are the target's
    log_softmax(logits / T) of the emitted tokens (recomputed by an HF forward)."""
    from transformers import AutoModelForCausalLM

    d = spec_models["qwen2"]
    params = dict(temperature=0.8, top_k=40, top_p=0.95, min_new_tokens=3, max_new_tokens=12)
    reqs = requests(VOCAB["qwen2"], LENGTHS, n=2, prompt_seed=2, **params)
    res1, engine = run(d, reqs, drafter, strategy)
    res2, _ = run(d, reqs, drafter, strategy)
    assert tokens(res1) == tokens(res2)
    assert engine.spec_decoder.metrics.summary()["total"]["num_drafts"] > 0
    other = requests(VOCAB["qwen2"], LENGTHS, n=2, prompt_seed=2, **dict(params, seed=99))
    res3, _ = run(d, other, drafter, strategy)
    assert sum(a != b for a, b in zip(tokens(res1), tokens(res3))) >= 6
    hf = AutoModelForCausalLM.from_pretrained(d).eval()
    for req, r in zip(reqs, res1):
        ids = torch.tensor([req.prompt_token_ids + r.token_ids])
        with torch.no_grad():
            logits = hf(ids).logits[0, len(req.prompt_token_ids) - 1:-1].float()
        want = torch.log_softmax(logits / 0.8, -1).gather(1, torch.tensor(r.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(r.logprobs), want, atol=2e-4, rtol=0)
        assert all(p <= 0.0 and math.isfinite(p) for p in r.processed_logprobs)
        assert all(lp <= plp + 1e-6 for lp, plp in zip(r.logprobs, r.processed_logprobs))


def test_depth_schedule_policy():
    """--spec-depth BATCH:DEPTH,...: the first bound >= the running batch picks the depth,
    above the last bound the last depth; the threshold still turns SD off; a plain integer
    is one depth at every size."""
    from megatron_tlt.errors import ConfigError
    from megatron_tlt.spec.decode import depth_policy, parse_depth_schedule, parse_strategy_schedule

    assert parse_depth_schedule("4") == [(None, 4)] and parse_depth_schedule(5) == [(None, 5)]
    assert parse_depth_schedule(" 1:6,8:4,32:3") == [(1, 6), (8, 4), (32, 3)]
    pol = depth_policy("1:6,8:4,32:3", threshold=40)
    assert [pol(b).depth for b in (1, 2, 8, 9, 32, 33, 40)] == [6, 4, 4, 3, 3, 3, 3]
    assert pol(41) is None
    one = depth_policy(4, topk=2, num_verify_tokens=6)
    assert one(1) == one(1000) and (one(7).depth, one(7).topk, one(7).num_draft_nodes) == (4, 2, 5)
    for bad in ("8:4,1:6", "1:6,1:4", "0:3", "2:0", "a:b", "4:", "x", "1:6x0", "6x", "1:6x2"):
        with pytest.raises(ConfigError):
            parse_depth_schedule(bad)
    # DxK: a tree width for that entry (an error where only depths are accepted, above)
    assert parse_strategy_schedule("1:6x2, 8:4,32:4") == [(1, 6, 2), (8, 4, None), (32, 4, None)]
    assert parse_strategy_schedule("5X3") == [(None, 5, 3)]
    mixed = depth_policy("1:6x2,8:4", topk=1, num_verify_tokens=None)
    assert [(mixed(b).depth, mixed(b).topk, mixed(b).num_draft_nodes) for b in (1, 2, 9)] == \
        [(6, 2, 12), (4, 1, 4), (4, 1, 4)]
    for bad in ("1:6x0", "6x", "1:x2", "2:3x2x2"):
        with pytest.raises(ConfigError):
            parse_strategy_schedule(bad)
    with pytest.raises(ConfigError, match="spec topk must be"):  # one entry: Strategy's check
        depth_policy("6x0")


def test_draft_ahead_needs_room_for_two_full_chains_within_max_model_len():
    """SpecDecoder._ahead_fits: a draft-ahead (and the verify forward queued after it) is
    queued only while every sequence has room for this step's depth + 1 tokens and the
    next step's depth + 1 positions within max_model_len (2 * depth + 2) and depth + 2
    tokens left of max_new_tokens; one short sequence stops it for the step."""
    from types import SimpleNamespace

    from megatron_tlt.spec.decode import SpecDecoder

    depth, max_len = 3, 64

    def seq(n_tokens, max_new=1000, n_out=0):
        return SimpleNamespace(token_ids=[0] * n_tokens, num_output=n_out,
                               request=SimpleNamespace(sampling_params=SimpleNamespace(max_new_tokens=max_new)))

    engine = SimpleNamespace(max_model_len=max_len)
    edge = max_len - (2 * depth + 2)
    assert SpecDecoder._ahead_fits(engine, [(seq(edge), None)], depth)
    assert not SpecDecoder._ahead_fits(engine, [(seq(edge + 1), None)], depth)
    assert not SpecDecoder._ahead_fits(engine, [(seq(10), None), (seq(edge + 1), None)], depth)
    assert SpecDecoder._ahead_fits(engine, [(seq(10, max_new=depth + 2), None)], depth)
    assert not SpecDecoder._ahead_fits(engine, [(seq(10, max_new=depth + 2, n_out=1), None)], depth)
