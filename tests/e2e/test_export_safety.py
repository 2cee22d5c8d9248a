"""``geartrain export`` runs no code from a run directory and destroys nothing (issue 35,
items 1, 4, 5 and 11): it builds from what the checkpoint records (its ``engine.json``),
refuses ``trust_remote_code`` from a run unless told on the command line, refuses a
non-empty target unless ``--overwrite`` (then removes only its own files), never writes
into a run or checkpoint directory, says when it falls back from a damaged newest
checkpoint and records the step it exported; a file or read-only target is one line; a
full disk during a run's final export is one line (item 6)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from e2e_helpers import MAIN_CONFIG, run_geartrain
from geartrain.cli import main
from geartrain.manifest import write_manifest

RUN = [
    "sft.enabled=false",
    "trainer.progress=false",
    "trainer.plot=false",
    "trainer.tensorboard=false",
    "trainer.export_hf=false",
    "trainer.total_steps=2",
    "trainer.save_every=1",
    "validation.every_n_steps=0",
    "validation.max_prompts=8",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("export-safety") / "run"
    proc = run_geartrain("train", str(MAIN_CONFIG), *RUN, f"trainer.output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture
def run(trained: Path, tmp_path: Path) -> Path:
    """A copy of the trained run, for a test to tamper with."""
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


@pytest.fixture
def geartrain(capsys: pytest.CaptureFixture[str]):  # noqa: ANN201
    """``geartrain ARGS`` through the CLI's entry point, in this process: (rc, stdout, stderr)."""

    def call(*args: str) -> subprocess.CompletedProcess[str]:
        capsys.readouterr()
        rc = main(list(args))
        out = capsys.readouterr()
        return subprocess.CompletedProcess(["geartrain", *args], rc, out.out, out.err)

    return call


def _step(run: Path, n: int) -> Path:
    return run / "checkpoints" / "actor" / f"step_{n:08d}"


