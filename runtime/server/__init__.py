"""OpenAI-compatible HTTP server (`k3runtime serve`): FastAPI app, Prometheus metrics, request limits."""
