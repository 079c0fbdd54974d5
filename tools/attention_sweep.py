"""Time the fused decode attention (gpu_model.rope_attention: RoPE + K/V write + paged
attention + the split merge) alone, one kernel setting against another, on the GPU.

    python tools/attention_sweep.py --shape 7b --batch 32 [--context 212] [--json FILE]

A CUDA graph of one call per layer (each layer its own KV cache, so the keys come from
HBM as in a decode step, not from L2) is replayed; printed: microseconds per call, the
KV bytes per call over that time, and the ratio to the default setting timed in the same
run. Settings: split counts, warps, pipelining stages, key-tile sizes (block_n), the key
loop's knobs (gpu_model.ROPE_ATTENTION_PAGES_AHEAD, _WRITE_FIRST, _OFF32, _SAME_STRIDES;
each setting leaves the knobs it does not name at their defaults; "before session 34" sets
the last three as they were then; --only picks settings by name), and an empty kernel's
per-launch floor. A benchmark, not a test: it asserts nothing about time;
every setting's output is checked equal to the default's (the same math, bit for bit,
for settings that keep the split layout; others only reported as max |diff|).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

import torch
import triton
import triton.language as tl

from megatron_tlt.bench import SHAPES, _git_revision
from megatron_tlt.models.arch import ModelArch
from megatron_tlt.rollout import gpu_model, triton_attention
from megatron_tlt.rollout.model import rope_table


@triton.jit
def _noop(x_ptr):
    tl.store(x_ptr, tl.load(x_ptr) + 1)


def case(arch: ModelArch, batch: int, context: int, layers: int, page: int, planes: int,
         dev: torch.device, seed: int = 0):
    """Per-layer caches with every sequence's `context` keys (the new token last) in
    scattered blocks, float32 QKV planes, positions, slots and RoPE tables."""
    g = torch.Generator().manual_seed(seed)
    hd, kvh = arch.head_dim, arch.num_kv_heads
    nblk = -(-context // page)
    total = batch * nblk + 4
    bt = torch.randperm(total, generator=g)[:batch * nblk].view(batch, nblk).to(torch.int32)
    caches = [(torch.randn(total, page, kvh, hd, generator=g).to(torch.bfloat16).to(dev),
               torch.randn(total, page, kvh, hd, generator=g).to(torch.bfloat16).to(dev))
              for _ in range(layers)]
    width = (arch.num_heads + 2 * kvh) * hd
    qkv = torch.randn(planes, batch, width, generator=g)  # float32 planes; one: the model dtype
    qkv = (qkv.to(torch.bfloat16) if planes == 1 else qkv).to(dev)
    pos = torch.full((batch,), context - 1, dtype=torch.int32, device=dev)
    slots = (bt[:, (context - 1) // page].long() * page + (context - 1) % page).to(torch.int32).to(dev)
    cos, sin = rope_table(context + 64, hd, arch.rope_theta, device=dev)
    bias = torch.randn(width, generator=g).to(torch.bfloat16).to(dev) if arch.qkv_bias else None
    meta = dict(block_tables=bt.to(dev), context_lens=torch.full((batch,), context, dtype=torch.int32, device=dev))
    return qkv, pos, slots, cos, sin, bias, caches, meta


_KNOBS = {"warps": "ROPE_ATTENTION_WARPS", "stages": "ROPE_ATTENTION_STAGES",
          "block_n": "ROPE_ATTENTION_BLOCK_N", "pages_ahead": "ROPE_ATTENTION_PAGES_AHEAD",
          "write_first": "ROPE_ATTENTION_WRITE_FIRST", "off32": "ROPE_ATTENTION_OFF32",
          "same": "ROPE_ATTENTION_SAME_STRIDES"}
"""setting()'s keywords -> the gpu_model knob each sets."""


@contextlib.contextmanager
def setting(full_grid=None, **knobs):
    """Launch knobs for the calls inside (keywords of _KNOBS; None leaves one as it is);
    full_grid=False: no full-grid 4-tile minimum and no full-grid in-kernel merge (the
    settings before session 27, with stages=2)."""
    ta = triton_attention
    targets = [(gpu_model, _KNOBS[k], v) for k, v in knobs.items() if v is not None]
    if full_grid is False:
        targets += [(ta, "FULL_GRID_MIN_TILES", 1), (ta, "FULL_GRID_MERGE", False)]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in targets]
    for mod, name, value in targets:
        setattr(mod, name, value)
    try:
        yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)


