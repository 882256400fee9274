# Hundred-and-thirty-fifth device batch (forty-eighth session): the MoE gate/up programs asking L2 for their first
# K steps of weights while the pair sort runs (MoETactic.prefetch): its GPU test (the same bits as decode_l over
# graph replays with new routing), then the MoE decode bench in two processes and a third with K3_PDL=1 (decode_l_yh_pf2/4/8 beside the
# TACTICS) and the touched-experts sweep (decode_l_pf4 beside decode_l).
source tools/device/env.sh
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
timeout 200 python3 -m pytest -q -m gpu tests/plugins/test_moe_gpu.py -k "prefetch or overlapped or half or gathering" -p no:cacheprovider 2>&1 | tail -5
for i in 1 2 pdl; do  # the third with K3_PDL=1: every MoE launch (sort, combine too) with PDL
  K3_PDL=$([ $i = pdl ] && echo 1 || echo 0) timeout 150 python3 tools/bench_plugins.py --only moe > $OUT/moe_$i.jsonl 2> $OUT/moe_$i.err
  grep '"bench": "moe"' $OUT/moe_$i.jsonl | cut -c1-400
  grep 'moe_tactic' $OUT/moe_$i.jsonl | grep -E '"decode_l(_yh)?(_pf[0-9])?"' | cut -c1-200
  tail -3 $OUT/moe_$i.err
done
timeout 120 python3 tools/bench_plugins.py --only moe_touched > $OUT/touched.jsonl 2> $OUT/touched.err
cut -c1-600 $OUT/touched.jsonl; tail -3 $OUT/touched.err
