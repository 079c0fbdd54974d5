#!/usr/bin/env bash
# Create (if missing) and fill the project's virtual environment, .venv/ at the repo root.
# Idempotent: a second run with unchanged packaging files does nothing.
#
#   TLT_VENV=DIR        use another venv location
#   PYTHON=python3.11   interpreter used to create the venv (default: python3)
#   TLT_FORCE_SETUP=1   reinstall even if nothing changed
#
# torch is installed FIRST and pinned: an unpinned torch pulls a multi-GB CUDA build
# (on our CPU machines torch==2.13.0 is a CPU wheel already on disk). Then the package
# is installed editable WITHOUT build isolation, so the csrc/ extension builds against
# that torch.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${TLT_VENV:-$ROOT/.venv}"
TORCH_SPEC="${TLT_TORCH_SPEC:-torch==2.13.0}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating virtual environment $VENV"
    "${PYTHON:-python3}" -m venv "$VENV"
fi
PY="$VENV/bin/python"

# Fingerprint of everything that changes what gets installed or built.
fingerprint() {
    {
        echo "$TORCH_SPEC"
        "$PY" --version 2>&1
        sha256sum setup.py pyproject.toml
        if [ -d csrc ]; then
            find csrc -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 | sort -z | xargs -0 -r sha256sum
        fi
    } | sha256sum | cut -d' ' -f1
}
STAMP="$VENV/.megatron_tlt_setup"
WANT="$(fingerprint)"
if [ "${TLT_FORCE_SETUP:-0}" != "1" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] \
    && "$PY" -c "import megatron_tlt" 2>/dev/null; then
    echo "[setup] $VENV is up to date"
    exit 0
fi

echo "[setup] installing $TORCH_SPEC and build tools"
"$PY" -m pip install -qq "$TORCH_SPEC" "setuptools>=70.1" wheel ninja
echo "[setup] installing megatron_tlt (editable, no build isolation) with dev extras"
"$PY" -m pip install -qq --no-build-isolation -e ".[dev]"
"$PY" -c "import megatron_tlt, torch; print(f'[setup] ok: megatron_tlt {megatron_tlt.__version__}, torch {torch.__version__}')"
echo "$WANT" > "$STAMP"
