# Sixty-eighth device batch (twenty-third session): the whole GPU suite with triton_l the sm90 default (the wide-
# experts engine end to end with triton_l and triton_p, --tune against triton_l, every MoE tactic's cases).
source tools/device/env.sh
timeout 560 python3 -m pytest -q -m gpu tests/plugins tests/model tests/runtime -p no:cacheprovider \
  --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -25
