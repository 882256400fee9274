# Fifty-fifth device batch (twenty-first session): the router's logits out of the MoE in_proj GEMM, or not
# (tools/device/router_merge_probe.py at the rank's batch sizes).
source tools/device/env.sh
PYTHONPATH=$PWD:$PYTHONPATH timeout 240 python3 tools/device/router_merge_probe.py 32,64,128 | tee $OUT/probe.jsonl
