"""prewarm's front doors, above the registry: the OpenAI-compatible HTTP gateway (`server`: looks
up ready replicas and proxies to them) and the KEDA external scaler (`keda`: serves the planner's
replica targets to autoscalers over gRPC and as a Prometheus gauge)."""
