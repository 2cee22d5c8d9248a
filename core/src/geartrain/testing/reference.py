"""Reference computations and batch builders the conformance suites (and plugin tests)
compare backends against: a plain transformers forward, nothing else."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from geartrain.batch import Batch


def make_batch(
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
    *,
    vocab_size: int = 128,
    seed: int = 0,
    low: int = 4,
) -> Batch:
    """A batch in geartrain's layout: left-padded prompts then right-padded responses.

    Token ids are drawn from ``[low, vocab_size)`` (so no special tokens). Holds
    ``input_ids``, ``attention_mask``, ``position_ids``, ``response_mask`` and
    ``loss_mask`` (= response mask), and ``info["prompt_length"]``.
    """
    if len(prompt_lengths) != len(response_lengths):
        raise ValueError("one prompt length per response length")
    gen = torch.Generator().manual_seed(seed)
    p_width, r_width = max(prompt_lengths), max(response_lengths)
    b = len(prompt_lengths)
    input_ids = torch.zeros(b, p_width + r_width, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    response = torch.zeros_like(input_ids)
    for i, (p, r) in enumerate(zip(prompt_lengths, response_lengths, strict=True)):
        if p < 1:
            raise ValueError("prompts need at least one token")
        input_ids[i, p_width - p : p_width] = torch.randint(low, vocab_size, (p,), generator=gen)
        input_ids[i, p_width : p_width + r] = torch.randint(low, vocab_size, (r,), generator=gen)
        attention[i, p_width - p : p_width + r] = 1
        response[i, p_width : p_width + r] = 1
    return Batch(
        {
            "input_ids": input_ids,
            "attention_mask": attention,
            "position_ids": position_ids_from_mask(attention),
            "response_mask": response,
            "loss_mask": response.clone(),
        },
        info={"prompt_length": p_width},
    )


def random_batch(seed: int = 0, rows: int = 6, prompt_max: int = 7, response_max: int = 9, vocab: int = 128) -> Batch:
    """``rows`` rows of ``[left pad | prompt | response | right pad]`` with random prompt
    (``1..prompt_max``) and response (``1..response_max``) lengths and token ids in
    ``[4, vocab)``: ``input_ids``, ``attention_mask``, ``loss_mask`` (the response) and
    ``info["prompt_length"] = prompt_max``. The same ``seed`` gives the same batch."""
    g = torch.Generator().manual_seed(seed)
    width = prompt_max + response_max
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    loss_mask = torch.zeros(rows, width, dtype=torch.long)
    for r in range(rows):
        p = int(torch.randint(1, prompt_max + 1, (1,), generator=g))
        a = int(torch.randint(1, response_max + 1, (1,), generator=g))
        ids[r, prompt_max - p : prompt_max + a] = torch.randint(4, vocab, (p + a,), generator=g)
        mask[r, prompt_max - p : prompt_max + a] = 1
        loss_mask[r, prompt_max : prompt_max + a] = 1
    return Batch({"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}, info={"prompt_length": prompt_max})


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting from 0 at each row's first real token (0 on left padding)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_valid_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Where a per-token output is defined: real tokens that have a real token before them."""
    valid = torch.zeros_like(attention_mask, dtype=torch.bool)
    valid[:, 1:] = attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
    return valid


@torch.no_grad()
def reference_token_outputs(model: torch.nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
    """``log_probs`` and ``entropy`` ``[B, T]`` from one plain transformers forward, aligned
    as geartrain aligns them (see :mod:`geartrain.types`)."""
    logits = reference_logits(model, batch)
    return token_outputs_from_logits(logits, batch["input_ids"], batch["attention_mask"])


def reference_logits(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    mask = batch["attention_mask"]
    return model(
        input_ids=batch["input_ids"], attention_mask=mask, position_ids=position_ids_from_mask(mask)
    ).logits.float()


def token_outputs_from_logits(
    logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Shift ``logits`` ``[B, T, V]`` into per-token ``log_probs``/``entropy``/
    ``sum_pi_squared`` (``Σ_v π(v)²``) aligned to ``input_ids``; undefined positions are 0.
    Plain PyTorch over the full logits: the reference the engines' chunked results are
    compared with."""
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    probs = logp.exp()
    valid = token_valid_mask(attention_mask)
    out = {}
    for key, value in (
        ("log_probs", picked),
        ("entropy", -(probs * logp).sum(-1)),
        ("sum_pi_squared", (probs * probs).sum(-1)),
    ):
        full = torch.zeros(input_ids.shape, dtype=logits.dtype)
        full[:, 1:] = value
        out[key] = full * valid
    return out


def reference_values(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Per-token values ``[B, T]`` from a one-label token-classification model:
    ``values[:, t]`` is the model's output at position ``t - 1`` (the state before token t)."""
    mask = batch["attention_mask"]
    with torch.no_grad():
        scores = model(
            input_ids=batch["input_ids"], attention_mask=mask, position_ids=position_ids_from_mask(mask)
        ).logits.float()[..., 0]
    values = torch.zeros_like(scores)
    values[:, 1:] = scores[:, :-1]
    return values * token_valid_mask(mask)


def token_mean_nll_loss(
    outputs: dict[str, torch.Tensor], micro_batch: Batch, ctx
) -> tuple[torch.Tensor, dict[str, float]]:  # noqa: ANN001
    """A loss function in the ``LossFn`` contract: negative log-likelihood of the
    ``loss_mask`` tokens, as this micro-batch's share of the global token mean."""
    mask = micro_batch["loss_mask"].to(outputs["log_probs"].dtype)
    share = -(outputs["log_probs"] * mask).sum() / ctx.global_tokens
    return share, {"loss": float(share.detach())}
