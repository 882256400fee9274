# Hundred-and-fifty-ninth device batch (fifty-fourth session): the whole GPU suite on an H200 (the issue asks for its
# record there; the last whole runs were on H100s), in two calls: PART=1 then PART=2 (tools/device/test_slice.py;
# each about 300 s with a cold Triton cache). Carry .whl.
source tools/device/env.sh
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
timeout 560 python3 tools/device/test_slice.py ${PART:-1} 2 2>&1 | grep -v Warning | tail -15 | tee $OUT/suite${PART:-1}.txt
