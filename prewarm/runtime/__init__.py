"""The model runtime: the torch model, its manifest, the progressive loader, snapshots, the engine and its HTTP host."""
