"""geartrain.layout: the one [B, T] sequence layout (checked cell by cell against a batch
written out by hand) and the checks of generate's inputs."""

from __future__ import annotations

import pytest
import torch
from geartrain.errors import GeartrainError
from geartrain.layout import check_generate_inputs, rollout_batch, sequence_batch
from geartrain.types import SamplingParams


def test_rollout_batch_is_the_documented_layout() -> None:
    batch = rollout_batch(
        [[5, 6], [7], [7]],
        [[11, 12, 13], [14], []],
        [[-0.1, -0.2, -0.3], [-0.4], []],
        prompt_index=[0, 1, 1],
        finish_reason=["length", "stop", "stop"],
        pad_token_id=9,
    )
    assert batch.info == {"prompt_length": 2}
    assert batch.meta == {"prompt_index": [0, 1, 1], "finish_reason": ["length", "stop", "stop"]}
    assert batch["input_ids"].tolist() == [[5, 6, 11, 12, 13], [9, 7, 14, 9, 9], [9, 7, 9, 9, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 0, 0], [0, 1, 0, 0, 0]]
    assert batch["response_mask"].tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 0, 0], [0, 0, 0, 0, 0]]
    expected = torch.tensor([[0, 0, -0.1, -0.2, -0.3], [0, 0, -0.4, 0, 0], [0, 0, 0, 0, 0]])
    torch.testing.assert_close(batch["rollout_log_probs"], expected, rtol=0, atol=0)
    assert batch["input_ids"].dtype == torch.long and batch["rollout_log_probs"].dtype == torch.float32


def test_no_prompts_give_an_empty_batch() -> None:
    batch = rollout_batch([], [], [], prompt_index=[], finish_reason=[], pad_token_id=0)
    assert len(batch) == 0 and batch.info["prompt_length"] == 0 and batch["input_ids"].shape == (0, 0)


def test_sft_names_the_mask_and_carries_no_log_probs() -> None:
    batch = sequence_batch([[1, 2, 3], [4]], [[5], [6, 7]], 0, mask_key="loss_mask")
    assert sorted(batch.tensor_keys()) == ["attention_mask", "input_ids", "loss_mask"]
    assert batch["loss_mask"].tolist() == [[0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]
    with pytest.raises(ValueError, match="row 1: 2 response tokens but 1 log-probs"):
        sequence_batch([[1], [2]], [[3], [4, 5]], 0, log_probs=[[0.0], [0.0]])


@pytest.mark.parametrize(
    ("prompts", "sampling", "message"),
    [
        ([[1, 2]], SamplingParams(n=0), "sampling.n must be >= 1, got 0"),
        ([[1, 2]], SamplingParams(max_tokens=0), "sampling.max_tokens must be >= 1"),
        ([[1, 2]], SamplingParams(top_p=0.0), r"sampling.top_p must be in \(0, 1\]"),
        ([[1, 2]], SamplingParams(temperature=-1.0), "sampling.temperature must be >= 0"),
        ([[1, 2], []], SamplingParams(), "prompt 1 is empty"),
        ([[1] * 8], SamplingParams(), "prompt 0 has 8 tokens.*max_model_len=8"),
        (
            [[1, 2], [3, 200, -1]],
            SamplingParams(),
            r"prompt 1 has token ids outside the vocabulary \(size 128\): \[200, -1\]",
        ),
    ],
)
def test_bad_generate_inputs_are_refused_naming_backend_prompt_and_limit(
    prompts: list[list[int]], sampling: SamplingParams, message: str
) -> None:
    with pytest.raises(GeartrainError, match=f"^mybackend rollout: {message}"):
        check_generate_inputs("mybackend", prompts, sampling, max_model_len=8, vocab_size=128)


def test_good_inputs_pass() -> None:
    check_generate_inputs(
        "x", [[1] * 7, [0, 127]], SamplingParams(n=2, top_p=1.0, temperature=0.0), max_model_len=8, vocab_size=128
    )


def test_cut_at_stop_keeps_the_sequence_and_prefers_the_earliest_end():
    from geartrain.layout import cut_at_stop

    assert cut_at_stop([1, 2, 3, 4, 5], [[3, 4]]) == 4
    assert cut_at_stop([1, 2, 3, 4, 3], [[4, 3], [3]]) == 3  # [3] ends at 3, before [4, 3] ends at 5
    assert cut_at_stop([1, 2], [[5]]) is None
    assert cut_at_stop([], [[1]]) is None


def test_per_prompt_budgets_and_stop_sequences_are_checked():
    from geartrain.layout import max_tokens_of

    prompts = [[1, 2], [3]]
    assert max_tokens_of(SamplingParams(max_tokens=7), 2) == [7, 7]
    assert max_tokens_of(SamplingParams(max_tokens=7, max_tokens_per_prompt=[3, 4]), 2) == [3, 4]
    with pytest.raises(GeartrainError, match="max_tokens_per_prompt has 1 entries for 2 prompts"):
        check_generate_inputs("torch", prompts, SamplingParams(max_tokens_per_prompt=[3]), max_model_len=16)
    with pytest.raises(GeartrainError, match=r"max_tokens_per_prompt\[1\] must be >= 1"):
        check_generate_inputs("torch", prompts, SamplingParams(max_tokens_per_prompt=[3, 0]), max_model_len=16)
    with pytest.raises(GeartrainError, match=r"stop_sequences\[0\] is empty"):
        check_generate_inputs("torch", prompts, SamplingParams(stop_sequences=[[]]), max_model_len=16)


def test_engine_samples_are_cut_at_a_stop_sequence_and_laid_out_as_the_rollout_batch() -> None:
    """The vLLM and SGLang rollouts convert their outputs through these (one place)."""
    from geartrain.layout import Sample, samples_batch

    sampling = SamplingParams(n=1, max_tokens=5, stop_sequences=[[7, 8]])
    cut = Sample.generated(1, [3, 4], [5, 7, 8, 9], [-0.1, -0.2, -0.3, -0.4], "length", sampling)
    assert (cut.tokens, cut.log_probs, cut.finish_reason) == ([5, 7, 8], [-0.1, -0.2, -0.3], "stop")
    whole = Sample.generated(0, [2], [6, 6], [-1.0, -2.0], "length", sampling)
    assert (whole.tokens, whole.finish_reason) == ([6, 6], "length")
    batch = samples_batch([whole, cut], pad_token_id=0)
    assert batch["input_ids"].tolist() == [[0, 2, 6, 6, 0], [3, 4, 5, 7, 8]]
    assert batch["response_mask"].tolist() == [[0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    expected = torch.tensor([[0, 0, -1.0, -2.0, 0], [0, 0, -0.1, -0.2, -0.3]])
    torch.testing.assert_close(batch["rollout_log_probs"].float(), expected)
    assert batch["prompt_index"] == [0, 1] and batch["finish_reason"] == ["length", "stop"]
