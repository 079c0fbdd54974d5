#!/usr/bin/env bash
# The multi-GPU issue's runs on one host with 2-4 GPUs (NCCL), in one go:
#   bash scripts/multigpu_runs.sh OUT_DIR [RESULTS_DIR]
#   1. actor forward/backward + optimizer step at TP=2, PP=2 (and TP=2 x PP=2 on 4 GPUs)
#      against TP=1, and logits against HF: tests/integration/test_actor_distributed.py
#      and tests/gpu/test_actor_gpu.py (their layouts follow the GPU count; NCCL on GPUs);
#   2. HF -> mcore at TP=2/PP=2 -> load, save -> HF bit-exact: same two files;
#   3. weight sync from the actor into the engine, seconds and GB/s, 1.5B and 7B shapes at
#      TP=1 and TP=2 (tools/bench_weight_sync.py; engine logits checked against the actor);
#   4. one RL step at TP=2 with spec=eagle: the 1.5B benchmark target (SFT, DP over the
#      GPUs), its drafter, then `train` under torchrun with parallel.tp=2.
# Every stage writes its log / JSON to RESULTS_DIR (default OUT_DIR/results) as it ends.
# Stages whose outputs exist are skipped, so the script can be re-run after a time limit.
set -uo pipefail
OUT=${1:?usage: multigpu_runs.sh OUT_DIR [RESULTS_DIR]}
RESULTS=${2:-$OUT/results}
PY=${PYTHON:-python3}
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
mkdir -p "$OUT" "$RESULTS"
t0=$(date +%s)
say() { echo "[multigpu_runs] $* ($(( $(date +%s) - t0 )) s)"; }
if [ "$NGPU" -lt 2 ]; then
  echo "[multigpu_runs] needs >= 2 GPUs, found $NGPU" >&2
  exit 2
fi
TORCHRUN="$PY -m torch.distributed.run --nnodes 1 --master_addr 127.0.0.1"

if [ ! -f "$RESULTS/actor_tests.log" ]; then
  say "1-2/4 actor TP/PP equivalence and conversion round trips on $NGPU GPUs"
  $PY -m pytest -q -s -p no:cacheprovider tests/integration/test_actor_distributed.py \
      tests/gpu/test_actor_gpu.py tests/gpu/test_optim_resume_gpu.py > "$RESULTS/actor_tests.log" 2>&1
  tail -n 3 "$RESULTS/actor_tests.log"
fi

for shape in 1.5b 7b; do
  for tp in 1 2; do
    j="$RESULTS/weight_sync_${shape}_tp${tp}.json"
    [ -f "$j" ] && continue
    say "3/4 weight sync $shape TP=$tp"
    $TORCHRUN --nproc_per_node "$tp" --master_port $((29600 + tp)) tools/bench_weight_sync.py \
        --shape "$shape" --tp "$tp" --json "$j" 2>&1 | grep -v -i warn | tail -n 2
  done
done

if [ ! -f "$OUT/sft/hf/config.json" ]; then
  say "4/4 target: SFT 120 steps, DP=$NGPU"
  $TORCHRUN --nproc_per_node "$NGPU" --master_port 29610 -m megatron_tlt sft \
      --config examples/sft_bench_1p5b.yaml train.out_dir="$OUT/sft" parallel.dp="$NGPU" \
      sft.eval_interval=0 sft.progress=false > "$RESULTS/sft.log" 2>&1
  tail -n 3 "$RESULTS/sft.log"
  rm -rf "$OUT/sft/checkpoints"
fi
if [ ! -f "$OUT/drafter/config.json" ]; then
  say "4/4 drafter"
  $PY -m megatron_tlt.spec.train_drafter --target "$OUT/sft/hf" --tasks arith,sort --num-prompts 128 \
      --max-new-tokens 192 --draft-vocab 128 --steps 60 --batch-tokens 4096 --out "$OUT/drafter" \
      --no-progress > "$RESULTS/drafter.log" 2>&1
  tail -n 1 "$RESULTS/drafter.log"
fi
if [ ! -f "$RESULTS/rl_step_tp2_eagle_metrics.jsonl" ]; then
  say "4/4 RL step, TP=2, spec=eagle"
  $TORCHRUN --nproc_per_node 2 --master_port 29620 -m megatron_tlt train \
      --config examples/rl_step_1p5b_h200.yaml model.hf_path="$OUT/sft/hf" parallel.tp=2 \
      rollout.spec=eagle rollout.drafter="$OUT/drafter" train.out_dir="$OUT/rl_tp2_eagle" \
      > "$RESULTS/rl_step_tp2_eagle.log" 2>&1
  tail -n 3 "$RESULTS/rl_step_tp2_eagle.log"
  cp "$OUT/rl_tp2_eagle/metrics.jsonl" "$RESULTS/rl_step_tp2_eagle_metrics.jsonl" 2>/dev/null
fi
say "done; results in $RESULTS"
