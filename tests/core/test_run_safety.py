"""A training job never loses a run: a fresh run into a directory holding one refuses,
nothing is deleted or truncated before every check has passed, and ``--resume`` compares
the new config with the run's (issue 10, items 1, 4 and 7).

These run the real job (:func:`geartrain.trainer.run_job`) up to the point where it would
build its first engine: every check in question happens before that, so no engine plugin
is needed (the core's environment has none).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pytest
from geartrain import CheckpointManager, ConfigError, GeartrainError
from geartrain.trainer import load_train_config, run_job
from geartrain.trainer.config_diff import diff_configs
from geartrain.trainer.rundir import SET_ASIDE, RunDirectory, RunDirectoryError

ROOT = Path(__file__).resolve().parents[2]
MAIN_CONFIG = ROOT / "examples" / "arithmetic" / "grpo.toml"
SMALL = ["trainer.total_steps=4", "sft.enabled=false", "trainer.progress=false"]


def _config(out: Path, *overrides: str):  # noqa: ANN202
    return load_train_config(MAIN_CONFIG, [*SMALL, f"trainer.output_dir={out}", *overrides], check_plugins=False)


def _finished_run(out: Path) -> dict[str, str]:
    """A run directory as a finished run leaves it; returns the SHA-256 of each file."""
    config = _config(out)
    out.mkdir(parents=True)
    (out / "config.json").write_text(config.model_dump_json(indent=2))
    (out / "metrics.jsonl").write_text(
        "".join(json.dumps({"phase": "rl", "step": s, "reward/mean": s / 4}) + "\n" for s in range(5))
    )
    mgr = CheckpointManager(out / "checkpoints" / "actor", keep_last=2)
    for step in (2, 4):
        mgr.save(step, lambda d, s=step: (d / "state.bin").write_bytes(bytes([s]) * 4096))
    return _tree(out)


def _tree(out: Path) -> dict[str, str]:
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }


def test_a_fresh_run_into_a_finished_run_refuses_and_changes_nothing(tmp_path: Path) -> None:
    # the probe: a typo in data.path, output_dir = a finished run, no --resume
    out = tmp_path / "run"
    before = _finished_run(out)
    with pytest.raises(RunDirectoryError) as err:
        run_job(_config(out, f"data.path={ROOT / 'examples/arithmetic/data/trian.jsonl'}"))
    message = str(err.value)
    assert "already holds a run" in message and "--resume" in message and "--overwrite" in message
    assert _tree(out) == before


def test_overwrite_deletes_nothing_until_every_check_passed(tmp_path: Path) -> None:
    out = tmp_path / "run"
    before = _finished_run(out)
    with pytest.raises(ConfigError, match="no such data file"):
        run_job(_config(out, "data.path=data/trian.jsonl"), overwrite=True)
    assert _tree(out) == before
    with pytest.raises(ConfigError, match="reward function file .*nope.py' does not exist"):
        run_job(_config(out, "reward.function=nope.py:score"), overwrite=True)
    assert _tree(out) == before


def test_overwrite_sets_aside_only_the_previous_runs_entries_and_deletes_them_at_commit(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _finished_run(out)
    (out / "notes.txt").write_text("mine")
    rundir = RunDirectory(out, overwrite=True)
    set_aside = rundir.claim()
    assert sorted(set_aside) == ["checkpoints", "config.json", "metrics.jsonl"]
    assert sorted(p.name for p in out.iterdir()) == [SET_ASIDE, ".geartrain.lock", "notes.txt"]  # the new run's lock
    assert sorted(p.name for p in (out / SET_ASIDE).iterdir()) == sorted(set_aside)
    assert rundir.commit()  # the new run's first step is done
    rundir.release()
    assert sorted(p.name for p in out.iterdir()) == [".geartrain.lock", "notes.txt"]


def test_overwrite_puts_the_previous_run_back_when_the_job_fails_after_its_checks(tmp_path: Path) -> None:
    """The probes' --overwrite findings (a tracker that fails to start, a starting model with
    NaN weights) were failures after the claim: the previous run was already deleted. Here
    the job fails at its first engine (the core's environment has no engine plugin)."""
    out = tmp_path / "run"
    before = _finished_run(out)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(GeartrainError, match="no engine named 'fsdp'"):
        run_job(_config(out), overwrite=True)
    after = {name: digest for name, digest in _tree(out).items() if name != ".geartrain.lock"}
    assert after == {**before, "notes.txt": hashlib.sha256(b"mine").hexdigest()}
    assert not (out / SET_ASIDE).exists()


def test_a_killed_overwrite_keeps_the_run_it_set_aside(tmp_path: Path) -> None:
    """A job killed before its first step leaves the previous run set aside and its own
    entries in place: the next --overwrite replaces the killed run's entries, keeps the set-aside
    run, and puts it back if it fails too; its first step deletes it."""
    out = tmp_path / "run"
    before = _finished_run(out)
    killed = RunDirectory(out, overwrite=True)
    killed.claim()
    (out / "metrics.jsonl").write_text('{"phase": "rl", "step": 0}\n')  # the killed run's
    killed.release()  # no commit, no restore: SIGKILL
    again = RunDirectory(out, overwrite=True)
    assert sorted(again.claim()) == ["checkpoints", "config.json", "metrics.jsonl"]
    assert not (out / "metrics.jsonl").exists()  # the killed run's own, never trained
    assert sorted(again.restore()) == ["checkpoints", "config.json", "metrics.jsonl"]
    again.release()
    assert {name: digest for name, digest in _tree(out).items() if name != ".geartrain.lock"} == before
    killed_early = RunDirectory(out, overwrite=True)
    killed_early.claim()
    killed_early.release()  # killed before it wrote anything: only the set-aside run is left
    with pytest.raises(RunDirectoryError, match=r"already holds a run \(\.geartrain-overwritten\)"):
        RunDirectory(out).check()  # a fresh run would delete the set-aside run at its first step
    last = RunDirectory(out, overwrite=True)
    last.claim()
    assert last.commit() and not (out / SET_ASIDE).exists() and not (out / "checkpoints").exists()
    last.release()


def test_resume_after_a_killed_overwrite_is_refused_and_deletes_nothing(tmp_path: Path) -> None:
    """Probe rerun for issue 35 item 2: an --overwrite stopped by SIGTERM right after it set
    the previous run aside, then ``train --resume``: the resume found no checkpoint of the
    stopped run, started from scratch, and its first step deleted the set-aside run (two
    checkpoints). Now it is refused, naming where that run is, and nothing moves; a job's
    commit deletes the set-aside run only when the job is an --overwrite."""
    out = tmp_path / "run"
    _finished_run(out)
    killed = RunDirectory(out, overwrite=True)
    killed.claim()
    (out / "config.json").write_text((out / SET_ASIDE / "config.json").read_text())  # the killed run's own
    (out / "metrics.jsonl").write_text('{"phase": "rl", "step": 0}\n')  # the killed run's
    killed.release()  # SIGTERM: no commit, no restore
    before = _tree(out)
    with pytest.raises(RunDirectoryError) as info:
        run_job(_config(out), resume=True)
    assert f"set aside in {out / SET_ASIDE} and was stopped before its first step" in str(info.value)
    assert "--overwrite again" in str(info.value) and "nothing was changed" in str(info.value)
    assert _tree(out) == before and (out / SET_ASIDE / "checkpoints").is_dir()
    resumed = RunDirectory(out, resume=True)
    assert not resumed.commit() and (out / SET_ASIDE / "checkpoints").is_dir()


def test_resume_and_overwrite_exclude_each_other(tmp_path: Path) -> None:
    with pytest.raises(RunDirectoryError, match="exclude each other"):
        RunDirectory(tmp_path, resume=True, overwrite=True).check()


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        (lambda out: out.write_text("x"), "is a file, not a directory"),
        (
            lambda out: (out.mkdir(), (out / "checkpoints").write_text("x")),
            "checkpoints is a file where geartrain keeps a directory",
        ),
        (lambda out: (out.mkdir(), (out / "metrics.jsonl").mkdir()), "metrics.jsonl is not a regular file"),
    ],
    ids=["output-dir-is-a-file", "checkpoints-is-a-file", "metrics-is-a-dir"],
)
def test_an_output_dir_entry_of_the_wrong_kind_is_one_clear_error(tmp_path: Path, setup, expected: str) -> None:  # noqa: ANN001
    out = tmp_path / "run"
    setup(out)
    before = _tree(out) if out.is_dir() else out.read_bytes()
    with pytest.raises(RunDirectoryError, match=expected) as err:
        run_job(_config(out))
    assert "\n" not in str(err.value)
    assert (_tree(out) if out.is_dir() else out.read_bytes()) == before


