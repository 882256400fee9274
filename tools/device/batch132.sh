# Hundred-and-thirty-second device batch (forty-sixth session), after batch131 on the same machine: the engine's GPU
# tests and the MLA GPU tests with both Gluon MLA variants on (LEAN_SOFTMAX, NARROW_REMAINDER: set in the process
# that runs pytest), then on an H200 the MoE bench (its 8 tokens an expert: 0.788 of the floor on the last H200).
source tools/device/env.sh
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
timeout 300 python3 - > $OUT/tests.txt 2>&1 <<'PY'
import sys
import pytest
from k3plugins.mla import gluon_sm90
gluon_sm90.LEAN_SOFTMAX = gluon_sm90.NARROW_REMAINDER = True
sys.exit(pytest.main(["-q", "-m", "gpu", "tests/model", "tests/runtime", "tests/plugins/test_mla_gpu.py", "-k",
                      "not narrow_remainder and not lean_softmax"]))
PY
echo "tests rc=$?"; tail -3 $OUT/tests.txt
case "$card" in
  *H200*) timeout 200 python3 tools/bench_plugins.py --only moe > $OUT/moe.jsonl 2> $OUT/moe.err
          grep '"bench": "moe"' $OUT/moe.jsonl | cut -c1-400 ;;
esac
