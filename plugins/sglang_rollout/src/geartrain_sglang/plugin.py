"""Entry point of the 'sglang' backend. Not implemented yet: loading it fails with a message
that says so, which geartrain reports as a plugin error (the other plugins still load)."""

raise NotImplementedError(
    "geartrain-sglang 0.0.1 is a skeleton: the 'sglang' backend (SGLang Engine rollout) is not implemented yet. "
    "Uninstall it (pip uninstall geartrain-sglang) or leave it out with GEARTRAIN_PLUGINS."
)
