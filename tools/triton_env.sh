#!/usr/bin/env bash
# Build the environment Triton's Python-backend stub runs runtime/triton_backend/model.py in.
# Triton 2.51's stub (nvidia-pytriton 0.7.0) needs numpy<2, the project env has numpy 2: a venv on the
# same interpreter with --system-site-packages gets torch/tokenizers/k3runtime from the project env and
# its own numpy 1.26 + nvidia-pytriton, which shadow the project's (venv site-packages come first).
# Usage: bash tools/triton_env.sh [VENV]   (default $K3_TRITON_VENV or ~/.cache/k3runtime/triton-venv)
set -euo pipefail
VENV=${1:-${K3_TRITON_VENV:-$HOME/.cache/k3runtime/triton-venv}}
PY=${PYTHON:-python3}
start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "nvidia-pytriton==0.7.0" "numpy<2" 2>&1 \
  | grep -v "^WARNING: Location" || true
"$VENV/bin/python" - <<'PY'
import numpy, torch, tokenizers
import k3runtime.async_engine  # the model's imports, under numpy 1.x
assert int(numpy.__version__.split(".")[0]) < 2, f"numpy {numpy.__version__}: the Triton 2.51 stub needs numpy<2"
print(f"triton env: numpy {numpy.__version__}, torch {torch.__version__}, k3runtime from {k3runtime.__file__}")
PY
echo "triton env ready in $VENV ($(( $(date +%s) - start )) s)"
