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


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_step_metrics_do_not_depend_on_the_micro_batch_size(aggregation):
    """The logged pg_loss is the step's loss (the one the gradient is of) and ratio_mean a
    mean over the step's loss tokens, whatever the micro-batch split: 3 rows in micro-batches
    of 4, 2 (one padding row) and 1 give the same figures. Before, pg_loss was divided by
    the number of micro-batches (-1.27 / -0.63 / -0.32 in the review's run) and a padding
    micro-batch pulled ratio_mean below 1."""
    mcore.init_parallel(1, 1, seed=0)
    arch = ModelArch.from_hf_config(tiny_hf_config("llama", vocab_size=60, num_layers=1).to_dict())
    batch = RolloutBatch.make_dummy(n=3, vocab=60, seed=1)
    batch.advantages = torch.tensor([1.0, 0.5, 2.0])
    got = []
    for size in (4, 2, 1):
        actor = Actor(arch, init_seed=0)
        opt = build_optimizer(actor, OptimSettings(lr=1e-2, clip_grad=0.0))
        mbs = make_microbatches(batch, seq_length=12, micro_batch_size=size)
        if size == 2:  # a padding micro-batch, as the RL loop adds to even out DP ranks
            pad = make_microbatches(batch.select([0]), seq_length=12, micro_batch_size=size)[0]
            pad.loss_mask.zero_()
            mbs.append(pad)
        old = actor_logprobs(actor, mbs)
        ntok = float(sum(mb.loss_mask.sum() for mb in mbs))
        m = policy_update(actor, opt, mbs, old, PPOLossConfig(aggregation=aggregation),
                          global_tokens=ntok, global_seqs=3.0)
        got.append((m["pg_loss"], m["ratio_mean"], m["clip_frac"]))
    assert got[0][0] < -0.5  # on policy, positive advantages: -mean advantage (token-weighted)
    for pg, ratio, clip in got:
        assert pg == pytest.approx(got[0][0], rel=1e-5) and ratio == pytest.approx(1.0, abs=1e-6)
        assert clip == 0.0


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_policy_update_counts_the_step_itself_when_not_given(aggregation):
    """Without global_tokens / global_seqs, policy_update normalises by the step's own
    counts: the same pg_loss and updated weights as with the counts passed (torch.equal
    for the same micro-batches of 3; within 1e-6 for micro-batches of 1, summed in another
    order). Before, each micro-batch normalised itself and Megatron averaged them, so the
    loss depended on the split."""
    mcore.init_parallel(1, 1, seed=0)
    arch = ModelArch.from_hf_config(tiny_hf_config("llama", vocab_size=60, num_layers=1).to_dict())
    batch = RolloutBatch.make_dummy(n=3, vocab=60, seed=4)
    batch.advantages = torch.tensor([1.0, 0.5, 2.0])
    results = []
    for size, given in ((3, True), (3, False), (1, False)):
        actor = Actor(arch, init_seed=0)
        opt = build_optimizer(actor, OptimSettings(lr=1e-2, clip_grad=0.0))
        mbs = make_microbatches(batch, seq_length=12, micro_batch_size=size)
        old = actor_logprobs(actor, mbs)
        kw = {}
        if given:
            kw = dict(global_tokens=float(sum(mb.loss_mask.sum() for mb in mbs)), global_seqs=3.0)
        m = policy_update(actor, opt, mbs, old, PPOLossConfig(aggregation=aggregation), **kw)
        w = torch.cat([p.detach().float().flatten() for p in actor.model.parameters()])
        results.append((m["pg_loss"], w))
    assert torch.equal(results[1][1], results[0][1])
    for pg, w in results[1:]:
        assert pg == pytest.approx(results[0][0], rel=1e-5)
        assert torch.allclose(w, results[0][1], rtol=0, atol=1e-6)


