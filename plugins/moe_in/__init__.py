from .reference import moe_in_proj

__all__ = ["moe_in_proj"]
