"""What each kernel of the decode step costs inside the CUDA graph: the step timed with one
kind of kernel left out (or replaced by an empty kernel), side by side with the whole step.

    python tools/ablate_decode.py --shape 1.5b --batch-sizes 1,8,32 [--variants base,norm:none,...]
        [--rounds 2] [--json FILE]

A kernel's time alone (tools/profile_decode.py) is not what it adds to a step whose
kernels overlap under programmatic dependent launch (rollout/pdl.py): session 30 made the
decode attention 1.11x faster alone and the step did not move. Leaving a kernel out of
the captured graph and timing the step again measures what it adds where it runs. The
outputs of an ablated step are garbage (tokens are not checked; the graph replays the
same inputs), so this is a measurement tool only, never a setting of the engine.

Variants (KIND:HOW; HOW = none: no launch, its output an uninitialised buffer of the
right shape; empty: one launch of a kernel that only takes part in PDL, i.e. the cost of
a graph node with no work):
  base           the engine's step as it is
  norm:none|empty   every RMSNorm launched on its own (not those fused into a projection)
  attn:none|empty   the fused RoPE + attention launch (and its L2 prefetch and merge)
  combine:none   the split-merge launch (_combine_kernel) only
  oproj:none     the attention output projection
  silu:none      SiLU * up where it is its own launch
  head:none      the LM head
  prefetch:none  the L2 weight prefetch after the attention (ATTN_L2_PREFETCH_MB=0)
  all:empty      every Triton or cuBLAS launch of the forward (norms, projections, fused
                 prologue and GLU-epilogue projections, attention, SiLU, LM head; the
                 embedding gather stays) an empty kernel: the floor of a chain of that
                 many dependent launches with no work
Each variant is captured afresh; `--rounds` repeats the whole list, and each ratio is taken
against the base step of the same round (drift cancels).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import statistics
import sys
from unittest.mock import patch

import torch
import triton
import triton.language as tl

from megatron_tlt.bench import SHAPES, _git_revision
from megatron_tlt.models.arch import ModelArch
from megatron_tlt.rollout import gpu_model, pdl
from megatron_tlt.rollout.triton_pdl import pdl_enter

VARIANTS = ("base", "norm:none", "norm:empty", "attn:none", "attn:empty", "combine:none",
            "oproj:none", "silu:none", "head:none", "prefetch:none", "all:empty")


@triton.jit
def _empty_kernel(x_ptr, USE_PDL: tl.constexpr):
    """A graph node that does nothing but wait for its predecessor and release its
    dependents (the PDL part of every decode kernel)."""
    pdl_enter(USE_PDL)


def _empty_launch(ref: torch.Tensor) -> None:
    _empty_kernel[(1,)](ref, **pdl.kwargs())


def _stand_in(shape_of, launch: bool):
    """A replacement returning an uninitialised tensor of `shape_of(*args, **kwargs)`
    (shape, dtype, device); `launch`: one empty kernel launch first."""
    def fake(*args, **kwargs):
        shape, dtype, dev = shape_of(*args, **kwargs)
        out = torch.empty(shape, dtype=dtype, device=dev)
        if launch:
            _empty_launch(out)
        return out
    return fake


def _norm_shape(x, weight, eps, residual=None, bias=None, *, sum_out=None):
    xp = gpu_model._planes(x)
    return (xp.shape[1], xp.shape[2]), weight.dtype, xp.device


def _paged_shape(q, *args, **kwargs):
    return tuple(q.shape), q.dtype, q.device


def _attn_shape(qkv, *args, num_heads, head_dim, **kwargs):
    """rope_attention's and qkv_rope_write_kv's output: [T, H, D] in the cache's dtype
    (args: positions, slot_mapping, cos, sin, k_cache, ...)."""
    t = gpu_model._planes(qkv).shape[1]
    return (t, num_heads, head_dim), args[4].dtype, qkv.device


def _linear_shape(x, weight, cfg):
    """linear_partials' output for `cfg`: cfg.splits float32 planes, or one model-dtype
    plane from cuBLAS, so the consumer (and its plan key) is the one the real step has."""
    if cfg.kind == "cublas":
        return (1, x.shape[0], weight.shape[0]), weight.dtype, x.device
    return (cfg.splits, x.shape[0], weight.shape[0]), torch.float32, x.device


def _fused_norm_linear(planes, residual, norm_weight, eps, weight, cfg, bias=None):
    return _stand_in(_linear_shape, True)(residual, weight, cfg), residual


def _fused_silu_linear(gate_up, weight, cfg):
    return _stand_in(_linear_shape, True)(gate_up[0], weight, cfg)


def _empty_head(x, weight, out, cfg):
    _empty_launch(out)
    return out


def _silu_shape(gate_up, dtype=None):
    gu = gpu_model._planes(gate_up)
    return (gu.shape[1], gu.shape[2] // 2), dtype or gate_up.dtype, gu.device


def _glu_shape(x, weight, cfg):
    return (x.shape[0], weight.shape[0] // 2), weight.dtype, x.device


@contextlib.contextmanager
def _all_empty():
    """all:empty's patches, applied on entering only (ablation() is also called just to
    check a variant's name: session 32's first GPU run had them applied at that call and
    never undone, so every variant, base included, ran with all:empty)."""
    with contextlib.ExitStack() as stack:
        for name, value in (("rms_norm", _stand_in(_norm_shape, True)),
                            ("rope_attention", _stand_in(_attn_shape, True)),
                            ("silu_mul", _stand_in(_silu_shape, True)),
                            ("glu_linear", _stand_in(_glu_shape, True)),
                            ("linear_partials", _stand_in(_linear_shape, True)),
                            ("norm_linear_partials", _fused_norm_linear),
                            ("silu_linear_partials", _fused_silu_linear),
                            ("linear_into", _empty_head),
                            ("paged_attention", _stand_in(_paged_shape, True)),
                            ("qkv_rope_write_kv", _stand_in(_attn_shape, True))):
            stack.enter_context(patch.object(gpu_model, name, value))
        yield


def ablation(variant: str, model) -> contextlib.AbstractContextManager:
    """The context under which `model` (a DecodeModel) runs `variant` (VARIANTS)."""
    kind, _, how = variant.partition(":")
    if variant == "base":
        return contextlib.nullcontext()
    if variant == "all:empty":
        return _all_empty()
    if kind == "norm" and how in ("none", "empty"):
        return patch.object(gpu_model, "rms_norm", _stand_in(_norm_shape, how == "empty"))
    if kind == "attn" and how in ("none", "empty"):
        return patch.object(gpu_model, "rope_attention", _stand_in(_attn_shape, how == "empty"))
    if variant == "combine:none":
        return patch.object(gpu_model, "combine_splits", lambda *a, **k: None)
    if variant == "silu:none":
        return patch.object(gpu_model, "silu_mul", _stand_in(_silu_shape, False))
    if variant == "prefetch:none":
        return patch.object(gpu_model, "ATTN_L2_PREFETCH_MB", 0)
    if variant == "head:none":
        return patch.object(gpu_model, "linear_into", lambda x, weight, out, cfg: out)
    if variant == "oproj:none":
        o_ptrs = {lw.o_weight.data_ptr() for lw in model.weights.layers}
        real = model._linear

        def linear(x, weight):
            if weight.data_ptr() in o_ptrs:
                return _stand_in(_linear_shape, False)(x, weight, model.planner.config(x, weight))
            return real(x, weight)
        return patch.object(model, "_linear", linear)
    raise ValueError(f"ablate_decode: unknown variant {variant!r} (one of {', '.join(VARIANTS)})")


def main() -> None:
    from profile_decode import decode_engine, replay_ms  # tools/, beside this file

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    # base first: its capture tunes the kernel planner, whose timings (LinearPlanner
    # ._tune_fused calls rms_norm / silu_mul) must never see a stand-in
    variants = ["base"] + [v for v in (x.strip() for x in a.variants.split(",")) if v and v != "base"]
    batches = sorted({int(b) for b in a.batch_sizes.split(",")})
    arch = ModelArch(**SHAPES[a.shape])
    engine, seqs = decode_engine(arch, batches, a.context)
    runner = engine.decode_runner
    model = runner.model
    for v in variants:  # unknown names fail before any timing
        ablation(v, model)
    ms: dict[int, dict[str, list[float]]] = {b: {v: [] for v in variants} for b in batches}
    for r in range(a.rounds):
        for v in variants:
            with ablation(v, model):
                runner.capture()
            for b in batches:
                bucket = runner.prepare(seqs[:b])
                ms[b][v].append(replay_ms(runner, bucket, steps=a.steps, repeats=a.repeats, warmup=10))
            print(f"round {r} {v}: " + "  ".join(f"B={b} {ms[b][v][-1]:.4f}" for b in batches),
                  flush=True)
    runner.release()
    rows = []
    for b in batches:
        base = ms[b]["base"]
        print(f"\n{a.shape} B={b}: base {statistics.median(base):.4f} ms/step "
              f"(context {a.context}, {arch.num_layers} layers)")
        for v in variants:
            ratios = [t / t0 for t, t0 in zip(ms[b][v], base)]
            d_us = [(t0 - t) * 1e3 for t, t0 in zip(ms[b][v], base)]
            row = dict(batch=b, variant=v, ms=ms[b][v], ratio_to_base=ratios,
                       saved_us_per_step=d_us,
                       saved_us_per_layer=[d / arch.num_layers for d in d_us])
            rows.append(row)
            print(f"  {v:14s} {statistics.median(ms[b][v]):.4f} ms  x{statistics.median(ratios):.4f} "
                  f"of base  saves {statistics.median(d_us):7.1f} us/step "
                  f"({statistics.median(d_us) / arch.num_layers:5.2f} us/layer)  rounds {['%.4f' % x for x in ms[b][v]]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": shlex.join(["python", *sys.argv]), "git_revision": _git_revision(),
                       "device": torch.cuda.get_device_name(), "shape": a.shape,
                       "context": a.context, "layers": arch.num_layers, "rows": rows,
                       "num_splits": {str(k): v for k, v in runner.num_splits.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
