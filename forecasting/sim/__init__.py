"""Trace replay: the policy interface, the simulator, the baseline policies, scoring and the report."""
