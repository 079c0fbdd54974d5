"""The decode attention kernel's sm_90 machine code, compiled on a machine without a GPU.

    python tools/sass_attention.py --shape 7b --batch 32 [--max-context 312]
        [--knob ROPE_ATTENTION_WRITE_FIRST=2 ...] [--warps N] [--stages N] [--dump DIR]

Compiles gpu_model._rope_attention_kernel for an H100/H200 (Triton's bundled ptxas and
cuobjdump, so no CUDA driver is needed) with the launch settings rope_attention would
choose for a decode step of the shape at that batch size (bench rollout's contexts:
--max-context is the engine's longest), and prints its static SASS instruction count,
shared memory, and each loop's instruction count and opcode mix. A decode attention
program at the 7B shape, batch 32, is issue-bound, not memory-bound (session 33, ncu on
an H100: ~7,200 instructions a warp at 0.91 instructions a cycle, 22% of the DRAM
bandwidth), so instructions a warp per key tile is the figure to bring down; this tool
counts them where no GPU is lent. Counting, not timing: loop trip counts depend on the
context (a 212-key context is 4 tiles of 64 keys).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megatron_tlt.bench import SHAPES
from megatron_tlt.models.arch import ModelArch
from megatron_tlt.rollout import gpu_model
from megatron_tlt.rollout import triton_attention as ta

_POINTERS = {"qkv_ptr": "*fp32", "bias_ptr": "*bf16", "pos_ptr": "*i32", "slot_ptr": "*i32",
             "cos_ptr": "*fp32", "sin_ptr": "*fp32", "k_ptr": "*bf16", "v_ptr": "*bf16",
             "bt_ptr": "*i32", "ctx_ptr": "*i32", "qs_ptr": "*i32", "tm_ptr": "*i32",
             "o_ptr": "*bf16", "po_ptr": "*fp32", "pm_ptr": "*fp32", "pl_ptr": "*fp32",
             "lk_ptr": "*i32"}
_UNIT_STRIDES = ("stride_pos", "stride_slot", "stride_ctx")  # Triton specializes 1s away


def launch_settings(arch: ModelArch, batch: int, max_context: int, sms: int = 132,
                    planes: int = 2) -> tuple[dict, int, int]:
    """(constexprs, warps, stages) of rope_attention's decode launch, as it chooses them
    on a GPU with `sms` multiprocessors that fills 3/4 of them at full grids."""
    kvh, group = arch.num_kv_heads, arch.num_heads // arch.num_kv_heads
    block_n = gpu_model.ROPE_ATTENTION_BLOCK_N or 64
    block_m = min(ta.MAX_BLOCK_M, max(16, 1 << (group - 1).bit_length()))
    programs = batch * kvh
    full = programs >= 0.75 * sms
    min_tiles = max(ta.split_min_tiles(), ta.FULL_GRID_MIN_TILES) if full else ta.split_min_tiles()
    splits = ta.choose_num_splits(batch, kvh, max_context, sms=sms, block_n=block_n,
                                  min_tiles=min_tiles)
    merge = splits > 1 and (ta.attention_merge_in_kernel() or (full and ta.FULL_GRID_MERGE))
    warps = gpu_model.ROPE_ATTENTION_WARPS or (8 if programs * splits <= sms else 4)
    stages = gpu_model.ROPE_ATTENTION_STAGES or ta.decode_stages(max_context, splits, block_n,
                                                                 min_tiles)
    # caches the engine would allocate (same strides for K and V), shapes only
    cache = torch.empty(batch * -(-max_context // 16), 16, kvh, arch.head_dim,
                        dtype=torch.bfloat16, device="meta")
    write_first, off32, same_strides = gpu_model.decode_loop_knobs(programs * splits, cache, cache,
                                                                   sms)
    const = dict(NUM_HEADS=arch.num_heads, NUM_KV_HEADS=kvh, G=group, HEAD_DIM=arch.head_dim,
                 HALF=arch.head_dim // 2, D_PAD=max(16, 1 << (arch.head_dim - 1).bit_length()),
                 BLOCK_M=block_m, BLOCK_N=block_n, PAGE=16, S=planes, HAS_BIAS=arch.qkv_bias,
                 SPLIT=splits > 1, MODE=ta.MODE_DECODE, WB=2, MERGE=merge, MIN_TILES=min_tiles,
                 PAGES_AHEAD=bool(gpu_model.ROPE_ATTENTION_PAGES_AHEAD),
                 WRITE_FIRST=write_first,
                 OFF32=off32, SAME_STRIDES=same_strides, USE_PDL=True,
                 **{s: 1 for s in _UNIT_STRIDES})
    return const, warps, stages


def compile_sm90(const: dict, warps: int, stages: int, fn=None, pointers: dict | None = None,
                 floats: tuple[str, ...] = ("scale_log2",)):
    """Compile `fn` (default: the fused decode attention) for sm_90: `const` its constexprs,
    `pointers` its pointer arguments' types (default: the attention's), `floats` its fp32
    scalars; other arguments i32, strides divisible by 16."""
    fn = fn or gpu_model._rope_attention_kernel
    pointers = _POINTERS if pointers is None else pointers
    sig, attrs = {}, {}
    const = dict(const)
    for param in fn.params:  # constexprs the launch leaves at their defaults
        if param.is_constexpr and param.name not in const:
            if not param.has_default:
                raise SystemExit(f"constexpr {param.name} has no default: give it")
            const[param.name] = param.default
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name], attrs[(i,)] = pointers[name], [["tt.divisibility", 16]]
        elif name in floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    missing = [n for n in const if n not in fn.arg_names]
    if missing:
        raise SystemExit(f"not arguments of the kernel: {missing}")
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})


def sass_of(cubin: bytes, path: str) -> list[tuple[int, str]]:
    with open(path, "wb") as f:
        f.write(cubin)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    text = subprocess.run([tool, "--dump-sass", path], capture_output=True, text=True,
                          check=True).stdout
    out = []
    for line in text.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def opcode(ins: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0]


def loops(sass: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(first, last) addresses of each backward branch's range."""
    spans = []
    for addr, ins in sass:
        m = re.search(r"BRA\s+(?:\S+\s+)?0x([0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < addr:
            spans.append((int(m.group(1), 16), addr))
    return spans


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="7b", choices=sorted(s for s in SHAPES if s != "tiny"))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-context", type=int, default=312)
    p.add_argument("--planes", type=int, default=2, help="the QKV projection's partial-sum planes")
    p.add_argument("--knob", action="append", default=[],
                   help="gpu_model.NAME=VALUE set before choosing the launch (repeatable)")
    p.add_argument("--warps", type=int, default=None)
    p.add_argument("--stages", type=int, default=None)
    p.add_argument("--dump", default="/tmp/sass_attention", help="directory for the cubin and SASS")
    a = p.parse_args()
    for spec in a.knob:
        name, _, value = spec.partition("=")
        if not hasattr(gpu_model, name):
            raise SystemExit(f"gpu_model has no {name}")
        setattr(gpu_model, name, {"True": True, "False": False, "None": None}.get(value, value)
                if not value.lstrip("-").isdigit() else int(value))
    arch = ModelArch(**SHAPES[a.shape])
    const, warps, stages = launch_settings(arch, a.batch, a.max_context, planes=a.planes)
    warps, stages = a.warps or warps, a.stages or stages
    kernel = compile_sm90(const, warps, stages)
    os.makedirs(a.dump, exist_ok=True)
    tag = f"{a.shape}_b{a.batch}_" + "_".join(k.split("=")[0][-12:] + k.split("=")[1] for k in a.knob)
    sass = sass_of(kernel.asm["cubin"], os.path.join(a.dump, tag.rstrip("_") + ".cubin"))
    with open(os.path.join(a.dump, tag.rstrip("_") + ".sass"), "w") as f:
        f.write("\n".join(f"/*{x:04x}*/ {ins}" for x, ins in sass))
    print(f"{a.shape} B={a.batch} {warps} warps {stages} stages, constexprs "
          f"{ {k: v for k, v in const.items() if k not in _UNIT_STRIDES} }")
    ops = collections.Counter(opcode(ins) for _, ins in sass)
    print(f"static SASS instructions {len(sass)}; shared memory {kernel.metadata.shared} bytes; "
          f"top {dict(ops.most_common(10))}")
    for first, last in loops(sass):
        body = [ins for x, ins in sass if first <= x <= last]
        mix = collections.Counter(opcode(ins) for ins in body)
        print(f"loop {first:#06x}-{last:#06x}: {len(body)} instructions, {dict(mix.most_common(10))}")


if __name__ == "__main__":
    main()
