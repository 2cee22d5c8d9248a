"""geartrain's FSDP2 engine backend (entry point ``geartrain.engines: fsdp``).

Modules, one job each: :mod:`options` (the ``[engine.options]`` schema), :mod:`mesh`
(device meshes), :mod:`modeling` (the module FSDP wraps), :mod:`packing` (micro-batch
plans and padding removal), :mod:`logprobs` (chunked per-token log-probs/entropy),
:mod:`ulysses` (sequence parallel attention), :mod:`train` (forward_backward),
:mod:`checkpoint` (DCP), :mod:`weights` (full-weight streaming and HF export),
:mod:`offload`, and :mod:`plugin` (the hook implementations). AdamW, the LR schedule and
the clipped step are the core's (:mod:`geartrain.optim`), shared by every engine.
"""

__version__ = "0.1.0"
