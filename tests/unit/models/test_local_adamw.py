"""LocalAdamW (the CPU optimizer) on a bfloat16 actor steps float32 master weights.

AdamW applied to bf16 weights in place rounds away every update smaller than half a
weight's bf16 spacing; with masters the model holds the masters rounded to bf16 and most
weights move. Checks (all deterministic, seeded):
- liveness: over 10 steps at lr 1e-5 the masters move 0.8x-1.25x as far as a float32
  actor's weights (mean |delta| over the matrices) and the bf16 weights, always the
  masters rounded (torch.equal), at least 0.55x (0.72x when written);
- negative control: torch AdamW on the bf16 weights themselves moves them at most 0.35x
  as far (0.18x when written);
- resume through the Checkpointer is exact: 2 steps, save, perturb, load, 1 step equals 3
  uninterrupted steps (weights and masters, torch.equal); a state without the masters
  (the masters re-read from the bf16 weights) must NOT match;
- float16 is refused with a ConfigError naming model.dtype.
"""

from __future__ import annotations

import pytest
import torch

from megatron_tlt.errors import ConfigError

LR = 1e-5


def _arch():
    from megatron_tlt.models.arch import ModelArch

    return ModelArch(family="llama", vocab_size=120, hidden_size=64, intermediate_size=96, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64)


@pytest.fixture(scope="module")
def parallel():
    from megatron_tlt.models import mcore

    mcore.init_parallel(1, 1, seed=3)


def _setup(dtype="bfloat16"):
    from megatron_tlt.models.actor import Actor
    from megatron_tlt.models.optim import OptimSettings, build_optimizer

    actor = Actor(_arch(), dtype=dtype, init_seed=0)
    return actor, build_optimizer(actor, OptimSettings(lr=LR, clip_grad=1.0), kind="local")


def _step(actor, opt, k):
    from megatron_tlt.models.actor import MicroBatch, lm_loss

    opt.zero_grad()
    mbs = [MicroBatch.make_dummy(batch=2, seq=12, vocab=actor.arch.vocab_size, seed=10 * k + j) for j in range(2)]
    actor.forward_backward(mbs, lambda lg, mb: lm_loss(lg, mb, actor.arch))
    info = opt.step()
    assert not info["skipped"]


def _matrices(actor):
    return {n: p.detach().float().clone() for n, p in actor.model.named_parameters() if p.ndim == 2}


def _displacement(before: dict, now: dict) -> float:
    """Mean |w_now - w_before| over the matrix weights."""
    return sum(float((now[n] - b).abs().sum()) for n, b in before.items()) / sum(
        b.numel() for b in before.values())


STEPS = 10


def _run(dtype, *, masters=True):
    """STEPS updates; (displacement of the model's weights, of the masters or None)."""
    actor, opt = _setup(dtype)
    if not masters:  # step the bf16 weights themselves, as before the masters
        opt.masters = None
        opt.opt = torch.optim.AdamW(opt.params, lr=LR, foreach=False)
    names = [n for n, p in actor.model.named_parameters() if p.requires_grad]
    before = _matrices(actor)
    for k in range(STEPS):
        _step(actor, opt, k)
    d_masters = None
    if opt.masters is not None:
        for m, p in zip(opt.masters, opt.params):
            assert torch.equal(p.detach(), m.detach().to(p.dtype))  # the weights: masters rounded
        d_masters = _displacement(before, {n: m.detach() for n, m in zip(names, opt.masters) if n in before})
    return _displacement(before, _matrices(actor)), d_masters


@pytest.fixture(scope="module")
def fp32_displacement(parallel):
    d, masters = _run("float32")
    assert masters is None and d > 0
    return d


def test_bf16_updates_kept_by_fp32_masters(fp32_displacement):
    d, d_masters = _run("bfloat16")
    print(f"bf16 with masters: weights moved {d / fp32_displacement:.2f}x, masters "
          f"{d_masters / fp32_displacement:.2f}x the fp32 actor's")
    assert 0.8 <= d_masters / fp32_displacement <= 1.25  # the masters follow the fp32 trajectory
    assert d / fp32_displacement >= 0.55  # measured 0.72


def test_negative_control_adamw_on_bf16_weights_loses_updates(fp32_displacement):
    d, _ = _run("bfloat16", masters=False)
    print(f"bf16 without masters: weights moved {d / fp32_displacement:.2f}x the fp32 actor's")
    assert d / fp32_displacement <= 0.35  # measured 0.18


def _state(actor, opt):
    return ({n: p.detach().clone() for n, p in actor.model.named_parameters()},
            [m.detach().clone() for m in opt.masters])


@pytest.mark.parametrize("drop_masters", [False, True])
def test_resume_with_masters_is_exact(parallel, tmp_path, drop_masters):
    from megatron_tlt.checkpoint import Checkpointer
    from megatron_tlt.models.optim import LocalAdamW

    actor, opt = _setup()
    for k in range(3):
        _step(actor, opt, k)
    want_params, want_masters = _state(actor, opt)

    actor, opt = _setup()
    for k in range(2):
        _step(actor, opt, k)
    ck = Checkpointer(str(tmp_path), keep_last=1)
    if drop_masters:  # a state saved without masters (before they existed)
        real = opt.state_dict
        opt.state_dict = lambda: {k: v for k, v in real().items() if k != LocalAdamW.MASTERS_KEY}
    ck.save(2, actor, opt, {"consumed_samples": 0})
    actor2, opt2 = _setup()
    with torch.no_grad():
        for m in opt2.masters:
            m.add_(1.0)  # stale masters: the load must replace them
    ck.load(ck.resolve("auto"), actor2, opt2)
    _step(actor2, opt2, 2)
    got_params, got_masters = _state(actor2, opt2)
    same = all(torch.equal(got_params[n], t) for n, t in want_params.items()) and all(
        torch.equal(a, b) for a, b in zip(got_masters, want_masters))
    assert same != drop_masters


def test_float16_is_refused(parallel):
    with pytest.raises(ConfigError, match="model.dtype=float16"):
        _setup("float16")
