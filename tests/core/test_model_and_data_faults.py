"""Issue 35, item 13: bad data and model inputs are one line naming the row or the key:
a JSONL line that is an array and a numeric prompt (named with their line), a
``config_overrides`` hidden size of the wrong type or too large for this machine, a pickled
``pytorch_model.bin`` (refused without running it), and no terminal escape codes in any
pickle refusal (torch's message carries bold on/off codes)."""

from __future__ import annotations

import fractions
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from geartrain.checkpoint import load_state
from geartrain.config import ModelConfig
from geartrain.data import PromptDataset
from geartrain.errors import CheckpointError, ConfigError, DataError, GeartrainError
from geartrain.modeling import build_hf_model, tiny_config
from geartrain.testing.tiny import tiny_tokenizer
from geartrain.trainer import load_train_config
from geartrain.trainer.preflight import preflight

JOB = Path(__file__).resolve().parents[2] / "examples" / "arithmetic" / "grpo.toml"
SMALL = ["sft.enabled=false"]


@pytest.mark.parametrize(
    ("lines", "said"),
    [
        ('{"prompt": "1+1=", "ground_truth": "2"}\n["1+1=", "2"]\n', "line 2: a row must be an object"),
        ('{"prompt": 5, "ground_truth": "2"}\n', "line 1: 'prompt' must be a non-empty string"),
    ],
    ids=["array-line", "numeric-prompt"],
)
def test_a_bad_jsonl_line_is_named_with_its_line(tmp_path: Path, lines: str, said: str) -> None:
    (tmp_path / "d.jsonl").write_text(lines)
    with pytest.raises(DataError) as info:
        PromptDataset(str(tmp_path / "d.jsonl"), tiny_tokenizer())
    assert f"{tmp_path / 'd.jsonl'}, {said}" in str(info.value) and "no rows" not in str(info.value)


def _problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        preflight(load_train_config(JOB, [*SMALL, *overrides], check_plugins=False))
    return str(info.value)


def test_a_hidden_size_of_the_wrong_type_is_one_line() -> None:
    text = _problems("model.config_overrides.hidden_size=1e6")
    assert "model: the model cannot be built as configured (" in text and "expected int, got float" in text, text


def test_a_model_larger_than_this_machine_is_one_line_before_anything_is_allocated() -> None:
    text = _problems("model.config_overrides.hidden_size=1000000")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert f"GiB of float32 weights), more than this machine's {memory / 2**30:,.1f} GiB of memory" in text, text


def _pickled_model(tmp_path: Path, payload: object) -> Path:
    model = tmp_path / "model"
    tiny_config("qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=1).save_pretrained(model)
    tiny_tokenizer().save_pretrained(model)
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2), "x": payload}, model / "pytorch_model.bin")
    return model


