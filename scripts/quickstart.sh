#!/usr/bin/env bash
# Set up .venv (scripts/setup_env.sh) and run the main job on the built-in tiny default, on CPU.
# Extra arguments are passed to the command.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh
VENV="${TLT_VENV:-$ROOT/.venv}"

# Until the RL loop lands this runs the demo; then it becomes:
#   exec "$VENV/bin/megatron-tlt" train --config examples/tiny_cpu.yaml "$@"
exec "$VENV/bin/megatron-tlt" demo "$@"
