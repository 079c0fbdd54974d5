"""Megatron's optimizer (`MegatronAdamW`) trains a float16 actor: the loss is scaled by the
grad scaler's loss scale in backward (`config.grad_scale_func`, which Megatron's own
training loop sets) and the step unscales the gradients. Before, nothing scaled the loss
and the step still divided by the scale (2**32 at first): gradients reached Adam 2**32
times too small, and Adam's eps turned each update into ~1% of its size.

A tiny Qwen3-shaped actor, the same batch every step, lr 1e-3: the float16 run's first
applied update (the dynamic scaler skips the first steps, whose scaled gradients
overflow, halving the scale) must move the weights 0.5x-2x as far as the float32 run's
first update (mean |delta| over the matrices; measured ~1x). Negative control: the same
float16 run with grad_scale_func cleared after the optimizer is built (the old
behaviour) must move them at most 0.2x as far. NCCL world of one (torchrun); this file is
also the script the test launches.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

MAX_STEPS = 80  # skipped steps while the loss scale comes down from 2**32


def test_megatron_fp16_update_size(run_torchrun, tmp_path):
    out = tmp_path / "r.json"
    run_torchrun(Path(__file__), 1, ["--out", str(out)], timeout=600)
    r = json.loads(out.read_text())
    print(r)
    assert r["float32"]["first_applied"] == 0
    assert r["float16"]["first_applied"] is not None, r
    ratio = r["float16"]["moved"] / r["float32"]["moved"]
    assert 0.5 <= ratio <= 2.0, r
    assert r["float16_unscaled"]["first_applied"] is not None, r
    assert r["float16_unscaled"]["moved"] / r["float32"]["moved"] <= 0.2, r


def _first_update(dtype: str, *, clear_scale_func: bool = False) -> dict:
    from megatron_tlt.models import mcore
    from megatron_tlt.models.actor import Actor, MicroBatch, lm_loss
    from megatron_tlt.models.arch import ModelArch
    from megatron_tlt.models.mcore_ckpt import unwrap
    from megatron_tlt.models.optim import OptimSettings, build_optimizer

    arch = ModelArch(family="qwen3", vocab_size=250, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True)
    actor = Actor(arch, dtype=dtype, init_seed=0)
    opt = build_optimizer(actor, OptimSettings(lr=1e-3, clip_grad=1.0), kind="megatron")
    if clear_scale_func:
        actor.config.grad_scale_func = None
    g = torch.Generator().manual_seed(7)
    full = torch.randint(0, arch.vocab_size, (4, 17), generator=g)
    mbs = [MicroBatch(tokens=full[i:i + 2, :-1].contiguous(), position_ids=mcore.causal_position_ids(2, 16),
                      labels=full[i:i + 2, 1:].contiguous(), loss_mask=torch.ones(2, 16)) for i in (0, 2)]
    model = unwrap(actor.model)
    before = {n: p.detach().float().clone() for n, p in model.named_parameters() if p.ndim == 2}
    for step in range(MAX_STEPS):
        opt.zero_grad()
        actor.forward_backward(mbs, lambda lg, mb: lm_loss(lg, mb, arch))
        if not opt.step()["skipped"]:
            now = {n: p.detach().float() for n, p in model.named_parameters() if p.ndim == 2}
            moved = sum(float((now[n] - b).abs().sum()) for n, b in before.items()) / sum(
                b.numel() for b in before.values())
            return {"first_applied": step, "moved": moved}
    return {"first_applied": None, "moved": None}


def main() -> int:
    from megatron_tlt.models import mcore

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    mcore.init_parallel(1, 1, seed=1234)
    res = {"float32": _first_update("float32"), "float16": _first_update("float16"),
           "float16_unscaled": _first_update("float16", clear_scale_func=True)}
    with open(args.out, "w") as f:
        json.dump(res, f)
    mcore.destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
