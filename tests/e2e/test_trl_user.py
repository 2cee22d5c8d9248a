"""What a TRL user tripped on (issue 34, items 1-8), each checked on the main job."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import MAIN_CONFIG
from geartrain.data.config import DataConfig
from geartrain.errors import ConfigError
from geartrain.trainer import load_train_config, run_job
from geartrain.trainer.config import TrainConfig, TrainerConfig


def _config(tmp_path: Path, *overrides: str) -> TrainConfig:
    """The main job for 2 steps without SFT, validation or exports."""
    return load_train_config(
        MAIN_CONFIG,
        [
            "sft.enabled=false",
            "trainer.progress=false",
            "trainer.export_hf=false",
            "trainer.plot=false",
            "trainer.tensorboard=false",
            "trainer.total_steps=2",
            "validation.every_n_steps=0",
            "validation.max_prompts=4",
            "trainer.log_completions=4",
            *overrides,
            f"trainer.output_dir={tmp_path / 'run'}",
        ],
        check_plugins=False,
    )


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def exact(response: str, ground_truth: str) -> float:
    return float(response.strip() == ground_truth.strip())


def brevity(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    return [-float(len(c)) for c in completions]


def test_run_job_takes_a_list_of_weighted_reward_functions(tmp_path: Path) -> None:
    """Item 4: ``run_job(reward_fn=[f, g], reward_weights=[...])`` as TRL's ``reward_funcs``
    and ``reward_weights`` (it raised TypeError: unhashable type: 'list'); each function is
    logged under its name and the reward is the weighted sum."""
    config = _config(tmp_path)
    run_job(config, reward_fn=[exact, brevity], reward_weights=[1.0, 0.1])
    records = [r for r in _rows(tmp_path / "run" / "completions.jsonl") if r["kind"] == "train"]
    assert records
    for r in records:
        assert set(r["rewards"]) == {"exact", "brevity"}
        assert r["rewards"]["brevity"] == -len(r["response"])
        assert r["reward"] == pytest.approx(r["rewards"]["exact"] + 0.1 * r["rewards"]["brevity"])
    metrics = [m for m in _rows(tmp_path / "run" / "metrics.jsonl") if m["step"] >= 1]
    assert all("reward/exact/mean" in m and "reward/brevity/mean" in m for m in metrics)
    with pytest.raises(ConfigError, match="reward_weights: 1 weights for 2 reward functions"):
        run_job(_config(tmp_path / "b"), reward_fn=[exact, brevity], reward_weights=[1.0])


def test_python_constructors_answer_trl_names_and_answer_key() -> None:
    """Item 4: a section built in Python gets the hints a job file gets (it raised pydantic's
    "Extra inputs are not permitted"), and ``answer_key`` is ``ground_truth_key``'s other
    name in Python too (the docs' name was refused on assignment)."""
    with pytest.raises(ValueError, match="max_steps: unknown key 'max_steps'; TRL's 'max_steps' is trainer.total_st"):
        TrainerConfig(max_steps=3)
    with pytest.raises(ConfigError) as info:
        TrainConfig(trainer={"total_step": 3}, sampling={"num_generations": 4})
    problems = dict(info.value.problems)
    assert problems["trainer.total_step"] == "unknown key 'total_step'; did you mean 'total_steps'?"
    assert "sampling.n" in problems["sampling.num_generations"]
    assert "Extra inputs" not in str(info.value)
    config = TrainConfig()
    config.data.answer_key = "answer"
    assert config.data.ground_truth_key == "answer" == config.data.answer_key
    assert DataConfig(answer_key="label").ground_truth_key == "label"


def test_a_lora_export_loads_with_auto_peft_and_names_its_base_portably(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 3: the adapter's ``task_type`` is ``CAUSAL_LM`` (it was null, so
    ``AutoPeftModelForCausalLM`` failed) and its base is named relative to the export (the
    run's warm start, ``../sft_model``), not as an absolute path of the training machine."""
    from peft import AutoPeftModelForCausalLM, PeftModel

    config = load_train_config(
        MAIN_CONFIG.parent / "grpo_lora.toml",
        [
            "sft.steps=2",
            "sft.min_steps=0",
            "sft.eval_every=100",
            "trainer.progress=false",
            "trainer.plot=false",
            "trainer.tensorboard=false",
            "trainer.total_steps=1",
            "validation.every_n_steps=0",
            "validation.max_prompts=4",
            f"trainer.output_dir={tmp_path / 'run'}",
        ],
        check_plugins=False,
    )
    run_job(config)
    export = tmp_path / "run" / "hf"
    adapter = json.loads((export / "adapter_config.json").read_text())
    assert adapter["task_type"] == "CAUSAL_LM"
    assert adapter["base_model_name_or_path"] == "../sft_model"
    monkeypatch.chdir(export)  # the base is named relative to the export directory
    model = AutoPeftModelForCausalLM.from_pretrained(".")
    assert isinstance(model, PeftModel) and model.peft_config["default"].r == config.actor.lora.rank
    from geartrain.modeling import tiny_tokenizer
    from transformers import AutoTokenizer

    text = "user: 12 + 3\nassistant: 15"  # item 2: the adapter directory's tokenizer round-trips too
    assert AutoTokenizer.from_pretrained(".").encode(text) == tiny_tokenizer().encode(text)


def test_portable_base_names(tmp_path: Path) -> None:
    """Item 3: a hub id stays, a Hugging Face cache snapshot is its hub id, another directory
    is relative to the export."""
    from geartrain.export import portable_base

    snapshot = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (tmp_path / "run" / "hf").mkdir(parents=True)
    assert portable_base(str(snapshot), tmp_path / "run" / "hf") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert portable_base("Qwen/Qwen2.5-0.5B", tmp_path) == "Qwen/Qwen2.5-0.5B"
    assert portable_base(str(tmp_path / "models" / "mine"), tmp_path) == str(tmp_path / "models" / "mine")  # absent
    (tmp_path / "models" / "mine").mkdir(parents=True)
    assert portable_base(str(tmp_path / "models" / "mine"), tmp_path / "run" / "hf") == "../../models/mine"


def well_formed(completions: list[str], ground_truth: list[str], **_: Any) -> list[float]:
    """A format reward: 0.5 for any answer, 1.0 for the right one (never 0, never an ``acc``)."""
    return [1.0 if c.strip() == t.strip() else 0.5 for c, t in zip(completions, ground_truth, strict=True)]


def _steps(out: Path, phase: str = "rl") -> list[dict[str, Any]]:
    return [m for m in _rows(out / "metrics.jsonl") if m.get("phase") == phase and m["step"] >= 1]


def test_accuracy_is_declared_and_said_once_when_read_from_a_reward_that_is_not_0_1(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Item 1: with a format reward, accuracy read as reward > 0 is 100 % whatever the
    answers: said once; ``reward.accuracy`` naming an exact-match function of weight 0 makes
    train and validation accuracy that function's."""
    run_job(_config(tmp_path / "a"), reward_fn=well_formed)
    steps = _steps(tmp_path / "a" / "run")
    assert steps and all(m["reward/accuracy"] == 1.0 for m in steps)
    notices = [r for r in caplog.records if "accuracy is read as reward > 0" in r.getMessage()]
    assert len(notices) == 1, [r.getMessage() for r in caplog.records]
    assert "reward.accuracy" in notices[0].getMessage()

    caplog.clear()
    config = _config(tmp_path / "b", "reward.accuracy=exact")
    run_job(config, reward_fn=[well_formed, exact], reward_weights=[1.0, 0.0])
    out = tmp_path / "b" / "run"
    steps = _steps(out)
    assert steps and all(m["reward/accuracy"] == pytest.approx(m["reward/exact/mean"]) for m in steps)
    val = [r for r in _rows(out / "completions.jsonl") if r["kind"] == "validation" and r["step"] == 0]
    first = next(m for m in _rows(out / "metrics.jsonl") if "val/accuracy" in m)
    assert first["val/accuracy"] == pytest.approx(sum(r["rewards"]["exact"] for r in val) / len(val))
    assert not [r for r in caplog.records if "accuracy is read as reward > 0" in r.getMessage()]


def test_sft_stop_at_accuracy_reads_the_declared_accuracy(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Item 1: the warm start stopped at its first evaluation "100 % accurate" under a format
    reward (said once for the run, warm start and RL together); with ``reward.accuracy`` a
    function that finds nothing right, it trains on."""
    (tmp_path / "acc.py").write_text("def never(response, ground_truth):\n    return 0.0\n")
    sft = ["sft.enabled=true", "sft.steps=3", "sft.min_steps=0", "sft.eval_every=1", "sft.stop_at_accuracy=0.01"]
    run_job(_config(tmp_path / "a", *sft, "trainer.total_steps=1"), reward_fn=well_formed)
    assert [m["sft/dev_accuracy"] for m in _steps(tmp_path / "a" / "run", "sft") if "sft/dev_accuracy" in m] == [1.0]
    assert len([r for r in caplog.records if "accuracy is read as reward > 0" in r.getMessage()]) == 1
    config = _config(tmp_path / "b", *sft, "trainer.total_steps=1", f"reward.accuracy={tmp_path / 'acc.py'}:never")
    run_job(config, reward_fn=well_formed)
    out = tmp_path / "b" / "run"
    assert [m["sft/dev_accuracy"] for m in _steps(out, "sft") if "sft/dev_accuracy" in m] == [0.0, 0.0, 0.0]
    assert all(m["reward/accuracy"] == 0.0 for m in _steps(out))


class Recorder:
    """Every event it gets, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        self.events.append(("step", step, metrics["reward/mean"]))

    def on_evaluate(self, step: int, metrics: dict[str, float]) -> None:
        self.events.append(("evaluate", step, metrics["val/accuracy"]))

    def on_save(self, step: int, path: Path) -> None:
        self.events.append(("save", step, path.name == f"step_{step:08d}" and (path / "dcp").is_dir()))

    def on_train_end(self, steps: int, metrics: dict[str, Any]) -> None:
        self.events.append(("end", steps, metrics["accuracy_after"]))


CALLBACK_FILE = """
import json, os

class Lines:
    def on_step_end(self, step, metrics):
        with open(os.environ["CALLBACK_OUT"], "a") as f:
            f.write(json.dumps({"step": step, "loss": metrics["actor/pg_loss"]}) + "\\n")
"""


def test_callbacks_from_python_and_from_the_job_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 5: a callback gets each step's metrics, each validation, each saved checkpoint
    and the end, as the run logged them; one named in the job file runs too; a callback
    that fails ends the run with one line naming it."""
    (tmp_path / "cb.py").write_text(CALLBACK_FILE)
    monkeypatch.setenv("CALLBACK_OUT", str(tmp_path / "lines.jsonl"))
    recorder = Recorder()
    config = _config(
        tmp_path,
        "trainer.total_steps=3",
        "trainer.save_every=2",
        "validation.every_n_steps=2",
        f"trainer.callbacks=['{tmp_path / 'cb.py'}:Lines']",
    )
    result = run_job(config, callbacks=[recorder])
    metrics = {m["step"]: m for m in _rows(tmp_path / "run" / "metrics.jsonl")}
    assert recorder.events == [
        ("evaluate", 0, metrics[0]["val/accuracy"]),
        ("save", 0, True),
        ("step", 1, metrics[1]["reward/mean"]),
        ("evaluate", 2, metrics[2]["val/accuracy"]),
        ("step", 2, metrics[2]["reward/mean"]),
        ("save", 2, True),
        ("evaluate", 3, metrics[3]["val/accuracy"]),
        ("step", 3, metrics[3]["reward/mean"]),
        ("save", 3, True),
        ("end", 3, result.accuracy_after),
    ]
    lines = _rows(tmp_path / "lines.jsonl")
    assert [(r["step"], r["loss"]) for r in lines] == [(s, metrics[s]["actor/pg_loss"]) for s in (1, 2, 3)]


class Failing:
    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        raise RuntimeError("disk quota")


def test_a_failing_callback_is_one_line_and_a_bad_one_is_refused_before_training(tmp_path: Path) -> None:
    """Item 5: a callback's error names the callback and the event; a callback spec that
    cannot be loaded is a config problem before anything is trained."""
    from geartrain.errors import GeartrainError

    with pytest.raises(GeartrainError, match=r"^callback Failing.on_step_end failed: RuntimeError: disk quota$"):
        run_job(_config(tmp_path / "a"), callbacks=[Failing()])
    with pytest.raises(ConfigError, match=r"trainer.callbacks: .*has none of the callback methods"):
        run_job(_config(tmp_path / "b"), callbacks=[object()])
    assert not (tmp_path / "b" / "run").exists()


def test_a_table_of_a_few_completions_is_printed_each_step(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Item 8: ``trainer.print_completions = N`` prints N of each step's samples as a table
    (TRL's completions table): the same samples, rewards and advantages as completions.jsonl."""
    config = _config(tmp_path, "trainer.print_completions=2", "trainer.log_completions=2")
    run_job(config, reward_fn=[exact, brevity], reward_weights=[1.0, 0.1])
    out = capsys.readouterr().out.splitlines()
    heads = [i for i, line in enumerate(out) if line.startswith("step") and "| completion" in line]
    assert len(heads) == 2, out
    head = [c.strip() for c in out[heads[0]].split(" | ")]
    assert head == ["step", "prompt", "completion", "reward", "brevity", "exact", "advantage"]
    assert all(len(line) <= 100 for line in out[heads[0] : heads[0] + 4])
    records = [r for r in _rows(tmp_path / "run" / "completions.jsonl") if r["kind"] == "train"]
    rows = [[c.strip() for c in line.split(" | ")] for h in heads for line in out[h + 2 : h + 4]]
    assert len(rows) == len(records) == 4
    for row, r in zip(rows, records, strict=True):
        assert row[0] == str(r["step"]) and r["prompt"].startswith(row[1].rstrip("…"))
        assert row[3:] == [
            f"{r['reward']:.3g}",
            f"{r['rewards']['brevity']:.3g}",
            f"{r['rewards']['exact']:.3g}",
            f"{r['advantage']:.3g}",
        ]


CHAT = ["data.apply_chat_template=true", "data.max_prompt_length=40", "rollout.max_model_len=48"]


def test_every_export_round_trips_through_auto_tokenizer(tmp_path: Path) -> None:
    """Item 2: the run's export, its warm start and ``geartrain export`` of a checkpoint load
    with ``AutoTokenizer`` to the same encodings as the run's tokenizer (a chat job's export
    loaded a Qwen2Tokenizer that dropped spaces and newlines), and a job on the export
    (``model.path``) validates to the same greedy outputs and accuracy as the run ended with."""
    from geartrain.modeling import tiny_tokenizer
    from geartrain.trainer.export import export_checkpoint
    from transformers import AutoTokenizer

    sft = ["sft.enabled=true", "sft.steps=2", "sft.min_steps=0", "sft.eval_every=100"]
    first = run_job(
        _config(
            tmp_path / "a",
            *sft,
            *CHAT,
            "trainer.export_hf=true",
            "trainer.save_every=1",
            "trainer.total_steps=1",
            "validation.max_prompts=8",
        )
    )
    run = tmp_path / "a" / "run"
    exported, _ = export_checkpoint(run, tmp_path / "exported")
    ours = tiny_tokenizer()
    val = [r for r in _rows(run / "completions.jsonl") if r["kind"] == "validation"]
    texts = [r["prompt"] for r in val] + ["user: 12 + 3\nassistant:  15 \n"]
    assert any(" " in t and "\n" in t for t in texts)
    messages = [{"role": "user", "content": "two words\nand a line"}]
    for directory in (run / "hf", run / "sft_model", exported):
        theirs = AutoTokenizer.from_pretrained(directory)
        assert [theirs.encode(t) for t in texts] == [ours.encode(t) for t in texts], (directory, type(theirs))
        assert theirs.decode(theirs.encode(texts[-1])) == texts[-1]
        chat = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert chat == ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert (theirs.eos_token_id, theirs.pad_token_id) == (ours.eos_token_id, ours.pad_token_id)

    overrides = ["model.tiny=null", "model.config_overrides={}", f"model.path={run / 'hf'}"]
    second = run_job(_config(tmp_path / "b", *CHAT, *overrides, "validation.max_prompts=8"))
    again = [r for r in _rows(tmp_path / "b" / "run" / "completions.jsonl") if r["kind"] == "validation"]
    last = max(r["step"] for r in val)
    assert [r["response"] for r in again if r["step"] == 0] == [r["response"] for r in val if r["step"] == last]
    assert second.accuracy_before == first.accuracy_after
