"""Where the device waits for the host in a speculative-decoding run: reads a chrome trace
written by `tools/profile_generate.py --trace-dir` (torch.profiler, CUDA) and prints, per
SD step phase (the `spec/<phase>` ranges SpecDecoder marks under the profiler) and for the
gaps between phases, the host wall time and how much of it the device was busy.

    python tools/trace_gaps.py TRACE.json.gz [--json FILE]

A step runs from one `spec/draft` range to the next. Device busy = the union of kernel,
memcpy and memset intervals (all streams). Work launched in one phase may run in the next
(nothing synchronises between phases unless SpecDecoder.timings is set), so the device
time of a window is what ran in it, not what it launched: idle device time inside a
window is host work the device waited for.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _busy(merged: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Device-busy microseconds within [lo, hi) (merged is sorted and disjoint)."""
    t = 0.0
    for a, b in merged:
        if b <= lo:
            continue
        if a >= hi:
            break
        t += min(b, hi) - max(a, lo)
    return t


def summarise(events: list[dict]) -> dict:
    gpu = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in events
           if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    merged = _union(gpu)
    phases = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"][5:]) for e in events
                    if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                    and str(e.get("name", "")).startswith("spec/"))
    starts = [p[0] for p in phases if p[2] == "draft"]
    if len(starts) < 3:
        raise SystemExit("trace_gaps: fewer than 3 spec/draft ranges in the trace")
    wall = defaultdict(float)
    busy = defaultdict(float)
    steps = 0
    for lo, hi in zip(starts[:-1], starts[1:]):
        steps += 1
        inside = [p for p in phases if lo <= p[0] < hi]
        cur = lo
        for a, b, name in inside:
            if a > cur:  # host time between phases (bookkeeping, commits, scheduling)
                wall["between"] += a - cur
                busy["between"] += _busy(merged, cur, a)
            wall[name] += b - a
            busy[name] += _busy(merged, a, b)
            cur = max(cur, b)
        if hi > cur:
            wall["between"] += hi - cur
            busy["between"] += _busy(merged, cur, hi)
    total_w = sum(wall.values())
    total_b = sum(busy.values())
    rows = {k: {"wall_ms_per_step": wall[k] / steps / 1e3, "busy_ms_per_step": busy[k] / steps / 1e3,
                "idle_ms_per_step": (wall[k] - busy[k]) / steps / 1e3} for k in wall}
    return {"steps": steps, "step_ms": total_w / steps / 1e3, "device_busy_ms": total_b / steps / 1e3,
            "device_idle_ms": (total_w - total_b) / steps / 1e3, "phases": rows}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("trace")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    s = summarise(_load(a.trace))
    print(f"{s['steps']} SD steps: {s['step_ms']:.3f} ms per step, device busy {s['device_busy_ms']:.3f}, "
          f"idle {s['device_idle_ms']:.3f}")
    for k, r in sorted(s["phases"].items(), key=lambda kv: -kv[1]["wall_ms_per_step"]):
        print(f"  {k:16s} wall {r['wall_ms_per_step']:.3f}  device busy {r['busy_ms_per_step']:.3f}  "
              f"idle {r['idle_ms_per_step']:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=1)


if __name__ == "__main__":
    main()
