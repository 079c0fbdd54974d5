import pytest
import torch

from megatron_tlt.models import mcore
from megatron_tlt.models.actor import Actor
from megatron_tlt.models.arch import ModelArch
from megatron_tlt.models.optim import OptimSettings, build_optimizer
from megatron_tlt.rl.losses import PPOLossConfig
from megatron_tlt.rl.step import RolloutBatch, actor_logprobs, make_microbatches, policy_update
from megatron_tlt.testing.tiny_models import tiny_hf_config


def test_microbatch_alignment():
    b = RolloutBatch(["a", "b", "c"], [0, 1, 0], [[5, 6], [7], [1, 2, 3]], [[8, 9, 10], [11, 12], [4]],
                     [[-0.1, -0.2, -0.3], [-0.4, -0.5], [-0.6]], torch.zeros(3), torch.tensor([1.0, -1.0, 0.5]))
    mbs = make_microbatches(b, seq_length=6, micro_batch_size=2, pad_id=0)
    assert len(mbs) == 2
    m0 = mbs[0]
    # row a: tokens 5 6 8 9 | labels 6 8 9 10; response labels at positions 1..3
    assert m0.tokens[0, :4].tolist() == [5, 6, 8, 9] and m0.labels[0, :4].tolist() == [6, 8, 9, 10]
    assert m0.loss_mask[0].tolist() == [0, 1, 1, 1, 0, 0]
    assert m0.extra["rollout_logp"][0, 1:4].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert m0.loss_mask[1].tolist() == [1, 1, 0, 0, 0, 0]  # prompt [7]: labels 11 12 from position 0
    # the last micro-batch is padded with an all-masked row
    assert mbs[1].extra["row"].tolist() == [2, -1] and mbs[1].loss_mask[1].sum() == 0
    with pytest.raises(ValueError, match="exceeds seq_length"):
        make_microbatches(b, seq_length=3, micro_batch_size=2)


def test_policy_update_moves_logprobs_with_advantage():
    mcore.init_parallel(1, 1, seed=0)
    arch = ModelArch.from_hf_config(tiny_hf_config("llama", vocab_size=60, num_layers=1).to_dict())
    actor = Actor(arch, init_seed=0)
    opt = build_optimizer(actor, OptimSettings(lr=1e-2, clip_grad=0.0))
    batch = RolloutBatch.make_dummy(n=4, vocab=60, seed=1)
    batch.advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    mbs = make_microbatches(batch, seq_length=12, micro_batch_size=2)
    old = actor_logprobs(actor, mbs)
    ntok = float(sum(mb.loss_mask.sum() for mb in mbs))
    m = policy_update(actor, opt, mbs, old, PPOLossConfig(), global_tokens=ntok)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and m["clip_frac"] == 0.0
    new = actor_logprobs(actor, mbs)
    for k, mb in enumerate(mbs):
        for j in range(mb.tokens.shape[0]):
            row = int(mb.extra["row"][j])
            if row < 0:
                continue
            mask = mb.loss_mask[j].bool()
            delta = (new[k][j][mask] - old[k][j][mask]).mean().item()
            assert delta * float(batch.advantages[row]) > 0, (row, delta)
