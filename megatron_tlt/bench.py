"""`megatron-tlt bench rollout`: decode speed of the native engine against the HBM roofline
and against Hugging Face `generate`, all measured in one run; a table and a JSON file.

    megatron-tlt bench rollout --json FILE [--shapes 1.5b,7b] [--batch-sizes 1,8,32,128]
        [--steps N] [--repeats R] [--prompt-len P] [--hf-batch-sizes 1,16] [--no-hf]
        [--hf-modes compiled,eager] [--compare-cublas] [--compare-pdl] [--compare-fused-rope]
        [--compare-merge] [--compare-split-min] [--compare-preload KB]
        [--compare-attr MODULE:NAME=VALUE[;MODULE:NAME=VALUE...]] ...

Models: Qwen2.5-1.5B- and 7B-shaped bf16 decoders with RANDOM weights built directly on
the device (`--shapes tiny` is a small model for CPU runs). Every prompt has P tokens and
every request `min_new_tokens == max_new_tokens`, so lengths are fixed and greedy
decoding never stops early.

What is measured, per model shape and batch size B:

- `decode_ms`: one decode step of the engine's GPU path — CUDA-graph replay of the fused
  forward (bucket B), then greedy argmax and the input update (next token, position,
  context length, slot) on the device — back to back, no host sync between steps;
  CUDA events around `--steps` steps, median over `--repeats`, after warm-up steps.
- `engine_ms_per_step`: the whole `RolloutEngine.generate` (scheduler, input upload,
  graph replay, on-device greedy sampling, one host sync and the stop checks per step)
  from wall-clock time, as (t(n_long) - t(n_short)) / (n_long - n_short) so prefill
  cancels; median over up to 3 repeats, after an untimed call of each length. Its steps
  run at shorter contexts than decode_ms's (`generate_mean_context` vs `mean_context`).
- roofline: bytes a decode step must read — every weight once (the tied LM head is the
  embedding, read once; an untied embedding contributes only its B looked-up rows) plus
  the K/V of the batch's mean context over the timed steps — divided by the measured
  bandwidth. Bandwidth is measured in this run two ways: a device-to-device copy (read +
  write bytes counted: 2 x size / time) and a read-only reduction (torch.sum: size /
  time). The roofline uses the HIGHER of the two (the stricter roofline); both are
  reported. `of_roofline` = roofline_ms / decode_ms.
- HF: `transformers` `generate` with `cache_implementation="static"`, greedy, in each of
  `--hf-modes` (compiled: generate's own torch.compile of the decode step, its default on
  CUDA; eager: `disable_compile=True`), the SAME weights copied into a model built from
  the config on the device, the same prompts; ms/step by the same differencing. The
  faster mode is the baseline (`hf_ms_per_step`, `hf_mode`). The speedup over HF is
  `hf_over_engine` (whole generate calls, both with their host work);
  `hf_over_decode` sets our device decode loop (no host work) against HF's whole
  generate, an upper bound.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import importlib
import os
import platform
import shlex
import statistics
import subprocess
import time
import traceback

import torch

from megatron_tlt.atomic_io import write_json
from megatron_tlt.errors import TLTError
from megatron_tlt.models.arch import ModelArch
from megatron_tlt.rollout.engine import RolloutEngine
from megatron_tlt.rollout.request import Request
from megatron_tlt.rollout.sampling import SamplingParams
from megatron_tlt.rollout.weights import EngineWeights, resolve_device

_QWEN25 = dict(family="qwen2", qkv_bias=True, rope_theta=1e6, rms_norm_eps=1e-6,
               max_position_embeddings=32768, head_dim=128)
SHAPES = {
    "1.5b": dict(_QWEN25, vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                 num_layers=28, num_heads=12, num_kv_heads=2, tie_word_embeddings=True),
    "7b": dict(_QWEN25, vocab_size=152064, hidden_size=3584, intermediate_size=18944,
               num_layers=28, num_heads=28, num_kv_heads=4, tie_word_embeddings=False),
    "tiny": dict(family="qwen2", qkv_bias=True, vocab_size=512, hidden_size=64,
                 intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                 tie_word_embeddings=True, max_position_embeddings=4096),
}


def _int_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return out


def parse_args(extra: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megatron-tlt bench rollout", add_help=True)
    p.add_argument("--shapes", default=None,
                   help=f"comma-separated model shapes from {sorted(SHAPES)} "
                        f"(default: 1.5b,7b on CUDA, tiny on CPU)")
    p.add_argument("--batch-sizes", type=_int_list, default=[1, 8, 32, 128])
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=4, help="untimed decode steps first")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--hf-batch-sizes", type=_int_list, default=[1, 16])
    p.add_argument("--hf-modes", default="compiled,eager",
                   help="transformers baselines: 'compiled' (generate's own torch.compile of the "
                        "static-cache decode step, HF's default on CUDA) and/or 'eager'")
    p.add_argument("--compare-cublas", action="store_true",
                   help="also time decode with every projection on cuBLAS (graphs recaptured)")
    p.add_argument("--compare-pdl", action="store_true",
                   help="also time decode with programmatic dependent launch of the Triton kernels "
                        "switched the other way (on by default on Hopper or later, "
                        "MEGATRON_TLT_PDL=0 turns it off; "
                        "graphs recaptured)")
    p.add_argument("--compare-fused-rope", action="store_true",
                   help="also time decode with RoPE + the K/V write folded into the attention "
                        "kernel switched the other way (on by default, MEGATRON_TLT_FUSED_ROPE=0 "
                        "turns it off; graphs recaptured)")
    p.add_argument("--compare-merge", action="store_true",
                   help="also time decode with the split-K attention merge in the attention kernel "
                        "switched the other way (MEGATRON_TLT_FUSED_COMBINE=1 turns it on; graphs "
                        "recaptured)")
    p.add_argument("--compare-split-min", action="store_true",
                   help="also time decode with split-K attention splits of at least 4 key "
                        "tiles (MEGATRON_TLT_SPLIT_MIN_TILES=4) against the default of 1 "
                        "(or 1 when the process runs with another; grids that fill the GPU "
                        "take at least FULL_GRID_MIN_TILES either way; graphs recaptured)")
    p.add_argument("--compare-preload", type=float, default=None, metavar="KB",
                   help="with PDL on, also time decode with projection programs loading up to KB "
                        "kilobytes of their first weight tiles before the PDL wait "
                        "(MEGATRON_TLT_PDL_PRELOAD_KB=KB; graphs recaptured)")
    p.add_argument("--compare-attr", action="append", default=[], metavar="MODULE:NAME=VALUE",
                   help="also time decode with a module attribute that kernels read at each "
                        "launch set to VALUE (a Python literal), e.g. "
                        "megatron_tlt.rollout.gpu_model:NORM_WARPS=8, or env:NAME=VALUE for an "
                        "environment variable read at each forward; several joined by ';' are "
                        "set together; repeatable, each timed on its own against the defaults "
                        "(graphs recaptured)")
    p.add_argument("--hf-shapes", default="1.5b,tiny", help="shapes that get the HF baseline")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--backend", default=None, choices=["triton", "torch"],
                   help="attention backend (default: triton on CUDA, torch on CPU)")
    p.add_argument("--no-graphs", action="store_true", help="decode without CUDA graphs")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(extra)
    for name in ("steps", "repeats", "prompt_len"):
        if getattr(args, name) < 1:
            raise TLTError(f"bench rollout: --{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        raise TLTError("bench rollout: --warmup must be >= 0")
    modes = [m for m in args.hf_modes.split(",") if m]
    bad = [m for m in modes if m not in ("compiled", "eager")]
    if bad or not modes:
        raise TLTError(f"bench rollout: --hf-modes takes compiled and/or eager, got {args.hf_modes!r}")
    args.hf_modes = modes
    return args


# ---------------------------------------------------------------------- helpers


class _Clock:
    """CUDA events on a GPU, perf_counter on CPU; `elapsed_ms` synchronises."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def start(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def elapsed_ms(self, start) -> float:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        return (time.perf_counter() - start) * 1e3


