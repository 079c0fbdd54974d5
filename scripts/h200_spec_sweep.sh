#!/usr/bin/env bash
# EAGLE speed sweep on one H200 (speculative-decoding issue): drafter recipes x chain depths,
# each `bench spec` run measuring plain decoding and EAGLE side by side at T=0.9.
#   bash scripts/h200_spec_sweep.sh OUT_DIR [RESULTS_DIR]
# Needs the benchmark-scale target at OUT_DIR/sft/hf (`STOP_AFTER=target bash
# scripts/h200_rl_step.sh OUT_DIR 120`). Every stage is skipped when its output exists, so
# a call cut by a time limit is resumed by running the script again on the same machine
# (a drafter cut mid-training resumes from its last checkpoint, train_drafter --save-every).
# RESULTS_DIR (e.g. the device tool's $OUT) receives each JSON and log as soon as it exists.
#
# SWEEP_DRAFTERS (default "greedy128 t09x512"):
#   greedy128  session 7's recipe: 128 prompts (seed 0), greedy responses, 60 steps;
#              its prompts are bench spec's (also seed 0), so its acceptance is optimistic
#   t09x512    512 prompts (seed 1: not bench spec's) x 2 responses sampled at T=0.9 (the
#              benchmark's temperature), 240 steps
#   t09x128    the same at a quarter: 128 prompts (seed 1) x 2, 60 steps (a quick check)
#   t09x1024   twice t09x512: 1024 prompts (seed 1) x 2, 480 steps (expect about twice
#              t09x512's 277 s on one H200: a call of its own; not yet run)
#   t09x512u3  t09x512 with chain levels 2-3 trained on the drafter's own features
#              (train_drafter --unroll 3; ~3x the training compute; not yet run)
#   t09x512u2  the same with level 2 only (--unroll 2, ~2x): on the tiny default (CPU,
#              session 21) --unroll 2 and 3 accepted alike (3.26 / 3.25 at depth 6 against
#              3.03-3.12 without; benchmarks/results/cpu_2026-12-05_drafter_recipes)
#   t09x512u2s960, t09x512s960  the same data, 4x the optimizer steps (with and without
#              --unroll 2): on the tiny default (CPU, session 22) twice the steps took
#              --unroll 2 from 3.26 to 4.33 at depth 6; the 240-step recipes stop early
# SWEEP_DEPTHS (default "4 6"): chain depths ("none": only train the drafters); SWEEP_BATCHES (default 1,4,16,32);
# SWEEP_PROMPT_SETS (default 4): disjoint prompt batches per timed run (bench spec --prompt-sets;
# bench spec raises it to at least 32 sequences per run, --min-sequences, e.g. 32 sets at batch 1).
# SWEEP_MODES (default eagle): bench spec --drafters, e.g. "eagle,eagle-readback" to time
# the step that reads the drafts back before verifying beside the default one,
# "eagle-noahead,eagle-ahead" to time the draft-ahead (MEGATRON_TLT_SPEC_AHEAD, on by
# default since session 14, so plain "eagle" has it) against the step without it, or
# "eagle,eagle@3,eagle@5" to time other depths in the same run (one model load, one plain
# baseline); SWEEP_DEPTHS entries may be schedules by running batch size ("1:5,16:4,32:3").
# SWEEP_AB (optional "DRAFTER:DEPTH"): the one configuration that runs with SWEEP_AB_MODES
# (default "eagle,eagle-readback") instead of SWEEP_MODES.
# SWEEP_BENCH_ARGS: more bench spec flags (e.g. --continuous); SWEEP_TAG: a suffix of the
# bench outputs' names (so a second sweep with other flags does not skip as done).
# BENCH_PYTHONPATH: a directory put first on PYTHONPATH for the bench runs only (an older
# revision's megatron_tlt + csrc, `git archive REV megatron_tlt csrc | tar -x -C DIR`, to
# measure two revisions on the same target and drafter); BENCH_GIT_REV: its revision,
# recorded in the bench JSON (MEGATRON_TLT_GIT_REV).
# An SFT still running in the background (h200_gpu_checks.sh) is waited for, up to
# WAIT_SFT seconds (default 300).
# Every run reads and extends one kernel-plan file, OUT_DIR/linear_plans.json
# (MEGATRON_TLT_LINEAR_PLANS, unless set): the planner picks cuBLAS or a Triton kernel per
# projection shape by timing, and separately timed processes disagree on some shapes
# (session 11), so without one file two benches' plain baselines may run other kernels
# (session 12: plain steps of one target differed by up to 13 % between two processes).
set -euo pipefail
OUT=${1:?usage: h200_spec_sweep.sh OUT_DIR [RESULTS_DIR]}
RESULTS=${2:-}
PY=${PYTHON:-python3}
keep() { [ -n "$RESULTS" ] && mkdir -p "$RESULTS" && cp "$@" "$RESULTS"/ 2>/dev/null; true; }
export MEGATRON_TLT_LINEAR_PLANS=${MEGATRON_TLT_LINEAR_PLANS:-$OUT/linear_plans.json}
t0=$(date +%s)
while [ ! -f "$OUT/sft/hf/config.json" ] && [ -f "$OUT/sft.log" ] && ! grep -q "stopping at" "$OUT/sft.log" \
      && [ $(( $(date +%s) - t0 )) -lt "${WAIT_SFT:-300}" ]; do
  sleep 5
