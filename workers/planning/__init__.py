"""The planner worker: the forecast loop, the executor of scale events, cluster-wide tasks and Kubernetes."""
