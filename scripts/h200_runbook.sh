#!/usr/bin/env bash
# One stage of a device session on the lent H200, each made to fit one call of the device
# tool and to leave the machine standing (a call the tool kills at its limit loses the
# machine: sessions 13 and 14). Every stage runs under `timeout` below LIMIT and this
# script always exits 0; what a stage finished is in RESULTS_DIR (the tool's $OUT).
#   bash scripts/h200_runbook.sh STAGE RESULTS_DIR [LIMIT_S]
# LIMIT_S: the tool call's timeout_s (default 590); each stage stops 25 s before it.
# Stages, in the order a session runs them (the machine keeps /tmp/h200rl between calls
# made within its 30 s idle window; `target` must run first on a fresh machine):
#   setup     megatron-core from .whl into /tmp/site, pytest from .whl/opt (every stage
#             runs it; idempotent, a few seconds)
#   target    the 120-step benchmark SFT alone (scripts/h200_rl_step.sh STOP_AFTER=target,
#             ~490-570 s): the trained target for every SD measurement; it checkpoints at
#             step 100, so when the call's limit cuts it, run the stage again at once (the
#             next call resumes there: ~100 s)
#   drafters  DRAFTERS (default "t09x512u2s960 t09x512": --unroll 2 at 4x the steps first,
#             session 22's CPU finding that the 240-step drafters stop far too early; then
#             sessions 16-20's drafter to compare) trained on the target; a cut run resumes at
#             the next call (train_drafter keeps its state)
#   spec      bench spec on the target with each drafter: SPEC_BATCHES (default 1,4,16,32),
#             SPEC_MODES (default eagle,eagle-torchlayer,eagle-onehot: the drafter's kernel
#             path against its torch ops, argmax chains against sampled ones; trees:
#             eagle@1:6x2/4:4/32:4 drafts top-2 trees of depth 6 at batch 1), SPEC_TAG
#             (default _s19), the defaults otherwise; JSONs and logs into RESULTS_DIR
#   acceptance  tools/drafter_acceptance.py on each trained drafter of DRAFTERS: first-level
#             acceptance by proposal rule (sampled chain, i.i.d. siblings, one-hot top-k)
#   rollout   bench rollout --shapes 1.5b,7b --batch-sizes 1,8,32 --no-hf --compare-pdl
#             (random weights, no target needed) and the PDL GPU test
#   kernels   the GPU tests of the newest kernels (KERNEL_TESTS, default the fused sampler's,
#             verify-probs', pick kernels', drafter chain and tree graphs' files; then test_engine_gpu.py
#             -k ENGINE_K: split merge, linear configs, fused prologues, sampling graphs),
#             then tools/profile_generate.py --shape 1.5b --batch-sizes 1,32 with every
#             kernel of sessions 18-19 on and off (random weights, no target needed;
#             pg_kernels_s19_{1,0}.json, each side its own plan file)
#             KERNEL_PARTS=tests (or profile) runs one half
#   pdl       programmatic dependent launch (MEGATRON_TLT_PDL, on by default since session 25)
#             with the 32 MB L2 prefetch through the speculative GPU tests first (what made
#             it the default), then tests/gpu/test_engine_gpu.py, then bench rollout with
#             PDL --compare-pdl --compare-preload 64 (random weights, no target needed; a
#             600 s call). The spec stage under MEGATRON_TLT_PDL=0 (SPEC_TAG=_nopdl) times
#             SD without it on the trained target
#   fusions   RoPE folded into the attention kernel of decode and verify (MEGATRON_TLT_FUSED_ROPE,
#             on by default since session 24) and the live-split in-kernel merge
#             (MEGATRON_TLT_FUSED_COMBINE=1, opt-in): their GPU tests (and
#             tests/gpu/test_spec_gpu.py with both on), then bench rollout
#             --compare-fused-rope --compare-merge with PDL on and off, then
#             tools/profile_decode.py at batch 1 with both off / on (random weights, no
#             target needed; a 600 s call)
#   splits    session 25's attention changes (4-tile minimum split, unrolled in-kernel merge,
#             decode K/V from registers, loads before the PDL wait): their GPU tests, bench
#             rollout --compare-split-min --compare-merge with PDL on and off, then
#             tests/gpu/test_spec_gpu.py (random weights, no target needed; a 600 s call)
#   warps     session 26's warps (decode attention 8 while its grid has <= 1 program per SM,
#             RMSNorm up to 16): the attention kernels' bit-exactness GPU tests and
#             tests/gpu/test_spec_gpu.py with them, then bench rollout against the old warps
#             side by side (--compare-attr; random weights, no target needed; a 600 s call)
#   attn      session 27's attention settings: bench rollout with one pipelining stage
#             for one-tile decode splits, 4-tile splits merged in the kernel on grids that
#             fill the GPU (defaults since session 27) against the old settings, and split
#             grids capped at 132 / 264 programs (opt-in SPLIT_PROGRAMS) side by side
#             (--compare-attr; random weights, no target needed), then tools/attention_sweep.py
#             at the 7B shape, batch 32, and the 1.5B shape, batch 1 (ATTN_PARTS=tests runs
#             the decode attention GPU tests and tests/gpu/test_spec_gpu.py instead)
#   tiles     session 28's key-tile and full-grid knobs against the defaults (bench rollout
#             --compare-attr), then the 1.5B batch-1 profile (TILES_PARTS=tests: GPU tests)
#   l2        session 29's weight prefetch into L2 after the attention (default 4 MB): bench
#             rollout against 0 and 8 MB (L2_PARTS=tests: its GPU tests, graph/PDL decode
#             and tests/gpu/test_spec_gpu.py)
#   phases    session 30's tools/attention_phases.py: the fused decode attention's time by
#             phase (clock reads in a copy of the kernel), PHASES_SHAPES (default
#             "1.5b:1 7b:32", SHAPE:BATCH each; random weights, no target needed)
#   ablate    session 31's tools/ablate_decode.py: the decode step in its graph with one
#             kind of kernel left out or emptied, side by side with the whole step;
#             ABLATE_SHAPES (default "1.5b:1,8,32 7b:1,32", SHAPE:BATCHES each), ABLATE_VARIANTS
#             (default the tool's list); random weights, no target needed
#   glu       session 32's GLU epilogue of the gate/up projection (opt-in, triton_linear._GLU):
#             bench rollout at GLU_BATCHES (default 1,8,32) against _GLU=1 (planner's
#             choice) and _GLU=2 (always), the planner's glu decisions from the plan file,
#             then its GPU tests (random weights, no target needed)
#   loop      session 33's decode-attention key-loop knobs (gpu_model.ROPE_ATTENTION_WRITE_FIRST,
#             _OFF32, _SAME_STRIDES, _PAGES_AHEAD; timed in session 34, whose defaults changed the
#             baseline these variants are set over: s34 compares against the old loop): the fused
#             attention alone at 7B B=32 and 1.5B B=1 (tools/attention_sweep.py --only),
#             bench rollout against WRITE_FIRST=1 / 2 with and without OFF32 (and SAME_STRIDES), then their
#             bit-for-bit GPU tests (random weights, no target needed; ~400 s)
#   s34       session 34's defaults (decode_write_first's WRITE_FIRST, OFF32, SAME_STRIDES): their
#             decode GPU tests and session 35's NORM_EARLY_WEIGHT's (S34_RESERVE s left for
#             what follows, default 150), then bench rollout at batch 1 / 8 / 16 / 32 against
#             the loop before them and WRITE_FIRST 1 / 2 everywhere (~250 s; S34_SHORT=1:
#             against the loop before only). Ran in session 36 (H100), with
#             NORM_EARLY_WEIGHT=True then too (the default since: s36 times it off).
#   s36       the defaults since session 36 (NORM_EARLY_WEIGHT on): on an H200 the issue's
#             benchmark (`bench rollout --json`, every shape and batch, HF included) first,
#             with S36_RESERVE s (default 260) left for the A/B after it (S36_BENCH_ARGS: more
#             bench arguments, e.g. --hf-batch-sizes 16); then bench rollout at
#             batch 1 / 8 / 16 / 32 against NORM_EARLY_WEIGHT=False and the L2 prefetch's
#             8 MB (16 MB too on an H100, where the decode GPU tests of the norm run first)
#   s37       the kernel after a cuBLAS projection launched without PDL (pdl.PLAIN_AFTER_CUBLAS,
#             opt-in when it ran in session 37, on by default since: here now =False): on an H200 the issue's benchmark first (as s36, S37_RESERVE s, default
#             300, left for the A/B; S37_FULL=0 skips it), elsewhere its GPU test and PDL's;
#             then bench rollout at batch 1 / 8 / 16 / 32 against the knob on, every
#             projection on cuBLAS, and every projection on cuBLAS with the knob on
#   s37b      bench rollout at batch 1 against triton_linear.FMA_WIDE=True, then at batch 32
#             against triton_linear.CUBLAS_MARGIN=1.05 and PLAIN_AFTER_CUBLAS=False (~2 min;
#             S37B_REPEAT=1: each compare twice, the second a repeat on the first's plans);
#             first the GPU test of FMA_WIDE's configs (S37B_TESTS=0 skips it; ~30 s)
#   s39       on an H200 the issue's benchmark first (S39_FULL=0 skips it, =2 runs it on any
#             card; ~6 min on an H100); then bench rollout
#             at batch 1 against the batch-1 L2 prefetch budget gpu_model.ATTN_L2_PREFETCH_MB_FEW
#             = None (4 MB, the budget before session 39) / 12 / 16 MB and the default
#             restated (8, the noise floor), twice (~1.5 min)
#   s40       on an H200 the issue's benchmark first (S40_FULL=0 skips it, =2 runs it on any
#             card); then bench rollout at batch 1 / 32, twice, against the projections'
#             own L2 prefetch before their PDL wait (MEGATRON_TLT_PDL_PREFETCH_MB=32 and 8:
#             1.036x at 1.5B batch 1 on session 24's H200, 0.91x-1.00x on session 26's H100),
#             16 KB of weight tiles loaded before it (MEGATRON_TLT_PDL_PRELOAD_KB=16) and
#             the one-row attention prefetch budget ATTN_L2_PREFETCH_MB_FEW = 16 / None
#             (4 MB) (~2 min)
#   s41       on an H200 the issue's benchmark first (S41_FULL as S40_FULL); then bench
#             rollout at batch 1 / 32, twice, against what the H200's faster HBM may tip:
#             MEGATRON_TLT_PDL_PREFETCH_MB=32 (1.036x on session 24's H200, 0.971x on
#             session 41's H100), the GLU epilogue where the planner times it faster
#             (triton_linear._GLU=1: one launch fewer a layer; 0.924x-1.004x on session
#             33's H100), a 16 MB one-row attention prefetch and an 8 MB one at every batch
#             (gpu_model.ATTN_L2_PREFETCH_MB=8) (~2.5 min)
#   s42       the float16 optimizer's GPU test, tests/gpu/test_engine_gpu.py and
#             test_eagle_graph_gpu.py (decode graphs now captured before verify graphs), then
#             on an H200 tools/ablate_decode.py at 1.5B batch 1 (what each kind of kernel adds
#             inside the graph; ~2 min)
#   s43       the one-launch argmax + input update of bench's device loop: its GPU test, then
#             bench rollout at batch 1 / 32, twice, against bench.FUSED_ADVANCE=True (~44 us of
#             the 1.5B batch-1 step on session 42's H200 is the loop's dozen torch launches) and
#             the split merge inside the attention kernel (triton_attention._MERGE: the
#             separate merge cost 34 us there); S43_FULL=1 runs the issue's benchmark first on
#             an H200 (default 0: the defaults did not change) (~3 min)
#   s44       the issue's benchmark with bench.FUSED_ADVANCE on by default (session 44: faster in
#             every cell on an H100), its torch-ops loop timed beside it (--compare-attr
#             megatron_tlt.bench:FUSED_ADVANCE=False); S44_FULL=1 (default) on an H200 only, 2 on
#             any card; then tests/gpu/test_engine_gpu.py in the time left (~4 min + tests)
#   lsweep    tools/linear_sweep.py --cases LSWEEP_CASES (default 1.5b:1,7b:32,1.5b:32): the
#             projections with Triton configs the planner does not try, against its own
#             candidates, each alone (no target needed; ~2-4 min)
#   gputests  tests/gpu (GPU_TESTS overrides the list)
# Running `target` in the background beside `kernels` in one call: wait for it with
# `wait $pid` (bash scripts/h200_runbook.sh target ... & pid=$!), never with
# `pgrep -f h200_rl_step`, which matches the call's own command line and waits until the
# tool's limit (session 23's first call).
# Environment: MEGATRON_TLT_GIT_REV (the revision to record; the tree has no .git there).
set -uo pipefail
STAGE=${1:?usage: h200_runbook.sh STAGE RESULTS_DIR [LIMIT_S]}
RESULTS=${2:?usage: h200_runbook.sh STAGE RESULTS_DIR [LIMIT_S]}
LIMIT=${3:-590}
BUDGET=$(( LIMIT - 25 ))
WORK=${WORK:-/tmp/h200rl}
PY=${PYTHON:-python3}
mkdir -p "$RESULTS"
t0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - t0) )); }
# seconds left minus a reserve for what follows, at least 30 (a negative timeout is an error)
upto() { local v=$(( $(left) - $1 )); [ "$v" -lt 30 ] && v=30; echo "$v"; }
# issue_bench_wanted FLAG: a stage's S<N>_FULL: 2 runs the issue's benchmark on any card, 0
# never, else (default 1) on an H200 only
issue_bench_wanted() {
  [ "$1" = 2 ] || { [ "$1" != 0 ] && nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; }
}
# issue_then_ab NAME FULL RESERVE ARGS...: the issue's benchmark when issue_bench_wanted
# FULL (RESERVE s left after it), then ab_bench NAME_1 and NAME_2 with ARGS (two runs)
issue_then_ab() {
  local name=$1 full=$2 reserve=$3 r
  shift 3
  if issue_bench_wanted "$full"; then
    issue_bench "$reserve"
  fi
  for r in 1 2; do
    ab_bench "${name}_$r" 5 "$@"
  done
}
# pytest_stage LABEL RESERVE LOG PYTEST_ARGS...: pytest under the stage's time left minus
# RESERVE, its output in RESULTS/LOG, rc and the last lines printed
pytest_stage() {
  local label=$1 reserve=$2 log=$3; shift 3
  timeout "$(upto "$reserve")" $PY -m pytest -q -p no:cacheprovider "$@" > "$RESULTS/$log" 2>&1
  echo "[runbook] $label: rc=$? at $(( $(date +%s) - t0 )) s"
  tail -n 4 "$RESULTS/$log"
}

