"""``forward_backward``: dynamic micro-batches, packing, sequence parallel pre/post
processing, the loss contract and gradient accumulation."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from geartrain.batch import Batch
from geartrain.micro_batches import plan_micro_batches
from geartrain.types import ADAPTERS_OFF, NEED_SUM_PI_SQUARED, LossContext, LossFn, StepOutput

from geartrain_fsdp.mesh import all_reduce_
from geartrain_fsdp.packing import pack, padded_inputs, scatter_shifted, shift_padded
from geartrain_fsdp.prefix_sharing import (
    has_standard_layout,
    pack_shared,
    prompt_groups,
    scatter_outputs,
)
from geartrain_fsdp.sharding import FSDPModel
from geartrain_fsdp.ulysses import PackedAttentionState, gather_sequence, local_slice, packed_attention_state

OPTIONAL_OUTPUTS = {"need_entropy": "entropy", NEED_SUM_PI_SQUARED: "sum_pi_squared"}
"""``batch.info`` flag -> the per-token output it asks for (causal LMs)."""


@dataclass(frozen=True, slots=True)
class SharedPrompts:
    """How a batch runs in the shared-prompt layout: its prompt width and its rows grouped
    by prompt (:func:`~geartrain_fsdp.prefix_sharing.prompt_groups`)."""

    prompt_length: int
    groups: list[list[int]]

    def within(self, rows: list[int]) -> list[list[int]]:
        """The groups restricted to ``rows`` (a micro-batch), as positions in ``rows``."""
        position = {row: k for k, row in enumerate(rows)}
        local = ([position[r] for r in group if r in position] for group in self.groups)
        return [g for g in local if g]


def _shares_prompts(model: FSDPModel, batch: Batch) -> SharedPrompts | None:
    """How this batch runs in the shared-prompt layout, or None when it does not."""
    options = model.options
    prompt_length = batch.info.get("prompt_length")
    if not (options.share_prompt_prefix and options.remove_padding and model.meshes.sp == 1):
        return None
    if not isinstance(prompt_length, int) or len(batch) < 2:
        return None
    if not has_standard_layout(batch["attention_mask"], prompt_length):
        return None
    groups = prompt_groups(batch["input_ids"], batch["attention_mask"], prompt_length)
    return SharedPrompts(prompt_length, groups) if len(groups) < len(batch) else None


def _planning_units(batch: Batch, shared: SharedPrompts | None, budget: int) -> tuple[list[list[int]], list[int]]:
    """Rows that must share a micro-batch and their token cost: single rows, or (shared
    prompts) each prompt's rows, costing the prompt once, split when over ``budget``."""
    mask = batch["attention_mask"]
    lengths = mask.sum(1).tolist()
    if shared is None:
        return [[i] for i in range(len(lengths))], lengths
    prompt = mask[:, : shared.prompt_length].sum(1).tolist()
    units: list[list[int]] = []
    costs: list[int] = []
    for rows in shared.groups:
        unit: list[int] = []
        cost = prompt[rows[0]]
        for row in rows:
            extra = lengths[row] - prompt[row]
            if unit and cost + extra > budget:
                units.append(unit)
                costs.append(cost)
                unit, cost = [], prompt[row]
            unit.append(row)
            cost += extra
        units.append(unit)
        costs.append(cost)
    return units, costs


def _micro_batch_plan(model: FSDPModel, batch: Batch, shared: SharedPrompts | None) -> list[list[int]]:
    """Rows of each micro-batch; every rank of the engine runs the same number (FSDP's
    collectives run once per micro-batch on every rank)."""
    budget = model.config.max_tokens_per_micro_batch
    units, costs = _planning_units(batch, shared, budget)
    plan = plan_micro_batches(costs, budget)
    count = torch.tensor([len(plan)], device=model.device)
    if model.meshes.distributed:
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=model.meshes.ctx_group)
    if int(count) > len(plan):
        plan = plan_micro_batches(costs, budget, min_count=int(count))
    return [sorted(row for u in group for row in units[u]) for group in plan]


