"""Run under torchrun (gloo on CPU, NCCL on GPU): Megatron actor checks at a given TP/PP.

Modes (results as JSON in --out, written by global rank 0 or the last stage):
  logits    load --mcore, compare logits with HF transformers on --hf (fp32); then a
            negative control: perturb one weight and compare again.
  resave    load --mcore at this TP/PP and save it to --save (resharded write).
  optim     load --mcore, one AdamW step of the LM loss on a fixed batch, save to --save.
"""

import argparse
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True, help="comma-separated: logits, resave, optim")
    ap.add_argument("--mcore", required=True, help="comma-separated: one job per checkpoint")
    ap.add_argument("--hf", default="")
    ap.add_argument("--save", default="")
    ap.add_argument("--out")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--optimizer", default="local")
    args = ap.parse_args()

    from megatron.core import parallel_state as ps

    from megatron_tlt.models import mcore

    mcore.init_parallel(args.tp, args.pp, seed=1234)
    mcores = args.mcore.split(",")
    hfs = args.hf.split(",") if args.hf else [None] * len(mcores)
    saves = args.save.split(",") if args.save else [None] * len(mcores)
    results = [run_job(args, m, h, s) for m, h, s in zip(mcores, hfs, saves)]
    writer = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    if args.out and writer:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    mcore.destroy_parallel()


def run_job(args, mcore_dir, hf_dir, save_dir):
    from megatron.core import parallel_state as ps

    from megatron_tlt.models import mcore
    from megatron_tlt.models.actor import Actor, MicroBatch, lm_loss
    from megatron_tlt.models.mcore_ckpt import read_meta
    from megatron_tlt.models.optim import OptimSettings, build_optimizer

    meta = read_meta(mcore_dir)
    arch = meta["arch"]
    actor = Actor(arch, tp=args.tp, pp=args.pp, dtype=meta["dtype"])
    actor.load(mcore_dir)
    dev = actor.device
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, arch.vocab_size, (3, 12), generator=g)
    result = {"tp": args.tp, "pp": args.pp, "world": dist.get_world_size(), "mcore": mcore_dir}

    modes = args.mode.split(",")
    if "resave" in modes:  # before logits, which perturbs weights
        actor.save(save_dir)
    if "logits" in modes:
        from transformers import AutoModelForCausalLM

        logits = actor.logits(tokens.to(dev))
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
        with torch.no_grad():
            ref = hf(tokens).logits
        if logits is not None:
            result["max_abs_diff"] = (logits.float().cpu() - ref).abs().max().item()
            result["shape"] = list(logits.shape)
        # Negative control: randomize every weight and compare again; the check must fail.
        gen = torch.Generator(device=dev).manual_seed(99)
        with torch.no_grad():
            for p in actor.model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, device=dev, dtype=torch.float32).mul_(0.2))
        logits2 = actor.logits(tokens.to(dev))
        if logits2 is not None:
            result["perturbed_max_abs_diff"] = (logits2.float().cpu() - ref).abs().max().item()
    if "optim" in modes:
        opt = build_optimizer(actor, OptimSettings(lr=1e-3, weight_decay=0.1, clip_grad=1.0), kind=args.optimizer)
        full = torch.randint(0, arch.vocab_size, (4, 13), generator=g)
        mbs = [MicroBatch(tokens=full[i:i + 2, :-1], position_ids=mcore.causal_position_ids(2, 12),
                          labels=full[i:i + 2, 1:], loss_mask=torch.ones(2, 12)) for i in (0, 2)]
        opt.zero_grad()
        losses = actor.forward_backward(mbs, lambda lg, mb: lm_loss(lg, mb, arch))
        stats = opt.step()
        if losses:
            result["losses"] = [float(x["lm_loss"]) for x in losses]
        result["grad_norm"] = stats["grad_norm"]
        if hasattr(actor.model, "module"):  # DDP-wrapped: save the inner model
            actor.model = actor.model.module
        actor.save(save_dir)
    return result


if __name__ == "__main__":
    sys.exit(main())
