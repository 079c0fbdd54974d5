"""Where the wall time of `RolloutEngine.generate` goes on a GPU: plain sampled decoding and
EAGLE speculative decoding, on a random-weight model of a benchmark shape.

    python tools/profile_generate.py --shape 1.5b --batch-sizes 1,32 [--json FILE]

Per batch size:
- plain decode ms per step at --temperature (wall of a long run minus a short run, over
  the difference in steps: prefill and warm-up cancel), against the graph replay alone
  (DecodeRunner.run on the same bucket): the difference is host work and sampling;
- the same for EAGLE (random one-layer drafter, draft vocabulary 128, chain depth 4) with
  SpecDecoder.timings (device synchronised around each phase);
- cProfile of one plain and one SD run: the top functions by own time (host work).
Random weights: acceptance is meaningless here; the per-phase costs are what is measured.
Not a benchmark of speedups (bench spec is).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch

from megatron_tlt.bench import SHAPES, random_weights
from megatron_tlt.models.arch import ModelArch
from megatron_tlt.rollout.engine import RolloutEngine, fast_path_options
from megatron_tlt.rollout.request import Request
from megatron_tlt.rollout.sampling import SamplingParams


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _requests(tag, prompts, temperature, new):
    return [Request(prompt_id=f"{tag}-{i}", prompt_token_ids=p,
                    sampling_params=SamplingParams(temperature=temperature, max_new_tokens=new,
                                                   seed=0))
            for i, p in enumerate(prompts)]


def _wall(engine, decoder, prompts, temperature, new, tag):
    engine.spec_decoder = decoder
    if decoder is not None:
        decoder.metrics.reset()
    _sync()
    t0 = time.perf_counter()
    res = engine.generate(_requests(tag, prompts, temperature, new))
    _sync()
    wall = time.perf_counter() - t0
    steps = None
    if decoder is not None:
        steps = sum(b.steps for b in decoder.metrics.buckets.values())
    return wall, sum(len(r.token_ids) for r in res), steps


def _top(prof: cProfile.Profile, n: int) -> str:
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(n)
    return s.getvalue()


def _kernels(engine, decoder, prompts, temperature, new, tag, top) -> str:
    """torch.profiler over one generate: device kernels by total time (graph replays'
    kernels included where CUPTI reports them), with the run's engine step count so calls
    per step can be read off."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.spec_decoder = decoder
        if decoder is not None:
            decoder.metrics.reset()
        res = engine.generate(_requests(tag, prompts, temperature, new))
        _sync()
    steps = (sum(b.steps for b in decoder.metrics.buckets.values()) if decoder is not None
             else max(len(r.token_ids) for r in res))
    table = prof.key_averages().table(sort_by="device_time_total", row_limit=top, max_name_column_width=70)
    return f"engine steps in this run: {steps}\n{table}"


def _trace(engine, decoder, prompts, temperature, new, tag, out_dir, name) -> str:
    """A gzipped chrome trace of one short generate (NVTX-free: the SD phases show as the
    record_function ranges spec/draft, spec/verify_forward, ...)."""
    import gzip
    import os
    import shutil
    from torch.profiler import ProfilerActivity, profile
    os.makedirs(out_dir, exist_ok=True)
    engine.spec_decoder = decoder
    _wall(engine, decoder, prompts, temperature, new, tag + "-warm")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _wall(engine, decoder, prompts, temperature, new, tag)
    raw = os.path.join(out_dir, name + ".json")
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as f, gzip.open(raw + ".gz", "wb") as g:
        shutil.copyfileobj(f, g)
    os.remove(raw)
    return raw + ".gz"


def _replay_ms(fn, n: int = 50) -> float:
    for _ in range(3):
        fn()
    _sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    _sync()
    return 1e3 * (time.perf_counter() - t0) / n


def _spec_graph_replays(engine, decoder, b: int) -> dict[str, float]:
    """Device ms of each speculative-step graph alone, replayed back to back at this batch
    size's buckets (its inputs are whatever the last step left; every write goes to
    positions of finished sequences): the chain drafter, the verify forward and the
    verification math. The SD step's wall minus their sum is host work and syncs."""
    out: dict[str, float] = {}
    from megatron_tlt.spec.eagle_graph import BUCKETS
    cb = next(x for x in BUCKETS if x >= b)
    for name in ("_chain_graphs", "_tree_graphs"):
        cg = getattr(decoder.drafter, name, None)
        for key, (graph, _) in (cg._graphs.items() if cg is not None else ()):
            if key[0] == cb and graph is not None:
                what = f"chain_depth{key[1]}" if name == "_chain_graphs" else "tree_{}x{}".format(*key[1])
                out[f"draft_{what}"] = _replay_ms(graph.replay)
    runner = engine.decode_runner
    vb = runner.bucket_for(b)
    for (bucket, q), (graph, _) in runner._vgraphs.items():
        if bucket == vb:
            out[f"verify_forward_q{q}"] = _replay_ms(graph.replay)
    math = decoder._math
    if math is not None:
        mb = 1 << max(0, (b - 1).bit_length())  # VerifyMath's power-of-two bucket
        for key, graph in math._graphs.items():
            if key[1] == mb:
                out[f"verify_math_{key[0]}_q{key[2]}"] = _replay_ms(graph.replay)
    return out


