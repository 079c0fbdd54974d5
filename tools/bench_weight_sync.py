#!/usr/bin/env python
"""Weight sync from the Megatron-Core actor into the rollout engine (the RL loop's
`sync_actor_to_engine`: TP/PP gather to the engine layout, bucketed, copied in place):
seconds and GB/s per sync for a benchmark shape, and a check that it synced.

    python tools/bench_weight_sync.py --shape 1.5b --json FILE            # one GPU (or CPU)
    torchrun --nproc_per_node 2 tools/bench_weight_sync.py --shape 7b --tp 2 --json FILE

Per run: the actor (random init, --dtype, TP x PP from the flags; the rest is DP) and on
every rank an engine with different random weights, as the RL loop holds them; one
warm-up sync, then --repeats timed syncs (median and each). Check, on a fixed batch: the
engine's logits against the actor's before the first sync (must differ: the negative
control) and after (max abs diff, reported; bf16 differs by kernel rounding). The JSON
(written by global rank 0) carries the command and the git revision. A benchmark, not a
test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys

import torch
import torch.distributed as dist


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1.5b", help="a megatron_tlt.bench shape: 1.5b, 7b or tiny")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.repeats < 1:  # runs[0] of an empty list was an IndexError on every rank
        ap.error(f"--repeats must be >= 1, got {args.repeats}")

    from megatron_tlt.bench import SHAPES, _git_revision, random_weights
    from megatron_tlt.models import mcore
    from megatron_tlt.models.actor import Actor
    from megatron_tlt.models.arch import ModelArch
    from megatron_tlt.rollout import RolloutEngine
    from megatron_tlt.weights.score import engine_logits
    from megatron_tlt.weights.sync import sync_actor_to_engine

    if args.shape not in SHAPES:
        print(f"error: --shape must be one of {sorted(SHAPES)}, got {args.shape!r}", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    mcore.init_parallel(args.tp, args.pp, seed=0)
    rank = dist.get_rank()
    arch = ModelArch(**SHAPES[args.shape])
    actor = Actor(arch, tp=args.tp, pp=args.pp, dtype=dtype)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    weights = random_weights(arch, dtype=mcore.torch_dtype(dtype), device=device, seed=100 + rank)
    engine = RolloutEngine(arch, weights, max_num_seqs=4, num_blocks=16, block_size=16,
                           dtype=weights.dtype, device=device, max_model_len=64)
    ptrs = [t.data_ptr() for t in weights.tensors()]
    tokens = torch.randint(0, arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))

    def diff():
        ref = actor.logits(tokens.to(actor.device))  # None off the last pipeline stage
        got = engine_logits(engine, tokens)
        return None if ref is None else (got.float().cpu() - ref.float().cpu()).abs().max().item()

    before = diff()
    sync_actor_to_engine(actor, engine, version=1)  # warm-up (allocations, NCCL setup)
    runs = [sync_actor_to_engine(actor, engine, version=2 + i) for i in range(args.repeats)]
    after = diff()
    secs = [r["seconds"] for r in runs]
    res = {"shape": args.shape, "tp": args.tp, "pp": args.pp, "world": dist.get_world_size(), "dtype": dtype,
           "device": torch.cuda.get_device_name() if cuda else "cpu", "bytes": runs[0]["bytes"],
           "tensors": runs[0]["tensors"], "seconds_median": statistics.median(secs), "seconds": secs,
           "gb_per_s_median": statistics.median(r["gb_per_s"] for r in runs),
           "logits_max_abs_diff_before": before, "logits_max_abs_diff_after": after,
           "data_ptrs_unchanged": ptrs == [t.data_ptr() for t in weights.tensors()],
           "policy_version": engine.policy_version}
    # The last pipeline stage holds the logits; global rank 0 writes what it has.
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, res)
    if rank == 0:
        last = next((g for g in reversed(gathered) if g["logits_max_abs_diff_after"] is not None), res)
        res.update({k: last[k] for k in ("logits_max_abs_diff_before", "logits_max_abs_diff_after")})
        world = dist.get_world_size()
        launcher = ["torchrun", "--nproc_per_node", str(world)] if world > 1 else ["python"]
        res["command"] = shlex.join([*launcher, "tools/bench_weight_sync.py",
                                     *(argv if argv is not None else sys.argv[1:])])
        res["git_revision"] = _git_revision()
        print(f"{args.shape} tp={args.tp} pp={args.pp} {dtype}: {res['bytes'] / 1e9:.2f} GB in "
              f"{res['seconds_median'] * 1e3:.1f} ms = {res['gb_per_s_median']:.1f} GB/s (median of {args.repeats}); "
              f"logits max abs diff before {res['logits_max_abs_diff_before']:.3g}, after "
              f"{res['logits_max_abs_diff_after']:.3g}; data_ptrs unchanged: {res['data_ptrs_unchanged']}")
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(res, f, indent=2)
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
