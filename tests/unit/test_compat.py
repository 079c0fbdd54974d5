"""Each CPU workaround in megatron_tlt.compat is needed: the Megatron call fails without it.

(`tied_embedding` needs PP=2 and is shown in tests/integration/test_actor_distributed.py.)
"""

import pytest
import torch

from megatron_tlt import compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU workarounds are only applied without CUDA")


@pytest.fixture(scope="module")
def parallel():
    from megatron_tlt.models import mcore

    mcore.init_parallel(1, 1, seed=1)
    yield


def test_all_applied_on_cpu(parallel):
    assert set(compat.applied()) == set(compat.PATCHES)


def test_current_device(parallel):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    assert RotaryEmbedding(kv_channels=16, rotary_percent=1.0).get_emb(8).shape == (8, 1, 1, 16)
    with compat.disabled("current_device"):
        with pytest.raises((AssertionError, RuntimeError)):
            RotaryEmbedding(kv_channels=16, rotary_percent=1.0).get_emb(8)


def test_cuda_synchronize():
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    assert FileSystemWriterAsync.preload_tensors([], non_blocking=True) == []
    with compat.disabled("cuda_synchronize"):
        with pytest.raises((AssertionError, RuntimeError)):
            FileSystemWriterAsync.preload_tensors([], non_blocking=True)


def test_causal_mask():
    import megatron.core.fusions.fused_softmax as fused_softmax

    mask = fused_softmax.get_default_causal_mask(4)
    assert mask.device.type == "cpu" and torch.equal(mask, torch.ones(4, 4, dtype=torch.bool).triu(1))
    with compat.disabled("causal_mask"):
        with pytest.raises((AssertionError, RuntimeError)):
            fused_softmax.get_default_causal_mask(5)


def _tiny_actor():
    from megatron_tlt.models.actor import Actor
    from megatron_tlt.models.arch import ModelArch
    from megatron_tlt.testing.tiny_models import tiny_hf_config

    arch = ModelArch.from_hf_config(tiny_hf_config("llama", num_layers=1).to_dict())
    return arch, Actor(arch, tp=1, pp=1)


def test_schedules_cuda(parallel):
    from megatron_tlt.models.actor import MicroBatch, lm_loss

    arch, actor = _tiny_actor()
    mb = MicroBatch.make_dummy(vocab=arch.vocab_size)
    out = actor.forward_backward([mb], lambda lg, m: lm_loss(lg, m, arch), forward_only=True)
    assert torch.isfinite(out[0]["lm_loss"])
    with compat.disabled("schedules_cuda"):
        with pytest.raises((AssertionError, RuntimeError)):
            actor.forward_backward([mb], lambda lg, m: lm_loss(lg, m, arch), forward_only=True)


def test_rng_tracker(parallel):
    import megatron.core.tensor_parallel.random as mrandom
    from megatron.core import tensor_parallel

    compat.model_parallel_seed(5)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        a = torch.rand(3)
    compat.model_parallel_seed(5)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        b = torch.rand(3)
    assert torch.equal(a, b)  # seeded, replayable
    with compat.disabled("rng_tracker"):
        # Megatron's own seeding needs CUDA generators ...
        with pytest.raises((AssertionError, RuntimeError)):
            mrandom.model_parallel_cuda_manual_seed(5, force_reset_rng=True)
        # ... and without a seeded tracker attention's fork() fails.
        with pytest.raises(Exception, match="not added"):
            with mrandom.get_cuda_rng_tracker().fork():
                pass
    compat.model_parallel_seed(5)
