"""Triton Inference Server Python-backend model repository for k3build engines (`k3runtime triton-repo`)."""
