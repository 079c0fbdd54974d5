"""Do separately timed kernel plans agree? (GPU only.)

Times LinearPlanner's candidates for the decode projections of a model shape REPEATS
times, each with a fresh planner (as separate engines or runs did before the shared
planner / MEGATRON_TLT_LINEAR_PLANS), and reports the shapes whose chosen kernel
differed between repeats: each such shape is a place where two engines could round
differently and so sample different tokens from the same seed. `--hog` runs a bf16
matmul loop in another process on the same GPU meanwhile (a training job sharing it).

    python tools/plan_agreement.py [--repeats 3] [--hog] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Qwen2.5-1.5B: hidden 1536, intermediate 8960, 12 query / 2 KV heads of 128, vocab 151936
SHAPES = {"qkv": (2048, 1536, True), "o": (1536, 1536, True), "gate_up": (17920, 1536, True),
          "down": (1536, 8960, True), "lm_head": (151936, 1536, False)}


def _hog(stop) -> None:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    while not stop.is_set():
        for _ in range(20):
            a = (a @ a).mul_(1e-4)
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", default="1,2,4,8,16,32", help="decode batch sizes (row counts)")
    ap.add_argument("--hog", action="store_true", help="a matmul loop on the same GPU meanwhile")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("plan_agreement: needs a CUDA GPU")
    from megatron_tlt.rollout.triton_linear import LinearPlanner

    stop = hog = None
    if args.hog:
        ctx = mp.get_context("spawn")
        stop = ctx.Event()
        hog = ctx.Process(target=_hog, args=(stop,), daemon=True)
        hog.start()
        time.sleep(5)  # let it start loading the GPU
    rows = [int(r) for r in args.rows.split(",")]
    weights = {name: torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
               for name, (n, k, _) in SHAPES.items()}
    choices: dict[str, list[str]] = {}
    gaps: dict[str, float] = {}
    t0 = time.perf_counter()
    try:
        for rep in range(args.repeats):
            planner = LinearPlanner()
            for name, (n, k, split) in SHAPES.items():
                for m in rows:
                    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
                    cfg = planner.config(x, weights[name], split=split)
                    key = f"{name} m={m}"
                    choices.setdefault(key, []).append(str(cfg))
                    if rep == 0:  # how close the runner-up timed
                        t = sorted(v for v in planner.timings[(1 << max(0, (m - 1).bit_length()), n, k, torch.bfloat16, split)].values()
                                   if v == v)
                        gaps[key] = (t[1] - t[0]) / t[0] if len(t) > 1 else float("inf")
            print(f"[plan_agreement] repeat {rep + 1}/{args.repeats} at {time.perf_counter() - t0:.0f} s",
                  flush=True)
    finally:
        if hog is not None:
            stop.set()
            hog.join(timeout=30)
    differ = {k: v for k, v in choices.items() if len(set(v)) > 1}
    out = {"device": torch.cuda.get_device_name(), "hog": args.hog, "repeats": args.repeats,
           "shapes": len(choices), "shapes_differing": len(differ), "differing": differ,
           "choices": choices,
           "best_vs_second_gap": {k: round(g, 4) for k, g in gaps.items()},
           "shapes_within_5pct": sum(g < 0.05 for g in gaps.values()),
           "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
           "git_rev": os.environ.get("MEGATRON_TLT_GIT_REV")}
    print(json.dumps({k: out[k] for k in ("device", "hog", "repeats", "shapes", "shapes_differing",
                                         "shapes_within_5pct", "differing")}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
