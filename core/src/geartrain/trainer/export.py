"""``geartrain export CHECKPOINT DIR``: any checkpoint of a run as a complete Hugging Face
directory (the one a finished run writes to ``<output_dir>/hf``).

What it builds comes from the checkpoint itself: its ``engine.json`` (covered by the
checkpoint's manifest) records the engine and model configs that saved it. A run's
``config.json`` (in no manifest) is read only for checkpoints saved before that record
existed. Either way no code runs from the run directory: a model that sets
``trust_remote_code`` is refused unless the command line says ``--trust-remote-code``.

The target directory is refused when it holds anything unless ``--overwrite`` is given, and
then only the files a previous ``geartrain export`` wrote there (listed in its
``.geartrain-export.json``) are removed; a run directory or anything inside a run's
``checkpoints/`` is never a target.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from geartrain.checkpoint import MARKER, CheckpointManager, export_disk_full
from geartrain.config import EngineConfig, ModelConfig
from geartrain.errors import CheckpointError, GeartrainError
from geartrain.export import EXPORT_RECORD, ModelCard, base_model_name, finish_adapter_export, finish_hf_export
from geartrain.trainer.interrupt import InterruptWatch, is_interrupt


class ExportError(GeartrainError):
    """The export cannot be done as asked (its target, or what the checkpoint would run)."""


def run_of(checkpoint: Path, echo: Callable[[str], None] = print) -> tuple[Path, Path]:
    """``(checkpoint, run directory)`` for a checkpoint directory
    (``<run>/checkpoints/actor/step_N``) or a run directory (its newest intact checkpoint;
    each damaged newer one is reported through ``echo`` as ``--resume`` reports it)."""
    if not checkpoint.exists():
        raise CheckpointError(
            f"{checkpoint} does not exist; give a checkpoint (<output_dir>/checkpoints/actor/step_N) or a run directory"
        )
    if (checkpoint / "checkpoints" / "actor").is_dir():
        try:
            latest = CheckpointManager(checkpoint / "checkpoints" / "actor").latest_intact(echo)
        except CheckpointError as exc:  # its advice is for training ("start a fresh run"): not an export's
            if "every checkpoint under" not in str(exc):
                raise
            hf = checkpoint / "hf"
            kept = f"; the run's final model is exported already, in {hf}" if (hf / "config.json").is_file() else ""
            raise CheckpointError(
                f"every checkpoint under {checkpoint / 'checkpoints' / 'actor'} is damaged (see above): nothing to "
                f"export from them{kept}; restore a checkpoint from a copy to export it"
            ) from None
        if latest is None:
            raise CheckpointError(f"{checkpoint} holds no complete checkpoint to export")
        return latest, checkpoint
    if _holds_run(checkpoint) and not (checkpoint / MARKER).exists():
        # stopped before its first save: "not a complete checkpoint, cut off mid-write" would mislead
        raise CheckpointError(f"{checkpoint} is a run directory that holds no checkpoint yet: nothing to export")
    _refuse_a_checkpoint_root(checkpoint)
    CheckpointManager.check_complete(checkpoint)
    run = checkpoint.resolve().parents[2]
    if checkpoint.resolve().parent.name == "critic":
        raise CheckpointError(
            f"{checkpoint} is the critic's checkpoint (a value model), not the policy's: export writes the "
            f"policy; give the actor's checkpoint of that step ({run}/checkpoints/actor/{checkpoint.name}) or "
            f"the run directory {run}"
        )
    if not (run / "config.json").is_file() and not (checkpoint / "engine.json").is_file():
        raise CheckpointError(
            f"{checkpoint}: no config.json in its run directory {run}; give a checkpoint inside a run "
            "(<output_dir>/checkpoints/actor/step_N)"
        )
    return checkpoint, run


def _refuse_a_checkpoint_root(path: Path) -> None:
    """A directory of checkpoints (``<run>/checkpoints/actor`` or ``<run>/checkpoints``) is
    not one checkpoint: say which to give instead of "not a complete checkpoint"."""
    root = path / "actor" if (path / "actor").is_dir() and path.name == "checkpoints" else path
    if (root / MARKER).exists() or not any(root.glob("step_*")):
        return
    run = root.resolve().parents[1]
    raise CheckpointError(
        f"{path} holds a run's checkpoints, not one: give one of them ({root}/step_N) or the run directory "
        f"{run} (its newest intact checkpoint)"
    )


def check_target(
    out: Path, run: Path, checkpoint: Path, *, overwrite: bool, models: list[ModelConfig] | None = None
) -> list[Path]:
    """Refuse a target that is (or is inside) a run's directory tree where geartrain keeps
    its own files, the directory of a model the checkpoint was built from (``models``:
    its ``model.path`` or tokenizer), a file, read-only, or not empty (unless ``overwrite``).
    Returns the entries to remove first (those a previous export recorded). Reads only."""
    from geartrain.trainer.rundir import RunDirectoryError, read_only, refuse_unusable_path
    from geartrain.trainer.runlock import held

    where = f"the export target {out}"
    try:
        refuse_unusable_path(out, where, "choose another directory")  # before resolve(): a loop raises there
    except RunDirectoryError as exc:
        raise ExportError(str(exc)) from None
    resolved = out.resolve()
    for parent in [resolved, *resolved.parents]:
        live, owner = held(parent)
        if live:
            who = owner.describe() if owner is not None else "its owner did not record itself yet"
            raise ExportError(
                f"{where} is inside {parent}, the directory of a run still training ({who}): it writes its own "
                "files there, its export among them; choose a directory outside it, or export once it has ended"
            )
    for model in models or []:
        for source in (model.path, model.tokenizer):
            if source is None or not Path(source).exists():
                continue  # a hub id, or a model built in code: nothing on this disk to replace
            kept = Path(source).resolve()
            if resolved == kept or kept in resolved.parents:
                raise ExportError(
                    f"{where} is the model this checkpoint was trained from ({source}, its model.path or "
                    "tokenizer): exporting there would replace it, and the run's checkpoints need it; choose "
                    "another directory"
                )
    for protected in (run.resolve(), checkpoint.resolve()):
        if resolved == protected or protected in resolved.parents and not _an_export_dir(resolved, run):
            raise ExportError(
                f"{where} is inside the run directory {run} (its checkpoints or files would be overwritten); "
                "choose a directory outside it (a finished run's own export is <output_dir>/hf)"
            )
    for parent in [resolved, *resolved.parents]:
        in_run = parent.name == "checkpoints" and _holds_run(parent.parent)
        saved = any((parent / name).is_file() for name in ("COMPLETE", "MANIFEST.json", "engine.json"))
        if in_run or saved or parent.name.startswith(".partial-step_"):
            raise ExportError(f"{where} is inside a checkpoint directory ({parent}); choose another directory")
    if os.path.lexists(out) and not out.is_dir():
        raise ExportError(f"{where} is a file, not a directory; choose another directory")
    if out.is_dir() and _holds_run(out):
        raise ExportError(f"{where} holds a training run; choose another directory")
    if not _an_export_dir(resolved, run):
        for parent in resolved.parents:
            if _holds_run(parent):
                raise ExportError(
                    f"{where} is inside the training run {parent} (a later --overwrite of that run removes what "
                    "it does not know); choose a directory outside it"
                )
    existing = out
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        raise ExportError(f"{where} cannot be created: {existing} is a file, not a directory")
    if read_only(existing):
        raise ExportError(f"{where} is on a read-only file system ({existing}); choose a writable directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ExportError(f"{where} is not writable ({existing} denies write access); choose another directory")
    entries = sorted(out.iterdir()) if out.is_dir() else []
    if not entries:
        return []
    if not overwrite:
        raise ExportError(
            f"{where} is not empty ({len(entries)} entries, e.g. {entries[0].name}); nothing was written. "
            "Pass --overwrite to replace a previous geartrain export there, or choose an empty directory"
        )
    own = _recorded_files(out)
    foreign = [e.name for e in entries if e.name not in own and e.name != EXPORT_RECORD]
    if foreign:
        raise ExportError(
            f"{where} holds files no geartrain export wrote there ({', '.join(foreign[:5])}"
            f"{', ...' if len(foreign) > 5 else ''}); --overwrite removes only an export's own files. "
            "Move them away or choose another directory"
        )
    return entries


def _holds_run(path: Path) -> bool:
    """Whether ``path`` is a training run's output directory (its own entries, or a job's
    ``config.json``; an export's ``config.json`` is a model's)."""
    if any(os.path.lexists(path / name) for name in ("checkpoints", "metrics.jsonl", "sft_model", ".geartrain.lock")):
        return True
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "trainer" in config and "actor" in config


def write_export_record(out: Path, step: int, source: Path) -> None:
    """:data:`EXPORT_RECORD` in ``out``: the exported step, where it came from, and the files
    the export wrote (what a later ``--overwrite`` may remove)."""
    files = sorted(p.name for p in out.iterdir() if p.name != EXPORT_RECORD)
    record = {"step": step, "source": str(Path(source).resolve()), "files": files}
    (out / EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def clear_previous_export(out: Path) -> list[str]:
    """Remove what the export recorded in ``out`` wrote (its :data:`EXPORT_RECORD` lists it),
    before a new export is written there: a file the new one does not write again (a LoRA
    run's ``merged/`` when ``export_merged`` was turned off on ``--resume``) stayed beside it,
    and the new record listed it as its own. Files it did not write stay. Returns the names
    removed."""
    names = sorted(_recorded_files(out))
    _remove([out / name for name in names if os.path.lexists(out / name)])
    if (out / EXPORT_RECORD).is_file():
        (out / EXPORT_RECORD).unlink()
    return names


def _an_export_dir(resolved: Path, run: Path) -> bool:
    """``<run>/hf``: the run's own export, which ``--overwrite`` may replace."""
    return resolved == (run / "hf").resolve()


def _recorded_files(out: Path) -> set[str]:
    try:
        record = json.loads((out / EXPORT_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return set()
    files = record.get("files") if isinstance(record, dict) else None
    return {str(f) for f in files if isinstance(f, str) and "/" not in f} if isinstance(files, list) else set()


def _remove(entries: list[Path]) -> None:
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _remove_partial(out: Path, before: set[Path] | None) -> None:
    """Remove what an interrupted or failed export wrote into ``out``: all of it when the
    export created ``out`` (``before`` is ``None``), else the entries not in ``before`` (an
    export whose record, written last, is missing would be refused as foreign files)."""
    if before is None:
        shutil.rmtree(out, ignore_errors=True)
        return
    try:
        written = [entry for entry in out.iterdir() if entry not in before]
        _remove(written)
    except OSError:  # best effort: the error being raised is the one to report
        pass


def what_built(checkpoint: Path, run: Path, *, trust_remote_code: bool, echo: Callable[[str], None]) -> dict[str, Any]:
    """The engine config, the policy's model config, the run's base model and algorithm the
    checkpoint was saved from: its ``engine.json``, or for an older checkpoint the run's
    ``config.json`` (said through ``echo``). A model that needs ``trust_remote_code`` is
    refused unless ``trust_remote_code`` (the command line's ``--trust-remote-code``)."""
    from geartrain.engine import ENGINE_RECORD

    record_file = checkpoint / ENGINE_RECORD
    if record_file.is_file():
        record = json.loads(record_file.read_text(encoding="utf-8"))
        engine = EngineConfig.model_validate(record["engine"])
        policy = ModelConfig.model_validate(record["model"])
        base = ModelConfig.model_validate(record.get("base_model") or record["model"])
        algorithm = str(record.get("algorithm") or "rl")
        sft_dir = run / "sft_model"
        if policy.path and Path(policy.path).name == "sft_model" and not Path(policy.path).is_dir():
            policy = policy.model_copy(update={"path": str(sft_dir.resolve())})  # the run directory moved
    else:
        from geartrain.trainer.config import TrainConfig

        echo(
            f"note: {checkpoint} has no {ENGINE_RECORD} (saved by an older geartrain): building from {run}/config.json"
        )
        config = TrainConfig.model_validate(json.loads((run / "config.json").read_text(encoding="utf-8")))
        engine, base, algorithm = config.actor.engine, config.model, config.algorithm.name
        policy = base
        sft_dir = run / "sft_model"
        if config.sft.enabled and (sft_dir / "config.json").is_file():  # RL started from the warm start
            policy = ModelConfig(
                path=str(sft_dir.resolve()), dtype=base.dtype, attn_implementation=base.attn_implementation
            )
    for model in (policy, base):
        if model.trust_remote_code and not trust_remote_code:
            named = model.path or model.tokenizer or model.preset or (model.tiny and f"the tiny {model.tiny} model")
            raise ExportError(
                f"the run sets model.trust_remote_code for {named}: export runs no code from a run directory "
                "unless told; pass --trust-remote-code if you trust that model's code"
            )
    return {"engine": engine, "policy": policy, "base": base, "algorithm": algorithm}


def check_models(built: dict[str, Any]) -> None:
    """Raise :class:`ExportError` in one line when a model the checkpoint records (its
    policy or its base) names a local directory whose weights cannot be read, or a path or
    hub id whose config cannot be read (the engine's load would fail with a traceback)."""
    from geartrain.modeling import hf_config
    from geartrain.weight_files import unreadable_safetensors_problem

    for key, model in (("model", built["policy"]), ("base_model", built["base"])):
        if model.path is None:
            continue
        problem = unreadable_safetensors_problem(model.path)
        local = model.path.startswith(("/", ".", "~"))
        if problem is None and local and not os.path.exists(os.path.expanduser(model.path)):
            problem = "no such file or directory"
        if problem is None:
            try:
                hf_config(model)
            except OSError as exc:
                lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
                problem = " ".join(lines)[:300] or type(exc).__name__
        if problem is not None:
            raise ExportError(
                f"the checkpoint was built from {key}.path {model.path} (its engine.json), which cannot be read "
                f"here: {problem}"
            )


@contextlib.contextmanager
def _target_lock(out: Path) -> Iterator[None]:
    """Hold an ``flock`` on the target directory (created here) for the export's life, or
    raise :class:`ExportError` when another export holds it: two exports into one
    directory would interleave their files. The kernel frees the lock however the process
    ends; no file is added to the directory."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise ExportError(
            f"cannot write the export to {out}: {exc.strerror} ({exc.filename or out}); choose another directory"
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ExportError(
                f"the export target {out} is being written by another geartrain export now; nothing was changed. "
                "Wait for it to end, or choose another directory"
            ) from None
        yield
    finally:
        os.close(fd)


#: how many times a run directory's newest checkpoint is read again when a running job
#: removes it meanwhile (its keep_last rotation): more means the job saves faster than a read
_READ_ATTEMPTS = 3


def _removed_while_read(checkpoint: Path) -> bool:
    """Whether ``checkpoint``, complete when chosen, is no longer complete: a job still
    running in its run rotated it away (``shutil.rmtree``) while the engine read it."""
    try:
        CheckpointManager.check_complete(checkpoint)
    except CheckpointError:
        return True
    return False


def _write(engine: Any, out: Path, tokenizer: Any, built: dict[str, Any], step: int, checkpoint: Path) -> None:
    engine.export_hf(out, tokenizer)
    if (out / "adapter_config.json").is_file():
        finish_adapter_export(out)
    if (out / "config.json").is_file():  # a LoRA export is an adapter directory
        card = ModelCard(
            base_model=base_model_name(built["base"]),
            algorithm=built["algorithm"].upper(),
            steps=step,
            source=str(checkpoint),
        )
        finish_hf_export(out, card, tokenizer)
    write_export_record(out, step, checkpoint)


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    overwrite: bool = False,
    trust_remote_code: bool = False,
    echo: Callable[[str], None] = print,
) -> tuple[Path, int]:
    """Load ``checkpoint`` (or a run directory's newest intact one) into the actor engine it
    records and write it to ``out_dir`` as a complete Hugging Face directory (weights, config
    with ``architectures``, ``generation_config.json``, the tokenizer, a model card; a LoRA
    run: the adapter directory) plus :data:`EXPORT_RECORD` with the exported step. Returns
    ``(out_dir, step)``. See the module docstring for what is refused; an export into a
    directory another export is writing is refused too."""
    source = Path(checkpoint)
    checkpoint, run = run_of(source, echo)
    out = Path(out_dir)
    built = what_built(checkpoint, run, trust_remote_code=trust_remote_code, echo=echo)
    models = [built["policy"], built["base"]]
    check_target(out, run, checkpoint, overwrite=overwrite, models=models)  # before anything is created
    created = not out.exists()
    with _target_lock(out):
        try:
            # again under the lock: what a concurrent export finished writing there meanwhile counts
            stale = check_target(out, run, checkpoint, overwrite=overwrite, models=models)
            return _export(source, checkpoint, out, built, stale, created, echo)
        except BaseException:
            if created:  # a refusal before anything was written leaves no empty directory behind
                with contextlib.suppress(OSError):
                    out.rmdir()
            raise


def _export(
    source: Path,
    checkpoint: Path,
    out: Path,
    built: dict[str, Any],
    stale: list[Path],
    created: bool,
    echo: Callable[[str], None],
) -> tuple[Path, int]:
    """:func:`export_checkpoint`'s work once its target is checked and locked (``created``:
    ``out`` did not exist before, so a failure removes it whole, not only what was written)."""
    from geartrain.engine import Engine
    from geartrain.modeling import load_tokenizer
    from geartrain.types import EngineContext

    check_models(built)
    tokenizer = load_tokenizer(built["base"])
    engine = Engine(built["engine"], built["policy"], EngineContext(role="actor", seed=0))
    for attempt in range(_READ_ATTEMPTS):
        try:
            extra = engine.load_checkpoint(checkpoint)
            break
        except Exception:
            if not _removed_while_read(checkpoint):
                raise
            if source.resolve() == checkpoint.resolve() or attempt + 1 == _READ_ATTEMPTS:
                raise CheckpointError(
                    f"{checkpoint} was removed while it was being read: the run is still saving and keeps only its "
                    "newest checkpoints (trainer.keep_last). Give the run directory to export its newest one, or "
                    "stop the run first"
                ) from None
            echo(f"{checkpoint} was removed while it was being read (the run keeps saving); taking its newest again")
            checkpoint, _ = run_of(source, echo)
    step = int(extra["step"]) if "step" in extra else CheckpointManager.step_of(checkpoint)
    _remove(stale)  # only now: everything that could refuse has run
    before = None if created else set(out.iterdir())
    # SIGTERM (a timeout, a scheduler) takes Ctrl-C's path: it would otherwise kill the process
    # with the partial export still in place
    watch = InterruptWatch()
    try:
        with watch:
            _write(engine, out, tokenizer, built, step, checkpoint)
    except BaseException as exc:  # a full disk (any form of it) is one line, the partial export removed
        full = export_disk_full(exc, out, checkpoint)
        if full is not None:
            raise full from None
        _remove_partial(out, before)
        if is_interrupt(exc) or watch.seen:
            echo(f"the partial export in {out} was removed")
        if isinstance(exc, OSError) and exc.errno is not None:  # the target refused the write: one line
            raise ExportError(
                f"cannot write the export to {out}: {exc.strerror} ({exc.filename or out}); choose another directory"
            ) from None
        raise
    return out, step