ab_bench() {  # ab_bench NAME RESERVE_S ARGS...: bench rollout (1.5B / 7B, batch 1 / 8 / 32, no HF)
  # the whole log in RESULTS (a run cut by the time limit keeps its per-batch lines there, and
  # the JSON the shapes it finished); its table and errors printed
  local name=$1 reserve=$2; shift 2
  timeout "$(upto "$reserve")" $PY -m megatron_tlt bench rollout --json "$RESULTS/bench_rollout_$name.json" \
      --shapes 1.5b,7b --batch-sizes 1,8,32 --no-hf "$@" > "$RESULTS/bench_rollout_$name.log" 2>&1
  echo "[runbook] $name bench: rc=$? at $(( $(date +%s) - t0 )) s"
  grep -E "^ *(shape|1.5b|7b) |rror" "$RESULTS/bench_rollout_$name.log" | tail -n 16
}

issue_bench() {  # issue_bench RESERVE_S: the issue's benchmark (bench rollout --json, every
  # shape and batch, HF included; S36_BENCH_ARGS: more arguments), RESERVE_S left after it
  # shellcheck disable=SC2086
  timeout "$(upto "$1")" $PY -m megatron_tlt bench rollout ${S36_BENCH_ARGS:-} \
      --json "$RESULTS/bench_rollout_full_h200.json" > "$RESULTS/bench_rollout_full_h200.log" 2>&1
  echo "[runbook] issue benchmark: rc=$? at $(( $(date +%s) - t0 )) s"
  grep -E "^ *(shape|1.5b|7b) |HF|hf|rror" "$RESULTS/bench_rollout_full_h200.log" | tail -n 24
}

