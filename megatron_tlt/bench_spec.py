"""`megatron-tlt bench spec`: speculative decoding against plain decoding of the same
target, side by side in one run, per batch size.

    megatron-tlt bench spec --model DIR --json FILE [--drafter DIR] [--drafters eagle,ngram]
        [--batch-sizes 1,4,16,32] [--temperature 0.9] [--max-new-tokens 256]
        [--tasks arith,sort | --prompts FILE.jsonl] [--spec-depth D --spec-topk K
        --spec-num-verify N] [--repeats R] [--profile-batch-sizes 1,32] [--seed S]

For each batch size B, the first B prompts (synthetic tasks, or a prompts file) are
generated with `--spec off` and with each drafter, on ONE engine (same weights, same
cache, the job's fast path: Triton + CUDA graphs on a GPU), the order alternating between
repeats. Reported per (B, mode): each repeat's wall seconds and generated tokens
(`repeats`), the median tokens/s, and for SD acceptance rate / length (vLLM's
definitions, spec/stats.py); then `speedup` = SD tokens/s / off tokens/s. At
temperature > 0 the modes draw different tokens (lossless means same distribution, not
same samples), so response lengths differ: tokens/s, not wall time, is the comparable
figure; the mean lengths are reported too. At temperature 0 each SD row reports
`tokens_equal_plain`, the share of requests whose tokens equal plain decoding's (lossless:
1.0), with a warning below it.
With few prompts the lengths can differ a lot (session 7, batch 1: plain 50 tokens, EAGLE
256), and a short run's tokens/s carries its prefill over few tokens: a row whose mean
length is off by more than 25% from plain's gets `length_mismatch` and a printed warning;
`--min-new-tokens N` (N = --max-new-tokens) fixes the lengths.
Each run also records its engine steps, ms per step and `events`: graph captures and
kernel-planner timings that happened inside it (they belong in the warm-up; a timed run
that holds one is slower than steady state).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import statistics
import time

import torch

from megatron_tlt.bench import _Clock, _command, _git_revision, _int_list, _version
from megatron_tlt.config import DEFAULT_SPEC_DEPTH
from megatron_tlt.errors import TLTError


def parse_args(extra: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megatron-tlt bench spec")
    p.add_argument("--model", required=True, help="HF target model directory")
    p.add_argument("--drafter", default=None, help="EAGLE drafter directory (needed for eagle)")
    p.add_argument("--drafters", default=None,
                   help="comma-separated: eagle, ngram, eagle-readback (EAGLE reading every "
                        "step's drafts back before verifying, MEGATRON_TLT_SPEC_DEFER=0's step, "
                        "for a side-by-side comparison), eagle-ahead / eagle-noahead (EAGLE with / "
                        "without the draft-ahead, which queues each step's chain before the host "
                        "reads the previous verification; plain eagle follows "
                        "MEGATRON_TLT_SPEC_AHEAD, default on), eagle-vahead (the draft-ahead "
                        "and the verify-ahead, which also queues the next verify forward; "
                        "eagle-ahead has the draft-ahead alone; plain eagle follows "
                        "MEGATRON_TLT_SPEC_VERIFY_AHEAD, default on), eagle-torchprobs (EAGLE "
                        "with the verification's target probabilities from torch ops instead of "
                        "the Triton kernels, MEGATRON_TLT_FUSED_VERIFY_PROBS=0's step), eagle-onehot "
                        "(chains of the drafter's argmax tokens verified as one-hot proposals, "
                        "EagleProposer.one_hot_chains), eagle-torchlayer (the drafter's layer "
                        "in torch ops instead of the Triton kernel path, "
                        "MEGATRON_TLT_DRAFTER_KERNELS=0's step); NAME@D: chain depth D, "
                        "NAME@B:D/B:D...: a depth schedule by running batch (--spec-depth's "
                        "form with / for its commas, e.g. eagle@1:6/8:5/32:4); a depth DxK is "
                        "a top-K tree (eagle@6x2, eagle@1:6x2/4:5/32:4) "
                        "(default: eagle with --drafter, else ngram)")
    p.add_argument("--batch-sizes", type=_int_list, default=[1, 4, 16, 32])
    p.add_argument("--temperature", type=float, default=0.9)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--min-new-tokens", type=int, default=0,
                   help="every response runs to at least this many tokens (stop tokens banned "
                        "until then; --min-new-tokens = --max-new-tokens fixes the length), so "
                        "the modes, whose sampled texts differ, compare at equal lengths: "
                        "with few prompts a short plain response carries its prefill over few "
                        "tokens and flatters SD's tokens/s. While the ban holds, SD verifies on "
                        "its general path (slower); --ignore-eos fixes lengths without it")
    p.add_argument("--ignore-eos", action="store_true",
                   help="no stop tokens: every response runs to --max-new-tokens (equal lengths, "
                        "as vLLM's benchmarks do) without --min-new-tokens' ban of the stop ids, "
                        "which sends verification to the general path (slower: the fast path "
                        "has no ban)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--tasks", default="arith,sort", help="built-in synthetic tasks for the prompts")
    src.add_argument("--prompts", default=None, help="prompts JSONL (prompt or prompt_token_ids)")
    p.add_argument("--spec-depth", default=DEFAULT_SPEC_DEPTH,
                   help="draft depth, or depths by running batch size BATCH:DEPTH,... (e.g. "
                        "1:6,8:4,32:3: depth 6 up to 1 running sequence, 4 up to 8, else 3; "
                        "a depth DxK drafts top-K trees there, e.g. 1:6x2,8:4,32:4; "
                        f"default {DEFAULT_SPEC_DEPTH}); a mode NAME@D (or NAME@B:D/B:D...) in --drafters "
                        "uses its own")
    p.add_argument("--spec-topk", type=int, default=1)
    p.add_argument("--spec-num-verify", type=int, default=None)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--continuous", action="store_true",
                   help="a timed run submits all --prompt-sets x B requests to one generate call "
                        "with at most B running at once (continuous batching, as an RL rollout "
                        "runs), instead of one generate call per set of B: a finished sequence's "
                        "place is taken by the next request, so the run does not wait, set by set, "
                        "for its slowest sequence")
    p.add_argument("--prompt-sets", type=int, default=1,
                   help="each timed run at batch size B generates for N disjoint sets of B "
                        "prompts one after the other and reports their totals (N x max batch "
                        "prompts are drawn): at batch 1 one prompt's text would otherwise "
                        "decide the acceptance and the speedup")
    p.add_argument("--min-sequences", type=int, default=32,
                   help="at least this many sequences per timed run: a batch size B runs "
                        "max(--prompt-sets, ceil(N / B)) sets (0: --prompt-sets everywhere). "
                        "Session 14: at batch 1 with 4 sets, one configuration's acceptance "
                        "length was 3.66 or 4.51 depending on which 4 responses were sampled")
    p.add_argument("--breakdown-tokens", type=int, default=64,
                   help="after the timed runs, one more run per (B, drafter) of this many new "
                        "tokens with the device synchronised around each phase of the SD step, "
                        "reported as ms per step per phase (0: skip)")
    p.add_argument("--profile-batch-sizes", type=_int_list, default=[],
                   help="also run each mode once more at these batch sizes under cProfile "
                        "(untimed; the top functions by own time go to the JSON)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="auto, cpu or cuda[:i] (default auto: cuda when available)")
    from megatron_tlt.rollout.weights import ENGINE_DTYPES
    p.add_argument("--dtype", default="auto", choices=("auto",) + ENGINE_DTYPES,
                   help="engine dtype (auto: the checkpoint's on a GPU, float32 on the CPU)")
    args = p.parse_args(extra)
    stray = sorted(set(args.profile_batch_sizes) - set(args.batch_sizes))
    if stray:  # profiled only inside the --batch-sizes loop: these were dropped silently
        raise TLTError(f"bench spec: --profile-batch-sizes {stray} are not among --batch-sizes "
                       f"{sorted(set(args.batch_sizes))}")
    if args.min_sequences < 0:
        raise TLTError(f"bench spec: --min-sequences must be >= 0, got {args.min_sequences}")
    if args.max_new_tokens < 1 or args.repeats < 1 or args.prompt_sets < 1 or args.temperature < 0:
        raise TLTError("bench spec: --max-new-tokens, --repeats and --prompt-sets must be >= 1, "
                       "--temperature >= 0")
    if not 0 <= args.min_new_tokens <= args.max_new_tokens:
        raise TLTError(f"bench spec: --min-new-tokens must be in [0, --max-new-tokens], got "
                       f"{args.min_new_tokens}")
    names = (args.drafters or ("eagle" if args.drafter else "ngram")).split(",")
    bad = [n for n in names if _mode(n) is None]
    if bad or not names or len(set(names)) != len(names):
        raise TLTError(f"bench spec: --drafters takes eagle, ngram, eagle-readback, eagle-ahead, "
                       f"eagle-noahead, eagle-vahead, eagle-torchprobs, eagle-onehot and/or "
                       f"eagle-torchlayer, "
                       f"each optionally @DEPTH, @DxK (a top-K tree) or @B:D/B:D... (e.g. eagle@3, eagle@6x2, "
                       f"eagle@1:6/32:4), once each, "
                       f"got {args.drafters!r}")
    if any(_mode(n)[0] != "ngram" for n in names) and not args.drafter:
        raise TLTError("bench spec: --drafters eagle needs --drafter DIR")
    from megatron_tlt.spec.decode import depth_policy
    depth_policy(args.spec_depth, topk=args.spec_topk,  # ConfigError now, not after loading the model
                 num_verify_tokens=args.spec_num_verify)
    args.drafter_names = names
    return args


def _mode(name: str) -> tuple[str, str | None] | None:
    """(drafter kind, depth or depth schedule override, or None) of a --drafters entry;
    None when invalid."""
    kind, _, depth = name.partition("@")
    if kind not in ("eagle", "ngram", "eagle-readback", "eagle-ahead", "eagle-noahead", "eagle-vahead",
                    "eagle-torchprobs", "eagle-onehot", "eagle-torchlayer"):
        return None
    if not depth:
        return kind, None
    # D, DxK or a schedule (B:D pairs separated by /: commas separate the modes)
    from megatron_tlt.spec.decode import depth_policy
    schedule = depth.replace("/", ",")
    try:
        depth_policy(schedule)  # the parse and every strategy's own checks
    except TLTError:
        return None
    return kind, schedule


def _prompts(args, tokenizer, n: int) -> list[tuple[str, list[int]]]:
    from megatron_tlt.spec.train_drafter import prompt_token_ids
    out = prompt_token_ids(path=args.prompts, tasks=args.tasks, n=n, seed=args.seed,
                           tokenizer=tokenizer, model_dir=args.model, flag="--prompts")
    if len(out) < n:
        raise TLTError(f"bench spec: {n} prompts needed (batch x sets: --prompt-sets, --min-sequences), "
                       f"the source has {len(out)}")
    return [(str(pid), ids) for pid, ids in out[:n]]


# SpecDecoder's step counts among _counters: reported per run, not as events
_STEP_COUNTS = ("deferred_steps", "ahead_steps", "adopted_steps", "verify_ahead_steps",
                "verify_adopted_steps", "tree_steps", "eager_draft_steps")


def _counters(engine, decoder) -> dict[str, int]:
    """Counters of the work that should happen once (graph captures, kernel-planner
    timings), to show that none of it fell into a timed run."""
    out: dict[str, int] = {}
    r = engine.decode_runner
    if r is not None:
        out.update(decode_captures=r.num_captures, sample_graphs=r.num_sample_graphs,
                   verify_graphs=r.num_verify_graphs,
                   planner_timings=r.model.planner.num_tuned)
    if decoder is not None:
        out["deferred_steps"] = decoder.num_deferred
        out["ahead_steps"] = decoder.num_ahead
        out["adopted_steps"] = decoder.num_adopted
        out["verify_ahead_steps"] = decoder.num_verify_ahead
        out["verify_adopted_steps"] = decoder.num_verify_adopted
        m = decoder._math
        if m is not None:
            out["verify_math_captures"] = m.num_captures
        g = getattr(decoder.drafter, "_chain_graphs", None)
        if g is not None:
            out.update(draft_captures=g.num_captures, draft_invalidations=g.num_invalidations)
        t = getattr(decoder.drafter, "_tree_graphs", None)
        if t is not None:
            out.update(tree_captures=t.num_captures, tree_invalidations=t.num_invalidations)
        out["tree_steps"] = t.num_steps if t is not None else 0
        out["eager_draft_steps"] = getattr(decoder.drafter, "num_eager_steps", 0)
    return out


def _run(engine, decoder, prompts, args, tag: str, clock: _Clock,
         max_new_tokens: int | None = None, profile: bool = False) -> dict:
    """One timed run: `prompts` is a list of batches [(id, ids), ...], generated one after
    the other (--prompt-sets) and reported as their totals."""
    from megatron_tlt.rollout import Request, SamplingParams
    new = max_new_tokens or args.max_new_tokens
    params = SamplingParams(temperature=args.temperature, seed=args.seed, max_new_tokens=new,
                            min_new_tokens=min(args.min_new_tokens, new))
    engine.spec_decoder = decoder
    if decoder is not None:
        decoder.metrics.reset()
    before = _counters(engine, decoder)
    capture0 = _capture_seconds(engine, decoder)
    prof = cProfile.Profile() if profile else None
    wall, results, steps, running = 0.0, [], 0, 0
    first_steps, later_steps = [], []  # each call's first step (the prefill); the rest
    tail_steps, tail_wall = 0, 0.0  # steps with fewer sequences running than the call had
    gc0 = gc.get_stats()[2]["collections"]
    batches, limit = prompts, None
    if getattr(args, "continuous", False) and len(prompts) > 1:
        # one generate call, at most one set's worth of sequences running at once
        batches, limit = [[p for batch in prompts for p in batch]], max(len(b) for b in prompts)
    sched = engine.scheduler
    full = sched.max_num_seqs
    try:
        if limit is not None:
            sched.max_num_seqs = min(limit, full)
        for batch in batches:
            reqs = [Request(prompt_id=f"{tag}-{pid}", prompt_token_ids=ids, sampling_params=params)
                    for pid, ids in batch]
            clock.sync()
            t0 = time.perf_counter()
            if prof is not None:
                prof.enable()
            results += engine.generate(reqs)
            if prof is not None:
                prof.disable()
            clock.sync()
            wall += time.perf_counter() - t0
            steps += len(engine.step_log)
            running = max([running] + [n for n, _ in engine.step_log])
            if engine.step_log:
                first_steps.append(engine.step_log[0][1])
                later_steps.extend(w for _, w in engine.step_log[1:])
                full_n = max(n for n, _ in engine.step_log)
                tail = [w for n, w in engine.step_log if n < full_n]
                tail_steps += len(tail)
                tail_wall += sum(tail)
    finally:
        sched.max_num_seqs = full
    errors = [r.error for r in results if r.error]
    if errors:
        raise TLTError(f"bench spec: a request failed: {errors[0]}")
    tokens = sum(len(r.token_ids) for r in results)
    after = _counters(engine, decoder)
    row = {"_tokens": [list(r.token_ids) for r in results],  # compared across modes, then dropped
           "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall if wall > 0 else None,
           "mean_len": tokens / len(results), "max_len": max(len(r.token_ids) for r in results),
           "steps": steps, "ms_per_step": 1e3 * wall / max(steps, 1),
           "max_running": running,  # most sequences in one engine step
           # wall of each generate call's first step (the prompts' prefill, its sample and
           # admission) and the median wall of the steps after it (host-timed, unsynchronised)
           "first_step_ms": 1e3 * statistics.mean(first_steps) if first_steps else None,
           "median_step_ms": 1e3 * statistics.median(later_steps) if later_steps else None,
           "first_steps_ms": [round(1e3 * w, 3) for w in first_steps],
           # Python's full (generation 2) garbage collections during the run: each walks
           # every live object, milliseconds in a process holding many graphs and tensors
           "gc_full_collections": gc.get_stats()[2]["collections"] - gc0,
           "generate_calls": len(batches),
           # The tail: steps after the first sequence of a call finished (fewer running
           # than the call's most), their count and host-timed wall. A static batch waits
           # for its slowest sequence, and with speculative decoding the sequences'
           # acceptance differs, so the batch thins out long before the last step.
           "tail_steps": tail_steps, "tail_wall_s": tail_wall,
           # Graph captures, recaptures and kernel-planner timings during this run: each
           # costs milliseconds to seconds of wall time (none expected after the warm-up).
           "events": {k: after[k] - before.get(k, 0) for k in after
                      if k not in _STEP_COUNTS and after[k] != before.get(k, 0)},
           # wall seconds of those captures inside this run (part of wall_s)
           "capture_s": _capture_seconds(engine, decoder) - capture0}
    if prof is not None:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        row["cprofile"] = text.getvalue()
    if decoder is not None:
        t = decoder.metrics.summary()["total"]
        row.update(acceptance_rate=t["acceptance_rate"], acceptance_length=t["acceptance_length"],
                   num_drafts=t["num_drafts"], drafted=t["drafted"], fallbacks=t["fallbacks"],
                   **{k: after[k] - before[k] for k in _STEP_COUNTS})
        row["sequence_acceptance_length"] = _spread([
            1.0 + r.spec_stats.get("accepted", 0) / r.spec_stats["num_drafts"]
            for r in results if r.spec_stats.get("num_drafts")])
    return row


def _spread(xs: list[float]) -> dict | None:
    """min / median / max of a per-sequence figure (None when no sequence has one)."""
    if not xs:
        return None
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def _capture_seconds(engine, decoder) -> float:
    """Wall seconds spent so far capturing CUDA graphs: the engine's decode and verify
    graphs and, with a decoder, its verification-math and drafting graphs."""
    r = engine.decode_runner
    t = r.capture_s if r is not None else 0.0
    return t + (decoder.capture_seconds() if decoder is not None else 0.0)


def _verify_graph_rows(engine) -> int | None:
    """Largest verify served from a CUDA graph (None: no decode runner, i.e. no Triton)."""
    if engine.decode_runner is None:
        return None
    from megatron_tlt.rollout.cuda_graphs import MAX_VERIFY_GRAPH_ROWS  # needs triton
    return MAX_VERIFY_GRAPH_ROWS


def _breakdown(engine, decoder, prompts, args, tag: str, clock: _Clock) -> dict:
    """Wall ms per engine step in each phase of the SD step (SpecDecoder.timings: the
    device is synchronised around every phase, so the sum exceeds an untimed step)."""
    decoder.timings = {}
    try:
        row = _run(engine, decoder, prompts, args, tag, clock,
                   max_new_tokens=min(args.breakdown_tokens, args.max_new_tokens))
        steps = sum(b.steps for b in decoder.metrics.buckets.values())
        timings = decoder.timings
    finally:
        decoder.timings = None
    return {"tokens": row["tokens"], "steps": steps, "wall_s": row["wall_s"],
            "ms_per_step": {k: 1e3 * v / max(steps, 1) for k, v in timings.items()},
            "wall_ms_per_step": 1e3 * row["wall_s"] / max(steps, 1)}


def main(args: argparse.Namespace) -> int:
    from megatron_tlt.data.tokenizer import load_tokenizer
    from megatron_tlt.rollout.cli import _eos_ids, _spec_decoder
    from megatron_tlt.rollout.engine import RolloutEngine, fast_path_options
    from megatron_tlt.models.arch import ModelArch
    from megatron_tlt.rollout.weights import engine_dtype, load_hf, resolve_device
    from megatron_tlt.spec.decode import depth_policy

    opts = parse_args(list(getattr(args, "extra", []) or []))
    if getattr(args, "json", None):  # before the model loads and the runs, not at the first save
        from megatron_tlt.atomic_io import check_output_file
        check_output_file(args.json)
    device = resolve_device(opts.device)
    start = time.perf_counter()
    arch, weights = load_hf(opts.model, device=device,
                            dtype=engine_dtype(ModelArch.from_hf_dir(opts.model), device, opts.dtype))
    try:
        tokenizer = load_tokenizer(opts.model)
    except TLTError:
        tokenizer = None
    max_b = max(opts.batch_sizes)

    def num_sets(b: int) -> int:
        return max(opts.prompt_sets, -(-opts.min_sequences // b))
    prompts = _prompts(opts, tokenizer, max(b * num_sets(b) for b in opts.batch_sizes))

    def sets(b: int) -> list[list]:
        """The disjoint batches of b prompts a timed run generates (num_sets(b) of them)."""
        return [prompts[j * b:(j + 1) * b] for j in range(num_sets(b))]
    def policy(name: str):
        depth = _mode(name)[1]
        return depth_policy(opts.spec_depth if depth is None else depth, topk=opts.spec_topk,
                            num_verify_tokens=opts.spec_num_verify)
    policies = {name: policy(name) for name in opts.drafter_names}
    strategies = [st for pol in policies.values() for st in pol.strategies]
    most_nodes = max(st.num_draft_nodes for st in strategies)
    deepest = max(st.depth for st in strategies)
    longest = max(len(ids) for _, ids in prompts) + opts.max_new_tokens + most_nodes + 1
    max_len = min(arch.max_position_embeddings, longest)
    bs = 16
    engine = RolloutEngine(arch, weights, max_num_seqs=max_b, block_size=bs,
                           num_blocks=max_b * -(-longest // bs) + 8, dtype=weights.dtype,
                           device=device, max_model_len=max_len,
                           eos_token_ids=() if opts.ignore_eos else _eos_ids(opts.model, tokenizer),
                           seed=opts.seed,
                           **fast_path_options(device))
    decoders = {}
    for name in opts.drafter_names:
        kind = _mode(name)[0]
        dec = decoders[name] = _spec_decoder(argparse.Namespace(drafter=opts.drafter), kind.split("-")[0],
                                             policies[name], arch, weights)
        if kind == "eagle-readback":
            dec.defer_max_batch = 0
        if kind == "eagle-torchprobs":
            dec.fused_verify_probs = False
        if kind == "eagle-torchlayer":
            dec.drafter.drafter.kernel_layers = False
        if kind == "eagle-onehot":
            dec.drafter.one_hot_chains = True
        if kind in ("eagle-ahead", "eagle-noahead", "eagle-vahead"):  # (plain eagle follows the environment)
            dec.draft_ahead = kind != "eagle-noahead"  # the next chain queued before the verification is read
            dec.verify_ahead = kind == "eagle-vahead"  # and the next verify forward after it
    for dec in decoders.values():
        kv = getattr(dec.drafter, "kv", None)
        if kv is not None:
            # The drafter's KV slots sized for the longest sequence of any prompt set up
            # front: growing them mid-run reallocates the buffers its graphs read, and every
            # drafting graph is captured again inside a timed run.
            from megatron_tlt.spec.drafter_kv import QUERY_TILE
            kv.ensure_capacity(longest + QUERY_TILE + deepest)
    clock = _Clock(torch.device(device))
    # Warm-up: first one full-length run per drafter at the largest batch, so the
    # drafter's KV slots and capacity reach their final size (growing them invalidates
    # the drafting graphs); then every batch size: graphs, Triton kernels, the linear
    # planner's row-count buckets (a verify runs B x Q rows), the verify extension.
    # None of it in the timings.
    for mode in opts.drafter_names:
        _run(engine, decoders[mode], [prompts[:max_b]], opts, f"warmup-full-{mode}", clock)
    for b in sorted(set(opts.batch_sizes)):
        for mode in [None] + opts.drafter_names:
            _run(engine, decoders.get(mode), [prompts[:b]], opts, f"warmup-b{b}-{mode}", clock,
                 max_new_tokens=min(16, opts.max_new_tokens))
        # Every prompt set's prefill once (two new tokens): a prefill through the fused
        # kernels meets Triton specialisations per row count (multiples of 16 or not, ...)
        # that one set does not cover; each compiles once, for ~0.1-1 s, which fell into
        # the first mode's timed run (session 15: the plain batch-1 run's first steps
        # averaged 130.8 ms against the SD mode's 19.7 ms right after it).
        _run(engine, None, sets(b), opts, f"warmup-prefill-b{b}", clock,
             max_new_tokens=min(2, opts.max_new_tokens))
    # Every verify shape a timed run can meet, captured now: a chain cut short near
    # max_new_tokens verifies fewer rows, which the short warm-ups may not have met.
    engine.capture_verify_graphs(max_b, most_nodes + 1)
    def save(rows: list[dict], complete: bool) -> None:
        """The JSON report; written after every batch size too, so a cut run keeps what
        it measured ("complete": false)."""
        report = {"command": _command(args), "git_revision": _git_revision(), "torch": torch.__version__,
                  "triton": _version("triton"),
                  "device": (torch.cuda.get_device_name(torch.device(device))
                             if device.startswith("cuda") else "cpu"),
                  "model": os.path.abspath(opts.model), "drafter": opts.drafter,
                  "settings": {k: v for k, v in vars(opts).items() if k not in ("drafter_names",)},
                  "engine": {"dtype": str(weights.dtype).replace("torch.", ""),
                             "attention_backend": "triton" if engine.decode_runner is not None else "torch",
                             "cuda_graphs": bool(fast_path_options(device).get("cuda_graphs")),
                             "verify_graph_rows": _verify_graph_rows(engine),
                             # torch's intra-op CPU threads (rollout.host.limit_host_threads)
                             # and the kernel-plan file every process of a sweep shares
                             "host_threads": torch.get_num_threads(),
                             "linear_plans": os.environ.get("MEGATRON_TLT_LINEAR_PLANS") or None},
                  "definitions": {
                      "tokens_per_s": "generated tokens / wall seconds of engine.generate (median of repeats); "
                                      "per prompt set unless --continuous (all sets in one call, at most "
                                      "the batch size running)",
                      "speedup": "SD tokens_per_s / off tokens_per_s at the same batch size, same engine",
                      "noise": "every mode's run of one batch size and repeat draws from the same "
                               "per-request noise streams (prompt ids name batch, repeat and prompt, not "
                               "the mode): modes that differ only in how a step is scheduled (eagle, "
                               "-ahead, -noahead, -vahead, -readback at one depth) emit the same tokens, "
                               "so their rows differ in step cost alone (eagle-torchprobs too, but for a "
                               "decision its other float32 roundings may flip: rare)",
                      "acceptance_length": "tokens per verification (accepted drafts + 1), vLLM's definition: "
                                           "drafts accepted and then cut by a stop or max_new_tokens count; "
                                           "the mean over repeats that verified anything (null: none did)",
                      "tokens_equal_plain": "--temperature 0 only: the share of (repeat, request) pairs whose "
                                            "tokens equal plain decoding's (lossless: 1.0; below it a warning)",
                      "breakdown": "a separate run of --breakdown-tokens new tokens with the device synchronised "
                                   "around each phase of the SD step (draft, plain, verify_forward, verify); "
                                   "ms_per_step = phase wall ms / engine steps; not part of tokens_per_s",
                      "tail_steps": "engine steps of a generate call with fewer sequences running than its "
                                    "most (after its first sequence finished); tail_wall_s their host-timed wall; "
                                    "tail_wall_share (per row): tail_wall_s / wall_s of the first repeat",
                      "sequence_acceptance_length": "min / median / max over the sequences of their own "
                                                    "acceptance length (accepted drafts / verifications + 1)",
                  },
                  "results": rows, "complete": complete, "wall_s": time.perf_counter() - start}
        if getattr(args, "json", None):
            from megatron_tlt.atomic_io import write_json
            write_json(args.json, report, default=str)
            if complete:
                print(f"wrote {args.json}")

    rows = []
    for b in sorted(set(opts.batch_sizes)):
        runs: dict[str, list[dict]] = {m: [] for m in ["off"] + opts.drafter_names}
        for r in range(opts.repeats):
            order = list(runs) if r % 2 == 0 else list(reversed(runs))
            for mode in order:
                # one tag for every mode: the same noise streams (see "noise" above)
                runs[mode].append(_run(engine, decoders.get(mode), sets(b), opts, f"b{b}-r{r}", clock))
        off_tps = statistics.median(x["tokens_per_s"] for x in runs["off"])
        off_len = statistics.mean(x["mean_len"] for x in runs["off"])
        for mode, xs in runs.items():
            x0 = xs[0]
            row = {"batch": b, "mode": mode, "repeats": xs,
                   "tokens_per_s": statistics.median(x["tokens_per_s"] for x in xs),
                   "mean_len": statistics.mean(x["mean_len"] for x in xs),
                   "tail_wall_share": x0["tail_wall_s"] / x0["wall_s"] if x0["wall_s"] > 0 else None}
            for k in ("first_step_ms", "median_step_ms"):
                vals = [x[k] for x in xs if x.get(k) is not None]
                row[k] = statistics.median(vals) if vals else None
            if mode != "off" and opts.temperature == 0:
                # greedy: lossless means the same tokens as plain decoding, request by request
                same = [a == o for x, xo in zip(xs, runs["off"]) for a, o in zip(x["_tokens"], xo["_tokens"])]
                row["tokens_equal_plain"] = sum(same) / len(same)
            if mode != "off":
                for k in ("acceptance_length", "acceptance_rate"):  # repeats that verified anything
                    vals = [x[k] for x in xs if x[k] is not None]
                    row[k] = statistics.mean(vals) if vals else None
                row["speedup"] = row["tokens_per_s"] / off_tps if off_tps else None
                row["length_mismatch"] = bool(off_len and abs(row["mean_len"] / off_len - 1) > 0.25)
            rows.append(row)
            length = "n/a" if row.get("acceptance_length") is None else f"{row['acceptance_length']:.2f}"
            speedup = "n/a" if row.get("speedup") is None else f"{row['speedup']:.2f}x"
            acc = f" acceptance length {length}, speedup {speedup}" if mode != "off" else ""
            steps = (f"; first step {row['first_step_ms']:.1f} ms, then {row['median_step_ms']:.2f} ms "
                     f"per step (median)" if row["median_step_ms"] is not None else "")
            tail = (f"; tail {x0['tail_steps']} of {x0['steps']} steps, {100 * row['tail_wall_share']:.0f}% "
                    f"of the wall" if b > 1 and row["tail_wall_share"] is not None else "")
            spread = x0.get("sequence_acceptance_length")
            if spread:
                tail += (f"; sequences' acceptance length {spread['min']:.2f} / {spread['median']:.2f} / "
                         f"{spread['max']:.2f} (min / median / max)")
            print(f"B={b:>3} {mode:>5}: {row['tokens_per_s']:.1f} tokens/s, mean length "
                  f"{row['mean_len']:.1f}{acc}{steps}{tail}", flush=True)
            if row.get("tokens_equal_plain", 1.0) < 1.0:
                print(f"B={b:>3} {mode:>5}: WARNING greedy tokens differ from plain decoding in "
                      f"{100 * (1 - row['tokens_equal_plain']):.0f}% of the requests (not lossless)",
                      flush=True)
            if row.get("length_mismatch"):
                print(f"B={b:>3} {mode:>5}: WARNING mean length {row['mean_len']:.1f} vs plain "
                      f"{off_len:.1f}: tokens/s carry prefill differently, the speedup is not "
                      f"comparable (use --ignore-eos)", flush=True)
        for xs in runs.values():
            for x in xs:
                x.pop("_tokens")
        if b in opts.profile_batch_sizes:
            for mode in runs:
                row = next(r for r in rows if r["batch"] == b and r["mode"] == mode)
                row["profile"] = _run(engine, decoders.get(mode), [prompts[:b]], opts,
                                      f"b{b}-profile-{mode}", clock, profile=True)
                row["profile"].pop("_tokens", None)
                print(f"B={b:>3} {mode:>5} under cProfile: {row['profile']['ms_per_step']:.2f} ms per "
                      f"engine step", flush=True)
        if opts.breakdown_tokens > 0:
            for mode in opts.drafter_names:
                row = next(r for r in rows if r["batch"] == b and r["mode"] == mode)
                row["breakdown"] = _breakdown(engine, decoders[mode], [prompts[:b]], opts,
                                              f"b{b}-breakdown-{mode}", clock)
                parts = ", ".join(f"{k} {v:.2f}" for k, v in row["breakdown"]["ms_per_step"].items())
                print(f"B={b:>3} {mode:>5} ms per SD step: {parts}", flush=True)
        save(rows, complete=False)
    save(rows, complete=True)
    return 0
