"""Configuration: every problem reported with its path; overrides; backend sections."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from geartrain.config import (
    EngineConfig,
    ModelConfig,
    RolloutConfig,
    apply_overrides,
    parse_override_value,
)
from geartrain.errors import ConfigError
from geartrain.validation import load_config
from pydantic import BaseModel, ConfigDict, Field


class Job(BaseModel):
    """A small root config, the way a trainer composes sections."""

    model_config = ConfigDict(extra="forbid")
    model: ModelConfig = Field(default_factory=lambda: ModelConfig(tiny="qwen2"))
    actor: EngineConfig = Field(default_factory=lambda: EngineConfig(backend="simple-test"))
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    steps: int = 1


@pytest.fixture(autouse=True)
def simple_engine():
    """Register a schema-bearing engine in code for the backend-section checks."""
    import types

    from geartrain import hookimpl, plugins, register_engine

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        chunk: int = Field(8, ge=1)

    module = types.ModuleType("gt_config_engine")
    # pluggy reads argument names from the function: give each stub the spec's signature
    import inspect

    from geartrain import hookspecs

    for hook in (
        "build_model",
        "shard",
        "forward_backward",
        "optimizer_step",
        "reshard_for_rollout",
        "save_checkpoint",
        "load_checkpoint",
        "config_schema",
        "capabilities",
    ):
        params = list(inspect.signature(getattr(hookspecs, hook)).parameters)
        ret = "Options" if hook == "config_schema" else ("['cpu']" if hook == "capabilities" else "None")
        ns = {"Options": Options}
        exec(f"def {hook}({', '.join(params)}):\n    return {ret}", ns)  # noqa: S102 - stub with the spec's argument names
        setattr(module, hook, hookimpl(ns[hook]))
    register_engine("simple-test", module)
    yield
    plugins.unregister("engine", "simple-test")


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_toml_and_yaml_give_the_same_config(tmp_path: Path) -> None:
    toml = write(
        tmp_path,
        "a.toml",
        "steps = 3\n[actor]\nbackend = 'simple-test'\n[actor.optim]\nlr = 2e-5\n[rollout]\nmax_model_len = 64\n",
    )
    yaml = write(
        tmp_path,
        "a.yaml",
        "steps: 3\nactor:\n  backend: simple-test\n  optim:\n    lr: 2.0e-5\nrollout:\n  max_model_len: 64\n",
    )
    a, b = load_config(Job, toml), load_config(Job, yaml)
    assert a == b
    assert a.actor.optim.lr == 2e-5 and a.rollout.max_model_len == 64


def test_every_problem_is_reported_with_its_path(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "bad.toml",
        'steps = "many"\n[actor]\nbackend = "simple-test"\nmax_tokens_per_micro_batch = 0\n'
        '[actor.optim]\nlr = -1\nlr_schedule = "cosine"\n'
        '[rollout]\ntemperatur = 1.0\n[model]\ntiny = "qwen2"\npath = "x"\n',
    )
    with pytest.raises(ConfigError) as err:
        load_config(Job, path)
    paths = {p for p, _ in err.value.problems}
    assert {"steps", "actor.max_tokens_per_micro_batch", "actor.optim.lr", "rollout.temperatur", "model"} <= paths
    assert str(path) in str(err.value)
    assert "set exactly one of 'path'" in str(err.value)


def test_backend_options_are_validated_by_the_backend_schema(tmp_path: Path) -> None:
    good = load_config(Job, write(tmp_path, "g.toml", "[actor]\nbackend = 'simple-test'\n[actor.options]\nchunk = 4\n"))
    assert good.actor.options.chunk == 4
    with pytest.raises(ConfigError) as err:
        load_config(
            Job,
            write(tmp_path, "b.toml", "[actor]\nbackend = 'simple-test'\n[actor.options]\nchunk = 0\ncolour = 'red'\n"),
        )
    assert {p for p, _ in err.value.problems} == {"actor.options.chunk", "actor.options.colour"}


def test_capabilities_a_backend_lacks_are_refused_up_front(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(
            Job,
            write(tmp_path, "sp.toml", "[actor]\nbackend = 'simple-test'\n[actor.parallel]\ndp = 2\nsp = 2\ntp = 2\n"),
        )
    problems = dict(err.value.problems)
    assert "does not declare 'data_parallel'" in problems["actor.parallel.dp"]
    assert "does not declare 'sequence_parallel'" in problems["actor.parallel.sp"]
    assert "does not declare 'tensor_parallel'" in problems["actor.parallel.tp"]


def test_a_missing_backend_is_a_problem_at_its_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(Job, write(tmp_path, "m.toml", "[actor]\nbackend = 'megatron'\n"))
    problems = dict(err.value.problems)
    assert (
        "pip install ./plugins/megatron_engine   "
        "(the geartrain-megatron package, from the root of a geartrain checkout)" in problems["actor.backend"]
    )


def test_dotted_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, "o.toml", "steps = 1\n")
    cfg = load_config(
        Job,
        path,
        [
            "steps=5",
            "actor.backend=simple-test",
            "actor.optim.lr=1e-4",
            "rollout.backend=torch",
            "actor.optim.betas=[0.8, 0.9]",
        ],
    )
    assert cfg.steps == 5 and cfg.actor.optim.lr == 1e-4 and cfg.actor.optim.betas == (0.8, 0.9)
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config(Job, path, ["steps"])
    with pytest.raises(ConfigError) as err:
        load_config(Job, path, ["actor.backend=simple-test", "actor.optim.lr=fast"])
    assert dict(err.value.problems).keys() == {"actor.optim.lr"}


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("3", 3),
        ("1e-6", 1e-6),
        ("true", True),
        ("[1, 2]", [1, 2]),
        ("fsdp", "fsdp"),
        ('"a b"', "a b"),
        ("0.5", 0.5),
        ("'it''s'", "it's"),
        # probes7 (issue 35): YAML's plain scalars silently became another path: a newline
        # folded into a space (the run went to "runs/a b"), everything from " #" cut as a comment
        ("runs/a\nb", "runs/a\nb"),
        ("runs/exp #2", "runs/exp #2"),
        (" runs/x ", "runs/x"),
    ],
)
def test_override_values_are_typed(text: str, value: object) -> None:
    assert parse_override_value(text) == value


def test_override_into_a_value_is_an_error() -> None:
    with pytest.raises(ConfigError, match="is a value, not a table"):
        apply_overrides({"steps": 1}, ["steps.inner=2"])


def test_an_override_giving_a_whole_table_names_the_keys_it_drops(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 35 round 9 (probes9): `actor.engine.optim={lr=1e-4}` replaced the job file's
    optimizer table without a word: its cosine schedule, warmup, weight decay and floor fell
    back to their defaults. The replacement stands (it is what the override says); the keys
    it drops are named, in a list of tables too."""
    data = {"optim": {"lr": 1.0, "lr_schedule": "cosine", "warmup_steps": 50}, "terms": [{"name": "a", "weight": 2}]}
    with caplog.at_level(logging.WARNING, logger="geartrain.config"):
        apply_overrides(data, ["optim={lr=1e-4}", "terms.0={name='b'}"])
    assert data["optim"] == {"lr": 1e-4} and data["terms"] == [{"name": "b"}]
    said = caplog.text
    assert "optim replaces the whole table: optim.lr_schedule, optim.warmup_steps from the job file" in said
    assert "terms.0 replaces the whole table: terms.0.weight" in said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="geartrain.config"):  # nothing left out, nothing to say
        apply_overrides(data, ["optim={lr=2e-4}", "optim.lr=3e-4", "new={a=1}"])
    assert "replaces the whole table" not in caplog.text