def time_graph(fn, reps: int) -> float:
    """Microseconds per replay of a graph of fn (median of `reps` timed groups of 10)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            graph.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / 10)
    ts.sort()
    return ts[len(ts) // 2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="7b", choices=sorted(s for s in SHAPES if s != "tiny"))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=212)
    p.add_argument("--max-context", type=int, default=None,
                   help="the engine's longest context, which sets the default split count "
                        "(default: bench rollout's, about context + 100)")
    p.add_argument("--planes", type=int, default=2, help="QKV split-K partial-sum planes")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--json", default=None)
    p.add_argument("--only", default=None,
                   help="comma-separated substrings: time only the settings whose names hold one")
    a = p.parse_args()
    dev = torch.device("cuda")
    arch = ModelArch(**SHAPES[a.shape])
    qkv, pos, slots, cos, sin, bias, caches, meta = case(arch, a.batch, a.context, a.layers, 16,
                                                         a.planes, dev)
    max_ctx = a.max_context or a.context + 100
    group = arch.num_heads // arch.num_kv_heads
    default_splits = triton_attention.splits_for(caches[0][0], a.batch, max_ctx, group)
    with setting(full_grid=False):
        old_splits = triton_attention.splits_for(caches[0][0], a.batch, max_ctx, group)
    kw = dict(num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
              scale=arch.head_dim ** -0.5, bias=bias)
    kv_bytes = 2 * a.batch * a.context * arch.num_kv_heads * arch.head_dim * 2

    def run(splits):
        return [gpu_model.rope_attention(qkv, pos, slots, cos, sin, k, v, num_splits=splits,
                                         **meta, **kw) for k, v in caches]

    variants = [("default", default_splits, {})]
    variants += [(f"before session 27 (splits={old_splits})", old_splits,
                  dict(stages=2, full_grid=False))]
    variants += [("before session 34", default_splits, dict(write_first=0, off32=False, same=False))]
    variants += [(f"splits={s}", s, {}) for s in (1, 2, 3, 4, 6, 8, 16) if s != default_splits]
    variants += [(f"warps={w}", default_splits, dict(warps=w)) for w in (2, 4, 8, 16)]
    variants += [(f"stages={s}", default_splits, dict(stages=s)) for s in (1, 2, 3, 4)]
    variants += [(f"block_n={n}", default_splits, dict(block_n=n)) for n in (16, 32, 128)]
    variants += [(f"splits=1,warps={w}", 1, dict(warps=w)) for w in (2, 8)]
    variants += [(f"splits=1,block_n={n}", 1, dict(block_n=n)) for n in (32, 128)]
    variants += [(f"splits={s},stages=1", s, dict(stages=1)) for s in (1, 2, 4, 8)]
    variants += [("splits=1,stages=1,block_n=128", 1, dict(stages=1, block_n=128))]
    variants += [("pages_ahead" + (f",stages={s}" if s else ""), default_splits,
                  dict(pages_ahead=True, stages=s)) for s in (None, 1, 2, 3)]
    variants += [("pages_ahead,block_n=32", default_splits, dict(pages_ahead=True, block_n=32))]
    wf = dict(write_first=1)
    variants += [("write_all", default_splits, dict(write_first=2)),
                 ("write_all,pages_ahead", default_splits, dict(write_first=2, pages_ahead=True)),
                 ("write_all,warps=8", default_splits, dict(write_first=2, warps=8)),
                 ("write_all,stages=3", default_splits, dict(write_first=2, stages=3))]
    variants += [("write_first", default_splits, wf), ("write_first,pages_ahead", default_splits,
                  dict(wf, pages_ahead=True))]
    variants += [(f"write_first,warps={w}", default_splits, dict(wf, warps=w)) for w in (4, 8)]
    variants += [(f"write_first,stages={s}", default_splits, dict(wf, stages=s)) for s in (1, 3)]
    variants += [("write_first,splits=1", 1, wf), ("write_first,splits=1,block_n=128", 1,
                                                   dict(wf, block_n=128))]
    variants += [("off32", default_splits, dict(off32=True)),
                 ("off32,write_first", default_splits, dict(off32=True, write_first=1)),
                 ("off32,write_all", default_splits, dict(off32=True, write_first=2)),
                 ("off32,write_all,warps=8", default_splits, dict(off32=True, write_first=2, warps=8)),
                 ("off32,write_all,same", default_splits, dict(off32=True, write_first=2, same=True)),
                 ("off32,write_first,same", default_splits, dict(off32=True, write_first=1, same=True))]
    if a.only:
        variants = [v for v in variants if v[0] == "default" or any(o in v[0] for o in a.only.split(","))]
    ref = None
    rows = []
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    floor = time_graph(lambda: [_noop[(1,)](flag) for _ in range(a.layers)], a.reps) / a.layers
    print(f"{a.shape} B={a.batch} context {a.context}: {arch.num_heads}/{arch.num_kv_heads} heads, "
          f"{kv_bytes / 1e6:.2f} MB of KV per call, default splits {default_splits}; "
          f"empty kernel {floor:.2f} us per launch; {torch.cuda.get_device_name()}")
    for name, splits, knobs in variants:
        try:
            with setting(**knobs):
                out = run(splits)
                us = time_graph(lambda: run(splits), a.reps) / a.layers  # noqa: B023
        except Exception as e:  # a setting that does not compile or fit (shared memory)
            print(f"{name:30s} failed: {type(e).__name__}: {str(e)[:120]}")
            rows.append({"name": name, "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        if ref is None:
            ref, base = out, us
        diff = max(float((o.float() - r.float()).abs().max()) for o, r in zip(out, ref))
        rows.append({"name": name, "splits": splits, **knobs, "us_per_call": us,
                     "kv_GBps": kv_bytes / us / 1e3, "vs_default": base / us, "max_abs_diff": diff})
        print(f"{name:30s} {us:7.2f} us/call  {kv_bytes / us / 1e3:7.1f} GB/s of KV  "
              f"{base / us:6.3f}x  max|diff| {diff:.3g}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": " ".join(["python", *sys.argv]), "git_revision": _git_revision(),
                       "shape": a.shape, "batch": a.batch, "context": a.context, "max_context": max_ctx,
                       "default_splits": default_splits, "layers": a.layers, "planes": a.planes,
                       "device": torch.cuda.get_device_name(), "empty_kernel_us": floor,
                       "kv_bytes_per_call": kv_bytes, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
