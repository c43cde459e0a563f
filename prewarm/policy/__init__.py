"""Pure policies of the request path: routing, warmup generation and validation rules (no I/O, `now` passed in)."""
