"""The verify-ahead (SpecDecoder(verify_ahead=True)): the next step's verify forward queued
after the draft-ahead, its inputs built on the device from the verification's outputs
(DecodeRunner.verify_ahead), against the same steps with the forward launched after the
host's bookkeeping. On CPU this needs the decode runner's fused verify path: Triton's
interpreter (TRITON_INTERPRET=1), the runner's static verify buffers run eagerly
(`static_verify`, what a CUDA engine replays from a graph), the verify path forced on.

Skipped without triton (CI) and on CUDA machines (tests/gpu/test_spec_gpu.py covers the
graph path).
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from spec_testutil import VOCAB, one_thread, random_eagle, requests, spec_models, tokens  # noqa: E402,F401
from rollout_testutil import make_engine, triton_interpreter  # noqa: E402

pytestmark = triton_interpreter()

from megatron_tlt.rollout.engine import RolloutEngine  # noqa: E402
from megatron_tlt.spec.decode import SpecDecoder  # noqa: E402
from megatron_tlt.spec.eagle import EagleProposer  # noqa: E402
from megatron_tlt.spec.tree import Strategy  # noqa: E402


def _run(model_dir, reqs, *, verify_ahead, **engine_kw):
    """One generate call on the triton backend with the runner's static verify path,
    deferred drafts and the draft-ahead (depth-3 chains on the static buffers): (results,
    decoder, runner)."""
    engine = make_engine(model_dir, attention_backend="triton", **engine_kw)
    engine.decode_runner.static_verify = True
    p = EagleProposer(random_eagle(engine, seed=2), min_kv_capacity=128)
    p.static_chains = True
    engine.spec_decoder = dec = SpecDecoder(p, Strategy(depth=3), defer_drafts=True, draft_ahead=True,
                                            verify_ahead=verify_ahead)
    return engine.generate(reqs), dec, engine.decode_runner


@pytest.fixture
def fused_verify(monkeypatch):
    monkeypatch.setattr(RolloutEngine, "_fused_verify", lambda self: self.decode_runner is not None)


@pytest.mark.parametrize("params", [dict(temperature=0.8), dict(temperature=0.0)])
@pytest.mark.parametrize("engine_kw", [{}, {"num_blocks": 14}], ids=["roomy", "preempting"])
def test_verify_ahead_equals_verifying_after_the_read(spec_models, fused_verify, params, engine_kw):
    """Same tokens, logprobs and acceptance counts with and without the verify-ahead, with
    and without forced preemption (a tight KV pool); most draft-aheads carry a
    verify-ahead that the next step uses, and steps that drop it stay exact."""
    reqs = requests(VOCAB["qwen2"], [5, 11, 3, 8], n=2, prompt_seed=3, max_new_tokens=24, **params)
    on, dec_on, run_on = _run(spec_models["qwen2"], reqs, verify_ahead=True, **engine_kw)
    off, dec_off, _ = _run(spec_models["qwen2"], reqs, verify_ahead=False, **engine_kw)
    assert tokens(on) == tokens(off)
    assert [r.logprobs for r in on] == [r.logprobs for r in off]
    assert [r.spec_stats["accepted"] for r in on] == [r.spec_stats["accepted"] for r in off]
    assert dec_off.num_verify_ahead == 0 and run_on.num_verify_ahead == dec_on.num_verify_ahead
    assert dec_on.num_verify_ahead > 0 and dec_on.num_verify_adopted > 0.5 * dec_on.num_verify_ahead, \
        (dec_on.num_verify_adopted, dec_on.num_verify_ahead, dec_on.num_ahead)
    if engine_kw:
        assert sum(r.num_preemptions for r in on) > 0


def test_verify_ahead_control_wrong_root_changes_output(spec_models, fused_verify, monkeypatch):
    """Negative control: a verify-ahead whose next root position is one too far (its KV
    written one entry late, positions and context lengths shifted) gives other tokens, so
    the equality above depends on the device-built inputs being right."""
    from megatron_tlt.rollout.cuda_graphs import DecodeRunner

    reqs = requests(VOCAB["qwen2"], [5, 11, 3, 8], n=2, prompt_seed=3, max_new_tokens=24, temperature=0.0)
    good, _, _ = _run(spec_models["qwen2"], reqs, verify_ahead=True)
    monkeypatch.setattr(DecodeRunner, "_next_roots", staticmethod(lambda roots, acc: roots + acc + 2))
    bad, dec, _ = _run(spec_models["qwen2"], reqs, verify_ahead=True)
    assert dec.num_verify_adopted > 0
    assert tokens(bad) != tokens(good)


def test_verify_ahead_needs_room(spec_models, fused_verify):
    """The worst case (every draft accepted) must fit the pool: with no free block the
    runner queues nothing and grows nothing."""
    engine = make_engine(spec_models["qwen2"], attention_backend="triton")
    runner = engine.decode_runner
    runner.static_verify = True
    seqs = [engine.add_sequence(r) for r in requests(VOCAB["qwen2"], [5, 6], max_new_tokens=8)]
    out = engine.forward_pending(seqs)
    engine.sample_and_append(seqs, out.logits)
    drafts = torch.zeros(2, 2, dtype=torch.int64)
    engine.verify_chains_output(seqs, 2, drafts, return_hidden=True)
    acc = torch.tensor([2, 0])
    toks = torch.tensor([[1, 2, 3], [4, 5, 6]])
    held = [engine.cache.num_slots(s.seq_id) for s in seqs]
    free = engine.cache._free[:]
    engine.cache._free.clear()
    assert engine.verify_chains_ahead(seqs, 2, drafts, acc, toks, return_hidden=True) is None
    assert [engine.cache.num_slots(s.seq_id) for s in seqs] == held
    engine.cache._free.extend(free)
    assert engine.verify_chains_ahead(seqs, 2, drafts, acc, toks, return_hidden=True) is not None
    # a different batch than the last verify's: nothing queued
    assert engine.verify_chains_ahead(seqs[:1], 2, drafts[:1], acc, toks, return_hidden=True) is None
