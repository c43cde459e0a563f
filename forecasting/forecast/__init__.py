"""Forecasters of request rate quantiles (scikit-learn estimator contract), their features and rolling-origin backtests."""
