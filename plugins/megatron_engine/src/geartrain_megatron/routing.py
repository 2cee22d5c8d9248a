"""MoE router replay (``options.router_replay``) over megatron-core's ``RouterReplay``.

megatron-core (``moe_enable_routing_replay``) gives every router a ``RouterReplay`` whose
action decides the top-k step: ``RECORD`` computes it and keeps the chosen expert ids,
``REPLAY_FORWARD`` takes given ids and only gathers their scores (so the router weights
still get gradients). This module drives those per micro-batch and per pipeline chunk
(never through megatron's process-wide list of instances, which mixes the routers of every
model built in the process), translating between megatron's token order inside a
micro-batch (sequence-major ``[L, b]``, left-aligned rows, see :mod:`.micro`) and the
caller's ``[B, T]`` layout:

* a batch without ``routed_experts``: record; the result is ``[B, T, layers, k]`` expert
  ids for every real input token (0 on padding), gathered from all pipeline stages;
* a batch with ``routed_experts``: replay those ids for every real token (padding and
  filler tokens get experts ``0..k-1``; causal attention keeps them out of real tokens).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from geartrain.batch import Batch
from torch import nn

from geartrain_megatron import modeling, parallel
from geartrain_megatron.engine import MegatronModel
from geartrain_megatron.micro import MicroBatch

KEY = "routed_experts"


def _routers(chunk: nn.Module) -> list[tuple[int, Any]]:
    """``(global layer, RouterReplay)`` of every MoE layer of ``chunk`` (DDP-wrapped or not)."""
    module = getattr(chunk, "module", chunk)
    out = []
    for layer in getattr(getattr(module, "decoder", None), "layers", []):
        router = getattr(getattr(layer, "mlp", None), "router", None)
        if router is not None and router.router_replay is not None:
            out.append((layer.layer_number - 1, router.router_replay))
    return out


def _token_positions(mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each real token of ``mb``: (micro-batch row, position) and (batch row, column)."""
    assert mb.batch is not None
    mask = mb.batch["attention_mask"].bool()
    rows, cols = mask.nonzero(as_tuple=True)  # row-major: a row's columns in order
    positions = mask.long().cumsum(1)[rows, cols] - 1
    batch_rows = torch.tensor(mb.rows, dtype=torch.long)[rows]
    return rows, positions, batch_rows, cols


class Replay:
    """Drives the routers of ``model`` through one ``forward_backward`` of ``batch``."""

    def __init__(self, model: MegatronModel, batch: Batch) -> None:
        self.model = model
        self.topk = int(model.hf_config.num_experts_per_tok)
        self.layers = int(model.hf_config.num_hidden_layers)
        self.routers = {id(c): _routers(c) for c in model.chunks}
        self.shape = (len(batch), batch["input_ids"].shape[1], self.layers, self.topk)
        self.replaying = KEY in batch
        if self.replaying:
            given = batch[KEY]
            if tuple(given.shape) != self.shape:
                raise ValueError(
                    f"batch field '{KEY}': expected shape {list(self.shape)} ([rows, tokens, layers, top-k]), "
                    f"got {list(given.shape)}"
                )
            self.routed = given.long()
        else:
            self.routed = torch.zeros(self.shape, dtype=torch.long)

    def before(self, chunk: nn.Module, mb: MicroBatch) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        action = RouterReplayAction.REPLAY_FORWARD if self.replaying else RouterReplayAction.RECORD
        b, length = mb.tokens.shape
        for layer, replay in self.routers[id(chunk)]:
            replay.set_router_replay_action(action)
            if self.replaying:
                target = torch.arange(self.topk).expand(length, b, self.topk).clone()
                if mb.batch is not None:
                    r, j, br, c = _token_positions(mb)
                    target[j, r] = self.routed[br, c, layer]
                # also queued for the activation recompute in backward (see after())
                replay.set_target_indices(target.reshape(length * b, self.topk).to(self.model.device))

    def after(self, chunk: nn.Module, mb: MicroBatch) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        b, length = mb.tokens.shape
        for layer, replay in self.routers[id(chunk)]:
            if self.replaying:
                # with gradient checkpointing the backward recomputes the forward: it must
                # take the queued targets in forward order (the schedules run a chunk's
                # backwards in the order of its forwards), not the latest one
                replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            elif mb.batch is not None:
                recorded = replay.get_recorded_indices().detach().to("cpu").reshape(length, b, self.topk)
                r, j, br, c = _token_positions(mb)
                self.routed[br, c, layer] = recorded[j, r]

    def finish(self) -> dict[str, torch.Tensor]:
        """Reset the routers; the recorded routing (all stages' layers) when recording."""
        for routers in self.routers.values():
            for _, replay in routers:
                replay.clear_router_replay_action()
                replay.clear_indices()
        if self.replaying:
            return {}
        if self.model.layout.pp > 1:  # each stage recorded its own layers; the rest are 0
            parallel.all_reduce_(self.routed, parallel.groups()["pp"], op=dist.ReduceOp.MAX)
        return {KEY: self.routed}


def replay_for(model: MegatronModel, batch: Batch) -> Replay | None:
    """The replay driver for ``batch``, or ``None`` when ``options.router_replay`` is off."""
    if not model.options.router_replay or not modeling.num_experts(model.hf_config):
        return None
    return Replay(model, batch)
