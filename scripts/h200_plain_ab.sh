#!/usr/bin/env bash
# Plain decoding on one machine, variants side by side (random 1.5B-shaped weights, no
# trained target needed), each through tools/host_timeline.py (plain and EAGLE with a
# random drafter, unwrapped and wrapped wall per engine step):
#   bash scripts/h200_plain_ab.sh RESULTS_DIR [OLD_DIR]
# Why: session 12's plain steps on the 120-step target (ms per step 2.15 / 2.57 / 4.13 /
# 5.29 at batch 1 / 4 / 16 / 32) were slower than session 9's at c03a581 (1.93 / 2.19 /
# 2.86 / 4.32), and two processes of session 12 differed by up to 13 %. Candidates: one
# intra-op CPU thread (d9c26ef), kernel plans timed once per process (5331817).
# Variants, in this order:
#   head           this tree, plans timed here and written to RESULTS_DIR/linear_plans.json
#   head_again     the same plans read back (the spread between processes with one plan)
#   head_threads   the same plans, torch's default CPU threads (MEGATRON_TLT_HOST_THREADS=0)
#   head_own       no plan file: plans timed in that process (as every run before 5331817)
#   old            OLD_DIR's package and its own tools/host_timeline.py, e.g.
#                  `git archive 1f8f24e megatron_tlt csrc tools | tar -x -C OLD_DIR` (session
#                  10 timed that revision: plain 2.20 ms at batch 1, 2.69 ms at batch 16)
# AB_BATCHES (default 1,4,16,32); AB_SHAPE (default 1.5b; tiny to try it on a CPU); AB_VARIANTS picks a subset (default all of the above).
set -uo pipefail
RESULTS=${1:?usage: h200_plain_ab.sh RESULTS_DIR [OLD_DIR]}
OLD=${2:-}
PY=${PYTHON:-python3}
mkdir -p "$RESULTS"
plans="$RESULTS/linear_plans.json"
t0=$(date +%s)
run() {
  local name=$1
  shift
  case " ${AB_VARIANTS:-head head_again head_threads head_own old} " in *" $name "*) ;; *) return 0 ;; esac
  echo "[plain_ab] $name ($(( $(date +%s) - t0 )) s)"
  "$@" --shape "${AB_SHAPE:-1.5b}" --batch-sizes "${AB_BATCHES:-1,4,16,32}" --json "$RESULTS/host_timeline_$name.json" 2>&1 \
      | grep -E "^B=|Error|error" | tee "$RESULTS/host_timeline_$name.log"
}
MEGATRON_TLT_LINEAR_PLANS=$plans run head "$PY" tools/host_timeline.py
MEGATRON_TLT_LINEAR_PLANS=$plans run head_again "$PY" tools/host_timeline.py
MEGATRON_TLT_LINEAR_PLANS=$plans MEGATRON_TLT_HOST_THREADS=0 run head_threads "$PY" tools/host_timeline.py
run head_own env -u MEGATRON_TLT_LINEAR_PLANS "$PY" tools/host_timeline.py
if [ -n "$OLD" ]; then
  PYTHONPATH="$OLD:${PYTHONPATH:-}" MEGATRON_TLT_GIT_REV=${OLD_GIT_REV:-old} run old "$PY" "$OLD/tools/host_timeline.py"
fi
echo "[plain_ab] done in $(( $(date +%s) - t0 )) s"
