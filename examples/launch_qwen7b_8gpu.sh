#!/usr/bin/env bash
# One node, 8 GPUs: torchrun starts 8 ranks of the same entry point.
# Extra arguments are config overrides, e.g.  bash examples/launch_qwen7b_8gpu.sh train.steps=10
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
exec torchrun --nproc_per_node 8 -m megatron_tlt train --config examples/qwen2p5_7b_grpo.yaml "$@"
