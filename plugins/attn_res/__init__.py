from .reference import attn_res

__all__ = ["attn_res"]
