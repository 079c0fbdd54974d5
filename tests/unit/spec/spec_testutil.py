"""Helpers for the speculative-decoding tests: tiny models, engines with a drafter,
requests. Import fixtures from here into a test module to use them (`one_thread` is
autouse: import it too)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "rollout"))

from rollout_testutil import FAMILIES, make_engine, make_hf_model, prompts  # noqa: E402,F401

from megatron_tlt.rollout import Request, SamplingParams  # noqa: E402
from megatron_tlt.spec.decode import SpecDecoder, TargetDrafter  # noqa: E402
from megatron_tlt.spec.eagle import DrafterConfig, EagleDrafter, EagleProposer  # noqa: E402
from megatron_tlt.spec.ngram import NgramDrafter  # noqa: E402
from megatron_tlt.spec.tree import Strategy  # noqa: E402

VOCAB = {"llama": 300, "qwen2": 300, "qwen3": 257, "tied": 257}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These tests run thousands of tiny ops: with 2 intra-op threads on a loaded 2-core
    machine each op waits for a busy core (measured 25x slower). Restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def spec_models(tmp_path_factory):
    """family -> model dir (tiny random HF model, GQA, fp32), plus "tied": a Qwen3 with
    tied embeddings. Untied models by default: random tied models mostly repeat one token
    greedily, which would make exactness tests weak."""
    out = {}
    for i, fam in enumerate(FAMILIES):
        d = str(tmp_path_factory.mktemp(f"spec_{fam}"))
        make_hf_model(fam, d, vocab_size=VOCAB[fam], seed=40 + i, tie=False)
        out[fam] = d
    d = str(tmp_path_factory.mktemp("spec_tied"))
    make_hf_model("qwen3", d, vocab_size=VOCAB["qwen3"], seed=47, tie=True)
    out["tied"] = d
    return out


def random_eagle(engine, seed: int = 0, draft_vocab: int | None = None) -> EagleDrafter:
    ids = None
    if draft_vocab is not None:
        ids = torch.randperm(engine.arch.vocab_size, generator=torch.Generator().manual_seed(seed))[:draft_vocab]
        ids = ids.sort().values
    d = EagleDrafter(DrafterConfig(arch=engine.arch, draft_vocab_size=draft_vocab),
                     engine.weights.embed, engine.weights.lm_head, ids)
    d.reset_parameters(seed, std=0.1)
    return d


def static_chains(proposer: EagleProposer) -> EagleProposer:
    """The proposer with its static-buffer chain path on (on CPU: eager, same buffers)."""
    proposer.static_chains = True
    return proposer


DRAFTERS = {
    "eagle": lambda e: EagleProposer(random_eagle(e)),
    "eagle_static": lambda e: static_chains(EagleProposer(random_eagle(e))),
    "eagle_small_vocab": lambda e: EagleProposer(random_eagle(e, draft_vocab=64)),
    "ngram": lambda e: NgramDrafter(max_ngram=3),
    "target": TargetDrafter,
}


def requests(vocab: int, lengths, *, prompt_seed: int = 0, n: int = 1, **params) -> list[Request]:
    params.setdefault("temperature", 0.0)
    params.setdefault("max_new_tokens", 16)
    out = []
    for i, p in enumerate(prompts(vocab, lengths, seed=prompt_seed)):
        for j in range(n):
            out.append(Request(prompt_id=i, sample_index=j, prompt_token_ids=p,
                               sampling_params=SamplingParams(**params)))
    return out


def run(model_dir: str, reqs, drafter: str | None = None, strategy: Strategy | None = None, *,
        threshold: int | None = None, **engine_kw):
    """(results, engine) of one generate call, with `drafter` (a DRAFTERS key or a
    factory engine -> Drafter) or plain decoding."""
    engine = make_engine(model_dir, **engine_kw)
    if drafter is not None:
        factory = DRAFTERS[drafter] if isinstance(drafter, str) else drafter
        engine.spec_decoder = SpecDecoder(factory(engine), strategy or Strategy(depth=3),
                                          threshold=threshold)
    return engine.generate(reqs), engine


def tokens(results) -> list[list[int]]:
    return [r.token_ids for r in results]
