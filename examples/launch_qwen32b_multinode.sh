#!/usr/bin/env bash
# 4 nodes x 8 GPUs. Run on every node with the same MASTER_ADDR (node 0's address) and
# NODE_RANK set to 0..3, e.g. from a Slurm script:  NODE_RANK=$SLURM_NODEID MASTER_ADDR=... bash ...
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
: "${MASTER_ADDR:?set MASTER_ADDR to node 0's address}"
: "${NODE_RANK:?set NODE_RANK to this node's index (0..3)}"
exec torchrun --nnodes 4 --nproc_per_node 8 --node_rank "$NODE_RANK" \
  --master_addr "$MASTER_ADDR" --master_port "${MASTER_PORT:-29500}" \
  -m megatron_tlt train --config examples/qwen2p5_32b_grpo.yaml "$@"
