from .reference import moe_out_proj

__all__ = ["moe_out_proj"]
