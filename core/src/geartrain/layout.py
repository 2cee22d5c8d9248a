"""The one sequence layout every batch uses, built in one place; and the checks a rollout
applies to ``generate``'s inputs.

Layout (see :mod:`geartrain.types`): row ``i`` of a ``[B, T]`` batch is prompt ``i``
left-padded to the widest prompt ``P`` (``info["prompt_length"] = P``), then response
``i`` right-padded to the longest response, so every response starts at column ``P``.
``attention_mask`` is 1 on prompt and response tokens, the response mask 1 on response
tokens only; a per-response-token value (the sampled token's log-prob) sits in the column
of its token, 0 elsewhere, i.e. aligned to ``input_ids`` as the contract requires.

* :func:`sequence_batch` — any prompt/response pairs (SFT names the mask ``loss_mask``);
* :func:`rollout_batch` — what the ``generate`` hook returns; :class:`Sample` and
  :func:`samples_batch` — the same from an inference engine's per-sample outputs (what the
  vLLM and SGLang rollouts convert theirs to);
* :func:`check_generate_inputs` — refuse bad prompts or sampling settings with an error that
  names the backend, the prompt and the limit, before anything reaches an engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from geartrain.batch import Batch
from geartrain.errors import GeartrainError, NonFiniteLogitsError
from geartrain.types import SamplingParams

__all__ = [
    "READY_AT",
    "Sample",
    "check_finite_log_probs",
    "check_generate_inputs",
    "cut_at_stop",
    "max_tokens_of",
    "native_stop_token_ids",
    "rollout_batch",
    "samples_batch",
    "sequence_batch",
    "stop_after_generation",
]


#: per-row ``meta`` key of a rollout that simulates generation time: the ``time.time()`` at
#: which the row finishes decoding (see ``Rollout.generate``)
READY_AT = "ready_at"


def sequence_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    pad_token_id: int,
    *,
    log_probs: Sequence[Sequence[float]] | None = None,
    mask_key: str = "response_mask",
    meta: Mapping[str, Sequence[Any]] | None = None,
) -> Batch:
    """A :class:`Batch` of ``input_ids``, ``attention_mask`` and ``mask_key`` (the response
    tokens), plus ``rollout_log_probs`` when ``log_probs`` (one value per response token)
    are given; ``info["prompt_length"]`` is the padded prompt width."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if log_probs is not None and len(log_probs) != len(responses):
        raise ValueError(f"{len(responses)} responses but {len(log_probs)} log-prob rows")
    rows = len(prompts)
    width = max((len(p) for p in prompts), default=0)
    total = width + max((len(r) for r in responses), default=0)
    input_ids = torch.full((rows, total), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((rows, total), dtype=torch.long)
    response_mask = torch.zeros((rows, total), dtype=torch.long)
    values = torch.zeros((rows, total), dtype=torch.float32) if log_probs is not None else None
    for row, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        start, end = width - len(prompt), width + len(response)
        input_ids[row, start:width] = torch.as_tensor(prompt, dtype=torch.long)
        input_ids[row, width:end] = torch.as_tensor(response, dtype=torch.long)
        attention_mask[row, start:end] = 1
        response_mask[row, width:end] = 1
        if values is not None:
            if len(log_probs[row]) != len(response):  # type: ignore[index]
                raise ValueError(f"row {row}: {len(response)} response tokens but {len(log_probs[row])} log-probs")  # type: ignore[index]
            values[row, width:end] = torch.as_tensor(log_probs[row], dtype=torch.float32)  # type: ignore[index]
    tensors = {"input_ids": input_ids, "attention_mask": attention_mask, mask_key: response_mask}
    if values is not None:
        tensors["rollout_log_probs"] = values
    return Batch(tensors, meta=meta, info={"prompt_length": width}, batch_size=rows)


def rollout_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    log_probs: Sequence[Sequence[float]],
    *,
    prompt_index: Sequence[int],
    finish_reason: Sequence[str],
    pad_token_id: int,
) -> Batch:
    """The ``generate`` hook's batch: row ``r`` is ``prompts[r]`` (the prompt of that
    sample, repeated for each sample) then ``responses[r]``, with ``response_mask``,
    ``rollout_log_probs`` and the meta ``prompt_index`` / ``finish_reason``.

    Raises :class:`~geartrain.errors.NonFiniteLogitsError` when a sampled token's log-prob
    is NaN or infinite: the logits it was drawn from were not finite, so the token means
    nothing (every backend's batch passes here, so all report that case alike)."""
    batch = sequence_batch(
        prompts,
        responses,
        pad_token_id,
        log_probs=log_probs,
        meta={"prompt_index": list(prompt_index), "finish_reason": list(finish_reason)},
    )
    if len(batch):
        check_finite_log_probs(batch["rollout_log_probs"], batch["response_mask"].bool())
    return batch


