#!/usr/bin/env bash
# The README's test command: install the project with its test extras, then run the CPU suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0 -e ".[test]"
python3 -m pytest -q -x tests "$@"
