# Hundred-and-forty-fifth device batch (fifty-first session): the part of the GPU suite batch143 did not reach in its
# 570 s on an H100 with a cold Triton cache (it stopped at 448 of about 650 tests). Collects the suite here, runs
# tests from SKIP on (default 440, a little overlap), not stopping at a failure. Carry .whl.
source tools/device/env.sh
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 -m pytest -q -m gpu tests --ignore=tests/server --collect-only -p no:cacheprovider 2>/dev/null \
  | grep '::' > /tmp/gpu_ids.txt
echo "collected $(wc -l < /tmp/gpu_ids.txt)"
tail -n +$(( ${SKIP:-440} + 1 )) /tmp/gpu_ids.txt > /tmp/rest.txt
echo "running $(wc -l < /tmp/rest.txt) from $(head -1 /tmp/rest.txt)"
timeout 560 python3 -m pytest -q -m gpu $(cat /tmp/rest.txt) -rf -p no:cacheprovider 2>&1 | tail -40 \
  | tee $OUT/gpu_suite_rest.txt