def _unwritable_dir(tmp_path: Path) -> Path:
    """A directory this process cannot write: a read-only one, or (as root, who may write
    anywhere) a directory on a read-only filesystem such as /proc/sys."""
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        return locked
    for candidate in (Path("/proc/sys"), Path("/sys/fs/cgroup")):
        if candidate.is_dir() and not os.access(candidate, os.W_OK):
            return candidate
    pytest.fail("found no unwritable directory to test with")


def test_an_unwritable_output_dir_is_one_clear_error(tmp_path: Path) -> None:
    out = _unwritable_dir(tmp_path) / "run"
    with pytest.raises(RunDirectoryError, match="is not writable") as err:
        run_job(_config(out))
    assert str(out) in str(err.value) and "\n" not in str(err.value)


def test_resume_lists_every_change_and_refuses_the_ones_that_cannot_apply(tmp_path: Path) -> None:
    out = tmp_path / "run"
    before = _finished_run(out)
    changed = _config(
        out, "actor.engine.optim.lr=1e-2", "model.config_overrides.hidden_size=64", "trainer.total_steps=6"
    )
    with pytest.raises(ConfigError) as err:
        run_job(changed, resume=True)
    message = str(err.value)
    # two refusals; the applied change and the way out are notes, not problems (probes6: "3 problem(s)" for one)
    assert "the config differs from the run's: 2 problem(s)\n" in message, message
    assert len(err.value.problems) == 2
    assert "actor.engine.optim.lr: 0.0003 -> 0.01: refused, the optimizer and LR schedule are restored" in message
    assert (
        "model.config_overrides.hidden_size: 128 -> 64: refused, the checkpoint holds this model's weights" in message
    )
    assert "trainer.total_steps: 4 -> 6 (applied" in message
    assert _tree(out) == before


