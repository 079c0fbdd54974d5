"""Per-kernel GPU time of one decode step of the engine's fused forward (eager, so the
profiler sees every kernel; graph replay runs the same kernels back to back).

    python tools/profile_decode.py --shape 1.5b --batch 1 [--attr MODULE:NAME=VALUE ...] [--json FILE]

Prints kernel name, calls per step and microseconds per step, sorted by time, and the
sum against the measured step time: the difference is launch gaps that CUDA graphs remove.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from megatron_tlt.bench import SHAPES, _git_revision, parse_attrs, random_weights
from megatron_tlt.models.arch import ModelArch
from megatron_tlt.rollout.engine import RolloutEngine
from megatron_tlt.rollout.request import Request
from megatron_tlt.rollout.sampling import SamplingParams


def decode_engine(arch: ModelArch, batches: list[int], context: int,
                  page: int = 16) -> tuple[RolloutEngine, list]:
    """A bf16 engine over random weights with decode graphs for `batches`, and max(batches)
    sequences of `context` - 8 random prompt tokens, prefilled, each with one token pending
    and its blocks allocated (DecodeRunner.prepare(seqs[:b]) takes any first b)."""
    w = random_weights(arch, dtype=torch.bfloat16, device=torch.device("cuda"), seed=0)
    top = max(batches)
    engine = RolloutEngine(arch, w, max_num_seqs=top, num_blocks=top * (context // page + 4),
                           block_size=page, dtype=torch.bfloat16, device="cuda",
                           max_model_len=context + 32, attention_backend="triton",
                           cuda_graphs=True, cuda_graph_batch_sizes=sorted(batches))
    g = torch.Generator().manual_seed(1)
    n = context - 8
    reqs = [Request(prompt_id=str(i), prompt_token_ids=torch.randint(0, arch.vocab_size, (n,), generator=g).tolist(),
                    sampling_params=SamplingParams(temperature=0.0, max_new_tokens=4, min_new_tokens=4))
            for i in range(top)]
    seqs = [engine.add_sequence(r) for r in reqs]
    engine.sample_and_append(seqs, engine.forward_pending(seqs).logits)
    for s in seqs:
        engine.cache.ensure(s.seq_id, len(s.token_ids) + 1)
    return engine, seqs


def replay_ms(runner, bucket: int, *, steps: int, repeats: int, warmup: int = 0) -> float:
    """Median ms per replay of the bucket's decode graph over `repeats` runs of `steps`
    replays (inputs unchanged between replays), after `warmup` untimed ones."""
    for _ in range(warmup):
        runner.run(bucket)
    ts = []
    for _ in range(repeats):
        s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s0.record()
        for _ in range(steps):
            runner.run(bucket)
        s1.record()
        s1.synchronize()
        ts.append(s0.elapsed_time(s1) / steps)
    return statistics.median(ts)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--attr", action="append", default=[], metavar="MODULE:NAME=VALUE",
                   help="set a kernel setting first (bench rollout --compare-attr's syntax; "
                        "';' joins several); repeatable")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    for spec in a.attr:
        for mod, name, value in parse_attrs(spec):
            setattr(mod, name, value)
    arch = ModelArch(**SHAPES[a.shape])
    engine, seqs = decode_engine(arch, [a.batch], a.context)
    runner = engine.decode_runner
    bucket = runner.prepare(seqs)
    runner.capture()  # tunes the planner in the warm-up pass
    for _ in range(3):
        runner._forward(bucket)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            runner._forward(bucket)
        torch.cuda.synchronize()
    agg: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.device_time > 0:
            agg.setdefault(e.name, []).append(e.device_time)
    rows = sorted(((k, len(v) / a.steps, sum(v) / a.steps) for k, v in agg.items()), key=lambda r: -r[2])
    graph_us = replay_ms(runner, bucket, steps=a.steps, repeats=5) * 1e3
    total = sum(r[2] for r in rows)
    print(f"{a.shape} B={a.batch}: kernels {total:.1f} us/step, graph replay {graph_us:.1f} us/step")
    for name, calls, us in rows[:25]:
        print(f"{us:9.1f} us {calls:6.1f}x  {name[:110]}")
    plans = {str(k[:3]): [str(c), round(us, 2)] for k, (c, us) in runner.model.planner.plans.items()}
    print("plans:", plans)
    fused = {str(tuple(x for x in k if not isinstance(x, torch.dtype))): [str(c), round(f, 2), round(u, 2)]
             for k, (c, f, u) in runner.model.planner.fused.items()}
    print("fused prologues (config or None, fused us, unfused us):", fused)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": shlex.join(["python", *sys.argv]), "git_revision": _git_revision(),
                       "attrs": a.attr, "device": torch.cuda.get_device_name(),
                       "shape": a.shape, "batch": a.batch, "context": a.context,
                       "kernel_us_per_step": total, "graph_us_per_step": graph_us,
                       "kernels": [{"name": r[0], "calls": r[1], "us": r[2]} for r in rows],
                       "plans": plans, "fused": fused, "planner_timings": {str(k[:3]): v for k, v in runner.model.planner.timings.items()}},
                      f, indent=1)


if __name__ == "__main__":
    main()
