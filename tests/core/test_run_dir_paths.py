"""Output directories and export targets that a hostile or unlucky user gives (issue 35,
probes6): under a symbolic link that leads nowhere, and run directories whose permissions
forbid what the job will do only later (save into ``checkpoints/actor`` after hours of
training, delete the previous run at the first step of an ``--overwrite``). Each was a
traceback, exit 1; each is one line before anything changes.

The permission cases run the check in a child process without the capabilities that let
root ignore permissions (``setpriv``), or as they are when not root.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from geartrain import CheckpointManager
from geartrain.manifest import verify_manifest, write_manifest
from geartrain.trainer.export import ExportError, check_target
from geartrain.trainer.rundir import SET_ASIDE, RunDirectory, RunDirectoryError

ROOT = Path(__file__).resolve().parents[2]


def _run(out: Path) -> Path:
    """A finished run's directory: its config, metrics and two checkpoints."""
    (out / "checkpoints" / "actor").mkdir(parents=True)
    (out / "config.json").write_text('{"trainer": {}, "actor": {}}')
    (out / "metrics.jsonl").write_text('{"phase": "rl", "step": 0}\n')
    mgr = CheckpointManager(out / "checkpoints" / "actor", keep_last=2)
    for step in (2, 4):
        mgr.save(step, lambda d, s=step: (d / "state.bin").write_bytes(bytes([s]) * 64))
    return out


@pytest.mark.parametrize("under", ["loop", "dangling"])
def test_an_output_dir_or_export_target_under_a_link_that_leads_nowhere_is_one_line(tmp_path: Path, under: str) -> None:
    """``trainer.output_dir=LOOP/sub`` was a 28-line ``OSError: Too many levels of symbolic
    links``; ``DANGLING/sub`` a 37-line ``FileExistsError``; ``geartrain export RUN LOOP`` a
    ``RuntimeError: Symlink loop`` from ``Path.resolve``; ``export RUN DANGLING/sub`` said
    'File exists'. A loop given itself was said to be a link 'which does not exist'."""
    link = tmp_path / "link"
    if under == "loop":
        other = tmp_path / "other"
        link.symlink_to(other)
        other.symlink_to(link)
        said = f"{link} is a symbolic link to {other} that leads back to itself (a loop of symbolic links)"
    else:
        link.symlink_to(tmp_path / "nowhere")
        said = f"{link} is a symbolic link to {tmp_path / 'nowhere'}, which does not exist"
    for out in (link, link / "sub", link / "sub" / "run"):
        with pytest.raises(RunDirectoryError) as err:
            RunDirectory(out).check()
        text = str(err.value)
        assert "\n" not in text and said.split(" is ", 1)[1] in text and "choose another trainer.output_dir" in text
        if out != link:
            assert f"trainer.output_dir '{out}' cannot be created: {said}" in text
    run = _run(tmp_path / "run")
    checkpoint = run / "checkpoints" / "actor" / "step_00000004"
    for out in (link, link / "sub"):
        with pytest.raises(ExportError) as err:
            check_target(out, run, checkpoint, overwrite=False)
        assert "\n" not in str(err.value) and said.split(" is ", 1)[1] in str(err.value)
    assert not (tmp_path / "nowhere").exists()


