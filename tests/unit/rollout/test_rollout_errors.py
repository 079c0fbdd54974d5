"""Each bad request is rejected alone, with a message naming it; the rest of the batch runs."""

import re

import pytest
import torch

from rollout_testutil import make_engine, prompts
from megatron_tlt.errors import ConfigError, TLTError
from megatron_tlt.rollout import Request, RolloutEngine, SamplingParams, expand_requests, load_hf

MAX_LEN = 40

BAD = {
    "empty": (dict(prompt_token_ids=[]), "prompt is empty"),
    "vocab_high": (dict(prompt_token_ids=[1, 300]), r"prompt token id 300 at index 1 is outside the vocabulary \[0, 300\)"),
    "vocab_negative": (dict(prompt_token_ids=[-1]), "prompt token id -1 at index 0"),
    "not_int": (dict(prompt_token_ids=[1, 2.5]), "prompt token id 2.5 at index 1 is not an integer"),
    "not_int_str": (dict(prompt_token_ids=["5"]), "prompt token id '5' at index 0 is not an integer"),
    "too_long": (dict(prompt_token_ids=[1] * 30, sampling_params=SamplingParams(max_new_tokens=11)),
                 "prompt length 30 \\+ max_new_tokens 11 = 41 exceeds max_model_len 40"),
    "temperature": (dict(sampling_params=SamplingParams(temperature=-1.0)), "temperature must be"),
    # logits / 1e-38 overflowed float32: NaN logprobs and token 0, unrejected
    "tiny_temperature": (dict(sampling_params=SamplingParams(temperature=1e-38)),
                         r"temperature must be 0 \(greedy\) or at least 1e-05, got 1e-38"),
    # math.isfinite(10**400) raised OverflowError out of generate(), taking the batch down
    "huge_int_temperature": (dict(sampling_params=SamplingParams(temperature=10 ** 400)),
                             "temperature must be a finite number >= 0"),
    "top_p": (dict(sampling_params=SamplingParams(top_p=0.0)), r"top_p must be in \(0, 1\]"),
    "top_k": (dict(sampling_params=SamplingParams(top_k=-5)), "top_k must be"),
    "max_new": (dict(sampling_params=SamplingParams(max_new_tokens=0)), "max_new_tokens must be"),
    "min_new": (dict(sampling_params=SamplingParams(min_new_tokens=20, max_new_tokens=5)), "min_new_tokens must be"),
    "stop_id": (dict(sampling_params=SamplingParams(stop_token_ids=(999,))), "stop token id 999"),
    "stop_str": (dict(sampling_params=SamplingParams(stop_strings=("x",))), "stop_strings need a tokenizer"),
    # these raised TypeError out of generate(), taking the whole batch down
    "stop_ids_none": (dict(sampling_params=SamplingParams(stop_token_ids=None)),
                      "stop_token_ids must be a tuple or list, got None"),
    "stop_ids_int": (dict(sampling_params=SamplingParams(stop_token_ids=2)),
                     "stop_token_ids must be a tuple or list, got 2"),
    "stop_strings_str": (dict(sampling_params=SamplingParams(stop_strings="###")),  # not 3 strings
                         "stop_strings must be a tuple or list, got '###'"),
    "sample_index": (dict(sample_index=-1), "sample_index must be"),
    "hidden": (dict(return_hidden_states="everything"), "return_hidden_states must be"),
}


@pytest.fixture(scope="module")
def engine(hf_models):
    return make_engine(hf_models["llama"][0], max_model_len=MAX_LEN, num_blocks=64, block_size=4)


def test_bad_requests_rejected_individually(engine):
    good_prompts = prompts(300, [3, 6], seed=41)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)
    good = [Request(prompt_id=f"good{i}", prompt_token_ids=p, sampling_params=params)
            for i, p in enumerate(good_prompts)]
    bad = []
    for name, (fields, _) in BAD.items():
        kw = dict(prompt_id=name, prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams())
        kw.update(fields)
        bad.append(Request(**kw))
    batch = [good[0]] + bad + [good[1], Request(prompt_id="good0", prompt_token_ids=[4])]
    res = engine.generate(batch)
    alone = [engine.generate([g])[0] for g in good]
    assert res[0].token_ids == alone[0].token_ids and res[0].error is None
    assert res[-2].token_ids == alone[1].token_ids and res[-2].error is None
    for i, (name, (_, pattern)) in enumerate(BAD.items(), start=1):
        r = res[i]
        assert r.finish_reason == "error" and r.token_ids == [] and r.logprobs is None
        assert r.error.startswith(f"request {i} (prompt_id={name!r}, sample_index="), r.error
        assert re.search(pattern, r.error), (name, r.error)
    assert "duplicate of request 0" in res[-1].error
    assert engine.cache.num_free_blocks == engine.cache.num_blocks