def test_resume_with_total_steps_below_the_runs_step_is_refused(tmp_path: Path) -> None:
    """Probe of issue 35 (probes6): ``--resume trainer.total_steps=7`` on a run at step 10
    said 'takes effect from the next step', trained nothing and exported step 10 as 7's."""
    out = tmp_path / "run"
    before = _finished_run(out)  # its newest checkpoint: step 4
    with pytest.raises(ConfigError) as err:
        run_job(_config(out, "trainer.total_steps=3"), resume=True)
    assert err.value.problems == [
        (
            "trainer.total_steps",
            "3 is below the step this run already reached (4, its checkpoint step_00000004): nothing would train, "
            "and its export would be step 4's",
        )
    ]
    assert f"`geartrain export {out} DIR` exports it" in str(err.value)
    assert _tree(out) == before


def test_config_diff_verdicts() -> None:
    saved = _config(Path("out")).model_dump(mode="json")
    new = _config(
        Path("out"), "sampling.temperature=0.7", "data.batch_size=8", "trainer.seed=3", "validation.every_n_steps=5"
    ).model_dump(mode="json")
    verdicts = {c.key: c.verdict for c in diff_configs(saved, new)}
    assert verdicts == {
        "data.batch_size": "refused",
        "sampling.temperature": "applied",
        "trainer.seed": "refused",
        # the seeds that follow trainer.seed change with it (issue 19 item 7)
        "model.seed": "refused",
        "data.seed": "refused",
        # this job has no SFT warm start: its seed has no effect (issue 35, round 13)
        "sft.seed": "applied",
        "validation.every_n_steps": "applied",
    }
    assert diff_configs(saved, saved) == []


