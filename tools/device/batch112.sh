# Hundred-and-twelfth device batch (thirty-fifth session): after batch110, the sampler with the sort for top-p and
# the draw as one Triton launch (sampler.TRITON_DRAW on), and MLA split for one wave (SPLIT_WAVES = 1): the sampling
# bench, then the whole GPU suite. Carry fla-core's wheel (.whl).
source tools/device/env.sh
timeout 100 python3 tools/bench_sampling.py --device cuda --steps 10 2>&1 | tee $OUT/sampling.jsonl
timeout 420 python3 -m pytest -q -m gpu tests/plugins tests/model tests/runtime tests/dist/test_graphs_nccl_gpu.py \
  -p no:cacheprovider --tb=short -rs > $OUT/pytest.txt 2>&1
grep -E "^E  |passed|failed|^FAILED" $OUT/pytest.txt | tail -20
