"""The one-row fused MLP (triton_linear.mlp_barrier, gpu_model.FUSED_MLP) alone against the
separate kernels it replaces (the planner's gate/up projection + silu_mul + the planner's
down projection), and each of its two phases alone, at the 1.5B and 7B shapes: CUDA-graph
replays over six weight copies (more than L2 holds), microseconds per call (GPU only).

    python tools/mlp_microbench.py

Session 38 (H100, benchmarks/results/gpu_2026-12-07_session38): 1.5B separate 33.4 us,
fused 71.6 us (its first phase alone 38.2, its second 32.7); 7B 135.5 against 169.8.
Session 39 (H100, benchmarks/results/gpu_2026-12-07_session39): 1.5B separate 33.4 us,
fused 67.8 (4 warps 45.1); 7B 136.6 against 163.0.
"""

from __future__ import annotations

import sys

import torch


def main() -> int:
    if not torch.cuda.is_available():
        print("mlp_microbench: needs a CUDA GPU", file=sys.stderr)
        return 2
    from megatron_tlt.rollout import triton_linear as T
    from megatron_tlt.rollout.gpu_model import mlp_barrier_config, silu_mul
    from megatron_tlt.rollout.triton_linear import _time_us, linear_partials, mlp_barrier
    d = torch.device("cuda")
    for h, i in [(1536, 8960), (3584, 18944)]:
        x = torch.randn(1, h, device=d).bfloat16()
        gus = [(0.02 * torch.randn(2 * i, h, device=d)).bfloat16() for _ in range(6)]
        dns = [(0.02 * torch.randn(h, i, device=d)).bfloat16() for _ in range(6)]
        cnt = torch.zeros(1, dtype=torch.int64, device=d)
        kw = mlp_barrier_config(d)
        planner = T.LinearPlanner()
        c1 = planner.config(x, gus[0])
        xi = torch.randn(1, i, device=d).bfloat16()
        c2 = planner.config(xi, dns[0])
        sep = _time_us(lambda k: linear_partials(silu_mul(linear_partials(x, gus[k % 6], c1), dtype=torch.bfloat16),
                                                 dns[k % 6], c2), 16)
        gu_only = _time_us(lambda k: linear_partials(x, gus[k % 6], c1), 16)
        dn_only = _time_us(lambda k: linear_partials(xi, dns[k % 6], c2), 16)
        res = {}
        for name, extra in [("fused", {}), ("fused_w4", dict(num_warps=4)),
                            ("fused_i16k512", dict(max_block_i=16, block_k=512)),
                            ("fused_i64k128", dict(max_block_i=64, block_k=128))]:
            k2 = dict(kw, **extra)
            res[name] = _time_us(lambda k: mlp_barrier(x, gus[k % 6], dns[k % 6], cnt, **k2), 16)  # noqa: B023
        for ph in (1, 2):  # one phase alone (phase 2 over an unset intermediate row: timing only)
            res[f"phase{ph}"] = _time_us(lambda k: mlp_barrier(x, gus[k % 6], dns[k % 6], cnt, phases=(ph,), **kw),  # noqa: B023
                                         16)
        print(f"hidden {h} intermediate {i}: separate {sep:.1f} us (gate/up {gu_only:.1f} {c1}, "
              f"down {dn_only:.1f} {c2}); " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