def check_finite_log_probs(log_probs: torch.Tensor, mask: torch.Tensor) -> None:
    """Raise :class:`~geartrain.errors.NonFiniteLogitsError` when an entry of ``log_probs``
    under ``mask`` is not finite, saying in how many rows."""
    bad_rows = (~torch.isfinite(log_probs) & mask).any(dim=-1)
    if bool(bad_rows.any()):
        raise NonFiniteLogitsError(
            f"the policy's logits are not finite (NaN or inf) in {int(bad_rows.sum())} of {len(bad_rows)} generated "
            "rows: its weights have overflowed (finite but huge) or are NaN, and nothing can be sampled from them"
        )


def check_generate_inputs(
    backend: str,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams,
    *,
    max_model_len: int,
    vocab_size: int | None = None,
) -> None:
    """Raise :class:`GeartrainError` (prefixed ``"<backend> rollout: "``) for the first bad
    input: ``sampling.n < 1``, ``max_tokens < 1``, ``top_p`` outside ``(0, 1]``, a negative
    temperature; an empty prompt, one with no room to generate within ``max_model_len``, or
    one with token ids outside ``[0, vocab_size)``. Checks the whole batch before any of it
    is generated (an engine that queued part of it would keep those requests)."""
    where = f"{backend} rollout"
    if sampling.n < 1:
        raise GeartrainError(f"{where}: sampling.n must be >= 1, got {sampling.n}")
    if sampling.max_tokens < 1:
        raise GeartrainError(f"{where}: sampling.max_tokens must be >= 1, got {sampling.max_tokens}")
    if sampling.max_tokens_per_prompt is not None:
        if len(sampling.max_tokens_per_prompt) != len(prompts):
            raise GeartrainError(
                f"{where}: sampling.max_tokens_per_prompt has {len(sampling.max_tokens_per_prompt)} entries "
                f"for {len(prompts)} prompts"
            )
        bad_budgets = [(i, b) for i, b in enumerate(sampling.max_tokens_per_prompt) if b < 1]
        if bad_budgets:
            raise GeartrainError(
                f"{where}: sampling.max_tokens_per_prompt[{bad_budgets[0][0]}] must be >= 1, got {bad_budgets[0][1]}"
            )
    empty = [i for i, seq in enumerate(sampling.stop_sequences) if len(seq) == 0]
    if empty:
        raise GeartrainError(f"{where}: sampling.stop_sequences[{empty[0]}] is empty")
    if not 0.0 < sampling.top_p <= 1.0:
        raise GeartrainError(f"{where}: sampling.top_p must be in (0, 1], got {sampling.top_p}")
    if sampling.temperature < 0:
        raise GeartrainError(f"{where}: sampling.temperature must be >= 0, got {sampling.temperature}")
    for index, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise GeartrainError(f"{where}: prompt {index} is empty")
        if len(prompt) >= max_model_len:
            raise GeartrainError(
                f"{where}: prompt {index} has {len(prompt)} tokens, which leaves no room to generate "
                f"within max_model_len={max_model_len}; shorten the prompt or raise rollout.max_model_len"
            )
        if vocab_size is not None:
            bad = [t for t in prompt if not 0 <= t < vocab_size]
            if bad:
                raise GeartrainError(
                    f"{where}: prompt {index} has token ids outside the vocabulary (size {vocab_size}): {bad[:5]}"
                )


