# Hundred-and-thirty-seventh device batch (forty-eighth session): the MoE prefetch runs and batch133 in one call, most wanted
# first, each under its own timeout (few machines came this session): the prefetch's GPU tests, the MoE decode bench,
# the touched-experts sweep, the MLA prefill case (never run before).
source tools/device/env.sh
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
timeout 80 python3 -m pytest -q -m gpu tests/plugins/test_moe_gpu.py -k "prefetch or overlapped" -p no:cacheprovider 2>&1 | tail -4
moe() {  # $1: output name; the environment: K3_PDL
  timeout $2 python3 tools/bench_plugins.py --only moe > $OUT/$1.jsonl 2> $OUT/$1.err
  grep '"bench": "moe"' $OUT/$1.jsonl | cut -c1-420
  grep 'moe_tactic' $OUT/$1.jsonl | grep -E '"decode_l(_yh)?(_pf[0-9])?"' | cut -c1-160
  tail -2 $OUT/$1.err
}
K3_PDL=0 moe moe_1 140
timeout 90 python3 tools/bench_plugins.py --only moe_touched > $OUT/touched.jsonl 2> $OUT/touched.err
cut -c1-700 $OUT/touched.jsonl; tail -2 $OUT/touched.err
bash tools/device/batch133.sh > $OUT/mla_prefill.log 2>&1; tail -12 $OUT/mla_prefill.log

