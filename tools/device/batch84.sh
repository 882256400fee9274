# Eighty-fourth device batch (twenty-fifth session): the rank's decode GEMMs by other routes (gemm_probe.py):
# cuBLAS as the engine calls it, transposed, cuBLAS against cuBLASLt, and a split-K Triton kernel leaving fp32
# partials for the consumer to sum.
source tools/device/env.sh
timeout 400 python3 tools/device/gemm_probe.py 2>&1 | grep '^{' | tee $OUT/gemm_probe.jsonl | cut -c 1-400