def max_tokens_of(sampling: SamplingParams, num_prompts: int) -> list[int]:
    """The response budget of each of ``num_prompts`` prompts: ``max_tokens_per_prompt``
    when given, else ``max_tokens`` for all."""
    if sampling.max_tokens_per_prompt is not None:
        return list(sampling.max_tokens_per_prompt)
    return [sampling.max_tokens] * num_prompts


def cut_at_stop(tokens: Sequence[int], stop_sequences: Sequence[Sequence[int]]) -> int | None:
    """The length of ``tokens`` up to and including the first place where it ends in one of
    ``stop_sequences`` (the earliest end wins), or ``None`` when none occurs. A backend that
    cannot stop on multi-token sequences natively keeps ``tokens[:cut]`` (and the log-probs
    of those tokens) and reports ``finish_reason = "stop"``."""
    for end in range(1, len(tokens) + 1):
        for seq in stop_sequences:
            if len(seq) <= end and list(tokens[end - len(seq) : end]) == list(seq):
                return end
    return None


def native_stop_token_ids(sampling: SamplingParams) -> list[int]:
    """The token ids a backend that stops only on single tokens stops on natively:
    ``stop_token_ids`` plus every one-token ``stop_sequences`` entry (the same rule: stop
    after the token, keep it). Longer sequences are left to :func:`stop_after_generation`."""
    ids = list(sampling.stop_token_ids)
    ids += [seq[0] for seq in sampling.stop_sequences if len(seq) == 1 and seq[0] not in ids]
    return ids


def stop_after_generation(
    tokens: Sequence[int], log_probs: Sequence[float], finish_reason: str, sampling: SamplingParams
) -> tuple[list[int], list[float], str]:
    """Apply ``sampling.stop_sequences`` to one generated sample of a backend that cannot
    stop on them natively: keep the tokens (and their log-probs) up to and including the
    first match in the response (:func:`cut_at_stop`), with ``finish_reason`` ``"stop"``;
    a sample with no match is returned as it is. The tokens and log-probs are those a
    native stop gives, because nothing before a token depends on what follows it."""
    cut = cut_at_stop(tokens, sampling.stop_sequences) if sampling.stop_sequences else None
    if cut is None:
        return list(tokens), list(log_probs), finish_reason
    return list(tokens[:cut]), list(log_probs[:cut]), "stop"


@dataclass(slots=True)
class Sample:
    """One generated response as an inference engine reports it: the index of its prompt
    in the ``generate`` call, the prompt's tokens, the response tokens, the log-prob of
    each, and why it ended (``"stop"`` or ``"length"``)."""

    prompt_index: int
    prompt: Sequence[int]
    tokens: Sequence[int]
    log_probs: Sequence[float]
    finish_reason: str

    @classmethod
    def generated(
        cls,
        prompt_index: int,
        prompt: Sequence[int],
        tokens: Sequence[int],
        log_probs: Sequence[float],
        finish_reason: str,
        sampling: SamplingParams,
    ) -> Sample:
        """A sample of a backend that stops on single tokens only, cut after its first
        multi-token stop sequence (:func:`stop_after_generation`)."""
        tokens, log_probs, finish_reason = stop_after_generation(tokens, log_probs, finish_reason, sampling)
        return cls(
            prompt_index=prompt_index, prompt=prompt, tokens=tokens, log_probs=log_probs, finish_reason=finish_reason
        )


def samples_batch(samples: Sequence[Sample], pad_token_id: int) -> Batch:
    """Lay ``samples`` out as the rollout batch the ``generate`` hook specifies
    (:func:`rollout_batch`), in their order."""
    return rollout_batch(
        [s.prompt for s in samples],
        [s.tokens for s in samples],
        [s.log_probs for s in samples],
        prompt_index=[s.prompt_index for s in samples],
        finish_reason=[s.finish_reason for s in samples],
        pad_token_id=pad_token_id,
    )
