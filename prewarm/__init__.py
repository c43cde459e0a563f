"""prewarm: predict traffic rises and falls for LLM inference and load replicas before they are needed."""

__version__ = "0.1.0"
