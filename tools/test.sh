#!/usr/bin/env bash
# The README's test command: install the project with its test extras, then run the CPU suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0 -e ".[test]"
# two workers (tests/conftest.py groups the tests: a module on one worker, all multi-rank tests on one), one torch
# thread each: two workers of two threads on two cores lose more to OpenMP's waits than they gain
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} python3 -m pytest -q -x -n 2 --dist loadgroup tests "$@"
