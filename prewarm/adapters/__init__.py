"""Thin adapters over things prewarm drives: model servers (built-in, OpenAI-compatible) and the Kubernetes API."""
