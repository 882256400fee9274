# Hundred-and-forty-ninth device batch (fifty-first session): the host store's page- and slot-major buffers with
# copies queued on the stream: its GPU test (a round trip under set_sync_debug_mode("error"), the device pages
# reused at once), the engine's swap tests on the GPU, then tools/bench_swap.py (a TEP16 rank's request of 8K
# tokens out and back, against the pageable copies before and the page-locked copy rate). Carry .whl.
source tools/device/env.sh
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
timeout 200 python3 -m pytest -q -m gpu tests/runtime/test_host_store.py tests/model/test_gpu_engine.py -k "host or preemption" \
  -rf -p no:cacheprovider 2>&1 | tail -5 \
  | tee $OUT/tests.txt
timeout 150 python3 tools/bench_swap.py --device cuda 2>&1 | tee $OUT/swap.jsonl