def test_request_larger_than_the_whole_cache(hf_models):
    eng = make_engine(hf_models["llama"][0], num_blocks=3, block_size=4)
    (r,) = eng.generate([Request(prompt_id="big", prompt_token_ids=[1] * 10,
                                 sampling_params=SamplingParams(max_new_tokens=5))])
    assert "15 tokens need 4 KV blocks, but the cache has only 3" in r.error


def test_not_a_request(engine):
    (r,) = engine.generate([{"prompt_token_ids": [1]}])
    assert "expected a Request, got dict" in r.error


def test_n_must_be_positive():
    with pytest.raises(TLTError, match=r"prompt 'q7': number of samples n must be an integer in \[1, 65536\], got 0"):
        expand_requests("q7", [1, 2], SamplingParams(), 0)
    # a huge n exhausted the host's memory building the requests
    with pytest.raises(TLTError, match=r"must be an integer in \[1, 65536\], got 100000000000"):
        expand_requests("q7", [1, 2], SamplingParams(), 10 ** 11)
    reqs = expand_requests("q7", [1, 2], SamplingParams(), 3)
    assert [r.sample_index for r in reqs] == [0, 1, 2]


def test_engine_config_errors(hf_models):
    arch, w = load_hf(hf_models["llama"][0])
    with pytest.raises(ConfigError, match="differs from the weights' dtype"):
        RolloutEngine(arch, w, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="max_model_len"):
        RolloutEngine(arch, w, max_model_len=10_000)
    with pytest.raises(ConfigError, match="num_blocks must be"):
        RolloutEngine(arch, w, num_blocks=0)
    with pytest.raises(ConfigError, match="eos token id 300"):
        RolloutEngine(arch, w, eos_token_ids=[300])


def test_kv_cache_beyond_the_device_memory_is_refused_before_allocating(hf_models):
    """num_blocks x block_size beyond the host's whole memory died in the allocator (or the
    OOM killer) instead of naming the flags."""
    arch, weights = load_hf(hf_models["llama"][0])
    with pytest.raises(ConfigError, match=r"the KV cache \(1000000000 blocks x 1024 tokens\) needs .* GiB, "
                                          r"more than the cpu device's .* GiB"):
        RolloutEngine(arch, weights, num_blocks=10 ** 9, block_size=1024)


def test_prompt_id_that_is_not_unicode_text_is_rejected_alone(engine):
    """request_seed hashes str(prompt_id) as UTF-8: a lone surrogate raised
    UnicodeEncodeError out of generate(), taking the other requests down with it."""
    good = Request(prompt_id="g", prompt_token_ids=[4, 5], sampling_params=SamplingParams(max_new_tokens=3))
    bad = Request(prompt_id="\ud800", prompt_token_ids=[4, 5], sampling_params=SamplingParams(max_new_tokens=3))
    res = engine.generate([bad, good])
    assert "prompt_id '\\ud800' is not valid Unicode text" in res[0].error and res[0].token_ids == []
    assert res[1].error is None and res[1].token_ids == engine.generate([good])[0].token_ids


def test_an_interrupt_while_admitting_leaves_nothing_queued(engine, monkeypatch):
    """An exception other than a request's own TLTError (here a KeyboardInterrupt on the
    second request) left the requests admitted before it in the scheduler's queue: the next
    generate() ran them too and returned request A's tokens as request C's result."""
    params = SamplingParams(max_new_tokens=4, seed=1)
    a = Request(prompt_id="A", prompt_token_ids=[1, 2, 3], sampling_params=params)
    b = Request(prompt_id="B", prompt_token_ids=[4, 5], sampling_params=params)
    c = Request(prompt_id="C", prompt_token_ids=[9, 9, 9, 9], sampling_params=params)
    expected = engine.generate([c])[0]
    real = engine.add_sequence

    def interrupted(req, **kw):
        if req.prompt_id == "B":
            raise KeyboardInterrupt
        return real(req, **kw)

    monkeypatch.setattr(engine, "add_sequence", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.generate([a, b])
    monkeypatch.undo()
    assert not engine.scheduler.has_work()
    (r,) = engine.generate([c])
    assert r.prompt_id == "C" and r.token_ids == expected.token_ids
    assert engine.cache.num_free_blocks == engine.cache.num_blocks