def test_errors_are_geartrain_errors() -> None:
    assert issubclass(RunDirectoryError, GeartrainError)  # the CLI prints them in one line, rc 2


def test_config_diff_refuses_a_different_lora_but_applies_its_sync_mode() -> None:
    saved = _config(Path("out"), "actor.lora.rank=16").model_dump(mode="json")
    new = _config(Path("out"), "actor.lora.rank=8", "actor.lora.sync=adapter").model_dump(mode="json")
    verdicts = {c.key: c.verdict for c in diff_configs(saved, new)}
    assert verdicts["actor.lora.rank"] == verdicts["actor.engine.lora.rank"] == "refused"
    assert verdicts["actor.lora.sync"] == verdicts["actor.engine.lora.sync"] == "applied"
    assert verdicts["rollout.max_lora_rank"] == "applied"
    reasons = {c.key: c.reason for c in diff_configs(saved, new)}
    assert "adapters of this rank" in reasons["actor.lora.rank"]


@pytest.mark.parametrize("overwrite", [True, False])
def test_a_config_json_no_run_wrote_is_never_taken_for_a_runs(tmp_path: Path, overwrite: bool) -> None:
    """Probe rerun for issue 35 item 2: ``train --overwrite`` with ``trainer.output_dir`` a
    Hugging Face model directory set the model's ``config.json`` aside as "the previous run's"
    and deleted it after the first step (a fresh run would have written over it)."""
    out = tmp_path / "model"
    out.mkdir()
    model_config = json.dumps({"model_type": "qwen2", "hidden_size": 64})
    (out / "config.json").write_text(model_config)
    (out / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(RunDirectoryError) as info:
        run_job(_config(out), overwrite=overwrite)
    assert str(info.value).startswith(f"{out / 'config.json'} is not a training run's config (a model's"), info.value
    assert "nothing was changed" in str(info.value)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert (out / "config.json").read_text() == model_config


@pytest.mark.parametrize("overwrite", [True, False])
def test_another_programs_checkpoints_are_never_taken_for_a_runs(tmp_path: Path, overwrite: bool) -> None:
    """Probe rerun for issue 35 item 2: a project directory with another tool's
    ``checkpoints/`` (and ``tensorboard/``, ``wandb/``) was refused as "already holds a run
    (checkpoints)"; with the --overwrite that message suggests, all three were set aside and
    deleted after the first step."""
    out = tmp_path / "project"
    for name, data in {"checkpoints/epoch=3.ckpt": "weights", "tensorboard/events": "tb", "wandb/run": "w"}.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(data)
    before = _tree(out)
    with pytest.raises(RunDirectoryError) as info:
        run_job(_config(out), overwrite=overwrite)
    assert str(info.value).startswith(f"{out / 'checkpoints'} holds what no training run saved there (epoch=3.ckpt"), (
        info.value
    )
    assert _tree(out) == before


def test_another_programs_metrics_jsonl_is_never_taken_for_a_runs(tmp_path: Path) -> None:
    """The same probe with a ``metrics.jsonl`` another program wrote (lines without a step)."""
    out = tmp_path / "project"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"epoch": 1, "loss": 0.5}\n')
    with pytest.raises(RunDirectoryError, match="metrics.jsonl is not a training run's metrics"):
        run_job(_config(out), overwrite=True)
    assert (out / "metrics.jsonl").read_text() == '{"epoch": 1, "loss": 0.5}\n'
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]


def _finished_run_with(out: Path, *overrides: str) -> None:
    """:func:`_finished_run` whose config.json has ``overrides``."""
    _finished_run(out)
    (out / "config.json").write_text(_config(out, *overrides).model_dump_json(indent=2))


