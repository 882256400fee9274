# Twentieth device batch (for the fourteenth session), under one call's 600 s on a fresh machine: the KDA GPU tests
# (the fused decode now loads its state first, at 4 warps), then bench_plugins' KDA section: fused against split at
# 8 / 64 / 256 sequences x 96 heads (thirteenth session: split 0.55 / 0.71 / 0.74 of the floor, fused 0.36 / 0.41 /
# 0.42 before the change). If fused beats split at 64 and 256, make it the default where decode_block_v gives 128
# (plugins/kda/fla.py). Then the rank, which has not been timed with the narrow KDA slices at 6 heads nor with the
# row-parallel latent up-projection (a 1/16 slice a rank: 4.4 GB less to read a step, so its floor drops too).
# Last the MoE section, for its new tile-pass mark. The timeouts add up to 490 s.
source tools/device/env.sh
timeout ${TEST_S:-150} python3 -m pytest -q -m gpu tests/plugins/test_kda_gpu.py -p no:cacheprovider --tb=short \
  > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
timeout ${KDA_S:-100} python3 tools/bench_plugins.py --only kda 2>&1 | grep '^{' | tee $OUT/kda.jsonl | grep kda_decode
timeout ${RANK_S:-150} python3 tools/bench_rank.py --batches ${BATCHES:-32,64,128} --reps 20 2>&1 | grep '^{' \
  | tee $OUT/rank.jsonl | grep rank_decode
# The MoE decode's row-tiled bytes read on its own grid with no decode or MMA (moe_tile_pass): whether the 0.64-0.69
# of the floor is the traffic pattern's or the math's (as the KDA slice pass showed for KDA: 0.95-0.97 without math)
timeout ${MOE_S:-90} python3 tools/bench_plugins.py --only moe 2>&1 | grep '^{' | tee $OUT/moe.jsonl \
  | grep -E 'moe_tile_pass|"bench": "moe"'
