"""sampling.repetition_penalty and sampling.min_p reach the rollouts that have them and are
refused, naming the backend, by those that have not (issue 19, item 5)."""

from __future__ import annotations

import pytest
from geartrain.errors import ConfigError
from geartrain.modeling import tiny_tokenizer
from geartrain.trainer import load_train_config
from geartrain.trainer.generation import Generation


@pytest.mark.parametrize(
    ("override", "key"),
    [("sampling.min_p=0.05", "sampling.min_p"), ("sampling.repetition_penalty=1.2", "sampling.repetition_penalty")],
)
def test_the_torch_rollout_refuses_what_it_has_not_by_name(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_train_config(None, [override])
    problems = dict(err.value.problems)
    cap = key.split(".")[1]
    assert problems[key].startswith(f"the 'torch' rollout has no {cap} (it does not declare '{cap}')")


def test_the_defaults_ask_nothing_and_the_values_reach_sampling_params() -> None:
    assert load_train_config(None, [], check_plugins=False).rollout_needs() == []
    config = load_train_config(
        None, ["sampling.min_p=0.05", "sampling.repetition_penalty=1.2", 'sampling.stop=["+"]'], check_plugins=False
    )
    params = Generation(config, None, tiny_tokenizer(), None).sampling(1)  # type: ignore[arg-type]
    assert (params.min_p, params.repetition_penalty) == (0.05, 1.2)
    assert params.stop_sequences == [tiny_tokenizer().encode("+", add_special_tokens=False)]
