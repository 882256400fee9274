# Eighty-eighth device batch (twenty-fifth session): the attention in_proj and MoE in_proj GEMMs in-graph, 16 layers
# back to back: cuBLAS against a split-K Triton kernel whose last program of a column block sums the partials
# (gemm_probe.py --chain).
source tools/device/env.sh
timeout 200 python3 tools/device/gemm_probe.py --chain 2>&1 | grep '^{' | tee $OUT/gemm_chain.jsonl