def test_actor_logprobs_are_the_engines_at_the_rollout_temperature():
    """At temperature 0.7 the engine samples from, and reports log-probs of,
    log_softmax(logits / 0.7); the actor recomputing them with `temperature=0.7` matches
    to < 1e-4 nats per token (CPU fp32: only summation order differs). Negative control:
    the untempered log-probs (the actor before it took the temperature) are off by
    > 0.05 nats per token on the same samples, so the PPO ratio would be off-policy.
    Measured: 5.3e-07 and 0.139 nats per token over 96 response tokens."""
    from megatron_tlt.rollout import EngineWeights, Request, RolloutEngine, SamplingParams
    from megatron_tlt.weights.sync import sync_actor_to_engine

    mcore.init_parallel(1, 1, seed=0)
    arch = ModelArch.from_hf_config(tiny_hf_config("llama", vocab_size=60, num_layers=2).to_dict())
    actor = Actor(arch, init_seed=0)
    with torch.no_grad():  # Megatron's init gives near-uniform logits, which a temperature barely changes
        actor.model.output_layer.weight.mul_(40.0)
    engine = RolloutEngine(arch, EngineWeights(arch), max_num_seqs=16, num_blocks=64, block_size=4)
    sync_actor_to_engine(actor, engine, version=0)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 60, (4,), generator=g).tolist() for _ in range(4)]
    reqs = [Request(prompt_id=f"p{i}", sample_index=j, prompt_token_ids=prompts[i],
                    sampling_params=SamplingParams(temperature=0.7, max_new_tokens=12, seed=100 * i + j))
            for i in range(4) for j in range(2)]
    results = engine.generate(reqs)
    n = len(results)
    batch = RolloutBatch([r.prompt_id for r in results], [r.sample_index for r in results],
                         [q.prompt_token_ids for q in reqs], [list(r.token_ids) for r in results],
                         [list(r.logprobs) for r in results], torch.zeros(n), torch.zeros(n))
    mbs = make_microbatches(batch, seq_length=16, micro_batch_size=4)
    ntok = float(sum(mb.loss_mask.sum() for mb in mbs))

    def gap(temperature: float) -> float:
        lps = actor_logprobs(actor, mbs, temperature=temperature)
        return float(sum(((lp - mb.extra["rollout_logp"]).abs() * mb.loss_mask).sum()
                         for lp, mb in zip(lps, mbs))) / ntok

    assert ntok >= 40
    assert gap(0.7) < 1e-4, f"actor vs engine log-probs at T=0.7: {gap(0.7):.2e} nats per token"
    assert gap(1.0) > 0.05, f"negative control: untempered log-probs only {gap(1.0):.2e} from the engine's"


def test_weight_sync_refuses_an_older_version_before_writing():
    """A sync whose version is older than the engine's is refused with the engine's weights
    untouched (the version was checked only after every bucket had been copied in: the old
    code changed every tensor and then raised, leaving new weights under the old version);
    the same sync at a newer version goes through (the check does not refuse everything)."""
    from megatron_tlt.errors import TLTError
    from megatron_tlt.rollout import EngineWeights, RolloutEngine
    from megatron_tlt.weights.sync import sync_actor_to_engine

    mcore.init_parallel(1, 1, seed=0)
    arch = ModelArch.from_hf_config(tiny_hf_config("qwen3", vocab_size=60, num_layers=2).to_dict())
    actor = Actor(arch, init_seed=0)
    weights = EngineWeights.make_dummy(arch, seed=1)
    engine = RolloutEngine(arch, weights, max_num_seqs=2, num_blocks=16, block_size=4)
    engine.update_weights({}, version=7)
    before = [t.clone() for t in weights.tensors()]
    with pytest.raises(TLTError, match="policy version 3 is not an int at least the engine's current version 7"):
        sync_actor_to_engine(actor, engine, version=3)
    assert all(torch.equal(a, b) for a, b in zip(before, weights.tensors()))
    assert engine.policy_version == 7
    sync_actor_to_engine(actor, engine, version=8)
    assert engine.policy_version == 8
    assert sum(not torch.equal(a, b) for a, b in zip(before, weights.tensors())) >= len(before) - 1
