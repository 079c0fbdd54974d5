"""Resuming Megatron's distributed optimizer (`MegatronAdamW`) is exact on a GPU.

The uninterrupted run takes 3 AdamW steps. The resumed run takes 2, saves the model
weights and `optimizer.state_dict()`, builds a fresh actor and optimizer, loads them and
takes the 3rd. Every parameter, and the whole optimizer state after the 3rd step (fp32
master weights, exp_avg, exp_avg_sq, step, param-group hyperparameters), must equal the
uninterrupted run's bit for bit (torch.equal), for bf16 and fp32 parameters. Two ways
to save: in memory through torch.save / torch.load(weights_only=True) (what the
Checkpointer does with the optimizer state), and through the Checkpointer itself
(dist-checkpoint of the model + per-rank optimizer files).

The lr is changed with `set_lr` before the first step and is not set again after the
resume, so the param-group hyperparameters must come back from the state too.

Controls:
- determinism: the uninterrupted run done twice gives equal weights and state (else a
  resume mismatch would be the kernels' fault, not the resume's);
- liveness: each step updates (not skipped, finite grad norm) and the weights move;
- negative: the same resume with the model weights loaded but a fresh optimizer (no
  moments, step or master-weight state; the lr set by hand) must NOT match;
- the loaded optimizer's state_dict() equals the one saved, tensor by tensor.

NCCL world of one (DP=1); with two GPUs also DP=2 (each rank saves its own shard).
This file is also the torchrun script the tests launch.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

DTYPES = ("bfloat16", "float32")
BASE_LR = 1e-3  # OptimSettings.lr: what a fresh optimizer starts with
RUN_LR = 1e-2  # set_lr() before the first step: only a restored state brings it back
DETERMINISTIC_ENV = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def _worlds() -> list[int]:
    return [1] + ([2] if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else [])


@pytest.mark.parametrize("world", _worlds())
def test_megatron_optimizer_resume_is_exact(run_torchrun, tmp_path, world):
    out = tmp_path / "r.json"
    run_torchrun(Path(__file__), world, ["--out", str(out), "--ckpt-root", str(tmp_path / "ckpt")],
                 timeout=600, env=DETERMINISTIC_ENV)
    results = json.loads(out.read_text())
    assert sorted(r["dtype"] for r in results) == sorted(DTYPES)
    for res in results:
        for rank, r in enumerate(res["ranks"]):
            where = f"{res['dtype']} rank {rank}/{world}: {r}"
            print(where)
            assert r["steps_ok"], where
            assert r["moved"], where
            assert r["rerun_mismatch"] is None, f"the uninterrupted run is not deterministic; resume cannot be judged: {where}"
            assert r["loaded_state_mismatch"] is None, where
            assert r["mem_param_mismatch"] == [], where
            assert r["mem_state_mismatch"] is None, where
            assert r["ckpt_param_mismatch"] == [], where
            assert r["ckpt_state_mismatch"] is None, where
            # Negative control: without the optimizer state the 3rd step lands elsewhere.
            assert r["fresh_optimizer_param_mismatch"], where


# ---- the torchrun script ------------------------------------------------------------

def _arch():
    from megatron_tlt.models.arch import ModelArch

    # Qwen3 with tied embeddings: QK-norm (1-D, no weight decay) and a shared embedding/output.
    return ModelArch(family="qwen3", vocab_size=250, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, tie_word_embeddings=True)


def _batches(arch, step: int, dp_rank: int):
    from megatron_tlt.models import mcore
    from megatron_tlt.models.actor import MicroBatch

    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    full = torch.randint(0, arch.vocab_size, (4, 17), generator=g)  # [micro_batches * b, s + 1]
    return [MicroBatch(tokens=full[i:i + 2, :-1].contiguous(), position_ids=mcore.causal_position_ids(2, 16),
                       labels=full[i:i + 2, 1:].contiguous(), loss_mask=torch.ones(2, 16)) for i in (0, 2)]


def _params(actor) -> dict:
    from megatron_tlt.models.mcore_ckpt import unwrap

    return {n: p.detach().clone() for n, p in unwrap(actor.model).named_parameters()}


def _param_mismatch(a: dict, b: dict) -> list:
    """[name, max |a - b|] of every parameter that is not bit-identical."""
    assert a.keys() == b.keys()
    return [[n, (a[n].float() - b[n].float()).abs().max().item()] for n in a
            if a[n].dtype != b[n].dtype or not torch.equal(a[n], b[n])]


def _state_mismatch(a, b, path: str = "state"):
    """The path of the first difference between two nested optimizer states, or None."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        same = (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.cpu(), b.cpu()))
        return None if same else path
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{path}: keys {sorted(map(str, a.keys() ^ b.keys()))}"
        for k in a:
            m = _state_mismatch(a[k], b[k], f"{path}[{k!r}]")
            if m:
                return m
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            m = _state_mismatch(x, y, f"{path}[{i}]")
            if m:
                return m
        return None
    return None if a == b else f"{path}: {a!r} != {b!r}"


