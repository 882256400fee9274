"""k3build: offline converter and engine builder for Kimi-K3."""

__version__ = "0.1.0"
