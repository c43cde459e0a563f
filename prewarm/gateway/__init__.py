"""The OpenAI-compatible HTTP gateway: looks up ready replicas in the registry and proxies to them."""
