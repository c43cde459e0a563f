"""Traffic history as it comes: trace files, Redis counters and Prometheus, read into one shape; synthetic workloads."""
