from .reference import embedding, linear, lm_head

__all__ = ["embedding", "linear", "lm_head"]
