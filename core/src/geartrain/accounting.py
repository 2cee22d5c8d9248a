"""FLOP and byte accounting for the GPU figures (issue 33 item 8): what a step computed, so
that MFU and the decode roofline are reported against the work actually done.

**Update MFU.** ``model FLOPs / step time / peak``, with model FLOPs

    k * N * computed_tokens + 12 * layers * heads * head_dim * attended_pairs

* ``N`` (:attr:`ModelShape.matmul_params`): the weights a token is multiplied by: every
  decoder layer's projections and the output projection (``vocab x hidden``), not the input
  embedding (a lookup) nor norms and biases. For a tied model (qwen2.5-0.5b and 1.5b) the
  shared matrix counts once, as the output projection, and ``N`` is within 0.02 % of the
  parameter count; for an untied one (qwen2.5-7b, llama3-8b) the input embedding is left
  out (all parameters overcount 7b by 8 %);
* ``k = 6`` for full training (forward 2N, backward 4N), ``k = 4`` for LoRA (the frozen
  base needs no weight gradients: forward 2N plus the input gradients 2N; the adapters'
  own FLOPs are negligible at rank 16);
* ``computed_tokens``: the tokens that ran through the model. With shared-prompt packing a
  GRPO group's prompt runs once, so a group of ``n`` samples computes ``p + sum(r)``
  tokens, not ``n p + sum(r)`` (:func:`computed_tokens`);
* attention: per attended (query, key) pair and head, ``4 d`` FLOPs forward (``QK^T`` and
  ``PV``) and ``8 d`` backward. ``attended_pairs`` counts the causal pairs actually
  computed (:func:`attended_pairs`; a shared prompt's keys are attended by its prompt once
  and by every response); ``convention="square"`` counts ``s^2`` per sequence as
  torchtitan's and verl's counters do (``12 l h d s^2``: twice the causal work).

**Decode roofline.** A decode step must read the weights and the live KV cache (each row's
filled context, not the static cache's full width) and do ``2 N`` FLOPs per row; it cannot
take less than ``max(bytes / bandwidth, 2 N B / peak)`` (:func:`decode_roofline_s`). The
decode figure is that bound summed over the call's steps divided by the measured time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "ModelShape",
    "attended_pairs",
    "computed_tokens",
    "decode_call_roofline",
    "decode_roofline_s",
    "decode_step_bytes",
    "update_flops",
]


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The sizes the accounting needs, from a transformers decoder config."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        heads = config.num_attention_heads
        return cls(
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate=config.intermediate_size,
            vocab=config.vocab_size,
        )

    @property
    def matmul_params(self) -> int:
        """``N``: q, k, v, o and the gated MLP's three projections per layer, plus the
        output projection."""
        h, d = self.hidden, self.head_dim
        attention = h * self.heads * d * 2 + h * self.kv_heads * d * 2
        mlp = 3 * h * self.intermediate
        return self.layers * (attention + mlp) + self.vocab * h

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Bytes of one token's keys and values over all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * itemsize


Rows = Sequence[tuple[int, int]]
"""One ``(prompt_tokens, response_tokens)`` per sample."""


def _groups(rows: Rows, group_ids: Sequence[int] | None) -> list[tuple[int, list[int]]]:
    """``(prompt length, response lengths)`` per prompt-sharing group (every row its own
    group when ``group_ids`` is None)."""
    if group_ids is None:
        return [(p, [r]) for p, r in rows]
    groups: dict[int, tuple[int, list[int]]] = {}
    for (p, r), g in zip(rows, group_ids, strict=True):
        if g in groups and groups[g][0] != p:
            raise ValueError(f"group {g} has prompts of {groups[g][0]} and {p} tokens")
        groups.setdefault(g, (p, []))[1].append(r)
    return list(groups.values())


def computed_tokens(rows: Rows, group_ids: Sequence[int] | None = None) -> int:
    """Tokens that run through the model: each group's prompt once plus every response
    (``group_ids``: rows with the same id share their prompt; None: no sharing)."""
    return sum(p + sum(rs) for p, rs in _groups(rows, group_ids))


def attended_pairs(
    rows: Rows, group_ids: Sequence[int] | None = None, *, convention: Literal["causal", "square"] = "causal"
) -> int:
    """(query, key) pairs attention computes. ``causal``: a prompt of ``p`` tokens
    ``p (p + 1) / 2`` (once per group), a response of ``r`` after it ``r p + r (r + 1) / 2``.
    ``square``: ``s^2`` per sequence of ``s = p + r`` tokens, no sharing (torchtitan, verl)."""
    if convention == "square":
        return sum((p + r) ** 2 for p, r in rows)
    return sum(p * (p + 1) // 2 + sum(r * p + r * (r + 1) // 2 for r in rs) for p, rs in _groups(rows, group_ids))


def update_flops(
    shape: ModelShape,
    rows: Rows,
    group_ids: Sequence[int] | None = None,
    *,
    lora: bool = False,
    convention: Literal["causal", "square"] = "causal",
) -> float:
    """Model FLOPs of one update (forward + backward) over ``rows`` (module docstring);
    ``convention="square"`` counts every row's full square without sharing."""
    shared = None if convention == "square" else group_ids
    k = 4 if lora else 6
    dense = k * shape.matmul_params * computed_tokens(rows, shared)
    attention = 12 * shape.layers * shape.heads * shape.head_dim * attended_pairs(rows, shared, convention=convention)
    return float(dense + attention)


def decode_step_bytes(shape: ModelShape, weight_bytes: int, contexts: Sequence[int], kv_itemsize: int) -> int:
    """Bytes a decode step must read: the weights once and each live row's KV cache over
    its ``contexts`` tokens."""
    return weight_bytes + sum(contexts) * shape.kv_bytes_per_token(kv_itemsize)


def decode_roofline_s(step_bytes: float, rows: int, matmul_params: int, bandwidth: float, peak: float) -> float:
    """The least time a decode step of ``rows`` live rows can take: ``max(bytes / bandwidth,
    2 N rows / peak)``."""
    return max(step_bytes / bandwidth, 2 * matmul_params * rows / peak)


def decode_call_roofline(
    shape: ModelShape,
    weight_bytes: int,
    prompt_lengths: Sequence[int],
    generated: Sequence[int],
    kv_itemsize: int,
    bandwidth: float,
    peak: float,
) -> dict[str, float]:
    """The roofline of a decode call: row ``i`` has a prompt of ``prompt_lengths[i]`` tokens
    and generated ``generated[i]`` tokens (the first from the prefill; then one decode step
    each, reading its context so far). Returns the summed bound ``seconds``, the ``steps``,
    and the mean and first/last ``bytes_per_step``."""
    steps = max(generated) - 1 if generated else 0
    total = 0.0
    step_bytes: list[int] = []
    for t in range(1, steps + 1):  # decode step t feeds token t-1 and samples token t
        live = [p + t for p, g in zip(prompt_lengths, generated, strict=True) if g > t]
        if not live:
            break
        b = decode_step_bytes(shape, weight_bytes, live, kv_itemsize)
        step_bytes.append(b)
        total += decode_roofline_s(b, len(live), shape.matmul_params, bandwidth, peak)
    return {
        "seconds": total,
        "steps": float(len(step_bytes)),
        "mean_bytes_per_step": sum(step_bytes) / len(step_bytes) if step_bytes else 0.0,
        "first_bytes_per_step": float(step_bytes[0]) if step_bytes else 0.0,
        "last_bytes_per_step": float(step_bytes[-1]) if step_bytes else 0.0,
    }