class _Ran:
    """A payload that leaves a marker when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (os.mkdir, (str(self.marker),))


@pytest.mark.parametrize("kind", ["os.mkdir", "fractions.Fraction"])
def test_a_pickled_pytorch_model_bin_is_one_line_and_never_runs(tmp_path: Path, kind: str) -> None:
    marker = tmp_path / "code-ran"
    payload = _Ran(marker) if kind == "os.mkdir" else fractions.Fraction(1, 3)
    model = _pickled_model(tmp_path, payload)
    text = _problems(f"model.path={model}", "model.tiny=null", "model.config_overrides={}")
    assert f"model.path: model.path '{model}': refusing to load its weights: pytorch_model.bin holds objects" in text
    assert "\x1b" not in text and "\n" not in text.split("problem(s)\n", 1)[1].strip(), text
    with pytest.raises(GeartrainError) as info:  # and where the engine builds it
        build_hf_model(ModelConfig(path=str(model)))
    assert "refusing to load its weights" in str(info.value) and "\x1b" not in str(info.value)
    assert not marker.exists()


def test_a_checkpoints_pickle_refusal_has_no_escape_codes(tmp_path: Path) -> None:
    torch.save({"scheduler": None, "extra": {"step": 1, "x": fractions.Fraction(1, 3)}}, tmp_path / "trainer.pt")
    with pytest.raises(CheckpointError) as info:
        load_state(tmp_path / "trainer.pt")
    assert "\x1b" not in str(info.value) and "GLOBAL fractions.Fraction" in str(info.value), str(info.value)


@pytest.mark.parametrize("damage", ["header", "not-safetensors"])
def test_a_damaged_safetensors_file_is_one_line(tmp_path: Path, damage: str) -> None:
    """Rerun of the probes on other weight files: a ``model.safetensors`` whose header is
    damaged (or that is no safetensors file) was a 63-line traceback from the engine's load,
    after ``--overwrite`` had deleted the previous run."""
    model = tmp_path / "model"
    build_hf_model(
        ModelConfig(tiny="qwen2", config_overrides={"hidden_size": 32, "num_hidden_layers": 1})
    ).save_pretrained(model)
    tiny_tokenizer().save_pretrained(model)
    weights = model / "model.safetensors"
    if damage == "header":
        with weights.open("r+b") as fh:
            fh.write(b"\xff" * 16)  # the header's length: far past the file's end
    else:
        weights.write_text("version https://git-lfs.github.com/spec/v1\n")  # an LFS pointer, say
    text = _problems(f"model.path={model}", "model.tiny=null", "model.config_overrides={}")
    assert f"model.path: {weights} cannot be read (" in text and "damaged or not a safetensors file" in text, text
    assert "\n" not in text.split("problem(s)\n", 1)[1].strip(), text


def test_query_heads_that_are_no_multiple_of_the_key_value_heads_are_one_line() -> None:
    """A model that builds on the meta device but cannot run attention (3 query heads over
    2 key/value heads) was a 112-line traceback at the first forward."""
    text = _problems("model.config_overrides.num_attention_heads=3")
    assert "model: num_attention_heads=3 is not a multiple of num_key_value_heads=2" in text, text


def test_a_model_directory_without_a_tokenizer_is_one_line_naming_it(tmp_path: Path) -> None:
    """Rerun on a model directory holding only its weights (a copied ``model.safetensors``):
    transformers' six-line message came through as it was, without saying which directory
    lacked what."""
    model = tmp_path / "model"
    build_hf_model(
        ModelConfig(tiny="qwen2", config_overrides={"hidden_size": 32, "num_hidden_layers": 1})
    ).save_pretrained(model)
    for other in model.iterdir():
        if other.name != "model.safetensors":
            other.unlink()
    text = _problems(f"model.path={model}", "model.tiny=null", "model.config_overrides={}")
    problem = text.split("problem(s)\n", 1)[1].strip()
    assert "\n" not in problem and problem.startswith(f"model: cannot load the tokenizer of {model}: "), text
    assert f"{model} holds no tokenizer files (tokenizer.json, " in problem and "set model.tokenizer" in problem, text


def test_a_sharded_model_missing_a_shard_is_one_line(tmp_path: Path) -> None:
    """Probe rerun for item 13: a sharded model directory whose index names a weight file
    that is not there (a download or copy cut short) was a 63-line traceback from the
    engine's load (exit 1), after the other checks had passed."""
    model = tmp_path / "model"
    build_hf_model(
        ModelConfig(tiny="qwen2", config_overrides={"hidden_size": 32, "num_hidden_layers": 2})
    ).save_pretrained(model, max_shard_size="100KB")
    tiny_tokenizer().save_pretrained(model)
    shards = sorted(model.glob("model-*.safetensors"))
    assert len(shards) >= 2 and (model / "model.safetensors.index.json").is_file()
    shards[-1].unlink()
    text = _problems(f"model.path={model}", "model.tiny=null", "model.config_overrides={}")
    problem = text.split("problem(s)\n", 1)[1].strip()
    assert "\n" not in problem, text
    assert problem.startswith(f"model.path: {model / 'model.safetensors.index.json'} names 1 of its {len(shards)}"), (
        text
    )
    assert f"({shards[-1].name}): the model is incomplete" in problem, text


UNDER_A_LIMIT = """
import resource, sys
from pathlib import Path
from geartrain.errors import ConfigError
from geartrain.trainer import load_train_config
from geartrain.trainer.preflight import address_space_left, preflight

config = load_train_config(sys.argv[1], sys.argv[2:], check_plugins=False)
with open("/proc/self/status") as status:
    mapped = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (mapped + 2 * 2**30, resource.RLIM_INFINITY))
left = address_space_left()
assert left is not None and left <= 2 * 2**30, left
try:
    preflight(config)
except ConfigError as exc:
    print(exc)
    sys.exit(2)
print("passed")
"""


