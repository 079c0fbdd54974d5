"""Inference forward vs HF transformers: greedy generation, logprobs, verify, hidden states."""

import pytest
import torch

from rollout_testutil import FAMILIES, make_engine, prompts
from megatron_tlt.rollout import Request, SamplingParams
from megatron_tlt.rollout.model import rms_norm


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # [L, V]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf_generate(hf_models, family):
    model_dir, hf = hf_models[family]
    vocab = hf.config.vocab_size
    ps = prompts(vocab, [1, 4, 9, 17, 6], seed=1)
    eng = make_engine(model_dir, block_size=4)
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    res = eng.generate([Request(prompt_id=i, prompt_token_ids=p, sampling_params=params)
                        for i, p in enumerate(ps)])
    for p, r in zip(ps, res):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=10, do_sample=False)
        assert r.error is None and r.finish_reason == "length"
        assert r.token_ids == out[0, len(p):].tolist(), f"{family}: prompt length {len(p)}"
    # Negative control: a different prompt gives different output somewhere.
    assert len({tuple(r.token_ids) for r in res}) > 1


@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_match_full_sequence_rescore(hf_models, family):
    model_dir, hf = hf_models[family]
    vocab = hf.config.vocab_size
    ps = prompts(vocab, [3, 11], seed=2)
    eng = make_engine(model_dir)
    temp = 0.7
    params = SamplingParams(temperature=temp, top_p=0.9, top_k=50, max_new_tokens=12, seed=5)
    res = eng.generate([Request(prompt_id=i, prompt_token_ids=p, sampling_params=params)
                        for i, p in enumerate(ps)])
    for p, r in zip(ps, res):
        full = p + r.token_ids
        lp = torch.log_softmax(_hf_logits(hf, full) / temp, dim=-1)
        ref = lp[len(p) - 1:-1].gather(1, torch.tensor(r.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(r.logprobs), ref, atol=1e-4, rtol=0)
        # processed logprobs are under the filtered, renormalized distribution: never lower.
        assert all(pl >= l - 1e-6 for pl, l in zip(r.processed_logprobs, r.logprobs))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_verify_forward_chain_and_tree_then_commit(hf_models, family):
    model_dir, hf = hf_models[family]
    vocab = hf.config.vocab_size
    full_a, full_b = prompts(vocab, [14, 14], seed=3)
    pa, pb = 7, 5  # committed prefix lengths
    ref_a, ref_b = _hf_logits(hf, full_a), _hf_logits(hf, full_b)
    eng = make_engine(model_dir, block_size=4)
    sa = eng.add_sequence(Request(prompt_id="a", prompt_token_ids=full_a[:pa]))
    sb = eng.add_sequence(Request(prompt_id="b", prompt_token_ids=full_b[:pb]))
    eng.forward_pending([sa, sb])

    # Chain of 3 on both sequences (batch of 2, different prefix lengths).
    q = torch.tensor([full_a[pa:pa + 3], full_b[pb:pb + 3]])
    pos = torch.tensor([[pa, pa + 1, pa + 2], [pb, pb + 1, pb + 2]])
    chain = torch.ones(3, 3, dtype=torch.bool).tril().expand(2, 3, 3)
    logits = eng.verify_forward([sa, sb], q, pos, chain)
    torch.testing.assert_close(logits[0], ref_a[pa:pa + 3], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[1], ref_b[pb:pb + 3], atol=1e-4, rtol=0)
    # Accept the first two on a, everything on b.
    eng.commit_kv(sa, [0, 1])
    eng.commit_kv(sb, [0, 1, 2])
    assert (sa.num_computed, sb.num_computed) == (pa + 2, pb + 3)
    pa, pb = pa + 2, pb + 3

    # Tree on a: node0 = true next token; node1 = a wrong sibling branch (child of 0);
    # node2 = true token after node0 (child of 0); node3 = true token after node2.
    alt = (full_a[pa + 1] + 1) % vocab
    q = torch.tensor([[full_a[pa], alt, full_a[pa + 1], full_a[pa + 2]],
                      full_b[pb:pb + 4]])
    pos = torch.tensor([[pa, pa + 1, pa + 1, pa + 2], list(range(pb, pb + 4))])
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    mask = torch.stack([tree, torch.ones(4, 4, dtype=torch.bool).tril()])
    logits = eng.verify_forward([sa, sb], q, pos, mask)
    for node, ref_pos in ((0, pa), (2, pa + 1), (3, pa + 2)):
        torch.testing.assert_close(logits[0, node], ref_a[ref_pos], atol=1e-4, rtol=0)
    alt_ref = _hf_logits(hf, full_a[:pa + 1] + [alt])[-1]
    torch.testing.assert_close(logits[0, 1], alt_ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[1], ref_b[pb:pb + 4], atol=1e-4, rtol=0)

    # Commit the path 0 -> 2 -> 3 (compaction drops node 1), reject everything on b.
    eng.commit_kv(sa, [0, 2, 3])
    eng.commit_kv(sb, [])
    assert (sa.num_computed, sb.num_computed) == (pa + 3, pb)
    # Continue normally: the next token's logits must match the full sequence.
    sa.token_ids = list(full_a[:pa + 4])
    sb.token_ids = list(full_b[:pb + 1])
    out = eng.forward_pending([sa, sb])
    torch.testing.assert_close(out.logits[0], ref_a[pa + 3], atol=1e-4, rtol=0)
    torch.testing.assert_close(out.logits[1], ref_b[pb], atol=1e-4, rtol=0)

    eng.free_sequence(sa)
    eng.free_sequence(sb)
    assert eng.cache.num_free_blocks == eng.cache.num_blocks


def test_verify_forward_rejects_bad_shapes(hf_models):
    model_dir, _ = hf_models["llama"]
    eng = make_engine(model_dir)
    s = eng.add_sequence(Request(prompt_id=0, prompt_token_ids=[1, 2, 3]))
    eng.forward_pending([s])
    with pytest.raises(ValueError, match="do not agree"):
        eng.verify_forward([s], torch.tensor([[4, 5]]), torch.tensor([[3, 4]]),
                           torch.ones(1, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="see itself"):
        eng.verify_forward([s], torch.tensor([[4, 5]]), torch.tensor([[3, 4]]),
                           torch.zeros(1, 2, 2, dtype=torch.bool))
    eng.verify_forward([s], torch.tensor([[4, 5]]), torch.tensor([[3, 4]]),
                       torch.ones(2, 2, dtype=torch.bool).tril()[None])
    with pytest.raises(ValueError, match="strictly increasing"):
        eng.commit_kv(s, [1, 0])
    with pytest.raises(ValueError, match="outside"):
        eng.commit_kv(s, [2])
    eng.free_sequence(s)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_hidden_states_final_and_pre_norm(hf_models, family):
    model_dir, hf = hf_models[family]
    vocab = hf.config.vocab_size
    (p,) = prompts(vocab, [6], seed=4)
    eng = make_engine(model_dir, num_blocks=8)
    params = SamplingParams(temperature=1.0, max_new_tokens=5, seed=1)
    r_final, r_pre = eng.generate([
        Request(prompt_id=0, prompt_token_ids=p, sampling_params=params, return_hidden_states="final"),
        Request(prompt_id=0, sample_index=1, prompt_token_ids=p, sampling_params=params,
                return_hidden_states="pre_norm")])
    captured = {}
    hook = hf.model.norm.register_forward_hook(
        lambda mod, inp, out: captured.update(pre=inp[0][0], final=out[0]))
    try:
        _hf_logits(hf, p + r_final.token_ids[:-1])
        final_ref = captured["final"]
        _hf_logits(hf, p + r_pre.token_ids[:-1])
        pre_ref = captured["pre"]
    finally:
        hook.remove()
    n = len(p) + 5 - 1
    assert r_final.hidden_states.shape == (n, hf.config.hidden_size)
    torch.testing.assert_close(r_final.hidden_states, final_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(r_pre.hidden_states, pre_ref, atol=1e-4, rtol=1e-4)
    # The two kinds are really different (the final norm lies between them).
    w = eng.weights.final_norm
    assert not torch.allclose(r_pre.hidden_states, rms_norm(r_pre.hidden_states, w, 1e-6))