def _through_torch_save(state: dict) -> dict:
    """What the Checkpointer does with the optimizer state: torch.save, torch.load(weights_only)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True, map_location="cpu")


def run_dtype(dtype: str, ckpt_root: str) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_tlt.checkpoint import Checkpointer
    from megatron_tlt.models.actor import Actor, lm_loss
    from megatron_tlt.models.mcore_ckpt import unwrap
    from megatron_tlt.models.optim import OptimSettings, build_optimizer

    arch = _arch()
    dp_rank = ps.get_data_parallel_rank()
    settings = OptimSettings(lr=BASE_LR, weight_decay=0.1, clip_grad=1.0)
    init = _params(Actor(arch, dtype=dtype))
    steps_ok = []

    def build(set_lr: bool):
        actor = Actor(arch, dtype=dtype)
        with torch.no_grad():
            for n, p in actor.model.named_parameters():
                p.copy_(init[n])
        opt = build_optimizer(actor, settings, kind="megatron")
        if set_lr:
            opt.set_lr(RUN_LR)
        return actor, opt

    def train(actor, opt, steps):
        for step in steps:
            opt.zero_grad()
            actor.forward_backward(_batches(arch, step, dp_rank), lambda lg, mb: lm_loss(lg, mb, arch))
            stats = opt.step()
            steps_ok.append(not stats["skipped"] and math.isfinite(stats["grad_norm"]))

    def uninterrupted():
        actor, opt = build(set_lr=True)
        train(actor, opt, range(3))
        return _params(actor), _through_torch_save(opt.state_dict())

    ref_params, ref_state = uninterrupted()
    again_params, again_state = uninterrupted()
    rerun_mismatch = _state_mismatch(ref_state, again_state) or _param_mismatch(ref_params, again_params) or None

    # Resume in memory: weights copied, optimizer state through torch.save/torch.load.
    actor, opt = build(set_lr=True)
    train(actor, opt, range(2))
    weights, saved = _params(actor), _through_torch_save(opt.state_dict())
    del actor, opt
    actor, opt = build(set_lr=False)
    with torch.no_grad():
        for n, p in unwrap(actor.model).named_parameters():  # views into DDP's param buffer
            p.copy_(weights[n])
    opt.opt.reload_model_params()  # as Checkpointer.load does before the optimizer state
    opt.load_state_dict(saved)
    loaded_state_mismatch = _state_mismatch(saved, _through_torch_save(opt.state_dict()))
    train(actor, opt, [2])
    mem_params, mem_state = _params(actor), _through_torch_save(opt.state_dict())
    del actor, opt

    # Resume through the Checkpointer.
    ckpt = Checkpointer(os.path.join(ckpt_root, dtype))
    actor, opt = build(set_lr=True)
    train(actor, opt, range(2))
    path = ckpt.save(2, actor, opt, {})
    del actor, opt
    actor, opt = build(set_lr=False)
    ckpt.load(path, actor, opt)
    train(actor, opt, [2])
    ckpt_params, ckpt_state = _params(actor), _through_torch_save(opt.state_dict())
    del actor, opt

    # Negative control: the same checkpoint's weights, a fresh optimizer.
    actor, opt = build(set_lr=True)
    ckpt.load(path, actor, optimizer=None)
    opt.opt.reload_model_params()
    train(actor, opt, [2])
    fresh_params = _params(actor)
    del actor, opt

    return {
        "num_params": len(ref_params),
        "steps_ok": all(steps_ok) and len(steps_ok) == 2 * 3 + 2 * (2 + 1) + 1,
        "moved": bool(_param_mismatch(init, ref_params)),
        "rerun_mismatch": rerun_mismatch,
        "loaded_state_mismatch": loaded_state_mismatch,
        "mem_param_mismatch": _param_mismatch(ref_params, mem_params),
        "mem_state_mismatch": _state_mismatch(ref_state, mem_state),
        "ckpt_param_mismatch": _param_mismatch(ref_params, ckpt_params),
        "ckpt_state_mismatch": _state_mismatch(ref_state, ckpt_state),
        "fresh_optimizer_param_mismatch": _param_mismatch(ref_params, fresh_params),
    }


def main() -> int:
    import torch.distributed as dist

    from megatron_tlt.models import mcore

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt-root", required=True)
    args = ap.parse_args()
    mcore.init_parallel(1, 1, seed=1234)
    results = []
    for dtype in DTYPES:
        mine = run_dtype(dtype, args.ckpt_root)
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        results.append({"dtype": dtype, "ranks": ranks})
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    mcore.destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