def _forward_shared(
    model: FSDPModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    prompt_length: int,
    groups: list[list[int]],
    wanted: dict[str, bool],
) -> tuple[dict[str, torch.Tensor], torch.Tensor, PackedAttentionState]:
    """Per-token outputs ``[b, T]`` of one micro-batch in the shared-prompt layout
    (:mod:`geartrain_fsdp.prefix_sharing`; sp = 1), and its attention state."""
    packed = pack_shared(ids, mask, prompt_length, groups)
    dev = model.device
    state = PackedAttentionState(
        cu_seqlens=[0, packed.num_tokens], segments=packed.segments, kernel=model.attention_kernel
    )
    with packed_attention_state(state):
        raw = model.module(
            input_ids=packed.input_ids.to(dev),
            position_ids=packed.position_ids.to(dev),
            targets=packed.out_targets.to(dev),
            **wanted,
            output_positions=packed.out_positions.to(dev),
        )
    outputs = {key: scatter_outputs(value, packed) for key, value in raw.items()}
    anchor = sum(v.sum() * 0.0 for v in raw.values())
    return outputs, anchor, state  # type: ignore[return-value]


def _forward_packed(
    model: FSDPModel, ids: torch.Tensor, mask: torch.Tensor, wanted: dict[str, bool]
) -> tuple[dict[str, torch.Tensor], torch.Tensor, PackedAttentionState | None]:
    """Per-token outputs ``[b, T]`` of one micro-batch run as one packed row (split over
    the sp group), a scalar tied to the raw outputs (for empty micro-batches), and the
    attention state (backward's recomputation under gradient checkpointing needs it)."""
    meshes = model.meshes
    packed = pack(ids, mask, multiple=meshes.sp)
    sl = local_slice(packed.input_ids.shape[1], meshes.sp, meshes.sp_rank)
    dev = model.device
    state = PackedAttentionState(
        cu_seqlens=packed.cu_seqlens.tolist(),
        sp_group=meshes.sp_group,
        sp_size=meshes.sp,
        kernel=model.attention_kernel,
    )
    with packed_attention_state(state):
        raw = model.module(
            input_ids=packed.input_ids[:, sl].to(dev),
            position_ids=packed.position_ids[:, sl].to(dev),
            targets=packed.targets[sl].unsqueeze(0).to(dev),
            **wanted,
        )
    outputs = {}
    anchor = None
    for key, value in raw.items():
        full = gather_sequence(value.squeeze(0), meshes.sp_group, meshes.sp, meshes.sp_rank)
        anchor = full.sum() * 0.0 if anchor is None else anchor + full.sum() * 0.0
        outputs[key] = scatter_shifted(full, packed)
    assert anchor is not None
    return outputs, anchor, state


def _forward_padded(
    model: FSDPModel, ids: torch.Tensor, mask: torch.Tensor, wanted: dict[str, bool]
) -> tuple[dict[str, torch.Tensor], torch.Tensor, PackedAttentionState | None]:
    """Per-token outputs ``[b, T]`` of one micro-batch run as padded rows."""
    dev = model.device
    sub_ids, sub_mask, position_ids, cols = padded_inputs(ids, mask)
    targets = torch.cat([sub_ids[:, 1:], sub_ids.new_zeros(sub_ids.shape[0], 1)], dim=1)
    raw = model.module(
        input_ids=sub_ids.to(dev),
        position_ids=position_ids.to(dev),
        attention_mask=sub_mask.to(dev),
        targets=targets.to(dev),
        **wanted,
    )
    outputs = {k: shift_padded(v, sub_mask, cols, ids.shape[1]) for k, v in raw.items()}
    anchor = sum(v.sum() * 0.0 for v in raw.values())
    return outputs, anchor, None  # type: ignore[return-value]


