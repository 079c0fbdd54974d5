"""Time decode projections with Triton configs the planner does not try, against the ones
it does, on the GPU.

    python tools/linear_sweep.py [--cases 1.5b:1,7b:32] [--only qkv,o] [--json FILE]

The planner (triton_linear.LinearPlanner) picks each projection's kernel from cuBLAS and
candidate_configs(m, n, k). On the H200 the small projections ran far below the HBM
bandwidth alone (session 27's plans: the 1.5B shape's QKV and O projections at batch 1 at
1729 and 1394 GB/s, the 7B shape's at batch 32 at 2925 and 2679 GB/s, of 4316). This
times, per case (shape:rows) and projection, every candidate of the planner and a wider
set (8 warps, 256-column K tiles, other pipelining depths; for one row fma configs with
1024-column tiles or 2 warps), each the planner's way (triton_linear._time_us: a CUDA
graph of 16 launches cycling through copies of the weight worth more than the L2 cache,
under programmatic dependent launch where the device has it), and prints the fastest of
each set, its GB/s and their ratio. A benchmark, not a test: it asserts nothing about
time; every config's output is checked against F.linear (max |diff| printed, a config
off by more than a rounding is reported and left out).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from megatron_tlt.bench import SHAPES, _git_revision, measure_bandwidth
from megatron_tlt.models.arch import ModelArch
from megatron_tlt.rollout import pdl
from megatron_tlt.rollout import triton_linear as tlin
from megatron_tlt.rollout.linear_plans import LinearConfig


def projections(arch: ModelArch) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of a layer's projections (fused QKV and gate/up, as EngineWeights)."""
    hd, h = arch.head_dim, arch.hidden_size
    return {"qkv": ((arch.num_heads + 2 * arch.num_kv_heads) * hd, h),
            "o": (h, arch.num_heads * hd),
            "gate_up": (2 * arch.intermediate_size, h),
            "down": (h, arch.intermediate_size)}


def wider_configs(m: int, n: int, k: int) -> list[LinearConfig]:
    """Triton configs outside candidate_configs(m, n, k) (m <= 64 rows)."""
    out = []
    block_m = max(16, 1 << (m - 1).bit_length())

    def dot(block_n, block_k, splits, warps, stages):
        if splits == 1 or k // splits >= block_k:
            out.append(LinearConfig("dot", block_m=block_m, block_n=block_n, block_k=block_k,
                                    splits=splits, num_warps=warps, num_stages=stages))
    for splits in (1, 2, 4, 8):
        for block_n in (32, 64, 128):
            dot(block_n, 128, splits, 8, 4)
        for block_n in (16, 32, 64):
            dot(block_n, 256, splits, 4, 3)
        for block_n in (32, 64):
            for stages in (2, 6):
                dot(block_n, 128, splits, 4, stages)
    if m == 1:
        for splits in (1, 2, 4, 8):
            for block_n in (2, 4, 8):
                if splits == 1 or k // splits >= 1024:
                    out.append(LinearConfig("fma", block_m=1, block_n=block_n, block_k=1024,
                                            splits=splits, num_warps=4, num_stages=3))
            for block_n in (4, 8, 16):
                if splits == 1 or k // splits >= 256:
                    out.append(LinearConfig("fma", block_m=1, block_n=block_n, block_k=256,
                                            splits=splits, num_warps=2, num_stages=3))
    known = {str(c) for c in tlin.candidate_configs(m, n, k)}
    return [c for c in out if str(c) not in known]


def time_configs(configs, x, ws, ref, iters: int) -> dict[str, dict]:
    """str(config) -> {us, max_abs_diff} (us None where it failed or was wrong)."""
    out = {}
    tol = 2e-2 * float(ref.abs().max()) + 1e-3
    for cfg in configs:
        try:
            got = tlin.linear_partials(x, ws[0], cfg).float().sum(0)
            diff = float((got - ref).abs().max())
            us = tlin._time_us(lambda i: tlin.linear_partials(x, ws[i % len(ws)], cfg), iters)  # noqa: B023
        except Exception as e:  # noqa: BLE001 - a config that does not compile here
            out[str(cfg)] = {"us": None, "error": f"{type(e).__name__}: {str(e)[:120]}"}
            continue
        out[str(cfg)] = {"us": us if diff <= tol else None, "max_abs_diff": diff}
    return out


def best(rows: dict[str, dict]) -> tuple[str | None, float]:
    ok = [(r["us"], name) for name, r in rows.items() if r.get("us") is not None]
    if not ok:
        return None, float("inf")
    us, name = min(ok)
    return name, us


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="1.5b:1,7b:32", help="shape:rows, comma-separated")
    ap.add_argument("--only", default="qkv,o,gate_up,down", help="projections to time")
    ap.add_argument("--iters", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("linear_sweep: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    names = [s for s in args.only.split(",") if s]
    roofline_gbps = measure_bandwidth(dev, 2 << 30)["roofline_GBps"]  # bench rollout's roofline bandwidth
    results = []
    on = pdl.supported(dev)
    print(f"{torch.cuda.get_device_name(dev)}; roofline bandwidth {roofline_gbps:.0f} GB/s; PDL {on}")
    print(f"{'case':>10} {'proj':>8} {'planner best':>26} {'us':>7} {'GB/s':>6} "
          f"{'wider best':>26} {'us':>7} {'GB/s':>6} {'ratio':>6}")
    for case in args.cases.split(","):
        shape, rows = case.split(":")
        m = int(rows)
        arch = ModelArch(**SHAPES[shape])
        for name, (n, k) in projections(arch).items():
            if name not in names:
                continue
            g = torch.Generator(device=dev).manual_seed(0)
            w = torch.randn(n, k, generator=g, device=dev).to(dtype)
            ws = tlin._weight_copies(w)
            x = torch.randn(m, k, generator=g, device=dev).to(dtype)
            ref = F.linear(x, w).float()
            with pdl.launches(on):
                cur = time_configs([c for c in tlin.candidate_configs(m, n, k) if c.kind != "cublas"],
                                   x, ws, ref, args.iters)
                cur["cublas"] = {"us": tlin._time_us(lambda i: F.linear(x, ws[i % len(ws)]), args.iters)}  # noqa: B023
                wide = time_configs(wider_configs(m, n, k), x, ws, ref, args.iters)
            (cb, cu), (wb, wu) = best(cur), best(wide)
            nbytes = n * k * w.element_size()
            print(f"{case:>10} {name:>8} {cb or '-':>26} {cu:7.2f} {nbytes / cu / 1e3:6.0f} "
                  f"{wb or '-':>26} {wu:7.2f} {nbytes / wu / 1e3:6.0f} {cu / wu:6.3f}")
            results.append({"shape": shape, "rows": m, "proj": name, "n": n, "k": k,
                            "weight_bytes": nbytes, "planner_best": cb, "planner_us": cu,
                            "wider_best": wb, "wider_us": wu, "planner_over_wider": cu / wu,
                            "planner_candidates": cur, "wider_candidates": wide})
            ws = w = None  # the copies freed before the next projection
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(["python", "tools/linear_sweep.py"] + (argv or sys.argv[1:])),
                       "git_revision": _git_revision(), "device": torch.cuda.get_device_name(dev),
                       "roofline_GBps": roofline_gbps, "pdl": on, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
