#!/usr/bin/env python
"""GRPO on a tiny SFT policy, spec=off and spec=eagle: exact-answer rate before and after.

    python tools/rl_acceptance.py [--config examples/tiny_grpo30.yaml] [--out-dir runs/rl_acceptance]

Runs, each as the `megatron-tlt` command a user would type (recorded verbatim):
  0. the starting point, when --sft-steps > 0 and it is not there yet:
     `sft --config examples/sft_tiny.yaml sft.exit_at_step=N train.out_dir=D`, the
     shipped tiny default's own recipe stopped at step N (same data, same schedule; the
     run is deterministic), whose checkpoint the config's model.mcore_ckpt names;
     --sft-steps 0 starts from the shipped tiny default instead;
  1. baseline: `eval` of the starting point on the held-out sort prompts (the task the
     config trains on) and on the default arith+sort mix;
  2. `train --config CFG rollout.spec=off` and `... rollout.spec=eagle rollout.drafter=D`
     (the shipped tiny drafter unless --drafter), each from scratch in its own out_dir;
  3. `eval --ckpt <run out_dir>` (the latest checkpoint: the final step) on the same
     prompts as the baseline.
and writes benchmarks/results/rl_tiny_30steps_sft<N>_<date>.json: the commands, the git
revision, the rates before/after (overall, per task, by reference length), each run's
wall time and per-step curves (reward, lengths, rollout time, acceptance length).

Held-out prompts: `eval` uses `make_dataset(..., split="test")`; training uses
`split="train"`. The split of a prompt is a hash of its content, and each split's
generator rejects the other's prompts, so no evaluated prompt is ever trained on
(data/tasks.py).

OMP_NUM_THREADS defaults to 1 for every command: on a small shared CPU, torch's
intra-op threads oversubscribe the cores and the rollout engine's many tiny kernels ran
18-48x slower with 2 threads under load than with 1 (measured here, batch 64 to 8). Set it to override.
A benchmark, not a test: it asserts nothing; the JSON says whether each run reached
--target-gain points.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_DEFAULT = os.path.join("megatron_tlt", "assets", "tiny_default")
SFT_CONFIG = os.path.join("examples", "sft_tiny.yaml")
TINY_DRAFTER = os.path.join("megatron_tlt", "assets", "tiny_drafter")
CURVE_KEYS = ("reward_mean", "groups_kept", "len_mean", "len_max", "t_rollout", "t_update", "t_step",
              "entropy_est", "grad_norm", "acceptance_length", "acceptance_rate")


def _cli() -> list[str]:
    return [sys.executable, "-m", "megatron_tlt"]


def _shown(cmd: list[str]) -> str:
    """The command as a user types it (`megatron-tlt ...`)."""
    head = ["megatron-tlt"] if cmd[:3] == _cli() else cmd[:3]
    return shlex.join(head + cmd[3:])


LOAD: dict[str, list[float]] = {}
"""1-minute load average before and after each command (wall times mean little without it)."""


def _run(cmd: list[str], log_path: str, env: dict) -> float:
    """Run `cmd` in the repository root, its output to `log_path`; wall seconds."""
    print(f"$ {_shown(cmd)}", flush=True)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        p = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    LOAD[_shown(cmd)] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    if p.returncode != 0:
        tail = open(log_path, encoding="utf-8", errors="replace").read()[-2000:]
        raise SystemExit(f"failed (exit {p.returncode}) after {wall:.0f} s: {_shown(cmd)}\n{tail}")
    return wall


def _eval(which: list[str], tasks: str, n: int, json_path: str, log_path: str, env: dict,
          extra: tuple[str, ...] = ()) -> dict:
    cmd = _cli() + ["eval", *which, "--tasks", tasks, "--n", str(n), *extra, "--json", json_path]
    wall = _run(cmd, log_path, env)
    with open(json_path, encoding="utf-8") as f:
        report = json.load(f)
    rate = report["overall"]["rate"]
    pk = f", pass@{report['samples']} {report['pass_at_k']['overall']['rate']:.1%}" if "pass_at_k" in report else ""
    print(f"  exact-answer rate {rate:.1%} ({report['overall']['correct']}/{report['overall']['n']}){pk}, "
          f"{wall:.0f} s", flush=True)
    keep = ("overall", "per_task", "by_reference_length", "n", "seed", "max_new_tokens", "tasks", "temperature",
            "samples", "pass_at_k")
    return {"command": _shown(cmd), "wall_s": round(wall, 1), **{k: report[k] for k in keep if k in report},
            **({"step": report["step"]} if "step" in report else {})}


def _curves(metrics_path: str) -> dict:
    rows = []
    with open(metrics_path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    out = {"step": [r["step"] for r in rows]}
    for k in CURVE_KEYS:
        if any(k in r for r in rows):
            out[k] = [round(r[k], 4) if isinstance(r.get(k), float) else r.get(k) for r in rows]
    return out


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="examples/tiny_grpo30.yaml")
    p.add_argument("--drafter", default=TINY_DRAFTER, help="EAGLE drafter directory for the spec=eagle run")
    p.add_argument("--sft-steps", type=int, default=800,
                   help=f"start from step N of {SFT_CONFIG} (run if missing); 0: the shipped tiny default")
    p.add_argument("--sft-out", default="runs/sft_tiny_800", help="train.out_dir of that SFT run")
    p.add_argument("--out-dir", default="runs/rl_acceptance", help="run directories, eval JSONs and logs")
    p.add_argument("--tasks", default="sort", help="held-out task mix of the main figure (the trained tasks)")
    p.add_argument("--n", type=int, default=500, help="held-out prompts of the main figure")
    p.add_argument("--n-mix", type=int, default=200, help="held-out arith+sort prompts (the eval default); 0: skip")
    p.add_argument("--n-sampled", type=int, default=200,
                   help="held-out prompts (--tasks) also evaluated at temperature 1, --samples each: the "
                        "expected reward GRPO maximises, and pass@k; 0: skip")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--specs", default="off,eagle", help="runs to make, comma separated")
    p.add_argument("--target-gain", type=float, default=10.0, help="points the acceptance item asks for")
    p.add_argument("--json", default=None,
                   help="default: benchmarks/results/rl_tiny_30steps[_sft<N>]_<date>.json")
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for both train runs")
    args = p.parse_args(argv)

    date = datetime.date.today().isoformat()
    start_tag = f"_sft{args.sft_steps}" if args.sft_steps else ""
    json_path = args.json or os.path.join(REPO, "benchmarks", "results", f"rl_tiny_30steps{start_tag}_{date}.json")
    from megatron_tlt.atomic_io import check_output_file
    check_output_file(json_path, renamed_into_place=False)  # before hours of training, not after
    out = os.path.abspath(args.out_dir)
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("RANK", None)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")

    import torch

    result = {
        "what": "GRPO on a tiny SFT policy (CPU): held-out exact-answer rate before and after, spec=off and "
                "spec=eagle",
        "acceptance_item": f"the run raises the held-out exact-answer rate by >= {args.target_gain:g} points over "
                           "the SFT starting point",
        "command": shlex.join(["python", "tools/rl_acceptance.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": date, "git_revision": _git("rev-parse", "HEAD").strip(),
        # porcelain lines are "XY path": the two status columns, a space, the path
        "git_dirty_files": [ln[3:] for ln in _git("status", "--porcelain").splitlines() if len(ln) > 3],
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
                 "torch": torch.__version__, "OMP_NUM_THREADS": env["OMP_NUM_THREADS"],
                 "loadavg_at_start": list(os.getloadavg())},
        "held_out": "eval draws make_dataset(tasks, n, seed=0, split='test'); training draws split='train'; a "
                    "prompt's split is a hash of its content and each split rejects the other's prompts "
                    "(data/tasks.py), so the two sets are disjoint",
        "config": args.config, "overrides": args.overrides,
    }
    with open(os.path.join(REPO, args.config), encoding="utf-8") as f:
        result["config_text"] = f.read()

    def evals(which: list[str], tag: str) -> dict:
        """main: greedy on --tasks; mix: greedy on arith+sort; sampled: T=1, --samples each."""
        path = lambda kind, ext: os.path.join(out, f"eval_{tag}_{kind}.{ext}")  # noqa: E731
        got = {"main": _eval(which, args.tasks, args.n, path("main", "json"), path("main", "log"), env)}
        if args.n_mix:
            got["mix"] = _eval(which, "arith,sort", args.n_mix, path("mix", "json"), path("mix", "log"), env)
        if args.n_sampled:
            got["sampled"] = _eval(which, args.tasks, args.n_sampled, path("sampled", "json"),
                                   path("sampled", "log"), env,
                                   ("--temperature", "1.0", "--samples", str(args.samples)))
        return got

    start_overrides: list[str] = []
    if args.sft_steps:
        start = os.path.join(args.sft_out, "checkpoints", f"step_{args.sft_steps}", "model")
        cmd = _cli() + ["sft", "--config", SFT_CONFIG, f"sft.exit_at_step={args.sft_steps}",
                        f"train.out_dir={args.sft_out}"]
        result["start"] = {"what": f"step {args.sft_steps} of the tiny default's SFT recipe ({SFT_CONFIG})",
                           "command": _shown(cmd), "checkpoint": start}
        if not os.path.isdir(os.path.join(REPO, start)):
            print("== the SFT starting point", flush=True)
            result["start"]["wall_s"] = round(_run(cmd, os.path.join(out, "sft_start.log"), env), 1)
        else:
            result["start"]["reused"] = True
        # The config names this checkpoint too; saying it here makes --sft-steps/--sft-out mean what they say.
        start_overrides = [f"model.mcore_ckpt={start}", "model.hf_path=null"]
        which_start = ["--ckpt", start]
    else:
        start_overrides = ["model.mcore_ckpt=null", "model.hf_path=null"]
        which_start = ["--model", TINY_DEFAULT]
        result["start"] = {"what": "the shipped tiny default", "checkpoint": TINY_DEFAULT}

    print("== baseline (the SFT starting point)", flush=True)
    result["baseline"] = evals(which_start, "base")
    before = result["baseline"]["main"]["overall"]["rate"]

    result["runs"] = {}
    for spec in [s.strip() for s in args.specs.split(",") if s.strip()]:
        run_dir = os.path.join(out, f"spec_{spec}")
        print(f"== train, rollout.spec={spec}", flush=True)
        cmd = _cli() + ["train", "--config", args.config, *start_overrides, f"train.out_dir={run_dir}",
                        "train.resume=none", f"rollout.spec={spec}"]
        if spec == "eagle":
            cmd.append(f"rollout.drafter={args.drafter}")
        cmd += args.overrides
        wall = _run(cmd, os.path.join(out, f"train_{spec}.log"), env)
        curves = _curves(os.path.join(run_dir, "metrics.jsonl"))
        print(f"  {len(curves['step'])} steps in {wall:.0f} s; reward {curves['reward_mean'][0]:.3f} -> "
              f"{curves['reward_mean'][-1]:.3f}", flush=True)
        run = {"command": _shown(cmd), "wall_s": round(wall, 1), "curves": curves}
        if "acceptance_length" in curves:
            al = [x for x in curves["acceptance_length"] if x is not None]
            run["acceptance_length_mean"] = round(sum(al) / max(len(al), 1), 3)
        run["eval"] = evals(["--ckpt", run_dir], spec)
        after = run["eval"]["main"]["overall"]["rate"]
        run["gain_points"] = round(100 * (after - before), 2)
        if args.n_sampled:
            run["gain_points_sampled"] = round(100 * (run["eval"]["sampled"]["overall"]["rate"]
                                                      - result["baseline"]["sampled"]["overall"]["rate"]), 2)
        run["reached_target"] = run["gain_points"] >= args.target_gain
        result["runs"][spec] = run

    result["loadavg_1min_before_after"] = LOAD
    result["summary"] = {
        "baseline_rate": before,
        **{f"after_rate_spec_{s}": r["eval"]["main"]["overall"]["rate"] for s, r in result["runs"].items()},
        **{f"gain_points_spec_{s}": r["gain_points"] for s, r in result["runs"].items()},
        **{f"gain_points_sampled_spec_{s}": r["gain_points_sampled"] for s, r in result["runs"].items()
           if "gain_points_sampled" in r},
        **{f"train_wall_s_spec_{s}": r["wall_s"] for s, r in result["runs"].items()},
    }
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)  # "" for a bare name
    with open(json_path, "w", encoding="utf-8") as f:  # a symlink's target, /dev/stdout: written through
        json.dump(result, f, indent=2)
        f.write("\n")
    print(f"== held-out exact-answer rate ({args.tasks}, n={args.n}): baseline {before:.1%}", flush=True)
    for s, r in result["runs"].items():
        print(f"   spec={s}: {r['eval']['main']['overall']['rate']:.1%} ({r['gain_points']:+.1f} points; "
              f"train {r['wall_s']:.0f} s)", flush=True)
    print(f"wrote {json_path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
