# Seventy-fourth device batch (twenty-third session): the whole GPU suite on the session's final code (after the
# review: the PTX multiply only for lane tactics on sm_90; the lane tactics' plain bf16 product tested too).
source tools/device/env.sh
timeout 380 python3 -m pytest -q -m gpu tests/plugins tests/model tests/runtime -p no:cacheprovider \
  --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -25