done
[ -f "$OUT/sft.log" ] && { tail -n 3 "$OUT/sft.log"; keep "$OUT/sft.log"; }
[ -f "$OUT/sft/hf/config.json" ] || { echo "no target at $OUT/sft/hf (run h200_rl_step.sh first)"; exit 2; }
echo "[spec_sweep] target ready at $(( $(date +%s) - t0 )) s"
recipe() {
  case "$1" in
    greedy128) echo "--num-prompts 128 --temperature 0 --steps 60 --seed 0 --max-new-tokens 192" ;;
    t09x512) echo "--num-prompts 512 --n 2 --temperature 0.9 --steps 240 --seed 1 --max-new-tokens 256" ;;
    t09x128) echo "--num-prompts 128 --n 2 --temperature 0.9 --steps 60 --seed 1 --max-new-tokens 256" ;;
    t09x1024) echo "--num-prompts 1024 --n 2 --temperature 0.9 --steps 480 --seed 1 --max-new-tokens 256" ;;
    t09x512u3) echo "--num-prompts 512 --n 2 --temperature 0.9 --steps 240 --seed 1 --max-new-tokens 256 --unroll 3" ;;
    t09x512u2) echo "--num-prompts 512 --n 2 --temperature 0.9 --steps 240 --seed 1 --max-new-tokens 256 --unroll 2" ;;
    t09x512u2s960) echo "--num-prompts 512 --n 2 --temperature 0.9 --steps 960 --seed 1 --max-new-tokens 256 --unroll 2" ;;
    t09x512s960) echo "--num-prompts 512 --n 2 --temperature 0.9 --steps 960 --seed 1 --max-new-tokens 256" ;;
    *) echo "unknown drafter recipe $1" >&2; exit 2 ;;
  esac
}
for d in ${SWEEP_DRAFTERS:-greedy128 t09x512}; do
  dir="$OUT/drafter_$d"
  if [ ! -f "$dir/config.json" ]; then
    echo "[spec_sweep] drafter $d: $(recipe "$d")"
    # shellcheck disable=SC2046
    $PY -m megatron_tlt.spec.train_drafter --target "$OUT/sft/hf" --tasks arith,sort \
        --draft-vocab 128 --batch-tokens 4096 $(recipe "$d") --out "$dir" --no-progress \
        2>&1 | tail -n 4 | tee "$OUT/drafter_$d.log"
    keep "$OUT/drafter_$d.log"
    [ -f "$dir/train_summary.json" ] && cp "$dir/train_summary.json" "$OUT/drafter_${d}_summary.json" \
        && keep "$OUT/drafter_${d}_summary.json"
    echo "[spec_sweep] drafter $d done at $(( $(date +%s) - t0 )) s"
  fi
done
depths=${SWEEP_DEPTHS:-4 6}
[ "$depths" = none ] && depths=""  # SWEEP_DEPTHS=none: train the drafters, no bench
for d in ${SWEEP_DRAFTERS:-greedy128 t09x512}; do
  for k in $depths; do
    name="bench_spec_${d}_depth${k//[:,]/_}${SWEEP_TAG:-}"
    json="$OUT/$name.json"
    [ -f "$json" ] && continue
    echo "[spec_sweep] bench spec: drafter $d, depth $k"
    modes=${SWEEP_MODES:-eagle}
    [ "${SWEEP_AB:-}" = "$d:$k" ] && modes=${SWEEP_AB_MODES:-eagle,eagle-readback}
    # shellcheck disable=SC2086
    PYTHONPATH="${BENCH_PYTHONPATH:+$BENCH_PYTHONPATH:}${PYTHONPATH:-}" \
    MEGATRON_TLT_GIT_REV="${BENCH_GIT_REV:-${MEGATRON_TLT_GIT_REV:-}}" \
    $PY -m megatron_tlt bench spec --json "$json" --model "$OUT/sft/hf" --drafter "$OUT/drafter_$d" \
        --drafters "$modes" --batch-sizes "${SWEEP_BATCHES:-1,4,16,32}" --temperature 0.9 \
        --max-new-tokens 256 --ignore-eos --tasks arith,sort --spec-depth "$k" \
        --prompt-sets "${SWEEP_PROMPT_SETS:-4}" ${SWEEP_BENCH_ARGS:-} 2>&1 \
        | grep -E "^B=|wrote|Error|error" | tee "$OUT/$name.log"
    keep "$json" "$OUT/$name.log"
    [ -f "$MEGATRON_TLT_LINEAR_PLANS" ] && keep "$MEGATRON_TLT_LINEAR_PLANS"
    echo "[spec_sweep] bench $d depth $k done at $(( $(date +%s) - t0 )) s"
  done
done
echo "[spec_sweep] done in $(( $(date +%s) - t0 )) s"
