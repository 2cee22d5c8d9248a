"""GQA-native decode attention for the torch rollout's model (issue 33, item 1).

transformers' ``sdpa`` attention expands the keys and values of a grouped-query model
(``repeat_kv``: ``kv_heads`` -> ``heads``) whenever it is given a mask on CUDA, since
SDPA's fused kernels take ``enable_gqa`` only without one. In a decode step the mask is
always there (left padding, the static cache's unfilled columns), so every layer of every
step copied the whole cache ``heads / kv_heads`` times (7x for Qwen2.5-0.5B/1.5B) before
reading it.

:func:`gqa_decode_attention` does the same arithmetic without the copy: the single query
token's ``heads`` query vectors are viewed as ``[B, kv_heads, group, d]``, the ``group``
query heads that share a key/value head becoming that head's "query positions", and one
SDPA call runs against the unexpanded ``[B, kv_heads, L, d]`` cache with the mask
``[B, 1, 1, L]`` broadcast over them. Prefill (more than one query token) and anything
else it does not cover go to transformers' own ``sdpa`` function unchanged.

It is registered with transformers as attention implementation :data:`GQA_DECODE` (its
mask function is ``sdpa``'s); :func:`use_gqa_decode` switches a model to it.

A decode step of a static cache may also pass :data:`KV_LEN` (a Python int, through the
model's forward keyword arguments, which transformers hands to the attention function):
only the first ``KV_LEN`` cache columns are read (the filled part, rounded up to a bucket by
the caller), not the cache's whole width; the columns left out are masked anyway.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["GQA_DECODE", "KV_LEN", "gqa_decode_attention", "kv_bucket", "register", "use_gqa_decode"]

#: The attention implementation name registered with transformers.
GQA_DECODE = "geartrain_gqa_decode"
#: The forward keyword argument that bounds a decode step's keys to the cache's first columns.
KV_LEN = "geartrain_kv_len"


def kv_bucket(needed: int, bucket: int, width: int) -> int:
    """The key length a step that needs ``needed`` cache columns reads: ``needed`` rounded up
    to a multiple of ``bucket`` (one compiled / captured graph per bucket), at most the
    cache's ``width``."""
    return min(width, -(-needed // bucket) * bucket)


def gqa_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``query`` ``[B, heads, Q, d]``, ``key`` /
    ``value`` ``[B, kv_heads, L, d]``, ``attention_mask`` a boolean (or additive) mask
    broadcastable to ``[B, 1, Q, L]``; returns ``([B, Q, heads, d], None)``. With one query
    token, a grouped model (``heads > kv_heads``) and no dropout, the keys and values are
    read where they are (no ``repeat_kv``), the first ``kwargs[KV_LEN]`` columns only when
    given; otherwise transformers' ``sdpa`` computes it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if (
        q_len != 1
        or heads == kv_heads
        or dropout != 0.0
        or kwargs.get("position_bias") is not None
        or kwargs.get("cache") is not None
        or (attention_mask is not None and attention_mask.shape[-2] != 1)
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    group = heads // kv_heads
    q = query.reshape(batch, kv_heads, group, dim)  # head h = kv * group + g, as repeat_kv orders them
    kv_len = kwargs.get(KV_LEN)
    if kv_len is not None and kv_len < key.shape[2]:  # the filled part of a static cache
        key, value = key[:, :, :kv_len], value[:, :, :kv_len]
    mask = attention_mask
    if mask is not None and mask.dim() == 4:
        mask = mask[:, :, :, : key.shape[2]]  # [B, 1, 1, L]: broadcast over kv heads and the group
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, 1, heads, dim), None


_REGISTERED = False


def register() -> None:
    """Register :data:`GQA_DECODE` (attention function and ``sdpa``'s mask function) with
    transformers; idempotent."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GQA_DECODE, gqa_decode_attention)
    AttentionMaskInterface.register(GQA_DECODE, sdpa_mask)
    _REGISTERED = True


def use_gqa_decode(model: torch.nn.Module) -> bool:
    """Switch ``model`` (a transformers causal LM) to :data:`GQA_DECODE` when it attends
    through ``sdpa`` and has grouped key/value heads; True when it did. Other
    implementations (flash, flex, eager) and models without grouping are left alone."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) not in ("sdpa", GQA_DECODE):
        return False
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not heads or kv_heads == heads:
        return False
    register()
    model.set_attn_implementation(GQA_DECODE)
    return True