$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/megatron*.whl > /dev/null 2>&1 || { [ -d /tmp/site/megatron ] || { echo "no megatron-core wheel in .whl"; exit 0; }; }
$PY -c "import pytest" 2> /dev/null || $PY -m pip install -q --no-index --no-deps \
    --target /tmp/site2 .whl/opt/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:/tmp/site2:$PWD TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} PYTHONUNBUFFERED=1
export MEGATRON_TLT_LINEAR_PLANS=${MEGATRON_TLT_LINEAR_PLANS:-$WORK/linear_plans.json}
mkdir -p "$WORK"
G=megatron_tlt.rollout.gpu_model  # the stages' --compare-attr module (some set it again)

case "$STAGE" in
  setup) ;;
  target)
    # A checkpoint at step 100 (~15 s to write): the 120 steps took 527 s of a 565 s budget
    # in session 16 and were cut at 565 s on the next machine (session 17), losing them all;
    # cut now, the stage run again resumes at step 100.
    SFT_SAVE_INTERVAL=${SFT_SAVE_INTERVAL:-100} STOP_AFTER=target timeout "$(left)" \
        bash scripts/h200_rl_step.sh "$WORK" 120 "$RESULTS"
    echo "[runbook] target: rc=$? at $(( $(date +%s) - t0 )) s" ;;
  drafters|spec)
    [ -f "$WORK/sft/hf/config.json" ] || { echo "[runbook] no target in $WORK (run the target stage first)"; exit 0; }
    for d in ${DRAFTERS:-t09x512u2s960 t09x512}; do
      [ "$(left)" -gt 30 ] || break
      if [ "$STAGE" = drafters ]; then
        SWEEP_DRAFTERS=$d SWEEP_DEPTHS=none timeout "$(left)" bash scripts/h200_spec_sweep.sh "$WORK" "$RESULTS"
      elif [ -f "$WORK/drafter_$d/config.json" ]; then
        SWEEP_DRAFTERS=$d SWEEP_DEPTHS=${SPEC_DEPTHS:-1:6,32:4} SWEEP_TAG=${SPEC_TAG:-_s19} \
        SWEEP_MODES=${SPEC_MODES:-eagle,eagle-torchlayer,eagle-onehot} SWEEP_BATCHES=${SPEC_BATCHES:-1,4,16,32} \
            timeout "$(left)" bash scripts/h200_spec_sweep.sh "$WORK" "$RESULTS"
      fi
      echo "[runbook] $STAGE $d: rc=$? at $(( $(date +%s) - t0 )) s"
    done ;;
  acceptance)
    # each trained drafter's first-level acceptance by proposal rule at T=0.9 on 64 fresh
    # responses of the target (tools/drafter_acceptance.py; a minute or less per drafter)
    [ -f "$WORK/sft/hf/config.json" ] || { echo "[runbook] no target in $WORK (run the target stage first)"; exit 0; }
    for d in ${DRAFTERS:-t09x512u2s960 t09x512}; do
      [ -f "$WORK/drafter_$d/config.json" ] && [ "$(left)" -gt 30 ] || continue
      timeout "$(left)" $PY tools/drafter_acceptance.py --target "$WORK/sft/hf" --drafter "$WORK/drafter_$d" \
          --tasks arith,sort --num-prompts 64 --seed 3 --json "$RESULTS/level1_$d.json" 2>&1 | tail -n 2
    done
    echo "[runbook] acceptance: at $(( $(date +%s) - t0 )) s" ;;
  rollout)
    timeout "$(upto 100)" $PY -m megatron_tlt bench rollout --json "$RESULTS/bench_rollout_pdl.json" \
        --shapes 1.5b,7b --batch-sizes 1,8,32 --no-hf --compare-pdl 2>&1 | tail -n 30
    timeout "$(left)" $PY -m pytest -q -p no:cacheprovider tests/gpu/test_engine_gpu.py -k pdl \
        2>&1 | tail -n 15 | tee "$RESULTS/gpu_tests_pdl.log"
    echo "[runbook] rollout: at $(( $(date +%s) - t0 )) s" ;;
  kernels)
    # KERNEL_PARTS (default "tests profile"): "tests" alone runs beside another stage (its
    # results are pass/fail, not times); "profile" alone wants the GPU to itself.
    parts=${KERNEL_PARTS:-tests profile}
    res=0; [[ $parts == *profile* ]] && res=170  # seconds kept for the profile
    if [[ $parts == *tests* ]]; then
    # shellcheck disable=SC2086
    timeout "$(( $(left) - res ))" $PY -m pytest -q -p no:cacheprovider \
        ${KERNEL_TESTS:-tests/gpu/test_triton_sample_gpu.py tests/gpu/test_triton_verify_probs_gpu.py tests/gpu/test_triton_pick_gpu.py tests/gpu/test_eagle_graph_gpu.py tests/gpu/test_eagle_tree_graph_gpu.py} \
        > "$RESULTS/gpu_tests_kernels.log" 2>&1
    echo "[runbook] kernels tests: rc=$? at $(( $(date +%s) - t0 )) s"
    tail -n 4 "$RESULTS/gpu_tests_kernels.log"
    # session 19's engine kernels: in-kernel split merge, Triton linears for 65-256 rows,
    # fma prologues, the fused sampler inside the engine
    timeout "$(( $(left) - res ))" $PY -m pytest -q -p no:cacheprovider tests/gpu/test_engine_gpu.py \
        -k "${ENGINE_K:-split_merge or linear_configs or fused_prologues or sample_graph or sampled_graphs or decode_kernel or verify_kernel or greedy_sampler}" \
        > "$RESULTS/gpu_tests_engine_kernels.log" 2>&1
    echo "[runbook] engine kernel tests: rc=$? at $(( $(date +%s) - t0 )) s"
    tail -n 4 "$RESULTS/gpu_tests_engine_kernels.log"
    fi
    [[ $parts == *profile* ]] || { echo "[runbook] kernels: no profile asked"; exit 0; }
    # k=1: every kernel of sessions 18-19 on (drafter layer kernels, fused sampler, in-kernel
    # split merge, Triton linears up to 256 rows, fma prologues); k=0: all off, as at
    # session 17. The plain decode column times the sampler, merge and fma prologues, the
    # verify-forward graph the 160-row linears, the draft-chain graph the drafter kernels.
    for k in 1 0; do
      [ "$(left)" -gt 60 ] || break
      if [ "$k" = 1 ]; then rows=256; frows=8; else rows=64; frows=1; fi
      # a plan file per side: a choice read from a shared file would cross over
      MEGATRON_TLT_DRAFTER_KERNELS=$k MEGATRON_TLT_FUSED_SAMPLE=$k MEGATRON_TLT_FUSED_COMBINE=$k \
          MEGATRON_TLT_FMA_PROLOGUES=$k MEGATRON_TLT_TRITON_ROWS=$rows MEGATRON_TLT_FUSED_ROWS=$frows \
          MEGATRON_TLT_LINEAR_PLANS="$WORK/linear_plans_s19_$k.json" timeout "$(left)" $PY \
          tools/profile_generate.py --shape 1.5b \
          --batch-sizes 1,32 --json "$RESULTS/pg_kernels_s19_$k.json" 2>&1 | grep -v -i warn | tail -n 12
      echo "[runbook] kernels profile (sessions 18-19 kernels $k): rc=$? at $(( $(date +%s) - t0 )) s"
    done ;;
  pdl)
    # What made PDL the default (session 25): the speculative GPU tests with it on, first
    # (session 24 cut them at 11 passed, 0 failed, compiling the PDL variants; the engine
    # tests passed with it there), then the engine tests the same session ran, then one
    # bench rollout with PDL against PDL off (--compare-pdl) and against PDL with 64 KB of
    # weight tiles preloaded before the wait (--compare-preload 64).
    MEGATRON_TLT_PDL=1 MEGATRON_TLT_PDL_PREFETCH_MB=32 timeout "$(upto 250)" $PY -m pytest -q \
        -p no:cacheprovider tests/gpu/test_spec_gpu.py tests/gpu/test_eagle_graph_gpu.py \
        tests/gpu/test_eagle_tree_graph_gpu.py > "$RESULTS/gpu_tests_pdl1_spec.log" 2>&1
    echo "[runbook] pdl spec tests: rc=$? at $(( $(date +%s) - t0 )) s"
    tail -n 4 "$RESULTS/gpu_tests_pdl1_spec.log"
    MEGATRON_TLT_PDL=1 MEGATRON_TLT_PDL_PREFETCH_MB=32 timeout "$(upto 130)" $PY -m pytest -q \
        -p no:cacheprovider tests/gpu/test_engine_gpu.py > "$RESULTS/gpu_tests_pdl1_engine.log" 2>&1
    echo "[runbook] pdl engine tests: rc=$? at $(( $(date +%s) - t0 )) s"
    tail -n 4 "$RESULTS/gpu_tests_pdl1_engine.log"
    if [ "$(left)" -gt 60 ]; then
      # PDL on (no L2 prefetch) against off, and against PDL with 64 KB weight preload
      MEGATRON_TLT_PDL=1 timeout "$(upto 5)" $PY -m megatron_tlt \
          bench rollout --json "$RESULTS/bench_rollout_pdl_preload.json" --shapes 1.5b,7b \
          --batch-sizes 1,8,32 --no-hf --compare-pdl --compare-preload 64 2>&1 | grep -E "^ *(shape|1.5b|7b) |rror" | tail -n 16
      echo "[runbook] pdl bench: rc=$? at $(( $(date +%s) - t0 )) s"
    fi ;;
  fusions)
    # Session 24's launches fewer per layer: RoPE + the K/V write inside the attention
    # kernel (MEGATRON_TLT_FUSED_ROPE, default on) and the in-kernel split-K merge over live
    # splits only (MEGATRON_TLT_FUSED_COMBINE=1, opt-in). Their GPU tests first (bit-exact
    # against the separate kernels, graphs, PDL), then bench rollout timing each side by
    # side, without and with PDL.
    timeout "$(upto 380)" $PY -m pytest -q -p no:cacheprovider tests/gpu/test_engine_gpu.py \
        -k "rope or split_merge or decode_kernel or verify_kernel or pdl or cuda_graph_decode" \
        > "$RESULTS/gpu_tests_fusions.log" 2>&1
    echo "[runbook] fusions tests: rc=$? at $(( $(date +%s) - t0 )) s"
    tail -n 4 "$RESULTS/gpu_tests_fusions.log"
    # The speculative paths with both fusions on (SD == plain decode, verify graphs == eager).
    MEGATRON_TLT_FUSED_ROPE=1 MEGATRON_TLT_FUSED_COMBINE=1 timeout "$(upto 310)" $PY -m pytest \
        -q -p no:cacheprovider tests/gpu/test_spec_gpu.py > "$RESULTS/gpu_tests_fusions_spec.log" 2>&1
    echo "[runbook] fusions spec tests: rc=$? at $(( $(date +%s) - t0 )) s"
    tail -n 4 "$RESULTS/gpu_tests_fusions_spec.log"
    for p in 1 0; do
      [ "$(left)" -gt 60 ] || break
      MEGATRON_TLT_PDL=$p timeout 150 $PY -m megatron_tlt bench rollout \
          --json "$RESULTS/bench_rollout_fusions_pdl$p.json" --shapes 1.5b,7b --batch-sizes 1,8,32 \
          --no-hf --compare-fused-rope --compare-merge 2>&1 | grep -E "^ *(shape|1.5b|7b) |rror" | tail -n 16
      echo "[runbook] fusions bench (PDL $p): rc=$? at $(( $(date +%s) - t0 )) s"
    done
    for f in 0 1; do  # per-kernel time of a batch-1 step, both fusions off / on
      [ "$(left)" -gt 45 ] || break
      MEGATRON_TLT_FUSED_ROPE=$f MEGATRON_TLT_FUSED_COMBINE=$f timeout 40 $PY tools/profile_decode.py \
          --shape 1.5b --batch 1 --json "$RESULTS/profile_decode_1p5b_b1_fused$f.json" 2>&1 | tail -n 12
    done ;;
  splits)
    # Session 25: split-K splits of at least 4 key tiles (a context of up to 256 keys is one
    # split that writes its output, no merge; the default was 4 at b6145d7 and is 1 again
    # since, so --compare-split-min now times 4 against 1), the unrolled in-kernel merge,
    # and decode attention taking the new token's K/V from registers (its first key tile
    # loaded before the PDL wait). The attention kernels' GPU tests first (bit-exact against
    # the separate kernels, graphs, PDL), then bench rollout with --compare-split-min
    # --compare-merge, PDL on and off, then the speculative tests.
    timeout "$(upto 320)" $PY -m pytest -q -p no:cacheprovider tests/gpu/test_engine_gpu.py \
        -k "rope or split_merge or decode_kernel or verify or causal or negative_control or pdl or cuda_graph_decode or decode_model" \
        > "$RESULTS/gpu_tests_splits.log" 2>&1
    echo "[runbook] splits tests: rc=$? at $(( $(date +%s) - t0 )) s"
    tail -n 4 "$RESULTS/gpu_tests_splits.log"
    for p in 1 0; do
      [ "$(left)" -gt 60 ] || break
      MEGATRON_TLT_PDL=$p timeout "$(upto 20)" $PY -m megatron_tlt bench rollout \
          --json "$RESULTS/bench_rollout_splits_pdl$p.json" --shapes 1.5b,7b --batch-sizes 1,8,32 \
          --no-hf --compare-split-min --compare-merge 2>&1 | grep -E "^ *(shape|1.5b|7b) |rror" | tail -n 16
      echo "[runbook] splits bench (PDL $p): rc=$? at $(( $(date +%s) - t0 )) s"
    done
    if [ "$(left)" -gt 60 ]; then
      timeout "$(upto 5)" $PY -m pytest -q -p no:cacheprovider tests/gpu/test_spec_gpu.py \
          > "$RESULTS/gpu_tests_splits_spec.log" 2>&1
      echo "[runbook] splits spec tests: rc=$? at $(( $(date +%s) - t0 )) s"
      tail -n 4 "$RESULTS/gpu_tests_splits_spec.log"
    fi ;;
  warps)
    # Session 26: decode attention with 8 warps while its grid has at most one program per
    # SM (triton_attention.decode_warps, paged and fused kernels alike) and RMSNorm with one
    # warp per 128 columns up to 16. Timed on two H100s only, and its bit-exactness tests
    # (fused == separate kernels, graphs, PDL, speculative decoding) not yet run on a GPU:
    # those first, then bench rollout against the old warps side by side (the first
    # --compare-attr is the old setting of the 1.5B shape, the second of the 7B) and two
    # untried steps further (RMSNorm 32 warps; attention 16 warps at every grid, which
    # matters where the grid is small: both compile for sm_90).
    pytest_stage "warps tests" 300 gpu_tests_warps.log tests/gpu/test_engine_gpu.py \
        -k "rope or split_merge or verify_kernel or causal or negative_control or pdl or cuda_graph_decode or decode_model"
    pytest_stage "warps spec tests" 150 gpu_tests_warps_spec.log tests/gpu/test_spec_gpu.py
    G=megatron_tlt.rollout.gpu_model A=megatron_tlt.rollout.triton_attention
    ab_bench warps 5 \
        --compare-attr "$G:NORM_WARPS=4;$G:ROPE_ATTENTION_WARPS=4;$A:ATTENTION_WARPS=4" \
        --compare-attr "$G:NORM_WARPS=8;$G:ROPE_ATTENTION_WARPS=4;$A:ATTENTION_WARPS=4" \
        --compare-attr "$G:NORM_WARPS=32" \
        --compare-attr "$G:ROPE_ATTENTION_WARPS=16;$A:ATTENTION_WARPS=16" ;;
  attn)
    G=megatron_tlt.rollout.gpu_model A=megatron_tlt.rollout.triton_attention
    if [ "${ATTN_PARTS:-bench}" = tests ]; then
      pytest_stage "attn tests" 200 gpu_tests_attn.log tests/gpu/test_engine_gpu.py \
          -k "rope_attention or fused_rope or split_merge or negative_control or cuda_graph_decode or pdl_decode"
      pytest_stage "attn spec tests" 5 gpu_tests_attn_spec.log tests/gpu/test_spec_gpu.py
    else
      ab_bench attn 120 \
          --compare-attr "$G:ROPE_ATTENTION_STAGES=2;$A:FULL_GRID_MIN_TILES=1;$A:FULL_GRID_MERGE=False" \
          --compare-attr "$G:ROPE_ATTENTION_STAGES=2" \
          --compare-attr "$A:FULL_GRID_MIN_TILES=1;$A:FULL_GRID_MERGE=False" \
          --compare-attr "$A:FULL_GRID_MERGE=False" \
          --compare-attr "$A:SPLIT_PROGRAMS=132" \
          --compare-attr "$A:SPLIT_PROGRAMS=264"
      for sb in "7b 32 2" "1.5b 1 1"; do
        set -- $sb
        timeout "$(upto 5)" $PY tools/attention_sweep.py --shape "$1" --batch "$2" --planes "$3" \
            --json "$RESULTS/attn_sweep_$1_b$2.json" 2>&1 | grep -E "us/call|failed|rror" \
            | grep -E "^(default|before|splits=1 |splits=4 |stages=|splits=1,stages=1 )|failed|rror"
      done
      echo "[runbook] attn sweeps: at $(( $(date +%s) - t0 )) s"
    fi ;;
  l2)
    # Session 29: weights asked into L2 after each layer's fused attention
    # (gpu_model.ATTN_L2_PREFETCH_MB, rollout/l2_prefetch.py; 4 MB by default since calls
    # 3-4 timed budgets side by side). L2_PARTS=tests: its GPU tests, the PDL and graph
    # decode tests and tests/gpu/test_spec_gpu.py (the verify takes it too) with the
    # default; else bench rollout, the default against 0 and 8 MB.
    G=megatron_tlt.rollout.gpu_model
    if [ "${L2_PARTS:-bench}" = tests ]; then
      pytest_stage "l2 and spec tests" 120 gpu_tests_l2.log tests/gpu/test_l2_prefetch_gpu.py \
          tests/gpu/test_spec_gpu.py
      pytest_stage "l2 engine tests" 5 gpu_tests_l2_engine.log tests/gpu/test_engine_gpu.py \
          -k "pdl or cuda_graph_decode or fused_rope"
    else
      ab_bench l2 5 --compare-attr "$G:ATTN_L2_PREFETCH_MB=0" --compare-attr "$G:ATTN_L2_PREFETCH_MB=8"
    fi ;;
  tiles)
    # Session 28: the fused attention's key tile (gpu_model.ROPE_ATTENTION_BLOCK_N, an A/B
    # knob) with the full-grid minimum tiles (triton_attention.FULL_GRID_MIN_TILES); session
    # 29 ran it (neither became a default: gpu_model's docstrings). TILES_PARTS=tests: the
    # GPU tests of the fused prologues, linear configs and decode; else bench rollout side
    # by side, then the 1.5B batch-1 profile with the planner's fused-prologue timings.
    G=megatron_tlt.rollout.gpu_model A=megatron_tlt.rollout.triton_attention
    if [ "${TILES_PARTS:-bench}" = tests ]; then
      pytest_stage "tiles tests" 120 gpu_tests_tiles.log tests/gpu/test_engine_gpu.py \
          -k "fused_prologues or planner_fused or linear_configs or decode_model or cuda_graph_decode"
      pytest_stage "tiles spec tests" 5 gpu_tests_tiles_spec.log tests/gpu/test_spec_gpu.py
    else
      ab_bench tiles 130 --compare-attr "$G:ROPE_ATTENTION_BLOCK_N=32" \
          --compare-attr "$A:FULL_GRID_MIN_TILES=2" \
          --compare-attr "$G:ROPE_ATTENTION_BLOCK_N=32;$A:FULL_GRID_MIN_TILES=8"
      timeout "$(upto 5)" $PY tools/profile_decode.py --shape 1.5b --batch 1 \
          --json "$RESULTS/profile_1.5b_b1.json" 2>&1 | grep -E "us/step|fused prologues|rror" | head -n 4
      echo "[runbook] tiles profile: at $(( $(date +%s) - t0 )) s"
    fi ;;
  phases)
    for sb in ${PHASES_SHAPES:-1.5b:1 7b:32}; do
      timeout "$(upto 5)" $PY tools/attention_phases.py --shape "${sb%%:*}" --batch "${sb##*:}" \
          --json "$RESULTS/attention_phases_${sb%%:*}_b${sb##*:}.json" 2>&1 | tail -n 19
    done ;;
  ablate)
    for sb in ${ABLATE_SHAPES:-1.5b:1,8,32 7b:1,32}; do
      timeout "$(upto 5)" $PY tools/ablate_decode.py --shape "${sb%%:*}" --batch-sizes "${sb##*:}" \
          ${ABLATE_VARIANTS:+--variants "$ABLATE_VARIANTS"} \
          --json "$RESULTS/ablate_${sb%%:*}.json" 2>&1 | grep -v Warn | tee "$RESULTS/ablate_${sb%%:*}.log" | tail -n 40
    done ;;
  glu)
    timeout "$(upto 120)" $PY -m megatron_tlt bench rollout --json "$RESULTS/bench_rollout_glu.json" \
        --shapes 1.5b,7b --batch-sizes ${GLU_BATCHES:-1,8,32} --no-hf \
        --compare-attr megatron_tlt.rollout.triton_linear:_GLU=1 \
        --compare-attr megatron_tlt.rollout.triton_linear:_GLU=2 2>&1 | grep -v Warn | tail -n 12
    $PY - "$MEGATRON_TLT_LINEAR_PLANS" <<'PYEOF' 2>&1 | tee "$RESULTS/glu_plans.txt"
