"""The module FSDP wraps: a transformers model plus the per-token head computation, so
that everything that touches the (possibly tied) embedding / output weights runs inside
the FSDP root's forward (its parameters are gathered there)."""

from __future__ import annotations

import torch
from torch import nn

from geartrain_fsdp.logprobs import token_log_probs


class TokenOutputs(nn.Module):
    """``forward`` returns per-token outputs at the positions of ``input_ids``: the
    log-prob of ``targets`` (the next tokens) and optionally the entropy and ``Σ_v π(v)²``
    of that distribution for a causal LM; the per-token value for a value model. The logits
    over the vocabulary are only ever computed in chunks of ``chunk_tokens``."""

    def __init__(
        self,
        hf: nn.Module,
        *,
        value_head: bool,
        chunk_tokens: int,
        fused_head: bool = True,
        compile_backend: str | None = None,
    ) -> None:
        """``fused_head`` / ``compile_backend``: how
        :func:`~geartrain_fsdp.logprobs.token_log_probs` computes the head (its ``fused``
        and ``backend``)."""
        super().__init__()
        self.hf = hf
        self.value_head = value_head
        self.chunk_tokens = chunk_tokens
        self.fused_head = fused_head
        self.compile_backend = compile_backend

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        need_entropy: bool = False,
        need_sum_pi_squared: bool = False,
        output_positions: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Outputs at every position of ``input_ids`` (shaped like ``targets``), or, with
        ``output_positions`` ``[U]`` (indices into the flattened positions), only there:
        ``targets`` is then ``[U]`` and so are the outputs."""
        hidden = self.hf.base_model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        if output_positions is not None:
            hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, output_positions)
        if self.value_head:
            # the token-classification head without its dropout: values must be deterministic
            return {"values": self.hf.score(hidden)[..., 0].float().clone()}
        assert targets is not None
        weight = self.hf.get_output_embeddings().weight
        flat = token_log_probs(
            hidden.reshape(-1, hidden.shape[-1]),
            weight,
            targets.reshape(-1),
            chunk_tokens=self.chunk_tokens,
            need_entropy=need_entropy,
            need_sum_pi_squared=need_sum_pi_squared,
            fused=self.fused_head,
            backend=self.compile_backend,
        )
        # clones: FSDP hooks its pre-backward on the outputs, which must not be views
        return {key: value.view(targets.shape).clone() for key, value in flat.items()}


def decoder_layers(hf: nn.Module) -> list[nn.Module]:
    """The transformer blocks FSDP shards one by one."""
    layers = getattr(hf.base_model, "layers", None)
    if layers is None:
        raise ValueError(f"{type(hf).__name__}: cannot find the decoder layers (base_model.layers)")
    return list(layers)