def random_weights(arch: ModelArch, *, dtype: torch.dtype, device: torch.device,
                   seed: int) -> EngineWeights:
    """Random engine weights generated on `device` (norms ~ 1, the rest std 0.02)."""
    w = EngineWeights(arch, dtype=dtype, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, view in w.hf_views().items():
            if name == "lm_head.weight" and arch.tie_word_embeddings:
                continue
            if name.endswith("norm.weight"):
                view.normal_(1.0, 0.1, generator=g)
            else:
                view.normal_(0.0, 0.02, generator=g)
    return w


def measure_bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> dict:
    """Device memory bandwidth in GB/s: copy (read + write bytes) and read-only sum."""
    clock = _Clock(device)
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)

    def timed(fn) -> float:
        fn()
        fn()
        clock.sync()
        ts = []
        for _ in range(repeats):
            t0 = clock.start()
            fn()
            ts.append(clock.elapsed_ms(t0))
        return statistics.median(ts)

    t_copy = timed(lambda: y.copy_(x))
    t_read = timed(lambda: torch.sum(x, dtype=torch.float32))
    size = x.numel() * x.element_size()
    out = {"buffer_bytes": size, "copy_ms": t_copy, "read_ms": t_read,
           "copy_rw_GBps": 2 * size / t_copy / 1e6, "read_GBps": size / t_read / 1e6}
    out["roofline_GBps"] = max(out["copy_rw_GBps"], out["read_GBps"])
    return out


def step_bytes(arch: ModelArch, weights: EngineWeights, batch: int, mean_context: float) -> dict:
    """Bytes one decode step of `batch` sequences must read from device memory."""
    elem = torch.empty((), dtype=weights.dtype).element_size()
    w = sum(t.numel() for t in weights.tensors()) * elem
    if not arch.tie_word_embeddings:  # the embedding table: only the looked-up rows
        w += (batch - arch.vocab_size) * arch.hidden_size * elem
    kv = batch * mean_context * arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * elem
    return {"weight_bytes": int(w), "kv_bytes": int(kv), "bytes": int(w + kv)}


def _requests(prompts: list[list[int]], tag: str, n: int) -> list[Request]:
    params = SamplingParams(temperature=0.0, max_new_tokens=n, min_new_tokens=n)
    return [Request(prompt_id=f"{tag}-{i}", prompt_token_ids=p, sampling_params=params)
            for i, p in enumerate(prompts)]


def _engine_generate(engine: RolloutEngine, prompts: list[list[int]], n: int):
    return engine.generate(_requests(prompts, f"e2e{len(prompts)}-{n}", n))


