"""Prefill A/B in one process: the generic forward (per-op RMSNorm and RoPE, an SDPA per
group of equal prompt lengths) against the fused decode model (`DecodeRunner.extend`,
MEGATRON_TLT_FUSED_PREFILL=1: one causal paged-attention launch per layer), on random
weights of a benchmark shape, alternating the two modes over --repeats rounds.

    python tools/prefill_ab.py --shape 1.5b --batch-sizes 1,4,16,32 --prompt-len 160 [--json FILE]
        [--new-tokens 64 --temperature 0.9]

A timed run is `engine.generate` of B requests with --new-tokens new tokens each (default
1: the prefill, one sample, admission and bookkeeping: what a rollout's first step costs).
With more than one new token it also reports, from the engine's step log, the first
step's wall (the prefill) and the median wall of the steps after it, per mode: do the
decode steps that follow a prefill depend on which path prefilled? (Prompts over the
engine's token budget per step, e.g. 8 x 2048 tokens, prefill over several steps: the
steps after the first are then partly prefill.)
Prompt lengths are drawn from [prompt_len / 2, prompt_len] (seeded), as the synthetic
tasks' prompts vary, so the generic path meets several length groups at larger batches.
Prints, per batch size, the median ms of each mode, their ratio and how many of the B
first tokens the two modes agree on (bfloat16 rounds differently on the two paths, so a
near-tie may flip). A benchmark: nothing is asserted on time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from megatron_tlt.rollout import Request, SamplingParams


def _requests(tag: str, prompts: list[list[int]], new: int, temperature: float) -> list[Request]:
    return [Request(prompt_id=f"{tag}-{i}", prompt_token_ids=p,
                    sampling_params=SamplingParams(temperature=temperature, max_new_tokens=new))
            for i, p in enumerate(prompts)]


def main() -> None:
    from profile_generate import random_spec_setup  # tools/ is the script's directory

    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="1.5b")
    p.add_argument("--batch-sizes", default="1,4,16,32")
    p.add_argument("--prompt-len", type=int, default=160)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    engine, _, _ = random_spec_setup(a.shape, max(sizes), a.prompt_len, a.new_tokens)
    if engine.decode_runner is None or not engine._fused_verify():
        raise SystemExit("prefill_ab: needs a CUDA engine with the Triton backend (the fused path)")
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(a.prompt_len // 2, a.prompt_len + 1, (max(sizes),), generator=g).tolist()
    vocab = min(1000, engine.arch.vocab_size)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]
    dev = engine.device

    steps: dict[bool, list[tuple[float, float]]] = {}

    def timed(tag: str, fused: bool, b: int) -> tuple[float, list[int]]:
        engine.fused_prefill = fused
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        out = engine.generate(_requests(tag, prompts[:b], a.new_tokens, a.temperature))
        torch.cuda.synchronize(dev)
        walls = [w for _, w in engine.step_log]
        if len(walls) > 1:
            steps.setdefault(fused, []).append((1e3 * walls[0], 1e3 * statistics.median(walls[1:])))
        return 1e3 * (time.perf_counter() - t0), [r.token_ids[0] for r in out]

    report = {"shape": a.shape, "prompt_lens": lens, "repeats": a.repeats,
              "new_tokens": a.new_tokens, "temperature": a.temperature, "results": []}
    for b in sizes:
        for fused in (False, True):  # warm-up: kernels, planner, allocator
            timed(f"warm-{b}-{fused}", fused, b)
        ms = {False: [], True: []}
        first = {}
        steps.clear()
        for r in range(a.repeats):
            for fused in ((False, True) if r % 2 == 0 else (True, False)):
                t, toks = timed(f"b{b}-r{r}", fused, b)  # same ids: same noise
                ms[fused].append(t)
                first[fused] = toks
        gen, fus = statistics.median(ms[False]), statistics.median(ms[True])
        agree = sum(x == y for x, y in zip(first[False], first[True]))
        row = {"batch": b, "generic_ms": gen, "fused_ms": fus, "ratio": gen / fus,
               "first_tokens_agree": agree, "runs_ms": {"generic": ms[False], "fused": ms[True]}}
        line = ""
        if steps:
            for fused, name in ((False, "generic"), (True, "fused")):
                row[f"{name}_first_step_ms"] = statistics.median(x[0] for x in steps[fused])
                row[f"{name}_decode_step_ms"] = statistics.median(x[1] for x in steps[fused])
            line = (f"; first step {row['generic_first_step_ms']:.2f} / {row['fused_first_step_ms']:.2f} ms, "
                    f"median decode step after it {row['generic_decode_step_ms']:.3f} / "
                    f"{row['fused_decode_step_ms']:.3f} ms (generic / fused)")
        report["results"].append(row)
        print(f"B={b:>3}: generic {gen:.2f} ms, fused {fus:.2f} ms, generic/fused {gen / fus:.2f}x, "
              f"first tokens agree {agree}/{b}{line}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
