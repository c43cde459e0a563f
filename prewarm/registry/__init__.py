"""Redis: the replica registry and its Lua transitions, request counters, client construction and the embedded server."""
