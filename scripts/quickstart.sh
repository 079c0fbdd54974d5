#!/usr/bin/env bash
# Set up .venv (scripts/setup_env.sh) and run the main job on the built-in tiny default, on CPU:
# GRPO on the shipped tiny policy (examples/tiny_cpu.yaml), then plots of its metrics.
# Extra arguments are config overrides, e.g.  bash scripts/quickstart.sh train.steps=30
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh
VENV="${TLT_VENV:-$ROOT/.venv}"

"$VENV/bin/megatron-tlt" train --config examples/tiny_cpu.yaml "$@"
OUT_DIR="$("$VENV/bin/python" - "$@" <<'PY'
import sys
from megatron_tlt.config import load_config
print(load_config("examples/tiny_cpu.yaml", sys.argv[1:]).train.out_dir)
PY
)"
"$VENV/bin/python" tools/plot_metrics.py "$OUT_DIR/metrics.jsonl" --out "$OUT_DIR/plots" >/dev/null
echo "[quickstart] metrics: $OUT_DIR/metrics.jsonl"
echo "[quickstart] plots:   $OUT_DIR/plots/ (reward, lengths, phase times, rollout time by batch size, acceptance, loss)"