@pytest.mark.parametrize(
    ("overrides", "entry"),
    [
        ([], "wandb/run-1/files"),  # the run's loggers: tensorboard only
        ([], "mlruns/0/meta.yaml"),
        (["trainer.tensorboard=false"], "tensorboard/events.out.tfevents.1"),
        (["trainer.export_hf=false"], "hf/model.safetensors"),
        (["trainer.loggers=[mlflow]", "trainer.mlflow_tracking_uri=http://127.0.0.1:1"], "mlruns/0/meta.yaml"),
    ],
)
@pytest.mark.parametrize("mode", ["overwrite", "resume"])
def test_another_programs_logs_or_model_next_to_a_run_are_never_taken_for_its(
    tmp_path: Path, overrides: list[str], entry: str, mode: str
) -> None:
    """Probe for issue 35 item 2 (probes2's leftover): ``hf/``, ``tensorboard/``, ``wandb/``
    and ``mlruns/`` next to a finished run were set aside and deleted by ``--overwrite``
    whoever wrote them; the run's config.json says which of them it writes."""
    out = tmp_path / "run"
    _finished_run_with(out, *overrides)
    (out / entry).parent.mkdir(parents=True, exist_ok=True)
    (out / entry).write_text("not geartrain's")
    before = _tree(out)
    name = entry.split("/")[0]
    with pytest.raises(RunDirectoryError) as info:
        run_job(_config(out), **{mode: True})
    assert str(info.value).startswith(f"{out / name} holds what no training run wrote there"), info.value
    assert "nothing was changed" in str(info.value)
    assert _tree(out) == before


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ("hf/config.json", "no geartrain export wrote it"),
        ("tensorboard/events.out.tfevents.1", "no run's config.json there accounts for it"),
        ("mlruns/0/meta.yaml", "no run's config.json there accounts for it"),
    ],
)
def test_a_project_directorys_model_or_logs_without_a_run_are_never_taken_for_a_runs(
    tmp_path: Path, entry: str, why: str
) -> None:
    out = tmp_path / "project"
    (out / entry).parent.mkdir(parents=True)
    (out / entry).write_text("another program's")
    before = _tree(out)
    with pytest.raises(RunDirectoryError) as info:
        run_job(_config(out), overwrite=True)
    assert str(info.value).startswith(f"{out / entry.split('/')[0]} holds what no training run wrote there ({why}")
    assert _tree(out) == before


@pytest.mark.parametrize("mode", ["overwrite", "resume"])
def test_a_run_whose_config_json_is_gone_is_refused_naming_config_json(tmp_path: Path, mode: str) -> None:
    """Probe of issue 35 (probes6): with config.json deleted, the refusal blamed the run's
    own tensorboard/ ('another program's?') and never named the missing file."""
    out = tmp_path / "run"
    _finished_run_with(out, "trainer.loggers=[tensorboard]")
    (out / "tensorboard").mkdir(exist_ok=True)
    (out / "tensorboard" / "events.out.tfevents.1").write_text("the run's")
    (out / "config.json").unlink()
    before = _tree(out)
    with pytest.raises(RunDirectoryError) as info:
        run_job(_config(out), **{mode: True})
    message = str(info.value)
    assert message.startswith(f"{out} holds a run (metrics.jsonl, checkpoints"), message
    assert "whose config.json is missing" in message
    assert "Put the run's config.json back, or move tensorboard/ away" in message
    assert _tree(out) == before


def test_a_runs_own_logs_and_export_are_its_to_overwrite(tmp_path: Path) -> None:
    """The other side: what the run's config says it writes, and an ``hf/`` with an export
    record (also ``geartrain export`` into a run made with export_hf = false), are its."""
    out = tmp_path / "run"
    _finished_run_with(out, "trainer.loggers=[tensorboard,wandb,mlflow]", "trainer.export_hf=false")
    for entry in ("tensorboard/events.out.tfevents.1", "wandb/run-1/files", "mlruns/0/meta.yaml"):
        (out / entry).parent.mkdir(parents=True, exist_ok=True)
        (out / entry).write_text("the run's")
    (out / "hf").mkdir()
    (out / "hf" / "model.safetensors").write_text("weights")
    (out / "hf" / ".geartrain-export.json").write_text('{"step": 4, "files": ["model.safetensors"]}')
    RunDirectory(out, overwrite=True).check()
    RunDirectory(out, resume=True).check()