def _git_revision() -> str:
    """HEAD of the checkout; MEGATRON_TLT_GIT_REV when the tree was copied without .git."""
    if os.environ.get("MEGATRON_TLT_GIT_REV"):
        return os.environ["MEGATRON_TLT_GIT_REV"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - absent or broken optional package
        return None


# ---------------------------------------------------------------------- measurements


FUSED_ADVANCE = True
"""decode_ms's greedy argmax and input update as one kernel (DecodeRunner.advance_greedy)
instead of a dozen torch ops (~44 us of the 1.5B batch-1 step on session 42's H200). On
since session 44: faster in every cell of three side-by-side runs on an H100 at 943a0b2
(1.016x-1.019x at 1.5B batch 1, 1.002x-1.007x at 7B; benchmarks/results/
gpu_2026-12-07_session44). False times the torch ops (--compare-attr
megatron_tlt.bench:FUSED_ADVANCE=False); read at each timing."""


def time_device_decode(engine: RolloutEngine, prompts: list[list[int]], *, steps: int,
                       repeats: int, warmup: int) -> float:
    """decode_ms (see module docstring) for len(prompts) sequences."""
    runner = engine.decode_runner
    clock = _Clock(engine.device)
    b = len(prompts)
    total = warmup + steps * repeats
    seqs = [engine.add_sequence(r) for r in _requests(prompts, f"dev{b}", total + 1)]
    try:
        out = engine.forward_pending(seqs)  # prefill
        engine.sample_and_append(seqs, out.logits)
        for s in seqs:
            if not engine.cache.ensure(s.seq_id, len(s.token_ids) + total):
                raise TLTError("bench: the KV cache is too small for the decode loop")
        bucket = runner.prepare(seqs)
        x = runner.static_inputs(bucket)
        page = engine.cache.block_size

        def advance(logits: torch.Tensor) -> None:  # next inputs, on the device
            if FUSED_ADVANCE:
                runner.advance_greedy(b, logits)
                return
            x["input_ids"][:b].copy_(torch.argmax(logits[:b], dim=-1))
            x["positions"][:b].add_(1)
            x["context_lens"][:b].add_(1)
            pos = x["positions"][:b].long()
            blk = x["block_tables"][:b].gather(1, (pos // page)[:, None])[:, 0].long()
            x["slot_mapping"][:b].copy_(blk * page + pos % page)

        if not runner.use_graphs:
            def step() -> None:
                advance(runner.run(bucket))
        else:
            # The input update as a second small graph: two graph launches per step.
            runner.run(bucket)  # captures the decode graphs if needed
            logits = runner.run(bucket)
            saved = {k: v.clone() for k, v in x.items()}
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                advance(logits)
            torch.cuda.current_stream().wait_stream(side)
            for k, v in saved.items():
                x[k].copy_(v)
            adv = torch.cuda.CUDAGraph()
            with torch.cuda.graph(adv):
                advance(logits)

            def step() -> None:
                runner.run(bucket)
                adv.replay()
        for _ in range(warmup):
            step()
        clock.sync()
        times = []
        for _ in range(repeats):
            t0 = clock.start()
            for _ in range(steps):
                step()
            times.append(clock.elapsed_ms(t0) / steps)
        return statistics.median(times)
    finally:
        for s in seqs:
            engine.free_sequence(s)


def time_engine_decode(engine: RolloutEngine, prompts: list[list[int]], *, steps: int,
                       repeats: int, warmup: int) -> float:
    """ms per decode step through the engine's step parts (forward_pending +
    sample_and_append), for backends without the device decode loop."""
    clock = _Clock(engine.device)
    total = warmup + steps * repeats
    seqs = [engine.add_sequence(r) for r in _requests(prompts, f"eng{len(prompts)}", total + 1)]
    try:
        engine.sample_and_append(seqs, engine.forward_pending(seqs).logits)  # prefill
        for _ in range(warmup):
            engine.sample_and_append(seqs, engine.forward_pending(seqs).logits)
        times = []
        for _ in range(repeats):
            t0 = clock.start()
            for _ in range(steps):
                engine.sample_and_append(seqs, engine.forward_pending(seqs).logits)
            times.append(clock.elapsed_ms(t0) / steps)
        return statistics.median(times)
    finally:
        for s in seqs:
            engine.free_sequence(s)


def time_generate(fn, n_short: int, n_long: int, repeats: int, clock: _Clock):
    """Median ms per generated token step of `fn(n)` by differencing two lengths, after
    one untimed call of each length (torch.compile, graph capture and the planner's
    timing happen there: with one or two repeats a cold call decided the median)."""
    fn(n_short)
    fn(n_long)
    per_step, last = [], None
    for _ in range(repeats):
        clock.sync()
        t0 = time.perf_counter()
        fn(n_short)
        clock.sync()
        t1 = time.perf_counter()
        last = fn(n_long)
        clock.sync()
        t2 = time.perf_counter()
        per_step.append(((t2 - t1) - (t1 - t0)) * 1e3 / (n_long - n_short))
    return statistics.median(per_step), last


def build_hf_model(arch: ModelArch, weights: EngineWeights):
    """A transformers model built from the config on the weights' device with the SAME
    weights copied in."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(arch.to_hf_config())
    cfg.pop("architectures", None)
    cfg.pop("torch_dtype", None)
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, bos_token_id=None, eos_token_id=None,
                                  pad_token_id=0, **cfg)
    with torch.device(weights.device):
        model = AutoModelForCausalLM.from_config(config, dtype=weights.dtype)
    model.eval()
    state = model.state_dict()
    views = weights.hf_views()
    missing = [n for n in state if n not in views and not n.endswith("rotary_emb.inv_freq")]
    if missing:
        raise TLTError(f"bench: HF model has tensors the engine does not: {missing[:3]}")
    with torch.no_grad():
        for name, t in state.items():
            if name in views:
                t.copy_(views[name])
    return model


def hf_generate_fn(model, prompts: list[list[int]], *, compiled: bool):
    """generate() with a static cache; `compiled`: transformers compiles the decode step
    itself (its default for static caches on CUDA), else it runs eagerly."""
    ids = torch.tensor(prompts, dtype=torch.int64, device=model.device)
    mask = torch.ones_like(ids)

    def run(n: int) -> torch.Tensor:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, num_beams=1,
                                 cache_implementation="static", disable_compile=not compiled,
                                 pad_token_id=0, eos_token_id=None)
        return out[:, ids.shape[1]:]
    return run


# ---------------------------------------------------------------------- main


@dataclasses.dataclass
class _Plan:
    device: torch.device
    backend: str
    graphs: bool
    dtype: torch.dtype


def _plan(args) -> _Plan:
    device = torch.device(resolve_device(args.device))
    backend = args.backend or ("triton" if device.type == "cuda" else "torch")
    graphs = device.type == "cuda" and backend == "triton" and not args.no_graphs
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return _Plan(device, backend, graphs, dtype)


_VARIANTS = {  # row key of an A/B timing -> its column title
    "decode_ms_pdl": "pdl_ms", "decode_ms_nopdl": "no_pdl_ms",
    "decode_ms_fused_rope": "fused_rope_ms", "decode_ms_separate_rope": "separate_rope_ms",
    "decode_ms_merge_in_kernel": "merge_in_kernel_ms",
    "decode_ms_combine_kernel": "combine_kernel_ms", "decode_ms_split_min": "split_min_ms",
    "decode_ms_preload": "preload_ms",
    "decode_ms_cublas": "cublas_ms"}


def parse_attrs(spec: str) -> list[tuple[object, str, object]]:
    """--compare-attr's 'MODULE:NAME=VALUE[;MODULE:NAME=VALUE...]' (several settings timed
    together) -> [(module, NAME, VALUE)] (parse_attr each)."""
    return [parse_attr(one.strip()) for one in spec.split(";") if one.strip()] or [parse_attr(spec)]


class _Environ:
    """--compare-attr's `env:NAME=VALUE`: an environment variable (for settings read at
    each forward, e.g. MEGATRON_TLT_PDL_PREFETCH_MB) behind the module-attribute protocol;
    None stands for unset."""

    def __getattr__(self, name):
        return os.environ.get(name)

    def __setattr__(self, name, value):
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = str(value)


def parse_attr(spec: str) -> tuple[object, str, object]:
    """'MODULE:NAME=VALUE' (--compare-attr) -> (the imported module, NAME, the literal
    VALUE); 'env:NAME=VALUE' sets an environment variable (VALUE as written). A clear
    error when the module or attribute does not exist or VALUE is not a Python literal."""
    target, sep, value = spec.partition("=")
    mod_name, colon, attr = target.partition(":")
    if not sep or not colon or not mod_name or not attr:
        raise TLTError(f"bench rollout: --compare-attr {spec!r}: expected MODULE:NAME=VALUE")
    if mod_name == "env":
        return _Environ(), attr, value
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise TLTError(f"bench rollout: --compare-attr {spec!r}: cannot import {mod_name}: {e}") from e
    if not hasattr(mod, attr):
        raise TLTError(f"bench rollout: --compare-attr {spec!r}: {mod_name} has no attribute {attr}")
    try:
        val = ast.literal_eval(value)
    except (ValueError, SyntaxError) as e:
        raise TLTError(f"bench rollout: --compare-attr {spec!r}: {value!r} is not a Python "
                       f"literal") from e
    return mod, attr, val


def _attr_keys(rows: list[dict]) -> list[str]:
    """The --compare-attr timings' row keys, in order (decode_ms_attr0, ...)."""
    n = max((int(k[len("decode_ms_attr"):]) + 1 for r in rows for k in r
             if k.startswith("decode_ms_attr") and k[len("decode_ms_attr"):].isdigit()), default=0)
    return [f"decode_ms_attr{i}" for i in range(n)]


def variant_table(rows: list[dict]) -> list[str]:
    """The A/B timings of one run side by side (no lines when there are none): per row,
    decode_ms and each variant's ms with decode_ms / variant ms (> 1: the variant is faster)."""
    titles = dict(_VARIANTS)
    for k in _attr_keys(rows):  # --compare-attr: titled NAME=VALUE
        spec = next((r.get("attr" + k[len("decode_ms_attr"):]) for r in rows), None) or k
        titles[k] = ";".join(one.rpartition(":")[2] for one in spec.split(";"))[:24]
    variants = [k for k in titles if any(r.get(k) is not None for r in rows)]
    if not variants:
        return []
    lines = [f"{'shape':>5} {'B':>4} {'decode_ms':>9} " + " ".join(f"{titles[k]:>24}" for k in variants)]
    for r in rows:
        cells = []
        for k in variants:
            d, v = r.get("decode_ms"), r.get(k)
            x = d / v if d is not None and v is not None and d > 0 and v > 0 else None
            cells.append(f"{_fmt(v)} ({_fmt(x)}x)")
        lines.append(f"{r['shape']:>5} {r['batch']:>4} {_fmt(r.get('decode_ms')):>9} "
                     + " ".join(f"{c:>24}" for c in cells))
    return lines


def _retime(engine, rows: list[dict], prompts, args, key: str, tag: str, what: str, name: str,
            log) -> None:
    """Every row's decode timed again into row[key] (after a setting changed and the
    graphs were released, so they are recaptured); a failure goes to the row's errors."""
    for row in rows:
        try:
            row[key] = time_device_decode(engine, prompts[:row["batch"]], steps=args.steps,
                                          repeats=args.repeats, warmup=args.warmup)
            log(f"[{name}] B={row['batch']}: decode with {what} {row[key]:.3f} ms/step")
        except Exception as e:  # noqa: BLE001 - keep measuring the rest; reported in the JSON
            row["errors"].append(f"decode ({tag}): {type(e).__name__}: {e}")


def run_shape(name: str, args, plan: _Plan, log) -> tuple[list[dict], list[dict], dict]:
    arch = ModelArch(**SHAPES[name])
    batch_sizes = sorted(set(args.batch_sizes))
    want_hf = not args.no_hf and name in args.hf_shapes.split(",")
    hf_sizes = sorted(set(args.hf_batch_sizes)) if want_hf else []
    max_batch = max(batch_sizes + hf_sizes)
    p_len = args.prompt_len
    n_short = min(8, args.steps)
    n_long = n_short + args.steps
    dev_total = args.warmup + args.steps * args.repeats
    max_len = p_len + max(dev_total + 2, n_long) + 16
    if max_len > arch.max_position_embeddings:
        raise TLTError(f"bench: prompt {p_len} + decode steps exceed {name}'s "
                       f"{arch.max_position_embeddings} positions")
    page = 16
    num_blocks = max_batch * -(-max_len // page) + 8
    clock = _Clock(plan.device)
    t0 = time.perf_counter()
    weights = random_weights(arch, dtype=plan.dtype, device=plan.device, seed=args.seed)
    engine = RolloutEngine(arch, weights, max_num_seqs=max_batch, num_blocks=num_blocks,
                           block_size=page, dtype=plan.dtype, device=plan.device,
                           max_model_len=max_len, max_num_batched_tokens=max_batch * p_len,
                           attention_backend=plan.backend, cuda_graphs=plan.graphs,
                           cuda_graph_batch_sizes=sorted(set(batch_sizes + hf_sizes)),
                           seed=args.seed)
    g = torch.Generator().manual_seed(args.seed + 1)
    prompts = torch.randint(0, arch.vocab_size, (max_batch, p_len), generator=g).tolist()
    capture_s = None
    if engine.decode_runner is not None and plan.graphs:
        t1 = time.perf_counter()
        engine.decode_runner.capture()
        capture_s = time.perf_counter() - t1
    log(f"[{name}] weights + engine {time.perf_counter() - t0:.1f}s, graph capture "
        f"{capture_s if capture_s is None else round(capture_s, 1)}s, "
        f"{sum(t.numel() for t in weights.tensors()) / 1e9:.2f}B parameters")

    rows = []
    engine_tokens = {}
    mean_ctx = p_len + 1 + args.warmup + (args.steps * args.repeats - 1) / 2
    # the differenced steps of generate (engine and HF): contexts p_len + n_short .. + n_long - 1
    gen_ctx = p_len + (n_short + n_long - 1) / 2
    for b in sorted(set(batch_sizes + hf_sizes)):
        row: dict = {"shape": name, "batch": b, "in_batch_sizes": b in batch_sizes,
                     "mean_context": mean_ctx, "errors": []}
        row.update(step_bytes(arch, weights, b, mean_ctx))
        timer = time_device_decode if engine.decode_runner is not None else time_engine_decode
        try:
            row["decode_ms"] = timer(engine, prompts[:b], steps=args.steps, repeats=args.repeats,
                                     warmup=args.warmup)
        except Exception as e:  # noqa: BLE001 - keep measuring the rest; reported in the JSON
            row["decode_ms"] = None
            row["errors"].append(f"decode: {type(e).__name__}: {e}")
            log(f"[{name}] B={b}: decode loop failed: {traceback.format_exc()}")
        try:
            e2e_ms, results = time_generate(
                functools.partial(_engine_generate, engine, prompts[:b]), n_short, n_long,
                max(1, min(3, args.repeats)), clock)
            bad = [r.error for r in results if r.error]
            if bad:
                raise TLTError(f"bench: engine rejected a request: {bad[0]}")
            engine_tokens[b] = [r.token_ids for r in results]
        except Exception as e:  # noqa: BLE001
            e2e_ms = None
            row["errors"].append(f"generate: {type(e).__name__}: {e}")
            log(f"[{name}] B={b}: engine.generate failed: {traceback.format_exc()}")
        row["engine_ms_per_step"] = e2e_ms
        row["generate_mean_context"] = gen_ctx
        d = row["decode_ms"]
        row["decode_tokens_per_s"] = b * 1e3 / d if d and d > 0 else None
        row["engine_tokens_per_s"] = b * 1e3 / e2e_ms if e2e_ms and e2e_ms > 0 else None
        rows.append(row)
        log(f"[{name}] B={b}: decode {_fmt(d)} ms/step, engine {_fmt(e2e_ms)} ms/step")

    runner = engine.decode_runner
    plans = []
    if runner is not None:
        plans = [{"m": k[0], "n": k[1], "k": k[2], "key_extra": [str(v) for v in k[5:]],
                  "config": str(c), "us": us,
                  "candidates_us": runner.model.planner.timings.get(k, {})}
                 for k, (c, us) in runner.model.planner.plans.items()]
    if args.compare_pdl and runner is not None and plan.graphs:
        from megatron_tlt.rollout import pdl
        if not pdl.supported(plan.device):
            log(f"[{name}] --compare-pdl: {plan.device} is not Hopper or later, skipped")
        else:
            flag = runner.model.pdl  # decode_ms ran with this setting; time the other one
            runner.model.pdl = not flag
            runner.release()
            key = "decode_ms_nopdl" if flag else "decode_ms_pdl"
            _retime(engine, rows, prompts, args, key, key, f"PDL {'off' if flag else 'on'}", name, log)
            runner.model.pdl = flag
            runner.release()
            for row in rows:
                row["pdl"] = flag
    if args.compare_fused_rope and runner is not None and plan.graphs:
        flag = runner.model.fused_rope  # decode_ms ran with this setting; time the other one
        runner.model.fused_rope = not flag
        runner.release()
        key = "decode_ms_separate_rope" if flag else "decode_ms_fused_rope"
        _retime(engine, rows, prompts, args, key, key,
                f"RoPE {'in its own kernel' if flag else 'in the attention kernel'}", name, log)
        runner.model.fused_rope = flag
        runner.release()
        for row in rows:
            row["fused_rope"] = flag
    if args.compare_merge and runner is not None and plan.graphs:
        from megatron_tlt.rollout import triton_attention
        flag = triton_attention.set_merge_in_kernel(not triton_attention.attention_merge_in_kernel())
        runner.release()
        key = "decode_ms_combine_kernel" if flag else "decode_ms_merge_in_kernel"
        _retime(engine, rows, prompts, args, key, key,
                f"the split-K merge {'in _combine_kernel' if flag else 'in the attention kernel'}",
                name, log)
        triton_attention.set_merge_in_kernel(flag)
        runner.release()
        for row in rows:
            row["merge_in_kernel"] = flag
    if args.compare_split_min and runner is not None and plan.graphs:
        from megatron_tlt.rollout import triton_attention
        cur = triton_attention.split_min_tiles()
        other = 4 if cur == 1 else 1
        triton_attention.set_split_min_tiles(other)
        runner.release()
        _retime(engine, rows, prompts, args, "decode_ms_split_min", "split_min",
                f"split-K splits of at least {other} key tile(s)", name, log)
        triton_attention.set_split_min_tiles(cur)
        runner.release()
        for row in rows:
            row["split_min_tiles"], row["split_min_tiles_variant"] = cur, other
    if args.compare_preload is not None and runner is not None and plan.graphs:
        from megatron_tlt.rollout import pdl
        if not runner.model.pdl:
            log(f"[{name}] --compare-preload: decode runs without PDL (MEGATRON_TLT_PDL=0 or not "
                f"Hopper), skipped")
        else:
            prev = os.environ.get(pdl.PRELOAD_ENV)
            os.environ[pdl.PRELOAD_ENV] = str(args.compare_preload)
            runner.release()
            try:
                _retime(engine, rows, prompts, args, "decode_ms_preload", "preload",
                        f"{args.compare_preload:g} KB of weight tiles loaded before the PDL wait",
                        name, log)
            finally:
                if prev is None:
                    os.environ.pop(pdl.PRELOAD_ENV, None)
                else:
                    os.environ[pdl.PRELOAD_ENV] = prev
                runner.release()
            for row in rows:
                row["preload_kb"] = args.compare_preload
    for i, spec in enumerate(args.compare_attr):
        if runner is None or not plan.graphs:
            break
        sets = parse_attrs(spec)
        prev = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in sets]
        for mod, attr, val in sets:
            setattr(mod, attr, val)
        runner.release()
        try:
            _retime(engine, rows, prompts, args, f"decode_ms_attr{i}", f"attr{i}", spec, name, log)
        finally:
            for mod, attr, val in reversed(prev):
                setattr(mod, attr, val)
            runner.release()
        for row in rows:
            row[f"attr{i}"] = spec
    if args.compare_cublas and runner is not None and plan.graphs:
        from megatron_tlt.rollout.triton_linear import CUBLAS, LinearPlanner
        runner.model.planner = LinearPlanner(fixed=CUBLAS)
        runner.release()
        _retime(engine, rows, prompts, args, "decode_ms_cublas", "cublas", "cuBLAS-only projections", name, log)

    hf_rows = []
    if want_hf:
        try:
            model = build_hf_model(arch, weights)
            for mode in args.hf_modes:
                for b in hf_sizes:
                    t_mode = time.perf_counter()
                    ms, toks = time_generate(hf_generate_fn(model, prompts[:b], compiled=mode == "compiled"),
                                             n_short, n_long, max(1, min(3, args.repeats)), clock)
                    ours = engine_tokens.get(b)
                    agree = None
                    if ours is not None:
                        hf_t = toks.tolist()
                        agree = statistics.mean(_prefix_agreement(o, h) for o, h in zip(ours, hf_t))
                    hf_rows.append({"shape": name, "batch": b, "mode": mode, "hf_ms_per_step": ms,
                                    "mean_tokens_agreeing_with_engine": agree,
                                    "wall_s": time.perf_counter() - t_mode})
                    log(f"[{name}] HF {mode} B={b}: {ms:.3f} ms/step")
            del model
        except Exception as e:  # noqa: BLE001 - a baseline failure must not lose our numbers
            hf_rows.append({"shape": name, "error": f"{type(e).__name__}: {e}"})
            log(f"[{name}] HF baseline failed: {type(e).__name__}: {e}")
    del engine, weights
    if plan.device.type == "cuda":
        torch.cuda.empty_cache()
    if runner is not None:  # the prologue-fusion choices (those of --compare-attr runs too)
        plans += [{"fused": k[0], "m": k[1], "n": k[2], "k": k[3], "planes": k[4],
                   "key_extra": [str(x) for x in k[6:]], "config": str(c), "fused_us": f_us,
                   "unfused_us": u_us}
                  for k, (c, f_us, u_us) in runner.model.planner.fused.items()]
    return rows, hf_rows, {name: plans}


def _prefix_agreement(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _command(args: argparse.Namespace) -> str:
    words = ["megatron-tlt", "bench", getattr(args, "what", "rollout")]
    if getattr(args, "json", None):
        words += ["--json", args.json]
    return shlex.join(words + list(getattr(args, "extra", None) or []))


def _fmt(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def main(args: argparse.Namespace) -> int:
    what = getattr(args, "what", "rollout")
    if what == "spec":
        from megatron_tlt.bench_spec import main as spec_main
        return spec_main(args)
    if what != "rollout":
        raise TLTError(f"bench {what}: not implemented yet (available: bench rollout, bench spec)")
    opts = parse_args(list(getattr(args, "extra", []) or []))
    for spec in opts.compare_attr:
        parse_attrs(spec)  # a typo fails now, not after the first shape's timings
    plan = _plan(opts)
    shapes = (opts.shapes or ("1.5b,7b" if plan.device.type == "cuda" else "tiny")).split(",")
    for s in shapes:
        if s not in SHAPES:
            raise TLTError(f"bench rollout: unknown shape {s!r} (known: {', '.join(sorted(SHAPES))})")

    def log(msg: str) -> None:
        print(msg, flush=True)

    start = time.perf_counter()
    bw_bytes = (2 << 30) if plan.device.type == "cuda" else (64 << 20)
    bw = measure_bandwidth(plan.device, bw_bytes)
    log(f"bandwidth: copy {bw['copy_rw_GBps']:.0f} GB/s (read+write), read-only "
        f"{bw['read_GBps']:.0f} GB/s -> roofline {bw['roofline_GBps']:.0f} GB/s")
    rows, hf_rows, errors, plans = [], [], [], {}
    for i, s in enumerate(shapes):
        try:
            r, h, p = run_shape(s, opts, plan, log)
        except Exception as e:  # noqa: BLE001 - the other shapes still run; reported below
            errors.append(f"{s}: {type(e).__name__}: {e}")
            log(f"[{s}] failed: {traceback.format_exc()}")
            if plan.device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        rows += r
        hf_rows += h
        plans.update(p)
        if getattr(args, "json", None) and i + 1 < len(shapes):
            # the shapes done so far, so a time limit or a crash in a later shape loses none
            # of them ("complete": false; the final write below replaces it)
            part = _report(args, opts, plan, shapes, bw, rows, hf_rows, plans, errors, start)
            part["complete"] = False
            _write_json(args.json, part)
    report = _report(args, opts, plan, shapes, bw, rows, hf_rows, plans, errors, start)
    _print_table(rows)
    if getattr(args, "json", None):
        _write_json(args.json, report)
        log(f"wrote {args.json}")
    for e in report["errors"]:
        log(f"ERROR {e}")
    log(f"bench rollout finished in {report['wall_s']:.1f}s"
        + (f" with {len(report['errors'])} error(s)" if report["errors"] else ""))
    return 1 if report["errors"] else 0


def _print_table(rows: list[dict]) -> None:
    """The run's table, one line per shape and batch, then the A/B variants side by side."""
    header = (f"{'shape':>5} {'B':>4} {'decode_ms':>9} {'tok/s':>9} {'roof_ms':>8} {'of_roof':>7} "
              f"{'engine_ms':>9} {'hf_ms':>7} {'hf/decode':>9} {'hf/engine':>9}")
    print(header)
    for r in rows:
        print(f"{r['shape']:>5} {r['batch']:>4} {_fmt(r['decode_ms']):>9} "
              f"{_fmt(r['decode_tokens_per_s'], '.0f'):>9} {r['roofline_ms']:>8.3f} "
              f"{_fmt(r['of_roofline'], '.2f'):>7} {_fmt(r['engine_ms_per_step']):>9} "
              f"{_fmt(r['hf_ms_per_step']):>7} {_fmt(r['hf_over_decode'], '.2f'):>9} "
              f"{_fmt(r['hf_over_engine'], '.2f'):>9}")
    for line in variant_table(rows):
        print(line)


def _write_json(path: str, report: dict) -> None:
    """Write `report` to `path` whole or not at all (atomic_io)."""
    write_json(path, report, default=str)


def _report(args: argparse.Namespace, opts: argparse.Namespace, plan, shapes: list[str],
            bw: dict, rows: list[dict], hf_rows: list[dict], plans: dict, errors: list[str],
            start: float) -> dict:
    """The run's JSON report of the shapes timed so far (`rows` gain roofline_ms,
    of_roofline and the HF ratios in place)."""
    errors = list(errors)
    errors += [f"{r['shape']} B={r['batch']}: {e}" for r in rows for e in r["errors"]]
    errors += [f"{h['shape']} HF: {h['error']}" for h in hf_rows if "error" in h]
    hf_ms: dict[tuple, dict[str, float]] = {}
    for h in hf_rows:
        if "hf_ms_per_step" in h:
            hf_ms.setdefault((h["shape"], h["batch"]), {})[h["mode"]] = h["hf_ms_per_step"]

    def ratio(a, b):
        return a / b if a is not None and b is not None and a > 0 and b > 0 else None

    for row in rows:
        row["roofline_ms"] = row["bytes"] / (bw["roofline_GBps"] * 1e6)
        row["of_roofline"] = ratio(row["roofline_ms"], row["decode_ms"])
        modes = hf_ms.get((row["shape"], row["batch"]), {})
        # the faster transformers mode is the baseline (compiled when it ran)
        hf = min(modes.values()) if modes else None
        row["hf_ms_per_step"] = hf
        row["hf_mode"] = min(modes, key=modes.get) if modes else None
        row["hf_ms_by_mode"] = modes
        row["of_roofline_cublas"] = ratio(row["roofline_ms"], row.get("decode_ms_cublas"))
        for key in ("pdl", "fused_rope", "merge_in_kernel"):
            row[f"of_roofline_{key}"] = ratio(row["roofline_ms"], row.get(f"decode_ms_{key}"))
        row["hf_over_decode"] = ratio(hf, row["decode_ms"])
        row["hf_over_engine"] = ratio(hf, row["engine_ms_per_step"])

    report = {
        "command": _command(args),
        "git_revision": _git_revision(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "cuda": torch.version.cuda,
        "device": (torch.cuda.get_device_name(plan.device) if plan.device.type == "cuda"
                   else f"cpu ({platform.processor() or platform.machine()})"),
        "dtype": str(plan.dtype).replace("torch.", ""),
        "attention_backend": plan.backend,
        "cuda_graphs": plan.graphs,
        "settings": {"shapes": shapes, "batch_sizes": opts.batch_sizes, "steps": opts.steps,
                     "repeats": opts.repeats, "warmup": opts.warmup,
                     "prompt_len": opts.prompt_len, "hf_batch_sizes": opts.hf_batch_sizes,
                     "hf": not opts.no_hf, "hf_modes": opts.hf_modes,
                     "compare_cublas": opts.compare_cublas, "compare_pdl": opts.compare_pdl,
                     "compare_fused_rope": opts.compare_fused_rope,
                     "compare_merge": opts.compare_merge,
                     "compare_split_min": opts.compare_split_min,
                     "compare_preload_kb": opts.compare_preload,
                     "compare_attr": opts.compare_attr,
                     "seed": opts.seed,
                     # the engine's knobs set for the whole run (the revision is git_revision)
                     "environment": {k: v for k, v in sorted(os.environ.items())
                                     if k.startswith("MEGATRON_TLT_") and k != "MEGATRON_TLT_GIT_REV"}},
        "bandwidth": bw,
        "definitions": {
            "decode_ms": "graph replay + on-device greedy argmax + input update, CUDA events, "
                         "median of repeats (backend torch: forward_pending + sample_and_append)",
            "engine_ms_per_step": "RolloutEngine.generate wall time per token step "
                                  "(differenced lengths, prefill cancels; after an untimed call "
                                  "of each length), at contexts of mean generate_mean_context",
            "mean_context": "the mean context of decode_ms's timed steps (its KV is in the roofline)",
            "generate_mean_context": "the mean context of the differenced steps of engine_ms_per_step "
                                     "and hf_ms_per_step (shorter than mean_context: their KV reads "
                                     "are fewer)",
            "roofline_ms": "(every weight once, an untied embedding only its B looked-up rows, + KV "
                           "of the mean context) / max(copy read+write bandwidth, read-only sum "
                           "bandwidth)",
            "of_roofline": "roofline_ms / decode_ms",
            "hf_over_engine": "hf_ms_per_step / engine_ms_per_step: whole generate calls against "
                              "each other, the speedup over HF",
            "hf_over_decode": "hf_ms_per_step / decode_ms: HF's whole generate against our device "
                              "decode loop (no host work), an upper bound of the speedup",
            "hf_ms_per_step": "transformers generate, static cache, greedy, the faster of its "
                              "compiled (generate's auto torch.compile) and eager modes "
                              "(differenced lengths after an untimed call of each; hf_ms_by_mode "
                              "has both)",
            "decode_ms_cublas": "decode_ms with every projection on cuBLAS (LinearPlanner fixed)",
            "decode_ms_pdl": "decode_ms with programmatic dependent launch (--compare-pdl, when "
                             "decode_ms ran without it; decode_ms_nopdl the converse)",
            "decode_ms_fused_rope": "decode_ms with RoPE + the K/V write in the attention kernel "
                                    "(--compare-fused-rope, when decode_ms ran without it; "
                                    "decode_ms_separate_rope the converse)",
            "decode_ms_merge_in_kernel": "decode_ms with the split-K attention merge in the "
                                         "attention kernel (--compare-merge, when decode_ms ran "
                                         "with _combine_kernel; decode_ms_combine_kernel the converse)",
            "decode_ms_split_min": "decode_ms with the split-K attention's minimum key tiles "
                                   "per split switched (--compare-split-min: "
                                   "split_min_tiles_variant against split_min_tiles)",
            "decode_ms_preload": "decode_ms (with PDL) with up to preload_kb KB of each projection "
                                 "program's weight tiles loaded before its PDL wait "
                                 "(--compare-preload)",
            "decode_ms_attrI": "decode_ms with the I-th --compare-attr setting (row attrI "
                               "names it: MODULE:NAME=VALUE) and every other setting as "
                               "decode_ms ran",
            "complete": "false in the JSON written after each shape but the last (the shapes "
                        "timed so far); true once the run has ended",
            "linear_plans": "per projection shape (m, n, k): the kernel LinearPlanner chose and "
                            "the microseconds it timed for each candidate (the process's shared "
                            "planner: a shape's list holds every shape timed so far); entries with "
                            "'fused' (norm / silu): the prologue-fused config chosen (None: "
                            "the separate kernel) with its and the separate pair's us",
        },
        "results": rows,
        "hf": hf_rows,
        "linear_plans": plans,
        "errors": errors,
        "complete": True,
        "wall_s": time.perf_counter() - start,
    }
    return report
