"""geartrain's megatron-core engine backend (entry point ``geartrain.engines: megatron``).

Modules, one job each: :mod:`options` (the ``[engine.options]`` schema), :mod:`compat`
(megatron's CUDA spots bridged on CPU-only machines), :mod:`parallel` (megatron's parallel
state from the role's ranks), :mod:`convert` (the HF <-> megatron weight mapping),
:mod:`modeling` (``GPTModel`` chunks from an HF config, loading HF weights), :mod:`engine`
(the handle and ``shard``), :mod:`micro` (micro-batches without padding), :mod:`logprobs`
(vocabulary-parallel log-probs and entropy), :mod:`train` (``forward_backward`` over
megatron's schedules), :mod:`optim` (DDP, optimizer, LR schedule, clipped step),
:mod:`weights` (rollout sync and HF export) and :mod:`plugin` (the hook implementations).
"""

__version__ = "0.1.0"
