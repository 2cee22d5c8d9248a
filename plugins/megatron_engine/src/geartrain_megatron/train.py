"""``forward_backward`` over megatron's pipeline schedules (no pipelining, 1F1B, or
interleaved 1F1B with virtual stages), with vocabulary-parallel log-probs and entropy and
the core's loss contract.

Gradient scaling: the schedule divides each micro-batch's loss by the number of
micro-batches and megatron's DDP averages gradients over the data-parallel ranks, so the
loss function's share is multiplied by both: the result is the gradient of the sum of all
shares over micro-batches and data-parallel ranks, as :data:`geartrain.types.LossFn` says.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from geartrain.batch import Batch
from geartrain.micro_batches import plan_micro_batches
from geartrain.types import NEED_SUM_PI_SQUARED, LossContext, LossFn, StepOutput

from geartrain_megatron import parallel, routing
from geartrain_megatron.compat import cpu_compat
from geartrain_megatron.engine import MegatronModel
from geartrain_megatron.logprobs import vocab_parallel_log_probs
from geartrain_megatron.micro import MicroBatch, make_micro_batch


def _plan(model: MegatronModel, attention_mask: torch.Tensor) -> list[list[int]]:
    lengths = attention_mask.sum(1).tolist()
    plan = plan_micro_batches(lengths, model.config.max_tokens_per_micro_batch)
    pp = model.layout.pp
    if model.layout.vpp and len(plan) % pp:
        # the interleaved schedule runs micro-batches in groups of pp
        plan = plan_micro_batches(lengths, model.config.max_tokens_per_micro_batch, min_count=-(-len(plan) // pp) * pp)
    return plan


OPTIONAL_OUTPUTS = {"need_entropy": "entropy", NEED_SUM_PI_SQUARED: "sum_pi_squared"}
"""``batch.info`` flag -> the per-token output it asks for (causal LMs)."""


def _outputs(
    model: MegatronModel, mb: MicroBatch, output: torch.Tensor, wanted: dict[str, bool]
) -> dict[str, torch.Tensor]:
    """Per-token outputs ``[b, T]`` from the last stage's output ``[b, L, V / tp]``
    (logits of this rank's vocabulary slice) or ``[b, L, 1]`` (values)."""
    if model.value_head:
        return {"values": mb.scatter(output[..., 0].float())}
    lay = model.layout
    local_vocab = output.shape[-1]
    per_token = vocab_parallel_log_probs(
        output,
        mb.targets.to(output.device),
        vocab_start=lay.tp_rank * local_vocab,
        vocab_size=model.dims.vocab_size,
        group=parallel.groups()["tp"],
        **wanted,
    )
    return {key: mb.scatter(value) for key, value in per_token.items()}


def forward_backward(model: MegatronModel, batch: Batch, loss_fn: LossFn | None, forward_only: bool) -> StepOutput:
    """See :func:`geartrain.hookspecs.forward_backward`."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    lay = model.layout
    groups = parallel.groups()
    input_ids = batch["input_ids"]
    attention_mask = batch["attention_mask"]
    wanted = {flag: bool(batch.info.get(flag, False)) for flag in OPTIONAL_OUTPUTS}
    train = not forward_only and loss_fn is not None
    dev = model.device

    counts = torch.tensor(
        [
            float(batch["loss_mask"].sum()) if "loss_mask" in batch else 0.0,
            float(len(batch)),
            float(attention_mask.sum()),
        ],
        dtype=torch.float64,
    )
    parallel.all_reduce_(counts, groups["dp"])
    global_tokens, global_sequences, global_real_tokens = (int(x) for x in counts.tolist())

    plan = _plan(model, attention_mask)
    width = input_ids.shape[1]
    micro = [make_micro_batch(batch.index(rows) if rows else None, rows, width) for rows in plan]
    if lay.vpp:
        # the interleaved schedule pairs activation and gradient exchanges of different
        # micro-batches: it needs one shape for all of them (trailing padding only)
        rows_max = max(mb.tokens.shape[0] for mb in micro)
        length_max = max(mb.tokens.shape[1] for mb in micro)
        micro = [mb.padded(rows_max, length_max) for mb in micro]
    n = len(micro)
    scale = float(lay.dp * n)
    store: list[dict[str, Any]] = []

    def loss_func(mb: MicroBatch, index: int, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        outputs = _outputs(model, mb, output, wanted)
        loss = sum(v.sum() * 0.0 for v in outputs.values())  # keeps fillers in the graph
        metrics: dict[str, float] = {}
        if mb.batch is not None and loss_fn is not None:
            ctx = LossContext(
                global_tokens=global_tokens,
                global_sequences=global_sequences,
                dp_size=lay.dp,
                micro_batch_index=index,
                num_micro_batches=n,
            )
            # the loss sees its micro-batch on the outputs' device (found on an H200: CPU-held
            # batch tensors met CUDA log-probs in every loss)
            on_device = mb.batch if output.device.type == "cpu" else mb.batch.to(output.device)
            share, metrics = loss_fn(outputs, on_device, ctx)
            loss = loss + share
        record = {"rows": mb.rows, "outputs": {k: v.detach().to("cpu") for k, v in outputs.items()}, "metrics": metrics}
        store.append(record)
        return loss * scale, record

    index_of = {id(mb): i for i, mb in enumerate(micro)}

    replay = routing.replay_for(model, batch)

    def forward_step(data_iterator: Any, chunk: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        mb: MicroBatch = next(data_iterator)
        tokens = mb.tokens.to(dev)
        positions = torch.arange(tokens.shape[1], device=dev).unsqueeze(0).expand_as(tokens)
        if replay is not None:
            replay.before(chunk, mb)
        output = chunk(input_ids=tokens, position_ids=positions, attention_mask=None)
        if replay is not None:
            replay.after(chunk, mb)
        return output, partial(loss_func, mb, index_of[id(mb)])

    func = get_forward_backward_func()
    data = [iter(micro) for _ in model.chunks] if len(model.chunks) > 1 else iter(micro)
    grad_ctx = contextlib.nullcontext() if train else torch.no_grad()
    with cpu_compat(), grad_ctx:
        for chunk in model.chunks:
            chunk.train(train)
        func(
            forward_step_func=forward_step,
            data_iterator=data,
            model=model.chunks,
            num_microbatches=n,
            seq_length=max(mb.tokens.shape[1] for mb in micro),
            micro_batch_size=max(mb.tokens.shape[0] for mb in micro),
            forward_only=not train,
        )

    extras = tuple(name for flag, name in OPTIONAL_OUTPUTS.items() if wanted[flag])
    result, metrics = _collect(model, store, len(batch), width, extras)
    if replay is not None:
        result.update(replay.finish())
    # this rank's slice only: the core sums metrics over the data-parallel ranks
    metrics.update(tokens=float(attention_mask.sum()), sequences=float(len(batch)), micro_batches=float(n))
    return StepOutput(outputs=result, metrics=metrics)


def _collect(
    model: MegatronModel, store: list[dict[str, Any]], rows: int, width: int, extras: tuple[str, ...]
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The last stage's per-micro-batch records -> ``[B, T]`` outputs (``log_probs`` and the
    ``extras`` asked for, or ``values``) in batch order and summed metrics, broadcast to
    every pipeline stage."""
    lay = model.layout
    keys = ("values",) if model.value_head else ("log_probs", *extras)
    payload: list[Any] = [None]
    if lay.is_last_stage:
        result = {k: torch.zeros(rows, width) for k in keys}
        sums: dict[str, float] = {}
        for record in store:
            if record["rows"]:
                for k in keys:
                    result[k][record["rows"]] = record["outputs"][k].to(result[k].dtype)
            for k, v in record["metrics"].items():
                sums[k] = sums.get(k, 0.0) + float(v)
        payload = [(result, sums)]
    if lay.pp > 1:
        from megatron.core import parallel_state as ps

        dist.broadcast_object_list(
            payload, src=ps.get_pipeline_model_parallel_last_rank(), group=parallel.groups()["pp"]
        )
    return payload[0]
