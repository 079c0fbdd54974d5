#!/usr/bin/env bash
# GPU tests and the random-weight speculative-step profile in one call of the device tool,
# optionally beside the benchmark-scale SFT (which runs in the background meanwhile):
#   bash scripts/h200_gpu_checks.sh RESULTS_DIR [SFT_OUT_DIR]
# 1. SFT_OUT_DIR given: `STOP_AFTER=target scripts/h200_rl_step.sh SFT_OUT_DIR 120` starts in
#    the background (setsid; its log SFT_OUT_DIR/sft.log), so a later call on the same
#    machine continues with the drafter and benchmarks (scripts/h200_spec_sweep.sh);
# 2. tests/gpu (GPU_TESTS overrides the list; GPU_TEST_TIMEOUT, default 330 s) ->
#    RESULTS_DIR/gpu_tests.log;
# 3. tools/profile_generate.py at batch 1 and 32 with chrome traces, and
#    tools/trace_gaps.py on each trace -> RESULTS_DIR/profile.json, traces/, trace_gaps.log
#    (PROFILE=0 skips this step: its timings are contended while the SFT trains);
# 4. with SFT_OUT_DIR: waits for the SFT until WAIT_UNTIL seconds into the script
#    (default 570) and copies its log.
# Beside the SFT the tests share the GPU: in session 11 they got 45 % through in 420 s
# (all of them took 431 s on an idle H200) and the SFT took 560 s (532 s alone in
# session 12), so running both in one call saves no device time; prefer the SFT alone,
# then the tests.
set -uo pipefail
RESULTS=${1:?usage: h200_gpu_checks.sh RESULTS_DIR [SFT_OUT_DIR]}
SFT_OUT=${2:-}
PY=${PYTHON:-python3}
mkdir -p "$RESULTS"
if [ -n "$SFT_OUT" ]; then
  mkdir -p "$SFT_OUT"
  STOP_AFTER=target setsid nohup bash scripts/h200_rl_step.sh "$SFT_OUT" 120 \
      > "$SFT_OUT/sft.log" 2>&1 < /dev/null &
  echo "[gpu_checks] SFT started in the background ($SFT_OUT/sft.log)"
fi
tests=${GPU_TESTS:-tests/gpu}
# shellcheck disable=SC2086
timeout "${GPU_TEST_TIMEOUT:-330}" $PY -m pytest -q -p no:cacheprovider $tests \
    > "$RESULTS/gpu_tests.log" 2>&1
echo "[gpu_checks] tests rc=$? at ${SECONDS} s"
grep -E "passed|failed|error" "$RESULTS/gpu_tests.log" | tail -n 25
if [ "${PROFILE:-1}" != "0" ]; then  # PROFILE=0 skips it (e.g. beside the SFT: contended timings)
  timeout "${PROFILE_TIMEOUT:-200}" $PY tools/profile_generate.py --batch-sizes 1,32 \
      --trace-dir "$RESULTS/traces" --json "$RESULTS/profile.json" 2>&1 | grep "^{" | cut -c1-1600
  for f in "$RESULTS"/traces/*.json.gz; do
    [ -f "$f" ] && { echo "$f"; $PY tools/trace_gaps.py "$f"; }
  done 2>&1 | tee "$RESULTS/trace_gaps.log"
  echo "[gpu_checks] profile done at ${SECONDS} s"
fi
if [ -n "$SFT_OUT" ]; then
  while ! grep -q "stopping at" "$SFT_OUT/sft.log" && [ "$SECONDS" -lt "${WAIT_UNTIL:-570}" ]; do
    sleep 5
  done
  tail -n 4 "$SFT_OUT/sft.log"
  cp "$SFT_OUT/sft.log" "$RESULTS/" 2>/dev/null
fi
echo "[gpu_checks] done at ${SECONDS} s"
