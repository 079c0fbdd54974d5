"""The decode runner's graph bookkeeping with CUDA's graph calls stubbed (CPU): verify
graphs captured before the first decode step (`capture_verify_graphs` on a fresh or woken
engine, or a speculative step that verifies first) survive that step. capture() releases
every graph, so they were dropped there and recaptured one by one mid-run, the cost
capture_verify_graphs exists to avoid; now the decode graphs are captured first.

The runner is built for Triton's interpreter (skipped without triton, CI); its forwards are
stubbed too: only which graphs exist is checked. tests/gpu/test_engine_gpu.py replays real
graphs."""

import contextlib

import pytest
import torch

from rollout_testutil import triton_interpreter  # noqa: E402

pytestmark = triton_interpreter()

from megatron_tlt.models.arch import ModelArch  # noqa: E402
from megatron_tlt.rollout import EngineWeights, RolloutEngine  # noqa: E402
from megatron_tlt.rollout import cuda_graphs as cg  # noqa: E402


class _Graph:
    def replay(self):
        pass


class _Stream:
    def __init__(self, *a, **k):
        pass

    def wait_stream(self, s):
        pass


@pytest.fixture
def runner(monkeypatch):
    for name, value in (("graph_pool_handle", lambda: object()), ("Stream", _Stream),
                        ("stream", lambda s: contextlib.nullcontext()),
                        ("current_stream", lambda *a: _Stream()), ("synchronize", lambda *a: None),
                        ("CUDAGraph", _Graph)):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(cg, "graph_capture", lambda g, pool=None: contextlib.nullcontext())
    arch = ModelArch(family="qwen2", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
                     num_heads=6, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                     tie_word_embeddings=True, qkv_bias=True)
    eng = RolloutEngine(arch, EngineWeights.make_dummy(arch, seed=5), max_num_seqs=8, num_blocks=96,
                        block_size=4, attention_backend="triton")
    r = eng.decode_runner
    r.use_graphs = True  # a CUDA engine's setting; the CUDA calls above are stubs
    monkeypatch.setattr(r, "_forward", lambda bucket, logits_out=None, hidden_out=None: (
        hidden_out.update(final=None, pre_norm=None) if hidden_out is not None else None))
    monkeypatch.setattr(r, "_verify_forward", lambda bucket, q, v, hidden: None)
    return r


def test_verify_graphs_captured_up_front_survive_the_first_decode_step(runner):
    n = runner.capture_verify_graphs(8, 3)
    assert n > 0 and runner.num_verify_graphs == n
    assert runner.num_captures == 1 and runner.num_graphs == len(runner.buckets)  # decode first
    runner.run(1)  # the first decode step: its graphs exist, nothing is released
    assert runner.num_verify_graphs == n and runner.num_captures == 1


def test_kv_pool_moved_still_releases_everything(runner):
    """Negative control: after the KV pool moved (sleep / wake) every graph is dropped and
    recaptured (they read stale addresses)."""
    runner.capture_verify_graphs(8, 3)
    runner._kv_ptr += 1  # as if the pool moved
    runner.run(1)
    assert runner.num_verify_graphs == 0 and runner.num_captures == 2
