"""The expert exchange backend for attention-DP + EP, chosen at start-up; the backends themselves are the ep plugin's
(k3plugins.ep: local, nccl, deepep).

The engine records its backend (`k3build build --expert-backend`, or the recipe's [runtime] expert_backend);
`--enable-deepep` asks for DeepEP whatever the engine says, and fails at start-up when it cannot be had.
"""

from __future__ import annotations

from k3plugins.ep import DeepEPExchange, NcclExchange

from ..loader import EngineError

BACKENDS = ("local", "nccl", "deepep")


def choose_backend(config: dict, enable_deepep: bool = False) -> str:
    """The exchange backend for this engine and flag; raises EngineError when it cannot be used."""
    recorded = config["build_config"].get("expert_backend", "nccl")
    if recorded not in BACKENDS:
        raise EngineError(f"engine build_config.expert_backend is {recorded!r}; expected one of {', '.join(BACKENDS)}")
    backend = "deepep" if enable_deepep else recorded
    mapping = config["mapping"]
    if backend == "local" and mapping["moe_ep_size"] > 1:
        raise EngineError(f"expert_backend 'local' cannot serve an engine with moe_ep_size={mapping['moe_ep_size']}; "
                          "rebuild with --expert-backend nccl")
    if backend == "deepep":
        from .deepep import check_deepep

        check_deepep(config["pretrained_config"])  # missing package or a limit K3 exceeds: fail before loading
        if config["build_config"]["dtype"] != "bf16":
            raise EngineError(f"--enable-deepep: DeepEP's low-latency dispatch carries bf16 tokens; this engine's "
                              f"activations are {config['build_config']['dtype']} (rebuild with --dtype bf16, or "
                              "use the nccl exchange)")
    return backend


def make_exchange(backend: str, config: dict, rank: int, group, *, upcast: bool):
    """The exchange object for `backend` on this rank (None for 'local' or without an EP group)."""
    if backend == "local" or group is None:
        return None
    if backend == "nccl":
        return NcclExchange(group, upcast)
    cfg, info = config["pretrained_config"], config["ranks"][str(rank)]
    width = cfg.get("routed_expert_hidden_size") or cfg["hidden_size"]
    return DeepEPExchange(group, num_experts=cfg["num_experts"], expert_start=info["experts"][0], hidden=width,
                          capacity=config["build_config"]["max_num_tokens"])
