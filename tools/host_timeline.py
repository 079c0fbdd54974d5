"""Where the host's time goes inside an engine step, without adding any synchronisation:
wraps the step's functions with perf_counter stamps (inclusive wall per call) and counts
the time the host spends blocked in device-to-host reads (`Tensor.cpu`, `.tolist`,
`.item`), on a random-weight model of a benchmark shape, plain decoding and EAGLE
(random one-layer drafter, chain depth 4, deferred drafts where the decoder takes them),
and EAGLE with the draft-ahead (`eagle-ahead`: SpecDecoder.draft_ahead; `ahead_adopted`:
draft-aheads queued and adopted over the three runs of that mode; `deferred_steps`: steps
verified on drafts left on the device, same runs). `--modes` adds `eagle-defer` and
`eagle-defer-ahead`: the same with deferred drafts at every batch size (the decoder's
limit, DEFER_MAX_BATCH, was 16 before session 16: at batch 32 `eagle-ahead` was then plain
`eagle`), and `eagle-defer-vahead`: that with the verify-ahead (SpecDecoder.verify_ahead;
`verify_ahead_adopted`: queued and used by the next step).

    python tools/host_timeline.py --shape 1.5b --batch-sizes 1,32 [--json FILE]

Per batch size and mode: the wall ms per engine step of a run without the wrappers
(`unwrapped_ms_per_step`: the number to compare), then, over a wrapped run (the wrappers
add their own cost), per wrapped function the calls per step and the inclusive host ms
per step. `blocked_in_reads` is host time waiting
for the device in reads, `blocked_in_event_waits` in torch.cuda.Event.synchronize (the
draft-ahead's step waits for its results' copy there, not in a read; the runners wait
for their pinned staging buffers there); wall minus both is the host's own work, which
the device waits for whenever it is not overlapped with queued kernels (after a blocking read nothing is queued, so
the work between that read and the next launch is on the critical path:
`after_sync_until_next_launch`). Random weights: acceptance is meaningless; the step's
shape (full-depth chains) is what is measured.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
import json
import time
from collections import defaultdict

import torch

from megatron_tlt.bench import SHAPES
from megatron_tlt.rollout.request import Request
from megatron_tlt.rollout.sampling import SamplingParams

WRAPPED = [
    "megatron_tlt.rollout.engine:RolloutEngine.step",
    "megatron_tlt.rollout.scheduler:Scheduler.schedule",
    "megatron_tlt.rollout.engine:RolloutEngine.forward_pending",
    "megatron_tlt.rollout.engine:RolloutEngine.sample_and_append",
    "megatron_tlt.rollout.engine:RolloutEngine.verify_forward_output",
    "megatron_tlt.rollout.engine:RolloutEngine._metadata",
    "megatron_tlt.rollout.engine:RolloutEngine.append_token",
    "megatron_tlt.rollout.engine:RolloutEngine.commit_kv",
    "megatron_tlt.rollout.cuda_graphs:DecodeRunner.verify",
    "megatron_tlt.rollout.cuda_graphs:DecodeRunner.decode",
    "megatron_tlt.spec.decode:SpecDecoder.step",
    "megatron_tlt.spec.decode:SpecDecoder._deferred",
    "megatron_tlt.spec.decode:SpecDecoder._verify",
    "megatron_tlt.spec.decode:SpecDecoder._track",
    "megatron_tlt.spec.eagle:EagleProposer.launch",
    "megatron_tlt.spec.eagle:EagleProposer.observe",
    "megatron_tlt.spec.eagle:EagleProposer._catch_up",
    "megatron_tlt.spec.eagle_graph:ChainGraphs.launch",
    "megatron_tlt.spec.eagle_graph:ChainGraphs.setting",
    "megatron_tlt.spec.eagle_graph:ChainGraphs._run",
    "megatron_tlt.spec.eagle_graph:ChainLaunch.placeholder_trees",
    "megatron_tlt.spec.eagle_graph:ChainLaunch.advance_draws",
    "megatron_tlt.spec.eagle_graph:ChainLaunch.queue_failures",
    "megatron_tlt.spec.eagle_graph:ChainLaunch.settle",
    "megatron_tlt.spec.eagle_graph:ChainGraphs.launch_ahead",
    "megatron_tlt.spec.eagle:EagleProposer.adopt",
    "megatron_tlt.spec.verify_math:VerifyMath.plan",
    "megatron_tlt.spec.verify_math:VerifyMath.run",
    "megatron_tlt.spec.verify_math:VerifyMath._load",
    "megatron_tlt.rollout.engine:RolloutEngine.verify_chains_output",
    "megatron_tlt.rollout.cuda_graphs:DecodeRunner.verify_rows",
    "megatron_tlt.rollout.cuda_graphs:DecodeRunner.verify_ahead",
    "megatron_tlt.rollout.engine:RolloutEngine.adopt_verify_ahead",
    "torch.cuda.graphs:CUDAGraph.replay",
]
READS = ("cpu", "tolist", "item")
MODES = ("off", "eagle", "eagle-ahead", "eagle-defer", "eagle-defer-ahead", "eagle-defer-vahead")


class Timeline:
    def __init__(self):
        self.incl = defaultdict(float)
        self.calls = defaultdict(int)
        self.blocked = 0.0
        self.event_wait = 0.0  # host time in torch.cuda.Event.synchronize
        self.last_read_end = None
        self.after_sync = 0.0  # host time from a blocking read's (or wait's) end to the next graph launch
        self.undo = []
        self.gc_s = [0.0, 0.0, 0.0]  # seconds in garbage collection, per generation
        self.gc_n = [0, 0, 0]
        self._gc_t0 = None

    def reset(self):
        self.incl.clear()
        self.calls.clear()
        self.blocked = self.after_sync = self.event_wait = 0.0
        self.last_read_end = None
        self.gc_s = [0.0, 0.0, 0.0]
        self.gc_n = [0, 0, 0]

    def _gc(self, phase, info):
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0 is not None:
            g = info["generation"]
            self.gc_s[g] += time.perf_counter() - self._gc_t0
            self.gc_n[g] += 1
            self._gc_t0 = None

    def install(self):
        gc.callbacks.append(self._gc)
        for spec in WRAPPED:
            mod, qual = spec.split(":")
            cls_name, meth = qual.split(".")
            try:
                cls = getattr(importlib.import_module(mod), cls_name)
            except (ImportError, AttributeError):
                continue
            orig = cls.__dict__.get(meth)
            if orig is None:
                continue
            is_static = isinstance(orig, staticmethod)
            is_class = isinstance(orig, classmethod)
            fn = orig.__func__ if (is_static or is_class) else orig
            name = f"{cls_name}.{meth}"
            wrapper = self._wrap(fn, name, launch=name == "CUDAGraph.replay")
            new = staticmethod(wrapper) if is_static else classmethod(wrapper) if is_class else wrapper
            setattr(cls, meth, new)
            self.undo.append((cls, meth, orig))
        for meth in READS:
            orig = getattr(torch.Tensor, meth)
            setattr(torch.Tensor, meth, self._wrap_wait(orig, "blocked", "device_reads",
                                                        lambda t: t.device.type == "cuda"))
            self.undo.append((torch.Tensor, meth, orig))
        if torch.cuda.is_available():
            orig = torch.cuda.Event.synchronize
            setattr(torch.cuda.Event, "synchronize", self._wrap_wait(orig, "event_wait", "event_waits"))
            self.undo.append((torch.cuda.Event, "synchronize", orig))

    def uninstall(self):
        if self._gc in gc.callbacks:
            gc.callbacks.remove(self._gc)
        for cls, meth, orig in reversed(self.undo):
            setattr(cls, meth, orig)
        self.undo.clear()

    def _wrap(self, fn, name, launch=False):
        tl = self

        @functools.wraps(fn)
        def w(*a, **k):
            t0 = time.perf_counter()
            if launch and tl.last_read_end is not None:
                tl.after_sync += t0 - tl.last_read_end
                tl.last_read_end = None
            try:
                return fn(*a, **k)
            finally:
                tl.incl[name] += time.perf_counter() - t0
                tl.calls[name] += 1
        return w

    def _wrap_wait(self, orig, total: str, calls: str, on_device=lambda self_: True):
        """orig wrapped to add the host's time in it to self.<total> (calls counted under
        `calls`) where on_device(self_) holds; its end starts the read -> next launch
        interval (nothing of the host's is queued behind a finished wait)."""
        tl = self

        def w(self_, *a, **k):
            counted = on_device(self_)
            t0 = time.perf_counter()
            try:
                return orig(self_, *a, **k)
            finally:
                if counted:
                    t1 = time.perf_counter()
                    setattr(tl, total, getattr(tl, total) + t1 - t0)
                    tl.last_read_end = t1
                    tl.calls[calls] += 1
        return w


def _requests(tag, prompts, temperature, new):
    return [Request(prompt_id=f"{tag}-{i}", prompt_token_ids=p,
                    sampling_params=SamplingParams(temperature=temperature, max_new_tokens=new,
                                                   min_new_tokens=new, seed=0))
            for i, p in enumerate(prompts)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--temperature", type=float, default=0.9)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=96)
    p.add_argument("--json", default=None)
    p.add_argument("--modes", default="off,eagle,eagle-ahead",
                   help="comma list of off, eagle, eagle-ahead, eagle-defer, eagle-defer-ahead, "
                        "eagle-defer-vahead (-defer: drafts verified on the device at every batch size, "
                        "SpecDecoder.defer_max_batch unbounded; the others keep the decoder's "
                        "limit, DEFER_MAX_BATCH or MEGATRON_TLT_SPEC_DEFER; -vahead: the "
                        "draft-ahead and the verify-ahead)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op CPU threads (MEGATRON_TLT_HOST_THREADS for the engine, "
                        "which otherwise sets one on a GPU)")
    a = p.parse_args()
    if a.threads:
        import os
        os.environ["MEGATRON_TLT_HOST_THREADS"] = str(a.threads)
        torch.set_num_threads(a.threads)
    from profile_generate import random_spec_setup  # tools/ is the script's directory

    sizes = [int(x) for x in a.batch_sizes.split(",")]
    modes = a.modes.split(",")
    bad = sorted(set(modes) - set(MODES))
    if bad:
        p.error(f"unknown --modes {bad}; choose from {list(MODES)}")
    engine, decoder, prompts = random_spec_setup(a.shape, max(sizes), a.prompt_len, a.new)
    dev = engine.device
    default_defer = decoder.defer_max_batch
    tl = Timeline()
    report = {"shape": a.shape, "temperature": a.temperature, "device": str(dev),
              "torch_threads": torch.get_num_threads(), "results": []}
    for b in sizes:
        for mode in modes:
            dec = None if mode == "off" else decoder
            engine.spec_decoder = dec
            if dec is not None:  # -ahead: SpecDecoder's draft-ahead (MEGATRON_TLT_SPEC_AHEAD)
                dec.draft_ahead = mode.endswith("ahead")  # -vahead: the verify-ahead too
                dec.verify_ahead = mode.endswith("-vahead")
                n_vahead, n_vadopted = dec.num_verify_ahead, dec.num_verify_adopted
                dec.defer_max_batch = 1 << 30 if "-defer" in mode else default_defer
                n_ahead, n_adopted = dec.num_ahead, dec.num_adopted
                n_deferred = dec.num_deferred
            engine.generate(_requests(f"warm-{mode}-{b}", prompts[:b], a.temperature, a.new))
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()  # unwrapped first: the step's real wall
            engine.generate(_requests(f"u-{mode}-{b}", prompts[:b], a.temperature, a.new))
            if dev.type == "cuda":
                torch.cuda.synchronize()
            plain_wall = time.perf_counter() - t0
            plain_steps = max(len(engine.step_log), 1)
            tl.reset()
            tl.install()
            try:
                t0 = time.perf_counter()
                engine.generate(_requests(f"t-{mode}-{b}", prompts[:b], a.temperature, a.new))
                wall = time.perf_counter() - t0
            finally:
                tl.uninstall()
            steps = max(tl.calls.get("RolloutEngine.step", 1), 1)
            row = {"batch": b, "mode": mode, "engine_steps": steps,
                   "unwrapped_ms_per_step": 1e3 * plain_wall / plain_steps,
                   "wall_ms_per_step": 1e3 * wall / steps,
                   "blocked_in_reads_ms_per_step": 1e3 * tl.blocked / steps,
                   "blocked_in_event_waits_ms_per_step": 1e3 * tl.event_wait / steps,
                   "after_sync_until_next_launch_ms_per_step": 1e3 * tl.after_sync / steps,
                   "deferred_steps": None if dec is None else dec.num_deferred - n_deferred,
                   "ahead_adopted": None if dec is None else [dec.num_ahead - n_ahead, dec.num_adopted - n_adopted],
                   "verify_ahead_adopted": None if dec is None else [dec.num_verify_ahead - n_vahead,
                                                                     dec.num_verify_adopted - n_vadopted],
                   "gc_collections": list(tl.gc_n),
                   "gc_ms_per_step": 1e3 * sum(tl.gc_s) / steps,
                   "functions": {k: {"calls_per_step": round(tl.calls[k] / steps, 2),
                                     "ms_per_step": round(1e3 * v / steps, 4)}
                                 for k, v in sorted(tl.incl.items(), key=lambda kv: -kv[1])}}
            row["functions"]["device_reads"] = {"calls_per_step": round(tl.calls["device_reads"] / steps, 2)}
            row["functions"]["event_waits"] = {"calls_per_step": round(tl.calls["event_waits"] / steps, 2)}
            report["results"].append(row)
            print(f"B={b} {mode}: {row['unwrapped_ms_per_step']:.3f} ms/step unwrapped; wrapped "
                  f"{row['wall_ms_per_step']:.3f} ms/step over {steps} steps, "
                  f"blocked in reads {row['blocked_in_reads_ms_per_step']:.3f}, "
                  f"in event waits {row['blocked_in_event_waits_ms_per_step']:.3f}, "
                  f"read -> next graph launch {row['after_sync_until_next_launch_ms_per_step']:.3f}, "
                  f"gc {row['gc_ms_per_step']:.3f} ({tl.gc_n} collections per generation)")
            for k, v in row["functions"].items():
                if "ms_per_step" in v:
                    print(f"    {k:42s} {v['calls_per_step']:7.2f} calls  {v['ms_per_step']:8.4f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
