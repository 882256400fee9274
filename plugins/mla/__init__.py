from .reference import mla_mixer

__all__ = ["mla_mixer"]