def random_spec_setup(shape: str, max_b: int, prompt_len: int, new: int, spec_depth: str = "4"):
    """(engine, EAGLE SpecDecoder, max_b prompts) on random weights of a benchmark shape:
    bf16 with the fast path on a GPU, float32 on CPU; a random one-layer drafter with a
    128-token draft vocabulary, depth-4 chains (spec_depth: --spec-depth's form, DxK
    entries draft top-K trees); room for prompt_len + new tokens."""
    from megatron_tlt.spec.decode import SpecDecoder, depth_policy
    from megatron_tlt.spec.eagle import DrafterConfig, EagleDrafter, EagleProposer

    arch = ModelArch(**SHAPES[shape])
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    w = random_weights(arch, dtype=dt, device=dev, seed=0)
    page = 16
    max_len = prompt_len + new + 16
    engine = RolloutEngine(arch, w, max_num_seqs=max_b, block_size=page,
                           num_blocks=max_b * (-(-max_len // page)) + 8, dtype=dt,
                           device=dev, max_model_len=max_len, eos_token_ids=(), seed=0,
                           **fast_path_options(dev))
    cfg = DrafterConfig(arch=arch, draft_vocab_size=128)
    drafter = EagleDrafter(cfg, w.embed, w.lm_head, draft_to_target=torch.arange(128))
    decoder = SpecDecoder(EagleProposer(drafter), policy=depth_policy(spec_depth))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (prompt_len,), generator=g).tolist() for _ in range(max_b)]
    return engine, decoder, prompts


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--temperature", type=float, default=0.9)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--json", default=None)
    p.add_argument("--spec-depth", default="4",
                   help="the EAGLE decoder's depth or schedule (generate's --spec-depth form; "
                        "DxK: top-K trees, e.g. 1:6x2,32:4)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--trace-dir", default=None,
                   help="also write a gzipped chrome trace (torch.profiler, CUDA) of one short "
                        "run per mode and batch size there, for timeline analysis "
                        "(tools/trace_gaps.py summarises device idle time per phase)")
    p.add_argument("--kernels", action="store_true",
                   help="also run torch.profiler over one run per mode and batch size (CUDA): "
                        "the top device kernels by total time, with calls per engine step")
    a = p.parse_args()
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    max_b = max(sizes)
    short, long_ = 8, 72
    engine, decoder, prompts = random_spec_setup(a.shape, max_b, a.prompt_len, long_, a.spec_depth)
    dev = engine.device
    report = {"shape": a.shape, "temperature": a.temperature, "spec_depth": a.spec_depth, "results": []}
    for b in sizes:
        ps = prompts[:b]
        row = {"batch": b}
        for mode, dec in (("off", None), ("eagle", decoder)):
            # Warm-up at the long length: graphs, planner, drafter KV growth (no capture
            # inside the timed runs).
            _wall(engine, dec, ps, a.temperature, long_, f"warm-{mode}-{b}")
            w_s, tok_s, st_s = _wall(engine, dec, ps, a.temperature, short, f"s-{mode}-{b}")
            w_l, tok_l, st_l = _wall(engine, dec, ps, a.temperature, long_, f"l-{mode}-{b}")
            if dec is None:
                row["off_ms_per_step"] = 1e3 * (w_l - w_s) / (long_ - short)
            else:
                row["eagle_ms_per_step"] = 1e3 * (w_l - w_s) / max(st_l - st_s, 1)
                row["eagle_tokens_per_step"] = (tok_l - tok_s) / max(st_l - st_s, 1) / b
                dec.timings = {}
                _, _, st = _wall(engine, dec, ps, a.temperature, long_, f"t-{mode}-{b}")
                row["eagle_phase_ms_per_step"] = {k: 1e3 * v / st for k, v in dec.timings.items()}
                dec.timings = None
            prof = cProfile.Profile()
            prof.enable()
            _wall(engine, dec, ps, a.temperature, long_, f"p-{mode}-{b}")
            prof.disable()
            row[f"{mode}_cprofile"] = _top(prof, a.top)
            if a.kernels and dev.type == "cuda":
                row[f"{mode}_kernels"] = _kernels(engine, dec, ps, a.temperature, long_, f"k-{mode}-{b}", a.top)
            if a.trace_dir and dev.type == "cuda" and dec is not None:
                row[f"{mode}_trace"] = _trace(engine, dec, ps, a.temperature, short * 3,
                                              f"tr-{mode}-{b}", a.trace_dir, f"trace_{mode}_b{b}")
        # graph replay alone at this bucket (the decode forward without host work)
        runner = engine.decode_runner
        if runner is None:  # CPU: no graph path
            report["results"].append(row)
            continue
        bucket = runner.bucket_for(b)
        row["graph_replay_ms"] = _replay_ms(lambda: runner.run(bucket))
        row["eagle_graph_replay_ms"] = _spec_graph_replays(engine, decoder, b)
        report["results"].append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("cprofile")}), flush=True)
        for k in ("off_cprofile", "eagle_cprofile", "off_kernels", "eagle_kernels"):
            if k not in row:
                continue
            print(f"---- B={b} {k}\n{row[k]}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
