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