def test_a_dangling_symlink_as_output_dir_or_export_target_is_named_as_such(tmp_path: Path) -> None:
    """Probe rerun for issue 35 items 4 and 11 (probes3): ``geartrain export RUN LINK`` with a
    symbolic link to a path that does not exist said 'LINK is a file, not a directory'."""
    from geartrain.trainer.export import ExportError, check_target

    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere" / "x")
    expected = f"is a symbolic link to {tmp_path / 'nowhere' / 'x'}, which does not exist; choose another"
    with pytest.raises(RunDirectoryError, match=re.escape(expected)):
        RunDirectory(link).check()
    run = tmp_path / "run"
    (run / "checkpoints" / "actor" / "step_00000001").mkdir(parents=True)
    with pytest.raises(ExportError, match=re.escape(expected)):
        check_target(link, run, run / "checkpoints" / "actor" / "step_00000001", overwrite=False)
    assert not (tmp_path / "nowhere").exists()


def test_export_of_a_run_stopped_before_its_first_checkpoint_says_so(tmp_path: Path) -> None:
    """Probe 53 of issue 35 round 7: ``geartrain export RUN DIR`` of a run interrupted in
    its SFT warm start (no checkpoints/ yet) said "cut off mid-write or not a geartrain
    checkpoint"; a checkpoint-less run is named as such."""
    from geartrain.errors import CheckpointError
    from geartrain.trainer.export import run_of

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"trainer": {}, "actor": {}}')
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(CheckpointError, match="is a run directory that holds no checkpoint yet: nothing to export"):
        run_of(run)
    (run / "checkpoints" / "actor").mkdir(parents=True)  # created, nothing saved in it yet
    with pytest.raises(CheckpointError, match="holds no complete checkpoint to export"):
        run_of(run)


@pytest.mark.parametrize("damage", ["cut", "not-utf8"])
@pytest.mark.parametrize("mode", ["resume", "overwrite"])
def test_a_runs_damaged_config_json_is_called_damaged_not_another_programs(
    tmp_path: Path, damage: str, mode: str
) -> None:
    """Probe 48 of issue 35's round 8: the run's own config.json cut off by 40 bytes made
    ``--resume`` say "not a training run's config (a model's, or another program's file) ...
    choose another output_dir", sending the user away from a run that is still there."""
    out = tmp_path / "run"
    (out / "checkpoints" / "actor").mkdir(parents=True)
    text = _config(out).model_dump_json(indent=2)
    data = text[:-40].encode() if damage == "cut" else text.encode().replace(b'"actor"', b'"act\xffor"', 1)
    (out / "config.json").write_bytes(data)
    with pytest.raises(RunDirectoryError) as info:
        run_job(_config(out), **{mode: True})
    message = str(info.value)
    assert message.startswith(f"{out / 'config.json'} is not readable JSON ("), message
    bad_byte = text.encode().index(b'"actor"') + 4
    if damage == "not-utf8":
        why = f"(byte {bad_byte} is not UTF-8)"
    else:  # where the cut lands depends on the path's length; json names its own reason
        with pytest.raises(json.JSONDecodeError) as decode:
            json.loads(data)
        why = f"({decode.value})"
    assert f"JSON {why}" in message and "cut off or edited by hand? Nothing was changed" in message, message
    assert "geartrain config <job file> [overrides] --json >" in message and "another program" not in message
    assert (out / "config.json").read_bytes() == data
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "config.json"]


def test_a_table_empty_before_is_no_difference_of_its_own() -> None:
    """Issue 35, round 12: --resume with model.config_overrides={hidden_size=64} listed a false
    difference ``model.config_overrides: {} -> "<not set>"`` beside the real one."""
    changes = diff_configs({"model": {"config_overrides": {}}}, {"model": {"config_overrides": {"hidden_size": 64}}})
    assert [c.line().split(" (")[0] for c in changes] == ['model.config_overrides.hidden_size: "<not set>" -> 64']
    assert diff_configs({"model": {"config_overrides": {}}}, {"model": {"config_overrides": {}}}) == []
