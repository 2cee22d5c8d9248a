"""The Hugging Face <-> megatron-core weight mapping for Llama / Qwen2-style decoders,
written once and used in both directions (loading, rollout sync, export).

Each megatron parameter of a ``GPTModel`` chunk is described by a :class:`Rule`: which
transformers tensors it comes from and how they are laid out in one tensor-parallel
shard. ``to_shard`` builds a rank's local tensor from the full HF tensors;
``from_shards`` turns the list of all TP ranks' local tensors back into the HF tensors.

Layouts (megatron's, for the local and the TransformerEngine specs alike):

* ``linear_qkv``: per query group ``[q heads of the group | k | v]``, groups one after the
  other; TP ranks own consecutive groups (so GQA needs ``tp`` to divide the KV heads).
* ``linear_fc1`` (gated MLP): each TP rank holds ``[gate shard; up shard]``.
* vocabulary tensors (embedding, output layer) are split by rows over TP, the vocabulary
  padded with zero rows so that ``tp`` divides it.
* ``linear_proj`` / ``linear_fc2`` are split by columns; norms are replicated.
* MoE (Mixtral layout, transformers 5 fused experts): the router ``mlp.router`` is HF's
  ``mlp.gate`` (replicated); each megatron expert ``mlp.experts.local_experts.<i>`` is one
  slice ``[e]`` of HF's stacked ``mlp.experts.gate_up_proj`` (``[E, 2I, H]``, gate rows
  first; megatron's gated ``linear_fc1``) and ``mlp.experts.down_proj`` (``[E, H, I]``,
  ``linear_fc2``), ``e`` being the expert's global index (expert parallelism gives each rank
  a range of them). :attr:`Rule.expert` names the slice.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Dims:
    """The shapes the mapping needs."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int


@dataclass(frozen=True, slots=True)
class Rule:
    """How one megatron parameter is made of HF tensors."""

    kind: str
    """``replicated``, ``rows`` (split dim 0), ``cols`` (split dim 1), ``vocab`` (rows,
    padded vocabulary), ``qkv`` (fused attention input) or ``gated`` (fused gate/up)."""
    hf_names: tuple[str, ...]
    expert: int | None = None
    """For a MoE expert: its index in HF's stacked expert tensors (the rule then maps the
    slice ``hf[expert]``)."""

    def to_shard(self, get: Callable[[str], torch.Tensor], dims: Dims, tp: int, rank: int) -> torch.Tensor:
        """This TP rank's local tensor, from ``get(hf_name)`` (full HF tensors)."""
        tensors = [get(n) for n in self.hf_names]
        if self.expert is not None:
            tensors = [t[self.expert] for t in tensors]
        if self.kind == "gated" and len(tensors) == 1:  # HF's fused [gate; up]
            tensors = list(tensors[0].chunk(2, dim=0))
        if self.kind == "replicated":
            return tensors[0]
        if self.kind == "rows":
            return tensors[0].chunk(tp, dim=0)[rank]
        if self.kind == "cols":
            return tensors[0].chunk(tp, dim=1)[rank]
        if self.kind == "vocab":
            full = tensors[0]
            pad = dims.padded_vocab_size - full.shape[0]
            if pad:
                full = torch.cat([full, full.new_zeros(pad, *full.shape[1:])])
            return full.chunk(tp, dim=0)[rank]
        if self.kind == "qkv":
            return fuse_qkv(*tensors, dims).chunk(tp, dim=0)[rank]
        if self.kind == "gated":
            gate, up = tensors
            return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])
        raise AssertionError(self.kind)

    def from_shards(self, shards: list[torch.Tensor], dims: Dims) -> list[torch.Tensor]:
        """The HF tensors (in ``hf_names`` order) from every TP rank's local tensor."""
        if self.kind == "replicated":
            return [shards[0]]
        if self.kind == "rows":
            return [torch.cat(shards, dim=0)]
        if self.kind == "cols":
            return [torch.cat(shards, dim=1)]
        if self.kind == "vocab":
            return [torch.cat(shards, dim=0)[: dims.vocab_size]]
        if self.kind == "qkv":
            return list(split_qkv(torch.cat(shards, dim=0), dims))
        if self.kind == "gated":
            halves = [s.chunk(2, dim=0) for s in shards]
            gate, up = torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])
            return [gate, up] if len(self.hf_names) == 2 else [torch.cat([gate, up])]
        raise AssertionError(self.kind)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dims: Dims) -> torch.Tensor:
    """HF ``q_proj``/``k_proj``/``v_proj`` (weights ``[heads * d, H]`` or biases
    ``[heads * d]``) -> megatron's group-major fused ``linear_qkv``."""
    g, d = dims.num_kv_heads, dims.head_dim
    per_group = dims.num_heads // g
    rest = q.shape[1:]
    qg = q.reshape(g, per_group * d, *rest)
    kg = k.reshape(g, d, *rest)
    vg = v.reshape(g, d, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def split_qkv(fused: torch.Tensor, dims: Dims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`."""
    g, d = dims.num_kv_heads, dims.head_dim
    per_group = dims.num_heads // g
    rest = fused.shape[1:]
    grouped = fused.reshape(g, (per_group + 2) * d, *rest)
    q, k, v = grouped.split([per_group * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_EXPERT_RULES = {
    "linear_fc1": ("gated", ("mlp.experts.gate_up_proj",)),
    "linear_fc2": ("cols", ("mlp.experts.down_proj",)),
}

_LAYER_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "input_layernorm.weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": (
        "qkv",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ),
    "self_attention.linear_qkv.bias": (
        "qkv",
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    ),
    "self_attention.linear_proj.weight": ("cols", ("self_attn.o_proj.weight",)),
    "pre_mlp_layernorm.weight": ("replicated", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": ("gated", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("cols", ("mlp.down_proj.weight",)),
    "mlp.router.weight": ("replicated", ("mlp.gate.weight",)),
}


def rule_for(
    name: str,
    global_layer: Callable[[int], int],
    *,
    tied: bool,
    value_head: bool,
    global_expert: Callable[[int, int], int] | None = None,
) -> Rule:
    """The rule of the megatron parameter ``name`` (as a ``GPTModel`` chunk names it);
    ``global_layer(local_index)`` maps a chunk's layer index to the model's layer number
    (0-based), ``global_expert(local_layer, local_expert)`` a rank's expert to its index in
    the model. Raises ``KeyError`` for a parameter the mapping does not know."""
    m = _LAYER.match(name)
    if m:
        local_layer, rest = int(m.group(1)), m.group(2)
        prefix = f"model.layers.{global_layer(local_layer)}."
        e = _EXPERT.match(rest)
        if e:
            kind, hf = _EXPERT_RULES[e.group(2)]
            local_expert = int(e.group(1))
            index = global_expert(local_layer, local_expert) if global_expert else local_expert
            return Rule(kind, tuple(prefix + n for n in hf), expert=index)
        kind, hf = _LAYER_RULES[rest]
        return Rule(kind, tuple(prefix + n for n in hf))
    if name == "embedding.word_embeddings.weight":
        return Rule("vocab", ("model.embed_tokens.weight",))
    if name == "decoder.final_layernorm.weight":
        return Rule("replicated", ("model.norm.weight",))
    if value_head and name in ("output_layer.weight", "output_layer.bias"):
        return Rule("replicated", ("score." + name.rsplit(".", 1)[1],))
    if name == "output_layer.weight":
        return Rule("vocab", ("model.embed_tokens.weight",) if tied else ("lm_head.weight",))
    raise KeyError(name)
