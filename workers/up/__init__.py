"""`prewarm up`: the whole system on one machine, driven by a traffic replay, and its report."""
