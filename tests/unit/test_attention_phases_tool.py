"""tools/attention_phases.py without a GPU: its copy of the fused decode attention kernel is
the kernel's own source plus one clock read per phase and nothing else, every phase's
statement is found (a kernel edit that moves one fails here, not on the device; the
negative control: a statement the kernel lacks raises), and the copy compiles for sm_90
with a decode launch's signature recorded under Triton's interpreter.

Skipped without triton (CI installs the CPU torch only)."""

import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import torch  # noqa: E402

# This process's kernels are defined under the interpreter on a CPU-only machine, as the
# interpreter test modules define them (Triton reads TRITON_INTERPRET when a kernel is
# defined): imported first, this module used to leave compiled-mode kernels for the
# interpreter tests collected after it ("0 active drivers"). The subprocesses below unset it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import attention_phases as ap  # noqa: E402

from megatron_tlt.rollout import gpu_model, triton_attention  # noqa: E402

TICK = re.compile(r"^\s*_tick(_t)?\(tm_ptr, (\d+), .*\)$")


def _generated_source() -> str:
    kernel = ap.instrumented_kernel()
    with open(kernel.fn.__code__.co_filename) as f:
        return f.read()


def test_instrumented_copy_is_the_kernel_plus_one_tick_per_phase():
    src = _generated_source()
    ticks = [int(m.group(2)) for line in src.splitlines() if (m := TICK.match(line))]
    assert sorted(ticks) == list(range(len(ap.PHASES)))
    body = "\n".join(line for line in src.splitlines() if not TICK.match(line))
    for fn, name in ((gpu_model._rope_attention_kernel, "_rope_attention_phases"),
                     (triton_attention._attend_tile, "_attend_tile"),
                     (triton_attention._attend, "_attend")):
        own = textwrap.dedent(inspect.getsource(fn.fn)).replace(f"def {fn.fn.__name__}(",
                                                                 f"def {name}(", 1)
        assert own.strip() in body, fn.fn.__name__


def test_a_statement_the_kernel_lacks_is_an_error(monkeypatch):
    monkeypatch.setattr(ap, "PHASES", ap.PHASES[:2] + [("kernel", "no_such_statement(", "0", "x")])
    with pytest.raises(RuntimeError, match="no_such_statement"):
        ap.instrumented_kernel()


RECORD = textwrap.dedent('''
    import sys
    sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2])
    from triton_compile_check import install_recorder
    install_recorder(sys.argv[3])
    import torch
    from megatron_tlt.bench import SHAPES
    from megatron_tlt.models.arch import ModelArch
    from megatron_tlt.rollout import gpu_model
    from attention_sweep import case
    from attention_phases import WRITE_FIRST_TIMED
    gpu_model.ROPE_ATTENTION_WRITE_FIRST = WRITE_FIRST_TIMED  # the loop the tool times
    arch = ModelArch(**{**SHAPES["1.5b"], "num_layers": 1})
    qkv, pos, slots, cos, sin, bias, caches, meta = case(arch, 1, 40, 1, 16, 1, torch.device("cpu"))
    gpu_model.rope_attention(qkv, pos, slots, cos, sin, *caches[0], num_splits=2, **meta,
                             num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads,
                             head_dim=arch.head_dim, scale=arch.head_dim ** -0.5, bias=bias)
''')


COMPILE = textwrap.dedent('''
    import json, sys
    sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2])
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import attention_phases as ap
    (entry,) = [e for e in map(json.loads, open(sys.argv[3]).read().splitlines())
                if e["name"] == "_rope_attention_kernel"]
    signature = {**entry["signature"], "tm_ptr": "*i64"}  # the timer buffer
    compiled = triton.compile(ASTSource(fn=ap.instrumented_kernel(), signature=signature,
                                        constexprs=entry["constexprs"]),
                              target=GPUTarget("cuda", 90, 32), options=entry["options"])
    ptx = compiled.asm["ptx"]
    print(json.dumps({"timers": ptx.count("%globaltimer"), "pdl": "griddepcontrol" in ptx,
                      "phases": len(ap.PHASES)}))
''')


def test_instrumented_copy_compiles_for_sm90(tmp_path):
    """Recorded under the interpreter, compiled without it: both in subprocesses, since
    Triton reads TRITON_INTERPRET when a kernel is defined, and other test modules set it
    in this process (the compile failed here in a full local run, not alone)."""
    script = tmp_path / "record.py"
    script.write_text(RECORD)
    records = tmp_path / "launches.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [str(REPO / "tools"), str(REPO), str(records)]
    subprocess.run([sys.executable, str(script), *args], check=True, env=env, cwd=REPO, timeout=600)
    compile_py = tmp_path / "compile.py"
    compile_py.write_text(COMPILE)
    done = subprocess.run([sys.executable, str(compile_py), *args], check=True, env=env, cwd=REPO,
                          timeout=600, capture_output=True, text=True)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["timers"] >= got["phases"] == len(ap.PHASES) and not got["pdl"]
