"""Stop strings matched on text, whatever tokens spell them.

The contract's ``SamplingParams.stop_sequences`` are token-id sequences: a stop string is
encoded once and a rollout stops when a sample's last tokens equal that encoding. A model
may spell the same text with other tokens (``"<" "/" "tool" ">"`` where the tokenizer
encodes ``"</" "tool" ">"``; ``"\\n\\n\\n"`` as one token that holds ``"\\n\\n"``): the
token match misses it and the sample runs on to its length limit, handing a reward
function or an environment text past the stop. vLLM and SGLang match stop strings on
the decoded text. This module applies the same rule after generation, on any rollout's
output: a sample is cut right after the first token at which its decoded text contains a
stop string, keeping that token (and its log-prob) and nothing after it, with
``finish_reason = "stop"``. Where the token match already stopped a sample, the cut is
where it stopped, so nothing changes; the tokens the rollout generated past the text's
stop are wasted work, not wrong results.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from geartrain.batch import Batch

__all__ = ["cut_batch_at_stop_texts", "stop_text_end"]


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _contains(text: str, stop_texts: Sequence[str]) -> bool:
    return any(stop in text for stop in stop_texts)


def stop_text_end(tokenizer: Any, ids: Sequence[int], stop_texts: Sequence[str]) -> int | None:
    """The number of tokens of ``ids`` up to and including the first token at which their
    decoded text (special tokens kept as text) contains one of ``stop_texts``; ``None``
    when the whole text contains none. Empty stop texts are ignored."""
    stops = [s for s in stop_texts if s]
    if not stops or not ids or not _contains(_decode(tokenizer, ids), stops):
        return None
    if not _contains(_decode(tokenizer, ids[:-1]), stops):
        return len(ids)  # the usual case: the sample stopped on it (or it ends the budget)
    # a text's prefixes contain a stop string from some length on: the first such length
    low, high = 1, len(ids) - 1  # ids[:high] contains one
    while low < high:
        mid = (low + high) // 2
        if _contains(_decode(tokenizer, ids[:mid]), stops):
            high = mid
        else:
            low = mid + 1
    return high


def cut_batch_at_stop_texts(batch: Batch, tokenizer: Any, stop_texts: Sequence[str]) -> list[bool]:
    """Cut each response of a rollout batch (:mod:`geartrain.layout`'s layout) right after
    its first stop text (:func:`stop_text_end`), in place: the tokens after the cut become
    padding (``input_ids`` = the tokenizer's pad id, every other per-token tensor 0,
    ``attention_mask`` and ``response_mask`` included) and the row's ``finish_reason``
    becomes ``"stop"``. Returns, per row, whether it was cut (it ran past a stop text the
    rollout did not report stopping on: it ran past it, or ended on it at its length
    limit, which is then a stop too)."""
    cut = [False] * len(batch)
    stops = [s for s in stop_texts if s]
    if not stops or not len(batch):
        return cut
    width = int(batch.info["prompt_length"])
    mask = batch["response_mask"].bool()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    per_token = [
        key
        for key, value in batch.tensors.items()
        if key != "input_ids" and value.dim() >= 2 and value.shape[1] == batch["input_ids"].shape[1]
    ]
    reasons = list(batch["finish_reason"]) if "finish_reason" in batch.meta else None
    for row in range(len(batch)):
        n = int(mask[row].sum())
        end = stop_text_end(tokenizer, batch["input_ids"][row, width : width + n].tolist(), stops)
        if end is None or (end == n and (reasons is None or reasons[row] == "stop")):
            continue
        start = width + end
        batch["input_ids"][row, start:] = pad
        for key in per_token:
            batch[key][row, start:] = 0
        if reasons is not None:
            reasons[row] = "stop"
        cut[row] = True
    if reasons is not None:
        batch.meta["finish_reason"] = reasons
    return cut
