"""geartrain-simple-engine: a single-process, plain-PyTorch training engine for geartrain."""
