from .reference import gated_mlp, glu, silu_glu, situ_glu

__all__ = ["gated_mlp", "glu", "silu_glu", "situ_glu"]