@pytest.mark.parametrize(
    ("size", "refused"), [("hidden_size=2048,intermediate_size=8192,num_hidden_layers=8", True), ("", False)]
)
def test_a_model_past_the_address_space_limit_is_one_line(size: str, refused: bool) -> None:
    """Issue 35, round 11: under ``ulimit -v`` a 540M-parameter model (2 GiB of weights, fits
    the machine) died at step 0 with torch's "can't allocate memory", 66 lines, exit 1."""
    overrides = (
        [*SMALL, f"model.config_overrides={{{size},num_attention_heads=16,num_key_value_heads=4}}"] if size else SMALL
    )
    proc = subprocess.run(
        [sys.executable, "-c", UNDER_A_LIMIT, str(JOB), *overrides],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
        timeout=600,  # a hang guard only
    )
    if refused:
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "model: training the model's" in proc.stdout and "its address-space limit (ulimit -v)" in proc.stdout
    else:
        assert proc.returncode == 0 and proc.stdout.strip() == "passed", proc.stdout + proc.stderr


def test_a_lora_adapter_given_as_the_model_is_named_as_such(tmp_path: Path) -> None:
    """Issue 35, round 12: following the LoRA resume refusal's advice, model.path=<run>/hf
    (for a LoRA run, a PEFT adapter directory) failed in transformers ("Unrecognized model")."""
    adapter = tmp_path / "hf"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"base_model_name_or_path": "tiny:qwen2", "peft_type": "LORA"}')
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    text = _problems(f"model.path={adapter}", "model.tiny=null")
    assert f"model.path: '{adapter}' is a LoRA adapter (PEFT's adapter_config.json, base model 'tiny:qwen2')" in text
    assert "actor.lora.export_merged = true" in text


