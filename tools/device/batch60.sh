# Sixtieth device batch (twenty-second session): the MLA glue's two launches (mla_cache_write_kernel,
# mla_gate_kernel): their GPU tests, then the rank A/B against the former torch launches, with the GPU's SM clock
# and power sampled through the run (is the step's MoE decode, bound by instruction issue, run at a lower clock?).
source tools/device/env.sh
timeout 150 python3 -m pytest -q -m gpu tests/plugins/test_mla_gpu.py -p no:cacheprovider --tb=short \
  > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 200 > $OUT/smi.csv 2>&1 &
SMI=$!
source tools/device/rank_ab.sh
RANK_S=330 rank_ab unfused-mla-glue
kill $SMI
python3 - <<'PY'
import os, collections
rows = [l.split(", ") for l in open(os.environ["OUT"] + "/smi.csv") if l.count(",") >= 5]
clk = collections.Counter(r[1] for r in rows)
print("sm clock samples:", clk.most_common(8))
pw = [float(r[3].split()[0]) for r in rows if r[3].split()[0].replace(".", "").isdigit()]
print("power W max/median:", max(pw, default=0), sorted(pw)[len(pw) // 2] if pw else 0)
print("throttle reasons:", collections.Counter(r[5].strip() for r in rows).most_common(5))
PY
