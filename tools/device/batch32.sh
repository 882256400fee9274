# Thirty-second device batch (seventeenth session): the GPU tests of the MoE (the shift-decoded paired layout,
# triton_p v4), of the new MoEOutProj and of the whole tiny engine (which runs it); then bench_plugins' MoE rows.
source tools/device/env.sh
timeout ${TEST_S:-300} python3 -m pytest -q -m gpu tests/plugins/test_moe_gpu.py tests/plugins/test_moe_out_gpu.py \
  tests/model/test_gpu_engine.py -p no:cacheprovider --tb=short > $OUT/pytest.txt 2>&1
grep -E "^E |Error|passed|failed" $OUT/pytest.txt | tail -20
timeout ${MOE_S:-200} python3 tools/bench_plugins.py --only moe 2>&1 | grep '^{' | tee $OUT/moe.jsonl \
  | grep -E '"moe"|moe_check' | cut -c1-400
# Would the router (logits + top-k) hide behind the MoE's in_proj GEMM if the graph forked it onto a second
# stream? A TEP16 rank's shapes at 64 tokens, 8 layers' distinct weights a replay (no L2 reuse), ms a layer.
(cd tools/bench && timeout ${OVL_S:-120} python3 -c "
import torch, common
from k3plugins.router import triton as rt
L, T = 8, 64
g = torch.Generator(device='cuda').manual_seed(0)
x = torch.randn(T, 7168, device='cuda', generator=g).bfloat16()
w_in = [torch.randn(4352, 7168, device='cuda', generator=g).bfloat16() * 0.01 for _ in range(L)]
gate = [torch.randn(896, 7168, device='cuda', generator=g).bfloat16() * 0.01 for _ in range(L)]
bias = torch.zeros(896, device='cuda')
side = torch.cuda.Stream()
kw = dict(top_k=16, renormalize=True, scaling_factor=2.5)
def gemm_only():
    for i in range(L): x @ w_in[i].T
def router_only():
    for i in range(L): rt.route(x, gate[i], bias, **kw)
def sequential():
    for i in range(L):
        x @ w_in[i].T
        rt.route(x, gate[i], bias, **kw)
def forked():
    main = torch.cuda.current_stream()
    for i in range(L):
        side.wait_stream(main)
        with torch.cuda.stream(side):
            rt.route(x, gate[i], bias, **kw)
        x @ w_in[i].T
        main.wait_stream(side)
for name, fn in (('gemm_only', gemm_only), ('router_only', router_only), ('sequential', sequential), ('forked', forked)):
    common.emit(bench='overlap_router_in_proj', case=name, ms_per_layer=round(common.time_ms(fn, rep=30) / L, 4))
" 2>&1 | grep -E '^\{|Error' | tee $OUT/overlap.jsonl)
