"""Non-finite policies at the pieces (issue 39): the sampler never returns an index outside
the vocabulary, the rollout batch refuses NaN or infinite log-probs, and the weight stream
refuses a non-finite tensor before any of its bucket is handed out."""

from __future__ import annotations

import pytest
import torch
from geartrain.errors import NonFiniteLogitsError, NonFiniteWeightsError
from geartrain.layout import rollout_batch
from geartrain.rollouts.sampler import sample_tokens
from geartrain.types import SamplingParams
from geartrain.weights import stream_weights


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_the_sampler_keeps_rows_of_non_finite_logits_inside_the_vocabulary(bad: float, top_p: float) -> None:
    logits = torch.randn(4, 128)
    logits[1, 7] = bad
    logits[3] = bad
    sampling = SamplingParams(temperature=1.0, top_p=top_p, seed=1)
    tokens = sample_tokens(logits, sampling, torch.arange(4), 0)
    assert tokens.shape == (4,) and int(tokens.min()) >= 0 and int(tokens.max()) < 128
    finite = sample_tokens(logits[[0, 2]], sampling, torch.tensor([0, 2]), 0)
    assert torch.equal(tokens[[0, 2]], finite)  # healthy rows sample as before


def _batch(log_probs: list[list[float]]):  # noqa: ANN202
    return rollout_batch(
        [[1, 2], [1, 2]],
        [[3] * len(lp) for lp in log_probs],
        log_probs,
        prompt_index=[0, 0],
        finish_reason=["length", "length"],
        pad_token_id=0,
    )


def test_the_rollout_batch_refuses_non_finite_log_probs() -> None:
    assert len(_batch([[-0.5, -1.0], [-2.0]])) == 2
    with pytest.raises(NonFiniteLogitsError, match=r"not finite \(NaN or inf\) in 1 of 2 generated rows"):
        _batch([[-0.5, float("nan")], [-2.0]])
    with pytest.raises(NonFiniteLogitsError, match="in 2 of 2 generated rows"):
        _batch([[float("-inf")], [float("inf"), -1.0]])


def test_the_weight_stream_refuses_a_non_finite_tensor_before_its_bucket() -> None:
    entries = [(f"w{i}", torch.ones(4)) for i in range(4)]
    entries[2][1][1] = float("nan")
    handed: list[str] = []
    stream = stream_weights(entries, dtype=torch.float32, bucket_bytes=32)  # two tensors a bucket
    with pytest.raises(NonFiniteWeightsError, match="weight w2 holds NaN or infinite values") as err:
        for name, _ in stream:
            handed.append(name)
    assert err.value.name == "w2"
    assert handed == ["w0", "w1"]  # nothing of the bad bucket (w2, w3) left the engine
