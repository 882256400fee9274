# Eighty-seventh device batch (twenty-fifth session): the whole GPU suite on the session's final code (the router
# top-k's cast programs).
source tools/device/env.sh
timeout 560 python3 -m pytest -q -m gpu tests/plugins tests/model tests/runtime -p no:cacheprovider \
  --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -25