def _saved_model(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    build_hf_model(
        ModelConfig(tiny="qwen2", config_overrides={"hidden_size": 32, "num_hidden_layers": 1})
    ).save_pretrained(model)
    tiny_tokenizer().save_pretrained(model)
    return model


def _one_problem(text: str) -> str:
    problem = text.split("problem(s)\n", 1)[1].strip()
    assert "\n" not in problem, text
    return problem


def test_a_misspelled_config_override_is_named_with_the_setting_meant() -> None:
    """Issue 35, round 13: ``model.config_overrides={hidden_sise=64}`` was taken silently: the
    model was built with the default width and the typo written into the export's config."""
    problem = _one_problem(_problems("model.config_overrides={hidden_sise=64}"))
    assert problem == (
        "model.config_overrides.hidden_sise: not a setting of the qwen2 model's config (nothing would read it); "
        "did you mean 'hidden_size'?"
    )


def test_a_model_directory_without_weights_is_one_line(tmp_path: Path) -> None:
    """Issue 35, round 13: config.json and the tokenizer without the weights: ``check`` said
    ok, ``train`` was a 50-line traceback at the engine's load."""
    model = _saved_model(tmp_path)
    (model / "model.safetensors").unlink()
    problem = _one_problem(_problems(f"model.path={model}", "model.tiny=null", "model.config_overrides={}"))
    assert problem == (
        f"model.path: {model} holds a model's config.json but no weight file (*.safetensors, pytorch_model.bin): "
        "a model directory copied without its weights; copy them too"
    )


def test_a_config_json_that_does_not_describe_its_weights_is_one_line(tmp_path: Path) -> None:
    """Issue 35, round 13: a config.json whose vocab_size disagrees with the weights: ``check``
    said ok, ``train`` printed transformers' load report and a traceback."""
    model = _saved_model(tmp_path)
    config = json.loads((model / "config.json").read_text())
    rows = config["vocab_size"]
    config["vocab_size"] = rows + 7
    (model / "config.json").write_text(json.dumps(config))
    problem = _one_problem(_problems(f"model.path={model}", "model.tiny=null", "model.config_overrides={}"))
    assert problem.startswith(
        f"model.path: model.safetensors: weight 'model.embed_tokens.weight' is [{rows}, 32] where the model its "
        f"config.json describes has [{rows + 7}, 32]: the config does not match the weights"
    ), problem


def test_a_tokenizer_larger_than_the_models_vocabulary_is_one_line() -> None:
    """Issue 35, round 13: a ``model.tokenizer`` with 49,152 tokens on a model of 128: ``check``
    said ok; ``train`` stopped at step 0 naming a prompt's token ids, not the tokenizer."""
    rows = len(tiny_tokenizer()) - 3
    problem = _one_problem(_problems(f"model.config_overrides.vocab_size={rows}"))
    assert problem.startswith(
        f"model: the tokenizer has {len(tiny_tokenizer())} tokens and the model embeds {rows} (its vocab_size)"
    ), problem


def test_gdpo_reward_keys_naming_no_reward_function_are_one_line() -> None:
    """Issue 35, round 13: ``gdpo_reward_keys = ["nonexistent"]`` passed ``check`` and failed at
    step 1, pointing at a ``reward.terms`` setting that does not exist."""
    problem = _one_problem(_problems("algorithm.advantage=gdpo", 'algorithm.gdpo_reward_keys=["nonexistent"]'))
    assert problem.startswith(
        "algorithm.gdpo_reward_keys: ['nonexistent'] name no reward function of the job; its functions: ["
    ), problem


def test_a_config_override_that_is_not_finite_is_named_and_a_legacy_name_is_read() -> None:
    """Issue 35, round 13: ``rope_theta = nan`` in ``model.config_overrides`` passed ``check``
    and the run's first step blamed overflowing weights and the learning rate. A legacy name
    the config's constructor converts (``rope_theta`` into ``rope_parameters``) is no typo."""
    problem = _one_problem(_problems("model.config_overrides.rope_theta=nan"))
    assert problem == "model.config_overrides.rope_theta: nan holds a number that is not finite"
    preflight(load_train_config(JOB, [*SMALL, "model.config_overrides.rope_theta=5000.0"], check_plugins=False))


def test_a_long_run_that_saves_only_at_its_end_is_said() -> None:
    """Issue 35, round 13: with save_every = 0, Ctrl-C at step 67 of 200 lost every step, and
    nothing at the start said the run keeps no checkpoint before its end."""
    notes = preflight(
        load_train_config(JOB, [*SMALL, "trainer.save_every=0", "trainer.total_steps=60"], check_plugins=False)
    ).notes
    said = "trainer.save_every = 0: the run saves its only checkpoint after its last step (60)"
    assert any(n.startswith(said) for n in notes), notes
    kept = preflight(
        load_train_config(JOB, [*SMALL, "trainer.save_every=10", "trainer.total_steps=60"], check_plugins=False)
    ).notes
    assert not any(n.startswith("trainer.save_every") for n in kept), kept


def test_a_critic_model_with_a_smaller_vocabulary_than_the_tokenizer_is_one_line() -> None:
    """Issue 35, round 14: PPO with a ``critic.model`` of vocab_size 50 under a 100-token
    tokenizer passed ``check`` and failed at step 1 in an 80-line IndexError."""
    ppo = JOB.parent / "ppo.toml"
    overrides = [*SMALL, "critic.model.tiny=qwen2", "critic.model.config_overrides.vocab_size=50"]
    with pytest.raises(ConfigError) as info:
        preflight(load_train_config(ppo, overrides, check_plugins=False))
    problem = _one_problem(str(info.value))
    assert problem.startswith("critic.model: the tokenizer has "), problem
    assert "tokens and the critic's model embeds 50 (its vocab_size)" in problem, problem


def test_async_settings_without_the_async_rollout_and_validation_on_the_training_data_are_said() -> None:
    """Issue 35, round 14: ``trainer.max_staleness`` without ``trainer.async_rollout`` was
    ignored without a word, and ``validation.path`` equal to ``data.path`` (the "held-out"
    accuracy measured on training prompts) passed silently."""
    notes = preflight(
        load_train_config(
            JOB, [*SMALL, "trainer.max_staleness=2", "validation.path=./data/train.jsonl"], check_plugins=False
        )
    ).notes
    assert any(n.startswith("trainer.max_staleness set the async rollout, which is off") for n in notes), notes
    assert any(n.startswith("validation.path is data.path (") for n in notes), notes
    quiet = preflight(load_train_config(JOB, SMALL, check_plugins=False)).notes
    assert not any("async rollout" in n or "validation.path is" in n for n in quiet), quiet


def test_an_output_dir_among_the_data_is_refused(tmp_path: Path) -> None:
    """Issue 35, round 15: trainer.output_dir equal to the data directory: the run wrote
    metrics.jsonl and completions.jsonl among the data (read as data by the next run, which
    then refused the directory naming hf/ as a subdirectory of data files)."""
    data = JOB.parent / "data"
    for out in (data, data / "run"):
        overrides = [*SMALL, f"data.path={data}", f"trainer.output_dir={out}"]
        problem = _one_problem(_problems(*overrides[len(SMALL) :]))
        assert problem.startswith(f"trainer.output_dir: {out} is "), problem
        assert f"data directory of data.path ({data})" in problem, problem
