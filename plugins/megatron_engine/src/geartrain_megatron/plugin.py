"""Entry point of the 'megatron' backend. Not implemented yet: loading it fails with a message
that says so, which geartrain reports as a plugin error (the other plugins still load)."""

raise NotImplementedError(
    "geartrain-megatron 0.0.1 is a skeleton: the 'megatron' backend (megatron-core TP/PP/VPP/CP/EP engine) is not implemented yet. "
    "Uninstall it (pip uninstall geartrain-megatron) or leave it out with GEARTRAIN_PLUGINS."
)
