#!/usr/bin/env bash
# One full GRPO step per rollout.spec (off, ngram, eagle) of the benchmark-scale target on
# one H200, with the phase breakdown of each: issue "RL loop", H200 acceptance item.
#   bash scripts/h200_rl_step.sh OUT_DIR [SFT_STEPS] [RESULTS_DIR]
# Stages (each skipped when its output exists, so the script can be re-run after a
# timeout on the same machine):
#   1. target: examples/sft_bench_1p5b.yaml for SFT_STEPS steps (default 20; the full
#      recipe is 120 steps / 447 s), exported to OUT_DIR/sft/hf;
#   2. drafter: offline EAGLE drafter trained on the target's own greedy responses;
#   3. `bench spec`: EAGLE and n-gram vs plain decoding at T=0.9, batch 1/4/16/32
#      (OUT_DIR/bench_spec.json; the speculative-decoding issue's H200 item);
#   4. one RL step per spec mode (examples/rl_step_1p5b_h200.yaml), metrics.jsonl each;
#   5. OUT_DIR/rl_step_h200.json: the three steps' metrics side by side.
# RESULTS_DIR (e.g. the device tool's $OUT) receives the small outputs (bench_spec.json,
# each run's metrics.jsonl and log tail, rl_step_h200.json) as soon as each stage ends,
# so a run cut by a time limit keeps what it finished. DRAFTER_PROMPTS / DRAFTER_STEPS /
# DRAFTER_TEMPERATURE change the drafter's recipe (128 prompts, 60 steps, greedy responses:
# top-1 0.741 on the 120-step target in session 6). SKIP_BENCH_SPEC=1 skips stage 3;
# STOP_AFTER=target / STOP_AFTER=drafter stop after stage 1 / 2, and RL_SPECS (default
# "off ngram eagle"; empty: none) picks the RL steps, to split the work over calls of a
# time-limited machine (re-running the script later skips the stages already done). The
# 120-step SFT takes ~510 s on one H200: give it a call of its own, with nothing else on the
# GPU (next to the GPU tests it ran past a 583 s limit), or start it with setsid in the
# background (STOP_AFTER=target) and run the GPU tests beside it (559 s in session 7).
# SFT_SAVE_INTERVAL (default 0: a checkpoint at the end only) also checkpoints every N steps,
# so a run cut by a time limit resumes there when the script is run again (resume: auto).
# BENCH_SPEC_ARGS adds bench spec flags (e.g. "--min-new-tokens 256" for equal lengths);
# RL_STEPS (default 1) runs more GRPO steps per spec: a first step's rollout also pays
# one-time work (the kernel planner's timings, graph captures; the metrics do not separate
# them), so a second step shows the steady state.
set -euo pipefail
OUT=${1:?usage: h200_rl_step.sh OUT_DIR [SFT_STEPS]}
SFT_STEPS=${2:-20}
RESULTS=${3:-}
keep() { [ -n "$RESULTS" ] && mkdir -p "$RESULTS" && cp "$@" "$RESULTS"/ 2>/dev/null; true; }
PY=${PYTHON:-python3}
mkdir -p "$OUT"
t0=$(date +%s)
if [ ! -f "$OUT/sft/hf/config.json" ]; then
  echo "[h200_rl_step] 1/3 target: SFT $SFT_STEPS steps"
  $PY -m megatron_tlt sft --config examples/sft_bench_1p5b.yaml train.out_dir="$OUT/sft" \
      train.steps="$SFT_STEPS" optim.lr_warmup_steps=5 sft.eval_interval=0 sft.progress=false \
      train.save_interval="${SFT_SAVE_INTERVAL:-0}" \
      2>&1 | tee "$OUT/sft_train.log" | tail -n 15
  echo "[h200_rl_step] target done at $(( $(date +%s) - t0 )) s"
  cp "$OUT/sft/metrics.jsonl" "$OUT/sft_metrics.jsonl" 2>/dev/null || true
  keep "$OUT/sft_train.log" "$OUT/sft_metrics.jsonl"  # the log; loss, step time, tokens/s, memory every 5 steps
  rm -rf "$OUT/sft/checkpoints"  # ~21 GB of model + optimizer state; the HF export is kept
fi
if [ "${STOP_AFTER:-}" = target ]; then
  echo "[h200_rl_step] STOP_AFTER=target: stopping at $(( $(date +%s) - t0 )) s"
  exit 0