import json, sys
for e in json.load(open(sys.argv[1])).get("fused", []):
    if str(e["key"][0]).startswith("glu"):
        print(e["key"][:4], e["config"], round(e["fused_us"], 2), "us against", round(e["unfused_us"], 2))
PYEOF
    timeout "$(left)" $PY -m pytest -q -p no:cacheprovider tests/gpu/test_glu_epilogue_gpu.py \
        2>&1 | tail -n 8 | tee "$RESULTS/gpu_tests_glu.log"
    echo "[runbook] glu: at $(( $(date +%s) - t0 )) s" ;;
  loop)
    G=megatron_tlt.rollout.gpu_model
    for sb in "7b 32 2" "1.5b 1 1"; do
      set -- $sb
      timeout "$(upto 300)" $PY tools/attention_sweep.py --shape "$1" --batch "$2" --planes "$3" \
          --only write,off32,pages_ahead --json "$RESULTS/attn_sweep_loop_$1_b$2.json" 2>&1 \
          | grep -E "us/call|failed|rror"
    done
    ab_bench loop 120 \
        --compare-attr "$G:ROPE_ATTENTION_WRITE_FIRST=1" \
        --compare-attr "$G:ROPE_ATTENTION_WRITE_FIRST=2" \
        --compare-attr "$G:ROPE_ATTENTION_WRITE_FIRST=1;$G:ROPE_ATTENTION_OFF32=True" \
        --compare-attr "$G:ROPE_ATTENTION_WRITE_FIRST=2;$G:ROPE_ATTENTION_OFF32=True" \
        --compare-attr "$G:ROPE_ATTENTION_WRITE_FIRST=2;$G:ROPE_ATTENTION_OFF32=True;$G:ROPE_ATTENTION_SAME_STRIDES=True" \
        --compare-attr "$G:ROPE_ATTENTION_OFF32=True"
    pytest_stage "loop tests" 5 gpu_tests_loop.log tests/gpu/test_engine_gpu.py \
        -k "rope_attention_equals_separate or full_grid_minimum_fused" ;;
  s34)
    G=megatron_tlt.rollout.gpu_model
    pytest_stage "s34 tests" "${S34_RESERVE:-150}" gpu_tests_s34.log tests/gpu/test_engine_gpu.py -k \
        "((rope_attention_equals_separate or full_grid_minimum_fused) and (default or before-s34 or same-write-first)) or fused_rope_graph_decode or cuda_graph_decode_equals or norm_early_weight"
    cmp=(--compare-attr "$G:ROPE_ATTENTION_WRITE_FIRST=0;$G:ROPE_ATTENTION_OFF32=False;$G:ROPE_ATTENTION_SAME_STRIDES=False")
    [ "${S34_SHORT:-0}" = 1 ] || cmp+=(--compare-attr "$G:ROPE_ATTENTION_WRITE_FIRST=1"
                                      --compare-attr "$G:ROPE_ATTENTION_WRITE_FIRST=2")
    ab_bench s34 5 --batch-sizes 1,8,16,32 "${cmp[@]}" ;;
  s36)
    G=megatron_tlt.rollout.gpu_model
    cmp=(--compare-attr "$G:NORM_EARLY_WEIGHT=False" --compare-attr "$G:ATTN_L2_PREFETCH_MB=8")
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
      issue_bench "${S36_RESERVE:-260}"
    else
      pytest_stage "s36 tests" "${S36_RESERVE:-300}" gpu_tests_s36.log tests/gpu/test_engine_gpu.py -k \
          "norm or cuda_graph_decode_equals or pdl_decode or fused_rope_graph_decode"
      cmp+=(--compare-attr "$G:ATTN_L2_PREFETCH_MB=16")
    fi
    ab_bench s36 5 --batch-sizes 1,8,16,32 "${cmp[@]}" ;;
  s37)
    L=megatron_tlt.rollout
    allcublas="$L.triton_linear:_MAX_TRITON_ROWS=0;$L.triton_linear:_FUSED_ROWS=0"
    cmp=(--compare-attr "$L.pdl:PLAIN_AFTER_CUBLAS=False" --compare-attr "$allcublas"
         --compare-attr "$allcublas;$L.pdl:PLAIN_AFTER_CUBLAS=False")
    if [ "${S37_FULL:-1}" != 0 ] && nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
      issue_bench "${S37_RESERVE:-300}"
    else
      pytest_stage "s37 tests" "${S37_RESERVE:-300}" gpu_tests_s37.log tests/gpu/test_engine_gpu.py -k \
          "plain_after_cublas or pdl_decode_equals or cuda_graph_decode_equals"
    fi
    ab_bench s37 5 --batch-sizes 1,8,16,32 "${cmp[@]}" ;;
  s37b)
    L=megatron_tlt.rollout
    n=1; [ "${S37B_REPEAT:-0}" = 1 ] && n=2
    b1=(); b32=()
    for _ in $(seq $n); do
      b1+=(--compare-attr "$L.triton_linear:FMA_WIDE=True")
      b32+=(--compare-attr "$L.triton_linear:CUBLAS_MARGIN=1.05" --compare-attr "$L.pdl:PLAIN_AFTER_CUBLAS=False")
    done
    [ "${S37B_TESTS:-1}" = 1 ] && pytest_stage "s37b tests" 200 gpu_tests_s37b.log \
        tests/gpu/test_engine_gpu.py -k "fma_wide_configs"
    ab_bench s37b_b1 60 --batch-sizes 1 "${b1[@]}"
    ab_bench s37b_b32 5 --batch-sizes 32 "${b32[@]}" ;;
  s39)
    issue_then_ab s39 "${S39_FULL:-1}" "${S39_RESERVE:-120}" --batch-sizes 1 \
        --compare-attr "$G:ATTN_L2_PREFETCH_MB_FEW=None" --compare-attr "$G:ATTN_L2_PREFETCH_MB_FEW=12" \
        --compare-attr "$G:ATTN_L2_PREFETCH_MB_FEW=16" --compare-attr "$G:ATTN_L2_PREFETCH_MB_FEW=8" ;;
  s40)
    issue_then_ab s40 "${S40_FULL:-1}" "${S40_RESERVE:-150}" --batch-sizes 1,32 \
        --compare-attr "env:MEGATRON_TLT_PDL_PREFETCH_MB=32" --compare-attr "env:MEGATRON_TLT_PDL_PREFETCH_MB=8" \
        --compare-attr "env:MEGATRON_TLT_PDL_PRELOAD_KB=16" --compare-attr "$G:ATTN_L2_PREFETCH_MB_FEW=16" \
        --compare-attr "$G:ATTN_L2_PREFETCH_MB_FEW=None" ;;
  s41)
    issue_then_ab s41 "${S41_FULL:-1}" "${S41_RESERVE:-150}" --batch-sizes 1,32 \
        --compare-attr "env:MEGATRON_TLT_PDL_PREFETCH_MB=32" --compare-attr "megatron_tlt.rollout.triton_linear:_GLU=1" \
        --compare-attr "$G:ATTN_L2_PREFETCH_MB_FEW=16" --compare-attr "$G:ATTN_L2_PREFETCH_MB=8" ;;
  s42)
    pytest_stage gpu 200 gpu_tests_s42.log tests/gpu/test_optim_fp16_gpu.py tests/gpu/test_engine_gpu.py \
        tests/gpu/test_eagle_graph_gpu.py
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
      timeout "$(upto 5)" $PY tools/ablate_decode.py --shape 1.5b --batch-sizes 1 --rounds 2 \
          --json "$RESULTS/ablate_1p5b_b1.json" 2>&1 | grep -v Warn > "$RESULTS/ablate_1p5b_b1.log"
      echo "[runbook] ablate: at $(( $(date +%s) - t0 )) s"
      tail -n 13 "$RESULTS/ablate_1p5b_b1.log"
    fi ;;
  s43)
    pytest_stage advance 300 gpu_tests_advance.log tests/gpu/test_triton_sample_gpu.py -k greedy_advance
    issue_then_ab s43 "${S43_FULL:-0}" "${S43_RESERVE:-150}" --batch-sizes 1,32 \
        --compare-attr "megatron_tlt.bench:FUSED_ADVANCE=True" \
        --compare-attr "megatron_tlt.rollout.triton_attention:_MERGE=True" ;;
  s44)
    if issue_bench_wanted "${S44_FULL:-1}"; then
      S36_BENCH_ARGS="--compare-attr megatron_tlt.bench:FUSED_ADVANCE=False" issue_bench "${S44_RESERVE:-20}"
    fi
    pytest_stage engine 5 gpu_tests_engine.log tests/gpu/test_engine_gpu.py ;;
  lsweep)
    timeout "$(left)" $PY tools/linear_sweep.py --cases "${LSWEEP_CASES:-1.5b:1,7b:32,1.5b:32}" \
        --json "$RESULTS/linear_sweep.json" > "$RESULTS/linear_sweep.log" 2>&1
    echo "[runbook] lsweep: rc=$? at $(( $(date +%s) - t0 )) s"
    tail -n 16 "$RESULTS/linear_sweep.log" ;;
  gputests)
    # shellcheck disable=SC2086
    timeout "$(left)" $PY -m pytest -q -p no:cacheprovider ${GPU_TESTS:-tests/gpu} \
        > "$RESULTS/gpu_tests.log" 2>&1
    echo "[runbook] gputests: rc=$? at $(( $(date +%s) - t0 )) s"
    grep -E "passed|failed|error" "$RESULTS/gpu_tests.log" | tail -n 25 ;;
  *) echo "[runbook] unknown stage $STAGE (setup target drafters spec acceptance rollout kernels pdl fusions splits warps attn tiles l2 phases ablate glu loop s34 s36 s37 s37b s39 s40 s41 s42 s43 s44 lsweep gputests)" ;;
esac
exit 0
