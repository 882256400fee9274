# Hundred-and-sixtieth device batch (fifty-fifth session): the Gluon MLA kernel's GPU tests after page_descriptors
# began keeping its TMA descriptors by cache tensor (over the storage, not a view), the mixers', and the tiny
# engine's GPU tests; then the 96-head decode bench (quick form) beside the floor. Any sm_90 card. Carry .whl.
source tools/device/env.sh
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
timeout 300 python3 -m pytest -q -m gpu tests/plugins/test_mla_gpu.py -rf -p no:cacheprovider \
  -k "gluon or mixer" 2>&1 | tail -4 | tee $OUT/tests.txt
timeout 150 python3 -m pytest -q -m gpu tests/model/test_gpu_engine.py tests/runtime/test_pp_graphs_gpu.py -rf \
  -p no:cacheprovider 2>&1 | tail -4 | tee $OUT/graph_tests.txt
K3_BENCH_MLA_QUICK=1 timeout 100 python3 tools/bench_plugins.py --only mla > $OUT/mla.jsonl 2>&1
grep -E '"bench": "mla"' $OUT/mla.jsonl | cut -c1-400