def test_an_output_dir_or_export_target_too_long_for_its_filesystem_is_one_line(tmp_path: Path) -> None:
    """Probes7 (issue 35): ``trainer.output_dir`` with a 300-character name was a 47-line
    ``OSError: [Errno 36] File name too long``, exit 1 (raised again inside the full-disk
    check of the error path); so was an export there. One line, nothing created."""
    name_max = os.pathconf(tmp_path, "PC_NAME_MAX")
    long = tmp_path / ("x" * (name_max + 1))
    for out in (long, long / "run"):
        with pytest.raises(RunDirectoryError) as err:
            RunDirectory(out).check()
        assert str(err.value) == (
            f"trainer.output_dir '{out}' has a name of {name_max + 1} bytes, longer than the {name_max} its "
            "filesystem takes; choose another trainer.output_dir"
        )
    deep = tmp_path.joinpath(*["d" * 200] * 25)  # every name fits, the whole does not
    with pytest.raises(RunDirectoryError, match="bytes long, longer than the system's"):
        RunDirectory(deep).check()
    RunDirectory(tmp_path / ("x" * name_max)).check()  # the longest name that fits is fine
    run = _run(tmp_path / "run")
    with pytest.raises(ExportError) as err:
        check_target(long / "hf", run, run / "checkpoints" / "actor" / "step_00000004", overwrite=False)
    assert "\n" not in str(err.value) and f"longer than the {name_max} its filesystem takes" in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def _unprivileged() -> list[str]:
    """The command prefix that runs a child which respects file permissions."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("root without setpriv: file permissions cannot be made to apply")
    return [setpriv, "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--"]


def _in_child(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "core" / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [*_unprivileged(), sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )


def _check(out: Path, mode: str) -> str:
    """The check of ``out`` as the job of ``mode`` runs it: ``ok`` or the error's line."""
    code = (
        "from geartrain.trainer.rundir import RunDirectory, RunDirectoryError\n"
        f"try:\n    RunDirectory({str(out)!r}, **{{{mode!r}: True}}).check()\n    print('ok')\n"
        "except RunDirectoryError as exc:\n    print(exc)\n"
    )
    done = _in_child(code)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _check_with_mode(out: Path, mode: str, path: Path, permissions: int) -> str:
    """:func:`_check` while ``path`` has ``permissions`` (restored to 0o755 afterwards)."""
    path.chmod(permissions)
    try:
        return _check(out, mode)
    finally:
        path.chmod(0o755)


def test_a_resume_into_a_role_directory_it_cannot_write_is_one_line_before_training(tmp_path: Path) -> None:
    """``chmod 555 <run>/checkpoints/actor`` then ``--resume``: the run trained its steps, then
    its save died in a 45-line ``PermissionError`` (exit 1). A ``checkpoints/`` it cannot
    list was a 32-line one at once."""
    out = _run(tmp_path / "run")
    role = out / "checkpoints" / "actor"
    line = _check_with_mode(out, "resume", role, 0o555)
    assert line.startswith(f"{role} is not readable and writable") and "fix its permissions" in line
    line = _check_with_mode(out, "resume", out / "checkpoints", 0o300)
    assert line.startswith(f"{out / 'checkpoints'} cannot be read")
    step = role / "step_00000004"
    line = _check_with_mode(out, "resume", step, 0o000)
    assert line.startswith(f"{step} cannot be read")
    assert _check(out, "resume") == "ok"


def test_an_overwrite_that_could_not_delete_the_previous_run_is_refused_before_it_moves_anything(
    tmp_path: Path,
) -> None:
    """``chmod 555 <run>/checkpoints/actor`` then ``--overwrite``: the previous run was set
    aside, the new run trained its first step, and deleting the previous run died in a
    ``PermissionError`` traceback (exit 1), half of it deleted, the new run stopped and its
    directory one that ``--resume`` refuses."""
    out = _run(tmp_path / "run")
    role = out / "checkpoints" / "actor"
    line = _check_with_mode(out, "overwrite", role, 0o555)
    assert line.startswith(f"{role} cannot be emptied (its permissions deny it)") and "nothing was changed" in line
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "config.json", "metrics.jsonl"]
    assert _check(out, "overwrite") == "ok"


