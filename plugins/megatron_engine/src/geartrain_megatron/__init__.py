"""geartrain-megatron: geartrain's megatron-core TP/PP/VPP/CP/EP engine. A skeleton: the package layout and entry point
exist, the backend does not yet."""
