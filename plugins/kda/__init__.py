from .reference import kda_gate, kda_mixer, kda_recurrent, short_conv

__all__ = ["kda_gate", "kda_mixer", "kda_recurrent", "short_conv"]
