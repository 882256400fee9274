"""Build options: what the user asks of an engine (limits, dtypes, target)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..memory import gib_bytes

TARGETS = ("cpu", "sm90", "gfx942")
# the ep plugin's backends (k3plugins.ep, chosen by runtime/dist/exchange.py); k3build.recipe checks the same names
EXPERT_BACKENDS = ("nccl", "deepep", "local")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class BuildOptions:
    target: str = "cpu"
    max_batch_size: int = 8
    max_num_tokens: int = 2048
    max_seq_len: int = 4096
    page_size: int = 64
    dtype: str = "bf16"  # activations and bf16-checkpoint weights
    kv_dtype: str = "bf16"
    state_dtype: str = "fp32"  # KDA recurrent state storage
    gpu_memory_gib: float | None = None  # memory plan budget per rank (None: no check)
    overhead_gib: float = 1.0  # held back from gpu_memory_gib by the plan (communicators, allocator slack)
    expert_backend: str = "nccl"  # attention-DP expert exchange the runtime starts with
    tactics: tuple[tuple[str, str], ...] = ()  # (plugin op, tactic) the user forces, instead of the target's preference
    tune: bool = False  # measure tactic choices on this machine's GPU (build/tune.py)

    def __post_init__(self):
        if self.target not in TARGETS:
            raise ValueError(f"--target: expected one of {', '.join(TARGETS)}, got {self.target!r}")
        for name in ("dtype", "kv_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"--{name.replace('_', '-')}: expected one of {', '.join(DTYPES)}, got {getattr(self, name)!r}")
        if self.expert_backend not in EXPERT_BACKENDS:
            raise ValueError(f"--expert-backend: expected one of {', '.join(EXPERT_BACKENDS)}, got {self.expert_backend!r}")
        if self.expert_backend == "deepep" and self.target == "cpu":
            raise ValueError("--expert-backend deepep: DeepEP runs on GPUs; pick --target sm90 or nccl")
        if self.expert_backend == "deepep" and self.dtype != "bf16":
            # k3runtime refuses it at every start (runtime/dist/exchange.py choose_backend)
            raise ValueError(f"--expert-backend deepep: DeepEP's low-latency dispatch carries bf16 tokens, but --dtype "
                             f"is {self.dtype}; use --dtype bf16 or --expert-backend nccl")
        if self.state_dtype not in ("fp32", "bf16"):
            raise ValueError(f"--state-dtype: expected fp32 or bf16, got {self.state_dtype!r}")
        for name in ("max_batch_size", "max_num_tokens", "max_seq_len", "page_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"--{name.replace('_', '-')}: expected a positive int, got {v!r}")
        if self.max_seq_len < 2:  # a prompt of one token and one generated
            raise ValueError(f"--max-seq-len: expected at least 2 tokens, got {self.max_seq_len}")
        if self.gpu_memory_gib is not None:
            gib_bytes(self.gpu_memory_gib, "--gpu-memory-gib")
        gib_bytes(self.overhead_gib, "--overhead-gib", positive=False)
        if self.page_size != 64 and self.target != "cpu":
            raise ValueError(f"--page-size: {self.page_size} on target {self.target}, but its MLA kernels need "
                             "pages of 64 tokens")
        if self.tune and self.target == "cpu":
            raise ValueError("--tune: measures GPU tactics; pick a GPU --target (sm90)")
        for pair in self.tactics:
            if len(pair) != 2 or not all(isinstance(x, str) and x for x in pair):
                raise ValueError(f"--tactic: expected OP=TACTIC, got {pair!r}")
        for op in dict(self.tactics):
            asked = sorted({t for o, t in self.tactics if o == op})
            if len(asked) > 1:  # dict() would keep the last one given, silently
                raise ValueError(f"--tactic: {op} given {len(asked)} tactics ({', '.join(asked)}); give one")
        if self.max_num_tokens < self.max_batch_size:
            raise ValueError(f"--max-num-tokens ({self.max_num_tokens}) must be >= --max-batch-size ({self.max_batch_size}): every running request decodes one token a step")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def plan_limits(self) -> dict:
        """`k3build.memory.plan_memory`'s keywords for these options but max_seq_len (which `plan` varies); the
        budget must be given."""
        assert self.gpu_memory_gib is not None, "a memory plan needs gpu_memory_gib"
        return dict(gpu_memory_bytes=gib_bytes(self.gpu_memory_gib, "--gpu-memory-gib"),
                    max_batch_size=self.max_batch_size, max_num_tokens=self.max_num_tokens,
                    kv_dtype_bytes=DTYPES[self.kv_dtype].itemsize, state_dtype=self.state_dtype, dtype=self.dtype,
                    page_size=self.page_size,
                    overhead_bytes=gib_bytes(self.overhead_gib, "--overhead-gib", positive=False))

    def to_dict(self) -> dict:
        return asdict(self)
