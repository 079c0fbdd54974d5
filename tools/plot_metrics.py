#!/usr/bin/env python
"""Render an RL run's metrics.jsonl to PNG plots: reward, response lengths, phase times,
rollout time per running-batch bucket (and the long tail's share), acceptance length.

    python tools/plot_metrics.py runs/tiny/metrics.jsonl --out runs/tiny/plots

Needs matplotlib (`pip install matplotlib`, or the `plot` extra). Panels whose metrics a
run did not log (e.g. acceptance with spec=off) are left out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

PANELS = {
    "reward": ["reward_mean"],
    "lengths": ["len_p50", "len_p90", "len_p99", "len_max"],
    "phase_times": ["t_rollout", "t_reward", "t_logprobs", "t_update", "t_weight_sync", "t_step"],
    "rollout_time": ["t_rollout_tail", "t_rollout_capture", "t_rollout_b*"],
    "acceptance": ["acceptance_length", "acceptance_rate", "accept_len_b*"],
    "loss": ["pg_loss", "clip_frac", "kl_ref", "train_infer_logp_gap", "entropy_est"],
}


def read(path: str) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                print(f"{path}:{n}: skipping a line that is not JSON (a write cut short by a crash?)", file=sys.stderr)
    return rows


def plot(rows: list[dict], out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    written = []
    logged = list(dict.fromkeys(k for r in rows for k in r))  # first-seen order
    for name, keys in PANELS.items():
        # "prefix*" stands for every logged metric of that prefix (per-bucket metrics).
        names = [m for k in keys for m in ([x for x in logged if x.startswith(k[:-1])] if k.endswith("*") else [k])]
        present = [k for k in names if any(isinstance(r.get(k), (int, float)) for r in rows)]
        if not present:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for k in present:
            pts = [(r["step"], r[k]) for r in rows if isinstance(r.get(k), (int, float))]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=k)
        ax.set_xlabel("step")
        ax.set_title(name.replace("_", " "))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        path = os.path.join(out_dir, f"{name}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("metrics", help="metrics.jsonl of a run")
    ap.add_argument("--out", default=None, help="output folder (default: <run>/plots)")
    args = ap.parse_args(argv)
    if not os.path.isfile(args.metrics):
        print(f"error: metrics file not found: {args.metrics}", file=sys.stderr)
        return 2
    rows = read(args.metrics)
    if not rows:
        print(f"error: {args.metrics} holds no metrics", file=sys.stderr)
        return 2
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.metrics)), "plots")
    for p in plot(rows, out):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
