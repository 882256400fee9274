# Seventh device batch: the strided MoE layout through the build (GPU tests incl. the wide-experts engine),
# one real-size rank at the build's tactics (triton_s now), and the KDA sweep with the conv-prefill tiles.
source tools/device/env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
PARTS=${PARTS:-tests,rank,kda}
if [[ $PARTS == *tests* ]]; then
  timeout ${TEST_S:-240} python3 -m pytest -q -m gpu tests/plugins/test_moe_gpu.py tests/model/test_gpu_engine.py \
    -p no:cacheprovider -rf 2>&1 | tail -15 | tee $OUT/pytest.txt
fi
if [[ $PARTS == *rank* ]]; then
  timeout ${RANK_S:-150} python3 tools/bench_rank.py --batches 32,64,128 --reps 5 2>&1 | grep '^{' | tee $OUT/rank.jsonl
fi
if [[ $PARTS == *kda* ]]; then
  timeout ${KDA_S:-150} python3 tools/bench_plugins.py --sweep --only kda 2>&1 | tee $OUT/kda.jsonl \
    | grep -v '"kda_split_config"'
fi
