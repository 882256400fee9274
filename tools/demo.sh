#!/usr/bin/env bash
# The README's main job on a fresh machine: install, then synth -> convert -> build -> generate on the tiny K3.
set -euo pipefail
cd "$(dirname "$0")/.."
# K3_DEMO_SKIP_INSTALL=1: the environment is already set up (tests/test_readme_demo.py runs the rest).
if [ -z "${K3_DEMO_SKIP_INSTALL:-}" ]; then
  python3 -m pip install -q torch==2.13.0 -e .
fi
work=${K3_DEMO_DIR:-$(mktemp -d)}
echo "working in $work"
k3build synth "$work/ckpt" --preset tiny --seed 0
k3build convert "$work/ckpt" "$work/converted" --tp-size 1 --ep-size 1 --pp-size 1
k3build build "$work/converted" "$work/engine" --target cpu --max-batch-size 8 --max-num-tokens 512 --max-seq-len 1024
k3build inspect "$work/engine"
k3runtime generate "$work/engine" --prompt "The quick brown fox" --prompt "Kimi-K3 is" --max-tokens 24
