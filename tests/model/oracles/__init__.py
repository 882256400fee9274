"""Oracles the engine is tested against (import as `oracles.*`; tests/model/conftest.py puts tests/model on sys.path).

- `tiny_models`: random tiny checkpoints — `make_kimi_linear` (transformers save_pretrained), `make_k3_tiny`
  (K3 naming, MXFP4 experts), `kimi_linear_to_k3_naming` (same function, K3 names).
- `hf_oracle`: transformers' KimiLinearForCausalLM in a kernel-free worker — `hf_logits`, `hf_greedy`, `hf_batch`.
- `k3_fp32`: an independent fp32 forward written from K3_SPEC.md — `k3_logits`, `k3_greedy`.
"""