fi
if [ ! -f "$OUT/drafter/config.json" ]; then
  echo "[h200_rl_step] 2/3 drafter: offline EAGLE training on the target's responses"
  $PY -m megatron_tlt.spec.train_drafter --target "$OUT/sft/hf" --tasks arith,sort \
      --num-prompts "${DRAFTER_PROMPTS:-128}" --max-new-tokens 192 --draft-vocab 128 \
      --steps "${DRAFTER_STEPS:-60}" --temperature "${DRAFTER_TEMPERATURE:-0}" \
      --batch-tokens 4096 --out "$OUT/drafter" --no-progress 2>&1 | tail -n 8
  echo "[h200_rl_step] drafter done at $(( $(date +%s) - t0 )) s"
fi
if [ "${STOP_AFTER:-}" = drafter ]; then
  echo "[h200_rl_step] STOP_AFTER=drafter: stopping at $(( $(date +%s) - t0 )) s"
  exit 0
fi
if [ "${SKIP_BENCH_SPEC:-0}" != 1 ] && [ ! -f "$OUT/bench_spec.json" ]; then
  echo "[h200_rl_step] SD benchmark: eagle and ngram vs off at T=0.9, batch 1/4/16/32"
  $PY -m megatron_tlt bench spec --json "$OUT/bench_spec.json" --model "$OUT/sft/hf" \
      --drafter "$OUT/drafter" --drafters eagle,ngram --batch-sizes 1,4,16,32 \
      --temperature 0.9 --max-new-tokens 256 --tasks arith,sort --profile-batch-sizes 1,32 \
      ${BENCH_SPEC_ARGS:-} 2>&1 | tail -n 20
  echo "[h200_rl_step] SD benchmark done at $(( $(date +%s) - t0 )) s"
  keep "$OUT/bench_spec.json"
fi
RL_SPECS=${RL_SPECS-off ngram eagle}
for spec in $RL_SPECS; do
  if [ ! -f "$OUT/rl_$spec/metrics.jsonl" ]; then
    echo "[h200_rl_step] 3/3 RL step, rollout.spec=$spec"
    extra=()
    [ "$spec" = eagle ] && extra=(rollout.drafter="$OUT/drafter")
    $PY -m megatron_tlt train --config examples/rl_step_1p5b_h200.yaml \
        model.hf_path="$OUT/sft/hf" rollout.spec=$spec train.out_dir="$OUT/rl_$spec" \
        train.steps="${RL_STEPS:-1}" "${extra[@]}" 2>&1 | tail -n 12 | tee "$OUT/rl_$spec.log"
    [ -f "$OUT/rl_$spec/metrics.jsonl" ] && cp "$OUT/rl_$spec/metrics.jsonl" "$OUT/metrics_$spec.jsonl" \
        && keep "$OUT/metrics_$spec.jsonl" "$OUT/rl_$spec.log"
    rm -rf "$OUT/rl_$spec/checkpoints" "$OUT/rl_$spec/init_mcore"  # disk: ~24 GB per run
    echo "[h200_rl_step] spec=$spec done at $(( $(date +%s) - t0 )) s"
  fi
done
$PY - "$OUT" "$SFT_STEPS" <<'PYEOF'
import json, os, subprocess, sys
out, sft_steps = sys.argv[1], int(sys.argv[2])
rev = os.environ.get("MEGATRON_TLT_GIT_REV") or subprocess.run(
    ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
report = {"command": f"bash scripts/h200_rl_step.sh OUT_DIR {sft_steps}", "git_revision": rev,
          "config": "examples/rl_step_1p5b_h200.yaml", "sft_steps": sft_steps, "steps": {}}
for spec in ("off", "ngram", "eagle"):
    path = os.path.join(out, f"rl_{spec}", "metrics.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            report["steps"][spec] = [json.loads(line) for line in f if line.strip()]
with open(os.path.join(out, "rl_step_h200.json"), "w") as f:
    json.dump(report, f, indent=1)
for spec, rows in report["steps"].items():
    m = rows[-1] if rows else {}
    print(spec, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in m.items()
                 if k.startswith(("t_", "reward_mean", "tokens_per_s", "len_p", "accept"))})
PYEOF
keep "$OUT/rl_step_h200.json"
echo "[h200_rl_step] done in $(( $(date +%s) - t0 )) s"
