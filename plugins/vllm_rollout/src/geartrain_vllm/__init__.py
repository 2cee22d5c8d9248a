"""geartrain's vLLM rollout backend (entry point ``geartrain.rollouts: vllm``).

Importing this package does not import vLLM; the engine is started by ``build_rollout``.
"""

__version__ = "0.1.0"
