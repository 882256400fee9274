# Hundred-and-forty-third device batch (fiftieth session): the whole GPU suite (`pytest -m gpu`, the server tests
# aside as in every run) on whichever card comes, for the record on an H200; not stopping at a failure (this
# session's new GPU tests run in it for the first time); the summary and failures to $OUT/gpu_suite.txt. Carry
# fla-core's wheel (.whl).
source tools/device/env.sh
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
timeout 570 python3 -m pytest -q -m gpu tests --ignore=tests/server -rf -p no:cacheprovider 2>&1 | tail -40 \
  | tee $OUT/gpu_suite.txt