def _evil_model(tmp_path: Path) -> tuple[Path, Path]:
    """A model directory whose config names a Python file (``auto_map``) that leaves a marker
    when it runs."""
    evil, marker = tmp_path / "evil", tmp_path / "code-ran"
    evil.mkdir()
    (evil / "config.json").write_text(json.dumps({"model_type": "evil", "auto_map": {"AutoConfig": "evil.Cfg"}}))
    (evil / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\nclass Cfg: pass\n")
    return evil, marker


def _point_config_at(run: Path, model: Path) -> None:
    config = json.loads((run / "config.json").read_text())
    config["model"] = {"path": str(model), "trust_remote_code": True}
    (run / "config.json").write_text(json.dumps(config))


def _one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    return done.stderr


def test_export_builds_from_the_checkpoint_not_from_the_runs_config(
    run: Path, tmp_path: Path, geartrain, trained: Path
) -> None:  # noqa: ANN001
    from safetensors.torch import load_file

    evil, marker = _evil_model(tmp_path)
    _point_config_at(run, evil)
    done = geartrain("export", str(run), str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert not marker.exists()
    assert done.stdout.strip().endswith(f"exported step 2 of {run} to {tmp_path / 'out'}")
    # the weights are the checkpoint's: a second export of the untouched run gives the same tensors
    assert geartrain("export", str(trained), str(tmp_path / "clean")).returncode == 0
    a, b = (
        load_file(str(tmp_path / "out" / "model.safetensors")),
        load_file(str(tmp_path / "clean" / "model.safetensors")),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_old_checkpoint_without_a_record_takes_no_trust_remote_code_from_the_run(
    run: Path, tmp_path: Path, geartrain
) -> None:  # noqa: ANN001
    evil, marker = _evil_model(tmp_path)
    _point_config_at(run, evil)
    for step in (run / "checkpoints" / "actor").glob("step_*"):  # as an older geartrain saved them:
        (step / "engine.json").unlink()  # no engine.json, and a manifest to match
        (step / "COMPLETE").unlink()
        write_manifest(step, exclude=frozenset({"COMPLETE"}))
        (step / "COMPLETE").write_text("")
    text = _one_line_error(geartrain("export", str(run), str(tmp_path / "out")))
    assert f"the run sets model.trust_remote_code for {evil}: export runs no code from a run directory" in text
    assert "--trust-remote-code" in text and not marker.exists() and not (tmp_path / "out").exists()


def test_export_never_writes_into_a_run_or_a_checkpoint(run: Path, geartrain) -> None:  # noqa: ANN001
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for target in (run, _step(run, 2), _step(run, 1) / "sub", run / "checkpoints"):
        text = _one_line_error(geartrain("export", str(_step(run, 2)), str(target), "--overwrite"))
        assert "choose" in text, text
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_a_non_empty_target_needs_overwrite_which_removes_only_an_exports_files(
    trained: Path, tmp_path: Path, geartrain
) -> None:  # noqa: ANN001
    out = tmp_path / "step_00000001"  # named like a checkpoint, but a user's directory: a fine target
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    text = _one_line_error(geartrain("export", str(trained), str(out)))
    assert "is not empty (1 entries, e.g. notes.txt); nothing was written. Pass --overwrite" in text
    text = _one_line_error(geartrain("export", str(trained), str(out), "--overwrite"))
    assert "holds files no geartrain export wrote there (notes.txt)" in text
    assert (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    assert geartrain("export", str(_step(trained, 1)), str(out)).returncode == 0
    # a file an earlier export wrote (here: a LoRA export's adapter) goes with --overwrite
    (out / "adapter_config.json").write_text("{}")
    record = json.loads((out / ".geartrain-export.json").read_text())
    record["files"].append("adapter_config.json")
    (out / ".geartrain-export.json").write_text(json.dumps(record))
    assert geartrain("export", str(trained), str(out), "--overwrite").returncode == 0
    assert not (out / "adapter_config.json").exists()
    assert json.loads((out / ".geartrain-export.json").read_text())["step"] == 2


def test_a_damaged_newest_checkpoint_is_said_and_the_exported_step_recorded(
    run: Path, tmp_path: Path, geartrain
) -> None:  # noqa: ANN001
    victim = max(
        (p for p in _step(run, 2).rglob("*") if p.is_file() and p.suffix == ".distcp"), key=lambda p: p.stat().st_size
    )
    victim.write_bytes(b"\0" * victim.stat().st_size)
    done = geartrain("export", str(run), str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert f"checkpoint {_step(run, 2)} is damaged: " in done.stdout
    assert "falling back to the previous checkpoint" in done.stdout
    assert f"exported step 1 of {run}" in done.stdout
    assert json.loads((tmp_path / "out" / ".geartrain-export.json").read_text())["step"] == 1
    assert "- steps: 1" in (tmp_path / "out" / "README.md").read_text()


def test_a_file_or_read_only_target_is_one_line(trained: Path, tmp_path: Path, geartrain) -> None:  # noqa: ANN001
    target = tmp_path / "a-file"
    target.write_text("x")
    assert "is a file, not a directory" in _one_line_error(geartrain("export", str(trained), str(target)))
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"], check=False).returncode:
        return  # no user namespaces here: the read-only case needs a mount
    ro = tmp_path / "ro"
    ro.mkdir()
    import sys

    script = f'mount --bind "{ro}" "{ro}" && mount -o remount,ro,bind "{ro}" "{ro}" && exec "$@"'
    done = subprocess.run(
        [
            "unshare",
            "-rm",
            "sh",
            "-c",
            script,
            "sh",
            sys.executable,
            "-m",
            "geartrain.cli",
            "export",
            str(trained),
            str(ro / "out"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert "is on a read-only file system" in _one_line_error(done)


def _blocks(root: Path, skip: str | None = None) -> int:
    """Bytes ``root``'s files take on a tmpfs (whole 4 KiB pages), leaving out ``skip``."""
    return sum(
        -(-p.stat().st_size // 4096) * 4096
        for p in root.rglob("*")
        if p.is_file() and (skip is None or skip not in p.relative_to(root).parts)
    )


def test_a_full_disk_during_the_final_export_is_one_line_and_keeps_the_checkpoint(tmp_path: Path) -> None:
    # issue 35 item 6: the final HF export on a full disk was a traceback, its partial files left
    job = [*RUN[:4], "trainer.export_hf=true", "trainer.total_steps=1", "trainer.save_every=0"]
    job += ["validation.every_n_steps=0", "validation.max_prompts=8"]
    sizing = tmp_path / "sizing"
    done = run_geartrain("train", str(MAIN_CONFIG), *job, f"trainer.output_dir={sizing}")
    assert done.returncode == 0, done.stderr[-3000:]
    before, export = _blocks(sizing, skip="hf"), _blocks(sizing / "hf")
    disk = tmp_path / "disk"
    disk.mkdir()
    size = before + export // 2 + 64 * 1024  # room for everything but half the export
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.decode().strip()})")
    try:
        out = disk / "run"
        done = run_geartrain("train", str(MAIN_CONFIG), *job, f"trainer.output_dir={out}")
        assert done.returncode == 2, done.stderr[-3000:]
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith(
            f"error: no space left on tmpfs (mounted at {disk}) while exporting the model to {out / 'hf'}"
        )
        assert "Traceback" not in done.stderr and not (out / "hf").exists()
        assert (out / "checkpoints" / "actor" / "step_00000001" / "COMPLETE").is_file()
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_trust_remote_code_refusal_names_the_tokenizer_it_is_for(run: Path, tmp_path: Path, geartrain) -> None:  # noqa: ANN001
    """Rerun on the checkpoint's own record: a base model that sets ``trust_remote_code``
    for its tokenizer only (no ``path``) was refused "for None"."""
    evil, marker = _evil_model(tmp_path)
    step = _step(run, 2)
    record = json.loads((step / "engine.json").read_text())
    record["base_model"] = {**record["base_model"], "tokenizer": str(evil), "trust_remote_code": True}
    (step / "engine.json").write_text(json.dumps(record))
    (step / "COMPLETE").unlink()
    write_manifest(step, exclude=frozenset({"COMPLETE"}))  # a manifest to match: the edit hides itself
    (step / "COMPLETE").write_text("")
    text = _one_line_error(geartrain("export", str(run), str(tmp_path / "out")))
    assert f"the run sets model.trust_remote_code for {evil}: export runs no code" in text, text
    assert not marker.exists()


def test_a_target_inside_another_run_is_refused(run: Path, trained: Path, geartrain) -> None:  # noqa: ANN001
    """Rerun on another run: exporting into a new directory inside a different run's output
    directory was allowed (into the source run's own it is refused)."""
    text = _one_line_error(geartrain("export", str(trained), str(run / "exported")))
    assert f"the export target {run / 'exported'} is inside the training run {run}" in text, text
    assert not (run / "exported").exists()


def _record_model(step: Path, model: Path) -> None:
    """Rewrite the checkpoint's record as if it was trained from the local model ``model``
    (its manifest rewritten to match)."""
    record = json.loads((step / "engine.json").read_text())
    for key in ("model", "base_model"):
        record[key] = {**record[key], "path": str(model), "tiny": None, "config_overrides": {}}
    (step / "engine.json").write_text(json.dumps(record))
    (step / "COMPLETE").unlink()
    write_manifest(step, exclude=frozenset({"COMPLETE"}))
    (step / "COMPLETE").write_text("")


def test_the_model_a_checkpoint_was_trained_from_is_never_a_target(
    run: Path, trained: Path, tmp_path: Path, geartrain
) -> None:  # noqa: ANN001
    """Probe rerun for items 4 and 1: a run trained from a local model that is an earlier
    geartrain export (here: the model's own directory, recorded in the checkpoint), exported
    with ``--overwrite`` into that directory, replaced the model the run's checkpoints need
    (its ``--resume`` then failed: 'Unrecognized model'). A recorded model directory that
    cannot be read was a traceback of the engine's load, exit 1."""
    base = tmp_path / "base"
    assert geartrain("export", str(trained), str(base)).returncode == 0
    before = {p.name: p.read_bytes() for p in base.iterdir()}
    _record_model(_step(run, 2), base)
    text = _one_line_error(geartrain("export", str(run), str(base), "--overwrite"))
    assert f"the export target {base} is the model this checkpoint was trained from ({base}" in text, text
    assert {p.name: p.read_bytes() for p in base.iterdir()} == before
    assert geartrain("export", str(run), str(tmp_path / "elsewhere")).returncode == 0  # from that model, elsewhere
    (base / "model.safetensors").rename(tmp_path / "moved.safetensors")
    (base / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"lm_head.weight": "model-00001-of-00001.safetensors"}})
    )
    text = _one_line_error(geartrain("export", str(run), str(tmp_path / "out")))
    assert f"the checkpoint was built from model.path {base} (its engine.json), which cannot be read here: " in text
    assert "model-00001-of-00001.safetensors): the model is incomplete" in text, text


def test_a_target_the_file_system_refuses_is_one_line_with_its_cause(trained: Path, geartrain) -> None:  # noqa: ANN001
    """Probe rerun for item 11: a target under /proc was reported as 'no space left on proc'."""
    text = _one_line_error(geartrain("export", str(trained), "/proc/geartrain-export"))
    assert text.startswith("error: cannot write the export to /proc/geartrain-export: No such file or directory"), text


@pytest.mark.parametrize("existed", [False, True])
def test_an_interrupted_export_leaves_nothing_behind(
    run: Path,
    tmp_path: Path,
    geartrain,
    monkeypatch: pytest.MonkeyPatch,
    existed: bool,  # noqa: ANN001
) -> None:
    # probes4: Ctrl-C after the weights were written left config.json and model.safetensors
    # without the export's record, which the next export (even with --overwrite) refused as
    # foreign files; now the partial export goes and the same command runs again
    import geartrain.trainer.export as export_module

    target = tmp_path / "out"
    if existed:
        target.mkdir()

    def interrupted(*args: object, **kwargs: object) -> None:
        assert (target / "model.safetensors").is_file()  # the weights were written
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(export_module, "finish_hf_export", interrupted)
        done = geartrain("export", str(run), str(target))
    assert done.returncode == 130, done.stderr
    assert f"the partial export in {target} was removed" in done.stdout
    assert (sorted(target.iterdir()) == []) if existed else not target.exists()
    again = geartrain("export", str(run), str(target))
    assert again.returncode == 0, again.stderr
    assert (target / "model.safetensors").is_file() and (target / ".geartrain-export.json").is_file()


_TERMINATED_EXPORT = """
import os, signal, sys
import geartrain.trainer.export as export_module
from geartrain.cli import main

run, target = sys.argv[1], sys.argv[2]

def terminated(*args, **kwargs):
    assert os.path.isfile(os.path.join(target, "model.safetensors"))  # the weights were written
    os.kill(os.getpid(), signal.SIGTERM)

export_module.finish_hf_export = terminated
sys.exit(main(["export", run, target]))
"""


def test_an_export_terminated_by_sigterm_leaves_nothing_behind(run: Path, tmp_path: Path) -> None:
    # probes4: SIGTERM (a timeout, a scheduler) mid-write killed the process with the partial
    # export in place, which the next export refused as foreign files; it now takes Ctrl-C's path
    import os
    import sys

    target = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-c", _TERMINATED_EXPORT, str(run), str(target)],
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard only: the export of the tiny model takes seconds
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    assert done.returncode == 143, (done.returncode, done.stderr[-2000:])
    assert done.stderr.strip().splitlines() == ["terminated by SIGTERM"], done.stderr
    assert f"the partial export in {target} was removed" in done.stdout
    assert not target.exists()


@pytest.mark.parametrize("where", ["checkpoints/actor", "checkpoints"])
def test_a_directory_of_checkpoints_says_which_to_give(trained: Path, tmp_path: Path, geartrain, where: str) -> None:  # noqa: ANN001
    # probes4: `export RUN/checkpoints/actor` said only "not a complete checkpoint (no COMPLETE marker)"
    text = _one_line_error(geartrain("export", str(trained / where), str(tmp_path / "out")))
    assert f"{trained / where} holds a run's checkpoints, not one: give one of them" in text, text
    assert f"{trained / 'checkpoints' / 'actor'}/step_N) or the run directory {trained.resolve()}" in text, text
    assert not (tmp_path / "out").exists()


def test_a_source_that_does_not_exist_is_named_so(tmp_path: Path, geartrain) -> None:  # noqa: ANN001
    # probes5 s4: a missing path was "not a complete checkpoint (no COMPLETE marker)"
    missing = tmp_path / "no-such-run"
    text = _one_line_error(geartrain("export", str(missing), str(tmp_path / "out")))
    assert text.startswith(f"error: {missing} does not exist; give a checkpoint"), text
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("given", ["run", "checkpoint"])
def test_a_checkpoint_rotated_away_while_it_is_read_is_said_and_the_run_read_again(
    run: Path, tmp_path: Path, geartrain, monkeypatch: pytest.MonkeyPatch, given: str
) -> None:  # noqa: ANN001
    """Issue 35 round 9 (by reading): exporting a run that a job is still saving into (a
    --resume) read its newest checkpoint while the job's keep_last rotation removed it: a
    FileNotFoundError traceback. Given the run directory, its newest is taken again; given
    the checkpoint, one line says what happened."""
    from geartrain.engine import Engine

    original = Engine.load_checkpoint
    removed: list[Path] = []

    def rotated_first(self: Engine, path: Path):  # noqa: ANN202
        if not removed:  # the job's rotation, as the first read starts
            removed.append(Path(path))
            shutil.rmtree(path)
        return original(self, path)

    monkeypatch.setattr(Engine, "load_checkpoint", rotated_first)
    source = run if given == "run" else _step(run, 2)
    done = geartrain("export", str(source), str(tmp_path / "out"))
    assert removed == [_step(run, 2)]
    if given == "run":
        assert done.returncode == 0, done.stderr
        assert (
            f"{_step(run, 2)} was removed while it was being read (the run keeps saving); taking its newest again"
            in (done.stdout)
        )
        assert json.loads((tmp_path / "out" / ".geartrain-export.json").read_text())["step"] == 1
    else:
        assert done.returncode != 0
        assert f"{_step(run, 2)} was removed while it was being read: the run is still saving" in _one_line_error(done)
        assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_an_export_into_a_directory_another_export_is_writing_is_refused(
    trained: Path, tmp_path: Path, geartrain
) -> None:  # noqa: ANN001
    """Issue 35 round 9 (by reading): two exports into one directory both passed the
    target's checks and interleaved their files. The target is locked for an export's life."""
    import fcntl
    import os

    out = tmp_path / "out"
    out.mkdir()
    fd = os.open(out, os.O_RDONLY)  # as the other export holds it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        line = _one_line_error(geartrain("export", str(trained), str(out)))
        assert f"the export target {out} is being written by another geartrain export now; nothing was changed" in line
        assert list(out.iterdir()) == []
    finally:
        os.close(fd)
    done = geartrain("export", str(trained), str(out))  # the lock ends with its holder
    assert done.returncode == 0, done.stderr
    again = geartrain("export", str(trained), str(tmp_path / "new" / "out"))
    assert again.returncode == 0, again.stderr
