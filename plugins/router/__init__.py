from .reference import route

__all__ = ["route"]
