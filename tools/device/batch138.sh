# Hundred-and-thirty-eighth device batch (forty-ninth session): the prefetch_per_sm runs the last session wrote but could
# not time, most wanted first: its GPU tests, the MoE decode bench (rows decode_l_yh_pf2_w2/_w4), the touched-experts
# sweep (decode_l_pf2_w2).
source tools/device/env.sh
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
timeout 90 python3 -m pytest -q -m gpu tests/plugins/test_moe_gpu.py -k "prefetch or overlapped" -p no:cacheprovider 2>&1 | tail -4
K3_PDL=0 timeout 150 python3 tools/bench_plugins.py --only moe > $OUT/moe.jsonl 2> $OUT/moe.err
grep '"bench": "moe"' $OUT/moe.jsonl | cut -c1-420
grep 'moe_tactic' $OUT/moe.jsonl | grep -E '"decode_l(_yh)?(_pf[0-9])?(_w[0-9])?"' | cut -c1-200
tail -2 $OUT/moe.err
timeout 100 python3 tools/bench_plugins.py --only moe_touched > $OUT/touched.jsonl 2> $OUT/touched.err
cut -c1-700 $OUT/touched.jsonl; tail -2 $OUT/touched.err
