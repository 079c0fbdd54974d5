"""Where the fused decode attention's time goes: a copy of gpu_model._rope_attention_kernel
with clock reads between its phases, on the GPU.

    python tools/attention_phases.py --shape 1.5b --batch 1 [--splits N] [--json FILE]

The copy is made from the kernel's own source (the reads inserted before the statements
named in PHASES; _attend_tile's too, whose reads are each program's last key tile's), so
it stays the kernel that runs; each read waits for a value its phase produced (the context
length, the first key tile, the new token's K, ...: each thread for its own elements of a
tensor), so a phase's time is how long its loads, wait or arithmetic took, in the order the
program meets them. The reads cost time themselves (the instrumented kernel's time per
call is printed beside the kernel's): read the phases as where the time goes, not as exact
figures. Each program records %clock64 and %globaltimer at every read into a buffer passed
as the decode's unused tree-mask pointer. Printed: per phase, the median and the slowest
program's time since the previous read (ns, from clock64 at the SM clock that globaltimer
gives over the whole program), the spread of the programs' start times, and the kernel's
span. A measurement tool, not a test: it asserts nothing about time, and checks the
instrumented kernel's output equal to the kernel's (torch.equal).

PHASES follow the key loop with ROPE_ATTENTION_WRITE_FIRST=0 (a first key tile loaded
before the PDL wait, the new K/V stored after the keys), so the tool times that loop
(WRITE_FIRST_TIMED), not session 34's default, which picks 1 or 2 by the grid
(gpu_model.decode_write_first): with 2 there is no preloaded tile to wait for.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import sys
import tempfile
import textwrap

import torch
import triton
import triton.language as tl

from megatron_tlt.bench import SHAPES, _git_revision, parse_attr
from megatron_tlt.models.arch import ModelArch
from megatron_tlt.rollout import gpu_model, triton_attention

sys.path.insert(0, os.path.dirname(__file__))
from attention_sweep import case, time_graph  # noqa: E402

# (the function: the kernel, or _attend_tile (one key tile's online softmax; its reads are
# the last tile's of each program); a statement the read goes before, searched in order
# from the previous one of that function (None: the function's end); the value it waits
# for, an expression of the function's names (a tensor: each thread waits for its own
# elements, no reduction added); the phase's name)
PHASES = [
    ("kernel", "if MODE != 0:", "0", "entry"),
    ("kernel", "prefix = ctx - n_new", "ctx", "context length loaded"),
    ("kernel", "if MODE == 0:", "pos", "position loaded"),
    ("kernel", "hold = (prefix >= start)", "k0.to(tl.float32) + v0.to(tl.float32)",
     "block table + first K/V tile loaded"),
    ("kernel", "row_w = qkv_ptr", "0", "PDL wait done"),
    ("kernel", "k_row = tl.max(", "k_new.to(tl.float32) + v_new.to(tl.float32)",
     "new token's K (RoPE) and V from the QKV planes"),
    ("kernel", "q = tl.zeros(", "k_row.to(tl.float32) + v_row.to(tl.float32)", "new row picked"),
    ("kernel", "if MODE == 0:", "q.to(tl.float32)", "query RoPE"),
    ("tile", "n = n0 + tl.arange", "k.to(tl.float32) + v.to(tl.float32)",
     "  last tile: its K/V in registers"),
    ("tile", "vis = row_ok[:, None]", "s", "  last tile: q.K^T (MMA)"),
    ("tile", "m_safe = tl.where(", "m_new", "  last tile: masked row max"),
    ("tile", "alpha = tl.exp2(", "p", "  last tile: exp2"),
    ("tile", "acc = acc * alpha", "l_i", "  last tile: row sum"),
    ("tile", "return m_new, l_i, acc", "acc", "  last tile: p.V (MMA)"),
    ("kernel", "_store_kv(k_ptr, v_ptr, slot, j_ok", "acc", "attention over the keys done"),
    ("kernel", "n_merge = _n_merge(", "0", "K/V store issued"),
    ("kernel", None, "0", "output / partials stored"),
]
WRITE_FIRST_TIMED = 0
"""gpu_model.ROPE_ATTENTION_WRITE_FIRST while the tool runs: the loop PHASES follow."""
_SLOTS = tl.constexpr(32)  # (clock64, globaltimer) pairs per program
SLOTS = _SLOTS.value
_ASM = tl.constexpr("{ .reg .b32 t; mov.b32 t, $2; "
                    "mov.u64 $0, %clock64; mov.u64 $1, %globaltimer; }")
_CONSTRAINTS = tl.constexpr("=l,=l,r")


@triton.jit
def _slot(tm_ptr, PHASE: tl.constexpr):
    """This program's (clock64, globaltimer) pair PHASE in the timer buffer."""
    pid = tl.program_id(0) + tl.num_programs(0) * (
        tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
    return tm_ptr + pid.to(tl.int64) * (2 * _SLOTS) + 2 * PHASE


@triton.jit
def _tick_t(tm_ptr, PHASE: tl.constexpr, dep):
    """%clock64 and %globaltimer into this program's slot PHASE once `dep` (a tensor) is
    ready: each thread reads the clocks once its own elements of it are, and stores them
    into the one slot (one of the threads' values lands)."""
    d = dep.to(tl.float32).to(tl.int32, bitcast=True)
    clk, gt = tl.inline_asm_elementwise(_ASM, _CONSTRAINTS, [d], dtype=(tl.int64, tl.int64),
                                        is_pure=False, pack=1)
    base = _slot(tm_ptr, PHASE)
    tl.store(base + 0 * clk, clk)
    tl.store(base + 1 + 0 * gt, gt)


@triton.jit
def _tick(tm_ptr, PHASE: tl.constexpr, dep):
    """_tick_t for a scalar `dep` (as a one-element tensor)."""
    _tick_t(tm_ptr, PHASE, tl.zeros([1], tl.int32) + dep)


def _instrument(fn, phases: list[tuple[int, str | None, str]]) -> str:
    """fn's source with a tick before each (phase, statement, dep) of `phases`."""
    lines = textwrap.dedent(inspect.getsource(fn)).splitlines()
    out, at = [], 0
    for phase, stmt, dep in phases:
        tick = "_tick" if dep in ("0", "ctx") else "_tick_t"
        if stmt is None:
            out += lines[at:]
            out.append(f"    {tick}(tm_ptr, {phase}, {dep})")
            at = len(lines)
            break
        i = next((j for j in range(at, len(lines)) if lines[j].strip().startswith(stmt)), None)
        if i is None:
            raise RuntimeError(f"attention_phases: no statement {stmt!r} in {fn.__name__}'s "
                               f"source after line {at}: update PHASES to the kernel")
        indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
        out += lines[at:i]
        out.append(f"{indent}{tick}(tm_ptr, {phase}, {dep})")
        at = i
    return "\n".join(out + lines[at:]) + "\n"


def instrumented_kernel():
    """The kernel's and _attend_tile's sources with a tick before each PHASES statement
    (and _attend's, unchanged, so it calls the instrumented tile), as a Triton kernel of a
    module written to a temporary file (Triton reads a kernel's source from its file)."""
    by_fn = {"kernel": [], "tile": []}
    for phase, (where, stmt, dep, _) in enumerate(PHASES):
        by_fn[where].append((phase, stmt, dep))
    kernel = _instrument(gpu_model._rope_attention_kernel.fn, by_fn["kernel"])
    kernel = kernel.replace("def _rope_attention_kernel(", "def _rope_attention_phases(", 1)
    tile = _instrument(triton_attention._attend_tile.fn, by_fn["tile"])
    attend = textwrap.dedent(inspect.getsource(triton_attention._attend.fn))
    module = ("from megatron_tlt.rollout import gpu_model as _gm, triton_attention as _ta\n"
              "for _m in (_ta, _gm):\n"
              "    globals().update({k: v for k, v in vars(_m).items() if not k.startswith('__')})\n"
              "from attention_phases import _tick, _tick_t\n\n"
              + tile + "\n\n" + attend + "\n\n" + kernel)
    path = os.path.join(tempfile.mkdtemp(prefix="attn_phases_"), "attn_phases_kernel.py")
    with open(path, "w") as f:
        f.write(module)
    spec = importlib.util.spec_from_file_location("attn_phases_kernel", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod._rope_attention_phases


class _Swap:
    """Stands in for gpu_model._rope_attention_kernel: launches `kernel` with the timer
    buffer in place of the tree-mask pointer (argument 11; decode never reads it)."""

    def __init__(self, kernel, timers_for):
        self.kernel, self.timers_for = kernel, timers_for

    def __getitem__(self, grid):
        def launch(*args, **kw):
            args = list(args)
            args[11] = self.timers_for(grid)
            return self.kernel[grid](*args, **kw)
        return launch


def summarize(t: torch.Tensor, n_phases: int) -> dict:
    """Per-phase median / max of the time since the previous read (ns), start spread, span:
    over the programs that ran every phase (a program whose split holds no keys skips the
    tile's)."""
    clk = t[:, :n_phases, 0].double()
    gt = t[:, :n_phases, 1].double()
    ran = (clk > 0).all(1) & (clk[:, 1:] >= clk[:, :-1]).all(1)
    ghz = ((clk[:, -1] - clk[:, 0]) / (gt[:, -1] - gt[:, 0]).clamp(min=1))[ran].median().item()
    d = (clk[ran, 1:] - clk[ran, :-1]) / ghz
    start = gt[:, 0] - gt[:, 0].min()
    rows = []
    for i in range(1, n_phases):
        rows.append({"phase": PHASES[i][3], "median_ns": d[:, i - 1].median().item(),
                     "max_ns": d[:, i - 1].max().item()})
    return {"sm_ghz": ghz, "programs": t.shape[0], "programs_timed": int(ran.sum()),
            "phases": rows,
            "program_median_ns": ((clk[ran, -1] - clk[ran, 0]) / ghz).median().item(),
            "start_spread_ns": start.max().item(),
            "span_ns": (gt[:, n_phases - 1].max() - gt[:, 0].min()).item()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="1.5b", choices=sorted(s for s in SHAPES if s != "tiny"))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=212)
    p.add_argument("--splits", type=int, default=None, help="default: the engine's for a "
                   "longest context of --context + 100 keys (bench rollout's)")
    p.add_argument("--planes", type=int, default=1)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="a gpu_model launch knob (a Python literal), e.g. ROPE_ATTENTION_WARPS=4")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    gpu_model.ROPE_ATTENTION_WRITE_FIRST = WRITE_FIRST_TIMED
    for kv in a.set:  # bench rollout --compare-attr's parser, on gpu_model's names
        setattr(*parse_attr(f"{gpu_model.__name__}:{kv}"))
    if gpu_model.ROPE_ATTENTION_WRITE_FIRST != WRITE_FIRST_TIMED:
        raise SystemExit(f"attention_phases: PHASES follow the WRITE_FIRST={WRITE_FIRST_TIMED} "
                         f"loop; --set ROPE_ATTENTION_WRITE_FIRST=... is not supported")
    print(f"timing the key loop with ROPE_ATTENTION_WRITE_FIRST={WRITE_FIRST_TIMED} "
          f"(the default picks it by the grid: see the docstring)")
    dev = torch.device("cuda")
    arch = ModelArch(**SHAPES[a.shape])
    qkv, pos, slots, cos, sin, bias, caches, meta = case(arch, a.batch, a.context, a.layers, 16,
                                                         a.planes, dev)
    group = arch.num_heads // arch.num_kv_heads
    splits = a.splits or triton_attention.splits_for(caches[0][0], a.batch, a.context + 100, group)
    kw = dict(num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
              scale=arch.head_dim ** -0.5, bias=bias, num_splits=splits)

    def run():
        return [gpu_model.rope_attention(qkv, pos, slots, cos, sin, k, v, **meta, **kw)
                for k, v in caches]

    ref = run()
    us = time_graph(run, 15) / a.layers
    bufs = []  # one timer buffer per launch, in launch order

    def timers_for(grid):
        bufs.append(torch.zeros(grid[0] * grid[1] * grid[2], SLOTS, 2, dtype=torch.int64,
                                device=dev))
        return bufs[-1]

    kernel = instrumented_kernel()
    saved = gpu_model._rope_attention_kernel
    gpu_model._rope_attention_kernel = _Swap(kernel, timers_for)
    try:
        for _ in range(3):  # compile, then warm
            bufs.clear()
            out = run()
            torch.cuda.synchronize()
        us_inst = time_graph(run, 15) / a.layers
        bufs.clear()
        out = run()
        torch.cuda.synchronize()
    finally:
        gpu_model._rope_attention_kernel = saved
    same = all(torch.equal(o, r) for o, r in zip(out, ref))
    per_layer = [summarize(b.cpu(), len(PHASES)) for b in bufs[1:]]  # layer 0: cold
    pick = per_layer[len(per_layer) // 2]
    print(f"{a.shape} B={a.batch} context {a.context} splits {splits}: {pick['programs']} "
          f"programs ({pick['programs_timed']} with keys), {torch.cuda.get_device_name()}, "
          f"SM {pick['sm_ghz']:.2f} GHz")
    print(f"kernel {us:.2f} us per call (graph of {a.layers}), instrumented {us_inst:.2f}; "
          f"output equal: {same}")
    print(f"one eager call (layer {len(per_layer) // 2 + 1}): span {pick['span_ns'] / 1e3:.2f} us, "
          f"program starts spread {pick['start_spread_ns'] / 1e3:.2f} us, "
          f"a program {pick['program_median_ns'] / 1e3:.2f} us (median)")
    for r in pick["phases"]:
        print(f"  {r['phase']:48s} median {r['median_ns']:8.0f} ns   slowest {r['max_ns']:8.0f} ns")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": " ".join(["python", *sys.argv]), "git_revision": _git_revision(),
                       "settings": a.set, "shape": a.shape, "batch": a.batch,
                       "context": a.context, "splits": splits,
                       "device": torch.cuda.get_device_name(), "us_per_call": us,
                       "us_per_call_instrumented": us_inst, "output_equal": same,
                       "layers": per_layer}, f, indent=1)


if __name__ == "__main__":
    main()