def test_a_failed_deletion_at_the_commit_does_not_stop_the_new_run(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """What the check cannot see (a file made undeletable after it) leaves the rest set aside
    and says why, instead of ending the new run with a traceback."""
    out = _run(tmp_path / "run")
    rundir = RunDirectory(out, overwrite=True)
    rundir.check()
    rundir.claim()

    def refuse(path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr("geartrain.trainer.rundir.shutil.rmtree", refuse)
    assert rundir.commit()
    rundir.release()
    assert rundir.not_deleted == f"Permission denied ({out / SET_ASIDE})"
    assert (out / SET_ASIDE / "checkpoints").is_dir()


def test_a_checkpoint_file_that_cannot_be_read_is_named_as_damaged(tmp_path: Path) -> None:
    """A checkpoint file without read permission made ``--resume`` a 39-line
    ``PermissionError`` from the manifest's hashing; it is named, and the resume falls back
    as for any damaged file."""
    step = tmp_path / "step_00000004"
    step.mkdir()
    (step / "trainer.pt").write_bytes(b"x" * 64)
    write_manifest(step)
    (step / "trainer.pt").chmod(0o000)
    code = f"from geartrain.manifest import verify_manifest\nprint(verify_manifest({str(step)!r}))\n"
    done = _in_child(code)
    (step / "trainer.pt").chmod(0o644)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['trainer.pt cannot be read (Permission denied)']"
    assert verify_manifest(step) == []


@pytest.mark.parametrize(
    "override",
    [
        "trainer.total_steps=true",
        "sampling.temperature=false",
        "actor.engine.optim.lr=true",
        "actor.engine.optim.betas=[true,0.9]",
    ],
)
def test_a_bool_given_for_a_number_is_refused(override: str) -> None:
    """``trainer.total_steps=true`` trained one step and ``sampling.temperature=false``
    sampled greedily, silently: pydantic's lax mode reads true and false as 1 and 0."""
    from geartrain.errors import ConfigError
    from geartrain.trainer import load_train_config

    with pytest.raises(ConfigError, match="should be a number, not (true|false)"):
        load_train_config(ROOT / "examples" / "arithmetic" / "grpo.toml", [override], check_plugins=False)
    load_train_config(ROOT / "examples" / "arithmetic" / "grpo.toml", ["trainer.progress=false"], check_plugins=False)
    config = load_train_config(
        ROOT / "examples" / "arithmetic" / "grpo.toml", ["actor.engine.optim.betas=[0.8,0.99]"], check_plugins=False
    )
    assert config.actor.engine.optim.betas == (0.8, 0.99)


@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_output_dir_is_refused_not_the_working_directory(value: str) -> None:
    """Issue 35 round 7 (probes7): `trainer.output_dir=` (an unset shell variable:
    `trainer.output_dir=$OUT`) was taken as '' and the run wrote its checkpoints, export and
    metrics into the working directory, beside whatever was there, with no word."""
    from geartrain.config import SectionError
    from geartrain.trainer.config import TrainerConfig

    with pytest.raises(SectionError, match="output_dir: is empty"):
        TrainerConfig(output_dir=value)
    assert TrainerConfig(output_dir=".").output_dir == "."  # the working directory, said so, stays allowed


def test_an_output_dir_not_utf8_is_refused_before_anything_is_written() -> None:
    """Issue 35 round 8 (probes8): `trainer.output_dir=$'runs/bad\\xffname'` (a name in
    another encoding, read by Python as a surrogate escape) ended `geartrain train` with a
    25-line PydanticSerializationError traceback (UnicodeEncodeError writing config.json),
    exit 1, after creating the directory and its lock."""
    from geartrain.config import SectionError
    from geartrain.trainer.config import TrainerConfig

    with pytest.raises(SectionError, match="output_dir: holds a byte that is not UTF-8 \\(0xff at character 9\\)"):
        TrainerConfig(output_dir="runs/bad\udcffname")
    assert TrainerConfig(output_dir="runs/ünï cødé").output_dir == "runs/ünï cødé"


def test_a_tilde_output_dir_is_the_home_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Issue 35, round 11: ``trainer.output_dir='~/tt'`` (quoted, so no shell expanded it) was
    a directory named '~' under the working directory, where ``data.path='~/x'`` was the home
    directory's file."""
    from geartrain.trainer.config import load_train_config

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    main_job = ROOT / "examples" / "arithmetic" / "grpo.toml"
    config = load_train_config(main_job, ["trainer.output_dir=~/runs/a"], check_plugins=False)
    assert config.trainer.output_dir == str(tmp_path / "home" / "runs" / "a")
    assert config.resolve("~/d.jsonl") == str(tmp_path / "home" / "d.jsonl")


def test_a_tilde_of_an_unknown_user_is_a_path_like_another(monkeypatch: pytest.MonkeyPatch) -> None:
    """``~nosuchuser/...`` (or ``~`` with no home directory to be found) stays as written,
    to be refused as a missing path: pathlib's expanduser raised RuntimeError there."""
    from geartrain.trainer.config import load_train_config

    main_job = ROOT / "examples" / "arithmetic" / "grpo.toml"
    config = load_train_config(main_job, ["trainer.output_dir=~nosuchuser_gt/run"], check_plugins=False)
    assert config.trainer.output_dir == "~nosuchuser_gt/run"
    assert config.resolve("~nosuchuser_gt/d.jsonl") == str(main_job.parent / "~nosuchuser_gt" / "d.jsonl")
