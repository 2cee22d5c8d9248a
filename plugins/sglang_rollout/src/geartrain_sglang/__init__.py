"""geartrain's SGLang rollout backend (entry point ``geartrain.rollouts: sglang``).

Importing this package does not import SGLang; the engine is started by ``build_rollout``.
"""

__version__ = "0.1.0"
