"""Compile every Triton kernel launch the interpreter tests made, for an H100/H200 (sm_90),
on a machine without a GPU.

Why: the CPU tests run our Triton kernels under Triton's interpreter (TRITON_INTERPRET=1),
which executes the Python body with NumPy. It accepts code the compiler rejects (a
non-constexpr global, a dynamic shape, a type mismatch between branches, libdevice
calls the interpreter lacks), so a kernel written on a GPU-less machine could pass every
CPU test and fail at its first launch on the device, costing a device session. This
closes that gap with no GPU:

1. record: run the interpreter tests with MEGATRON_TLT_RECORD_KERNELS=FILE.jsonl
   (tests/conftest.py installs `install_recorder`): every launch's kernel, argument types,
   constexpr values and launch options are written to FILE, once per distinct launch;
2. check: `python tools/triton_compile_check.py FILE.jsonl` (TRITON_INTERPRET unset)
   compiles each recorded launch through Triton's full pipeline (TTIR, TTGIR, LLVM, PTX,
   ptxas to a cubin) for `GPUTarget("cuda", 90, 32)` and prints a line per kernel; the
   exit code is the number of launches that failed to compile.

What it does not check: runtime behaviour on the device (numerics, memory ordering,
performance) -- the tests under tests/gpu do that -- nor the integer specialisations the
launcher would add (arguments equal to 1, 16-byte alignment): a launch is compiled with
its generic signature, which every specialisation refines.

Usage:
    MEGATRON_TLT_RECORD_KERNELS=/tmp/kernels.jsonl python -m pytest -q tests/unit/rollout tests/unit/spec
    python tools/triton_compile_check.py /tmp/kernels.jsonl [--arch 90]
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import inspect
import json
import os
import sys
import time

RECORD_ENV = "MEGATRON_TLT_RECORD_KERNELS"
_TORCH_TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64",
                "int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8",
                "bool": "i1"}
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "launch_pdl", "maxnreg")


def _arg_type(v):
    """Triton's signature type of a launch argument, or None for a constexpr-like value."""
    import torch
    if isinstance(v, torch.Tensor):
        return "*" + _TORCH_TYPES[str(v.dtype).removeprefix("torch.")]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        if -2 ** 31 <= v < 2 ** 31:
            return "i32"
        return "i64" if -2 ** 63 <= v < 2 ** 63 else "u64"
    if isinstance(v, float):
        return "fp32"
    return None


def _is_constexpr(annotation) -> bool:
    return "constexpr" in str(annotation)


def install_recorder(path: str) -> None:
    """Record every interpreted launch (module docstring, step 1) into `path` at exit.
    Sets TRITON_INTERPRET=1 first: triton reads it once, and the kernels must be
    interpreted for their launches to pass through here."""
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime.interpreter import InterpretedFunction

    seen: dict[str, dict] = {}
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        try:
            _record(self.fn, args, kwargs, seen)
        except Exception as e:  # noqa: BLE001 - recording must never change a test's outcome
            print(f"[triton_compile_check] could not record {self.fn.__name__}: {e}", file=sys.stderr)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run

    def write():
        existing = {}
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    if line.strip():
                        e = json.loads(line)
                        existing[e["id"]] = e
        existing.update(seen)
        with open(path, "w") as f:
            for e in existing.values():
                f.write(json.dumps(e) + "\n")

    atexit.register(write)


def _record(fn, args, kwargs, seen: dict) -> None:
    params = inspect.signature(fn).parameters
    bound = {name: a for name, a in zip(params, args)}
    options = {}
    for k, v in kwargs.items():
        if k in params:
            bound[k] = v
        elif k in _OPTIONS:
            options[k] = v
    signature, constexprs = {}, {}
    for name, p in params.items():
        v = bound.get(name, p.default)
        if v is inspect.Parameter.empty:
            raise ValueError(f"argument {name} missing")
        if _is_constexpr(p.annotation):
            signature[name] = "constexpr"
            constexprs[name] = getattr(v, "value", v)
            continue
        t = _arg_type(v)
        if t is None:  # None and the like: Triton makes them constexprs
            signature[name] = "constexpr"
            constexprs[name] = v
        else:
            signature[name] = t
    entry = {"module": fn.__module__, "name": fn.__qualname__, "signature": signature,
             "constexprs": constexprs, "options": options}
    entry["id"] = json.dumps(entry, sort_keys=True, default=str)
    seen.setdefault(entry["id"], entry)


def check(path: str, arch: int) -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("triton_compile_check: unset TRITON_INTERPRET to compile")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # the kernels of the checkout this tool is in (not whatever `megatron_tlt` the
    # environment would import first)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(path) as f:
        entries = [json.loads(line) for line in f if line.strip()]
    target = GPUTarget("cuda", arch, 32)
    failed, by_kernel = 0, {}
    t0 = time.time()
    for e in entries:
        key = f"{e['module']}.{e['name']}"
        try:
            fn = getattr(importlib.import_module(e["module"]), e["name"])
            params = list(inspect.signature(fn.fn).parameters)
            if params != list(e["signature"]):
                raise ValueError(f"stale record: the kernel's parameters are now {params}, the "
                                 f"launch recorded {list(e['signature'])} (record again)")
            src = ASTSource(fn=fn, signature=e["signature"], constexprs=e["constexprs"])
            opts = {k: v for k, v in e["options"].items() if k != "launch_pdl" or v}
            triton.compile(src, target=target, options=opts)
            ok, msg = True, ""
        except Exception as ex:  # noqa: BLE001 - report every failure, go on
            ok, msg = False, f"{type(ex).__name__}: {str(ex).strip().splitlines()[-1][:300]}"
            failed += 1
        n_ok, n_all, msgs = by_kernel.get(key, (0, 0, []))
        by_kernel[key] = (n_ok + ok, n_all + 1, msgs + ([msg] if msg else []))
    for key, (n_ok, n_all, msgs) in sorted(by_kernel.items()):
        print(f"{'ok  ' if n_ok == n_all else 'FAIL'} {key}: {n_ok}/{n_all} launches compiled")
        for m in dict.fromkeys(msgs):
            print(f"       {m}")
    print(f"{len(entries)} launches of {len(by_kernel)} kernels for sm_{arch}: {failed} failed "
          f"({time.time() - t0:.0f} s)")
    return failed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", help="the JSONL file written with " + RECORD_ENV)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90)")
    args = ap.parse_args(argv)
    return min(check(args.records, args.arch), 125)


if __name__ == "__main__":
    sys.exit(main())
