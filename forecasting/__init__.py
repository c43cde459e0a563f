"""History, forecasting, planning and trace replay: the pure brain of prewarm."""
