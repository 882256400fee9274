"""The engine builder: layout passes, the rank graph, tactics, the engine writer."""

from .engine import BuildError, build
from .options import BuildOptions

__all__ = ["BuildError", "BuildOptions", "build"]