def forward_backward(model: FSDPModel, batch: Batch, loss_fn: LossFn | None, forward_only: bool) -> StepOutput:
    """See :func:`geartrain.hookspecs.forward_backward`.

    Gradient scaling: FSDP averages gradients over all ``world = dp * sp`` ranks, and
    each sp rank back-propagates only its own tokens' part of the (identical) loss, so the
    summed share is multiplied by ``world``: the result is the gradient of the sum of all
    shares over micro-batches and dp ranks.
    """
    meshes = model.meshes
    input_ids = batch["input_ids"]
    attention_mask = batch["attention_mask"]
    # the per-token outputs the caller asked for besides log_probs (the module's keywords)
    wanted = {flag: bool(batch.info.get(flag, False)) for flag in OPTIONAL_OUTPUTS}
    train = not forward_only and loss_fn is not None

    counts = torch.tensor(
        [
            float(batch["loss_mask"].sum()) if "loss_mask" in batch else 0.0,
            float(len(batch)),
        ],
        dtype=torch.float64,
        device=model.device,
    )
    all_reduce_(counts, meshes.dp_group)
    global_tokens, global_sequences = (int(x) for x in counts.tolist()[:2])

    shared = _shares_prompts(model, batch)
    plan = _micro_batch_plan(model, batch, shared)
    forward = _forward_packed if model.options.remove_padding else _forward_padded
    scale = float(meshes.world)
    metric_sums: dict[str, float] = {}
    collected: dict[str, list[torch.Tensor]] = {}
    order: list[int] = []
    model.module.train(mode=train)
    grad_ctx = contextlib.nullcontext() if train else torch.no_grad()
    with grad_ctx, _autocast(model), _adapters(model, batch):
        for index, rows in enumerate(plan):
            if rows:
                mb = batch.index(rows)
                ids, mask = mb["input_ids"], mb["attention_mask"]
            else:  # this rank has no rows left: one filler token keeps the collectives in step
                mb = None
                ids = torch.zeros(1, 1, dtype=input_ids.dtype)
                mask = torch.zeros(1, 1, dtype=attention_mask.dtype)
            if shared is not None and mb is not None and len(mb) > 1:
                outputs, anchor, state = _forward_shared(
                    model, ids, mask, shared.prompt_length, shared.within(rows), wanted
                )
            else:
                outputs, anchor, state = forward(model, ids, mask, wanted)
            loss = anchor
            if mb is not None and loss_fn is not None:
                loss_ctx = LossContext(
                    global_tokens=global_tokens,
                    global_sequences=global_sequences,
                    dp_size=meshes.dp,
                    micro_batch_index=index,
                    num_micro_batches=len(plan),
                )
                # The loss sees its micro-batch on the device of the outputs (found on an H200:
                # CPU-held batch tensors met CUDA outputs in every loss).
                mb_on_device = mb if model.device.type == "cpu" else mb.to(model.device)
                share, metrics = loss_fn(outputs, mb_on_device, loss_ctx)
                loss = loss + share
                for key, value in metrics.items():
                    metric_sums[key] = metric_sums.get(key, 0.0) + float(value)
            if train:
                # gradient checkpointing recomputes the layers (their attention) in backward
                with packed_attention_state(state) if state is not None else contextlib.nullcontext():
                    (loss * scale).backward()
            if mb is not None:
                order.extend(rows)
                for key, value in outputs.items():
                    collected.setdefault(key, []).append(value.detach().to("cpu"))

    result: dict[str, torch.Tensor] = {}
    if order:
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        result = {k: torch.cat(v, dim=0)[inverse] for k, v in collected.items()}
    else:
        width = input_ids.shape[1]
        extras = (name for flag, name in OPTIONAL_OUTPUTS.items() if wanted[flag])
        for key in ("values",) if model.value_head else ("log_probs", *extras):
            result[key] = torch.zeros(0, width)

    # this rank's slice only: the core sums metrics over the data-parallel ranks
    metrics = dict(metric_sums)
    metrics.update(tokens=float(attention_mask.sum()), sequences=float(len(batch)), micro_batches=float(len(plan)))
    return StepOutput(outputs=result, metrics=metrics)


def _adapters(model: FSDPModel, batch: Batch) -> contextlib.AbstractContextManager:
    """The base model alone when the batch asks for it (``ADAPTERS_OFF``) and there are
    LoRA adapters to turn off."""
    if model.peft is None or not batch.info.get(ADAPTERS_OFF, False):
        return contextlib.nullcontext()
    from geartrain_fsdp.lora import adapters_disabled

    return adapters_disabled(model.module)


def _autocast(model: FSDPModel) -> contextlib.AbstractContextManager:
    """Mixed precision outside FSDP (a single process runs the plain module): autocast to
    ``param_dtype``; under FSDP the MixedPrecisionPolicy does it."""
    dtype = model.config.param_dtype
    if model.meshes.distributed or dtype == "float32":
        return contextlib.nullcontext()
    from geartrain.modeling import torch_dtype

    return torch.autocast(model.device.type, dtype=torch_dtype(dtype))