def test_unreadable_files_are_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        load_config(Job, tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(Job, write(tmp_path, "x.toml", "steps = = 1\n"))
    with pytest.raises(ConfigError, match="unknown config format"):
        load_config(Job, write(tmp_path, "x.ini", "steps=1\n"))


# ----------------------------------------------------------------------------- job configs


def _job(overrides: list[str], *, check_plugins: bool = True):  # noqa: ANN202
    from geartrain.trainer.config import load_train_config

    return load_train_config(None, overrides, check_plugins=check_plugins)


def test_roles_follow_the_actor_backend_and_only_built_roles_are_checked() -> None:
    # GRPO with a rule reward builds no reference, critic or reward engine: only the actor
    # and the rollout sections are checked, and the other roles follow the actor's backend.
    job = _job(["actor.engine.backend=simple-test"])
    assert (job.reference.engine.backend, job.critic.engine.backend, job.reward.engine.backend) == ("simple-test",) * 3
    assert [path for path, _ in job.backend_sections()] == ["actor.engine", "rollout"]
    # a role that is not built may name a backend that is not installed...
    _job(["actor.engine.backend=simple-test", "critic.engine.backend=megatron"])
    # ...a role that is built may not
    with pytest.raises(ConfigError) as err:
        _job(["actor.engine.backend=simple-test", "algorithm.use_kl_loss=true", "reference.engine.backend=megatron"])
    assert set(dict(err.value.problems)) == {"reference.engine.backend"}
    with pytest.raises(ConfigError) as err:
        _job(["actor.engine.backend=simple-test", "algorithm.name=ppo", "critic.engine.options.chunk=0"])
    assert set(dict(err.value.problems)) == {"critic.engine.options.chunk"}


def test_optimizer_total_steps_are_derived_from_the_trainer() -> None:
    job = _job(
        [
            "trainer.total_steps=7",
            "algorithm.ppo_epochs=2",
            "algorithm.mini_batches=3",
            "actor.engine.optim.lr_schedule=cosine",
        ],
        check_plugins=False,
    )
    assert job.actor.engine.optim.total_steps == 7 * 2 * 3
    ppo = _job(
        ["algorithm.name=ppo", "trainer.total_steps=7", "algorithm.critic_warmup_steps=2", "algorithm.mini_batches=2"],
        check_plugins=False,
    )
    assert (ppo.actor.engine.optim.total_steps, ppo.critic.engine.optim.total_steps) == (5 * 2, 7 * 2)
    sft = _job(["sft.enabled=true", "sft.steps=9"], check_plugins=False)
    assert sft.sft.optim.total_steps == 9
    assert _job(
        ["trainer.total_steps=4", "actor.engine.optim.total_steps=8", "algorithm.mini_batches=2"], check_plugins=False
    )
    with pytest.raises(ConfigError) as err:
        _job(
            ["trainer.total_steps=4", "actor.engine.optim.total_steps=4", "algorithm.mini_batches=2"],
            check_plugins=False,
        )
    message = dict(err.value.problems)["actor.engine.optim.total_steps"]
    assert message.startswith("4 disagrees with the 8 optimizer steps")
    assert "trainer.total_steps (4) x algorithm.ppo_epochs (1) x algorithm.mini_batches (2)" in message


def test_a_backend_config_error_carries_the_section_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A backend raises ConfigError with a path inside its section; the core puts the
    section's path in front, in the Python API and in the CLI (one message, no traceback)."""
    import types

    from geartrain import Engine, EngineContext, cli, hookimpl, plugins, register_engine

    module = types.ModuleType("gt_picky_engine")
    for hook in ("forward_backward", "optimizer_step", "reshard_for_rollout", "save_checkpoint", "load_checkpoint"):
        exec(f"def {hook}(model):\n    return None", module.__dict__)  # noqa: S102 - stubs
        setattr(module, hook, hookimpl(getattr(module, hook)))

    @hookimpl
    def build_model(config, ctx):  # noqa: ANN001, ANN202
        return None

    @hookimpl
    def shard(module, config, model_config, ctx):  # noqa: ANN001, ANN202
        raise ConfigError([("parallel.dp", "the picky engine wants dp = 3")])

    module.build_model, module.shard = build_model, shard
    register_engine("picky", module)
    try:
        with pytest.raises(ConfigError) as err:
            Engine(EngineConfig(backend="picky"), ModelConfig(tiny="qwen2"), EngineContext(role="critic"))
        assert err.value.problems == [("critic.engine.parallel.dp", "the picky engine wants dp = 3")]
        # options given in code are checked against the backend's schema, with their path
        with pytest.raises(ConfigError) as err:
            Engine(
                EngineConfig(backend="simple-test", options={"chunk": 0}),
                ModelConfig(tiny="qwen2"),
                EngineContext(role="actor"),
            )
        assert [p for p, _ in err.value.problems] == ["actor.engine.options.chunk"]

        data = write(tmp_path, "d.jsonl", '{"prompt": "1+1=", "ground_truth": "2"}\n' * 4)
        job = write(
            tmp_path,
            "job.toml",
            '[model]\ntiny = "qwen2"\n[reward]\nfunction = "arithmetic"\n[actor.engine]\nbackend = "picky"\n'
            f'[data]\npath = "{data}"\nbatch_size = 2\n'
            f'[trainer]\noutput_dir = "{tmp_path / "out"}"\n[validation]\nevery_n_steps = 0\n',
        )
        assert cli.main(["train", str(job)]) == 2
        err_text = capsys.readouterr().err
        assert "actor.engine.parallel.dp: the picky engine wants dp = 3" in err_text
        assert "Traceback" not in err_text
    finally:
        plugins.unregister("engine", "picky")


def test_an_engine_built_in_code_needs_the_decay_horizon() -> None:
    from geartrain import Engine, EngineContext
    from geartrain.config import OptimConfig

    cosine = OptimConfig(lr=1e-3, lr_schedule="cosine")  # a section alone may leave it to the job
    with pytest.raises(ConfigError) as err:
        Engine(
            EngineConfig(backend="simple-test", optim=cosine), ModelConfig(tiny="qwen2"), EngineContext(role="critic")
        )
    assert [p for p, _ in err.value.problems] == ["critic.engine.optim.total_steps"]


def test_every_field_of_a_job_has_a_description() -> None:
    from geartrain.config import describe_fields
    from geartrain.trainer.config import TrainConfig

    rows = describe_fields(TrainConfig)
    assert len(rows) > 150 and {"actor.engine.optim.lr", "rollout.max_model_len", "trainer.total_steps"} <= {
        r.path for r in rows
    }
    undescribed = [r.path for r in rows if not r.description]
    assert not undescribed, f"config fields without a description (add an attribute docstring): {undescribed}"
    # a section is described by its own docstring, never by the base class's (trainer was)
    from geartrain.config import Section

    base_doc = " ".join(Section.__doc__.split())
    inherited = [r.path for r in rows if r.description == base_doc]
    assert not inherited, f"sections described by Section's docstring instead of their own: {inherited}"
    assert next(r for r in rows if r.path == "trainer").description.startswith("The RL loop")


def test_config_schema_prints_every_field_and_check_explains_a_bad_key(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from geartrain import cli
    from geartrain.config import describe_fields
    from geartrain.trainer.config import TrainConfig

    assert cli.main(["config", "--schema"]) == 0
    text = capsys.readouterr().out
    assert "actor.engine.optim.lr (float, default 1e-06)\n    Peak learning rate (AdamW)" in text
    printed = [line.split(" (")[0] for line in text.splitlines() if not line.startswith(" ")]
    assert printed == [r.path for r in describe_fields(TrainConfig)]
    assert cli.main(["config", "--schema", "--json"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["$defs"]["OptimConfig"]["properties"]["lr"]["description"].startswith("Peak learning rate")

    job = Path(__file__).resolve().parents[2] / "examples" / "arithmetic" / "grpo.toml"
    assert cli.main(["check", str(job), "actor.engine.optim.lr=-1", "--no-plugins", "--config-only"]) == 2
    err = capsys.readouterr().err
    assert (
        "actor.engine.optim.lr: should be greater than or equal to 0; "
        "got -1 (the command-line override 'actor.engine.optim.lr=-1')" in err
    )
    assert "actor.engine.optim.lr is: Peak learning rate (AdamW)" in err


def _stub_rollout_without_lora():  # noqa: ANN202
    import inspect
    import types

    from geartrain import hookimpl, hookspecs

    module = types.ModuleType("gt_config_rollout")
    for hook in ("build_rollout", "generate", "update_weights", "release", "resume", "capabilities"):
        params = list(inspect.signature(getattr(hookspecs, hook)).parameters)
        ns: dict = {}
        exec(f"def {hook}({', '.join(params)}):\n    return {['cpu'] if hook == 'capabilities' else None}", ns)  # noqa: S102
        setattr(module, hook, hookimpl(ns[hook]))
    return module


def test_lora_is_refused_where_the_engine_or_rollout_lacks_it_and_names_what_has_it() -> None:
    from geartrain import plugins, register_rollout

    with pytest.raises(ConfigError) as err:
        _job(["actor.engine.backend=simple-test", "actor.lora.rank=16"])
    problem = dict(err.value.problems)["actor.engine.lora"]
    assert "'simple-test' engine does not support LoRA adapters" in problem and "'fsdp' engine" in problem
    register_rollout("nolora-test", _stub_rollout_without_lora())
    try:
        with pytest.raises(ConfigError) as err:
            _job(["actor.engine.backend=simple-test", "actor.lora.sync=adapter", "rollout.backend=nolora-test"])
        problems = dict(err.value.problems)
        assert "'nolora-test' rollout does not support LoRA" in problems["rollout.max_lora_rank"]
        assert "rollouts that do: torch" in problems["rollout.max_lora_rank"]
        assert "actor.lora.sync = 'merged'" in problems["rollout.max_lora_rank"]
    finally:
        plugins.unregister("rollout", "nolora-test")


def test_actor_lora_reaches_the_engine_and_an_adapter_sync_sizes_the_rollout() -> None:
    job = _job(["actor.lora.rank=16", "actor.lora.sync=adapter"], check_plugins=False)
    assert job.actor.engine.lora is job.actor.lora and job.actor.lora.rank == 16
    assert job.rollout.max_lora_rank == 16
    assert (
        _job(["actor.lora.rank=8"], check_plugins=False).rollout.max_lora_rank is None
    )  # merged: no LoRA in the rollout
    with pytest.raises(ConfigError, match="set LoRA once"):
        _job(["actor.lora.rank=8", "actor.engine.lora.rank=4"], check_plugins=False)


@pytest.mark.parametrize("extra", [["examples/arithmetic/grpo.toml"], ["trainer.total_steps=3"]])
def test_config_schema_refuses_a_job_file_or_overrides_it_would_ignore(
    extra: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """--schema describes every job's fields; a job file or overrides given with it were
    silently ignored (probe of issue 35, round 4), so the user thought they saw their job."""
    from geartrain import cli

    assert cli.main(["config", "--schema", *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert f"takes no job file or overrides (got {extra[0]}): drop --schema" in captured.err


def test_yaml_base_60_numbers_are_not_numbers(tmp_path: Path) -> None:
    """Issue 35 round 9 (probes 17, 20): YAML 1.1 read ``steps: 20:00`` as 1200 (base 60)
    without a word; a time-like value is now the string it is written as (YAML 1.2's and
    TOML's reading), so a number field refuses it with its path."""
    assert parse_override_value("20:00") == "20:00" and parse_override_value("1:30.5") == "1:30.5"
    assert parse_override_value("1_200") == 1200  # digit separators stay numbers
    with pytest.raises(ConfigError) as err:
        load_config(Job, write(tmp_path, "a.yaml", "steps: 20:00\nactor:\n  backend: simple-test\n"))
    assert "steps" in str(err.value) and "20:00" in str(err.value), err.value
    with pytest.raises(ConfigError, match="steps"):
        load_config(Job, write(tmp_path, "b.toml", "[actor]\nbackend = 'simple-test'\n"), ["steps=20:00"])
    assert load_config(Job, write(tmp_path, "c.yaml", "steps: 1_200\nactor:\n  backend: simple-test\n")).steps == 1200


@pytest.mark.parametrize(
    "key", ["data.path", "validation.path", "sft.path", "sft.dev_path", "model.path", "model.tokenizer"]
)
def test_an_empty_path_setting_is_named_as_empty_not_read_as_a_directory(key: str) -> None:
    """Issue 35 round 10 (lead's probe): ``validation.path=`` (an unset shell variable) was
    read as the job file's directory and refused as "a directory with no .jsonl ... files",
    far from its cause. Every optional path setting refuses an empty value by name."""
    from geartrain.trainer import load_train_config

    job = Path(__file__).resolve().parents[2] / "examples" / "arithmetic" / "grpo.toml"
    for empty in ("", "  "):
        with pytest.raises(ConfigError) as err:
            load_train_config(job, [f"{key}={empty}"], check_plugins=False)
        assert f"{key}: is empty (an unset shell variable?); give a path, or null for none" in str(err.value), err.value
    if key in ("validation.path", "model.tokenizer"):  # null is "none" for these
        assert load_train_config(job, [f"{key}=null"], check_plugins=False) is not None
