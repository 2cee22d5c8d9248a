"""geartrain-sglang: geartrain's SGLang Engine rollout. A skeleton: the package layout and entry point
exist, the backend does not yet."""
