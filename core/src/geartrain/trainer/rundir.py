"""The output directory of a training job, guarded so that no run is lost by accident.

A job checks its directory with :meth:`RunDirectory.check` before anything else and only
*claims* it (:meth:`RunDirectory.claim`: creates it, and with ``overwrite`` sets the
previous run's files aside) after every other check — config, data, reward, checkpoints — has
passed. So a fresh run into a directory that holds a run refuses unless told ``--resume``
(continue it) or ``--overwrite`` (replace it), and a run that fails its checks deletes and
truncates nothing.

``--overwrite`` deletes nothing at the claim either: the previous run's entries move into
``<output_dir>/.geartrain-overwritten`` (:data:`SET_ASIDE`; a rename, no copy) and are deleted
only once the new run has finished its first step (:meth:`RunDirectory.commit`). A failure
before that — a tracker that does not start, a model whose weights are not finite, Ctrl-C
during the SFT warm start — puts them back (:meth:`RunDirectory.restore`), so the previous
run is never lost to a run that did not start. A job killed outright before its first step
leaves them set aside; the next ``--overwrite`` keeps them (the killed run's own entries are
what it replaces), and its first step deletes them; ``--resume`` there is refused (it would
continue the killed run), naming where the previous run is.

A directory whose run is still going is refused in every mode: :meth:`RunDirectory.claim`
takes the directory's lock (:mod:`geartrain.trainer.runlock`) before deleting anything and
the job holds it until it ends (:meth:`RunDirectory.release`).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from geartrain.errors import GeartrainError
from geartrain.export import EXPORT_RECORD, MODEL_CARD_MARK
from geartrain.trainer.runlock import RunLock, probe

#: What a job writes into its output directory, and what kind of filesystem entry each is.
#: ``overwrite`` removes exactly these; files of other names are left alone.
RUN_ENTRIES: dict[str, str] = {
    "config.json": "file",
    "metrics.jsonl": "file",
    "completions.jsonl": "file",
    "episodes.log": "file",
    "curves.png": "file",
    "checkpoints": "dir",
    "tensorboard": "dir",
    "sft_model": "dir",
    "hf": "dir",
    "wandb": "dir",
    "mlruns": "dir",
}
#: Where ``--overwrite`` keeps the previous run's entries until the new run's first step.
SET_ASIDE = ".geartrain-overwritten"
#: The entries whose presence means the directory holds a run.
_RUN_MARKERS = ("config.json", "metrics.jsonl", "checkpoints", "sft_model", "hf", SET_ASIDE)


def _run_config(path: Path) -> dict[str, object] | None:
    """The file ``path`` as a training run's ``config.json`` (a JSON object with its
    ``trainer`` and ``actor`` sections), or ``None`` when it is not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "trainer" in data and "actor" in data else None


def json_damage(path: Path) -> str | None:
    """Why the file ``path`` is not readable JSON (not UTF-8, cut off, edited into invalid
    syntax), or ``None`` when it is (or cannot be opened: the entry checks name that)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        return f"byte {exc.start} is not UTF-8"
    except OSError:
        return None
    try:
        json.loads(text)
    except ValueError as exc:
        return str(exc)
    return None


def is_run_config(path: Path) -> bool:
    """Whether the file ``path`` is a ``config.json`` a training run wrote (a JSON object
    with its ``trainer`` and ``actor`` sections), not a model's or another program's."""
    return _run_config(path) is not None


def is_run_metrics(path: Path) -> bool:
    """Whether the file ``path`` is a ``metrics.jsonl`` a run wrote: empty or cut short
    before its first line ended (a run killed at once), or a first line that is a JSON
    object with a ``step``."""
    try:
        with path.open("rb") as fh:
            first = fh.readline(1 << 20)
    except OSError:
        return True  # unreadable: the entry checks above name it
    if not first.endswith(b"\n"):
        return True
    try:
        row = json.loads(first)
    except ValueError:
        return False
    return isinstance(row, dict) and "step" in row


def foreign_checkpoints(path: Path) -> str | None:
    """The first entry of the directory ``path`` that a run's ``checkpoints/`` never holds
    (it holds one directory per role, each holding only ``step_N`` and ``.partial-step_N``
    directories), or ``None`` when everything there is a run's."""
    for role in sorted(path.iterdir()):
        if not role.is_dir() or role.is_symlink():
            return role.name
        for entry in sorted(role.iterdir()):
            if not entry.name.startswith(("step_", ".partial-step_")):
                return f"{role.name}/{entry.name}"
    return None


def recorded_config(checkpoint: Path) -> dict[str, object] | None:
    """The job config ``checkpoint`` was saved with (its engine record's ``config``; ``None``:
    an older checkpoint that has none, or no readable record)."""
    from geartrain.engine import ENGINE_RECORD

    try:
        record = json.loads((checkpoint / ENGINE_RECORD).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    config = record.get("config") if isinstance(record, dict) else None
    return config if isinstance(config, dict) else None


def _checkpoint_trainer_sections(path: Path) -> list[dict[str, object]]:
    """The ``trainer`` sections of the job configs the run's checkpoints were saved with."""
    configs = [recorded_config(step) for step in sorted(path.glob("checkpoints/*/step_*"))]
    return [c["trainer"] for c in configs if c is not None and isinstance(c.get("trainer"), dict)]


def _run_writes(trainer: dict[str, object], name: str) -> bool:
    """Whether a run whose config's ``trainer`` section is ``trainer`` writes the entry
    ``name`` of its directory (``True`` where the section does not say: an older run's)."""
    if name == "hf":
        return trainer.get("export_hf") is not False
    loggers = trainer.get("loggers")
    if not isinstance(loggers, list):
        return True
    if name == "tensorboard":
        return "tensorboard" in loggers and trainer.get("tensorboard") is not False
    if name == "wandb":
        return "wandb" in loggers
    if name == "mlruns":  # MLflow's local store; a tracking URI puts it elsewhere
        return "mlflow" in loggers and not trainer.get("mlflow_tracking_uri")
    return True


def _an_export(path: Path) -> bool:
    """Whether the directory ``path`` is (or was made as) a geartrain export."""
    if (path / EXPORT_RECORD).is_file():
        return True
    try:
        return MODEL_CARD_MARK in (path / "README.md").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


def foreign_entry(path: Path) -> tuple[str, str] | None:
    """The first of ``hf/``, ``tensorboard/``, ``wandb/`` and ``mlruns/`` in the directory
    ``path`` that holds something its run did not write there, and why (``None``: none).
    A run's ``config.json`` (written before anything else of the run) says which of them it
    writes (its final export, its loggers); without one, none is a run's, except an ``hf/``
    that is a geartrain export."""
    trainer: dict[str, object] | None = None
    if (config := _run_config(path / "config.json")) is not None:
        section = config["trainer"]
        trainer = section if isinstance(section, dict) else {}
    # a resume may have turned a logger off: the configs its checkpoints were saved with (in
    # their engine.json) say what the run wrote before
    earlier = _checkpoint_trainer_sections(path) if trainer is not None else []
    for name in ("hf", "tensorboard", "wandb", "mlruns"):
        entry = path / name
        if not entry.is_dir() or entry.is_symlink() or not any(entry.iterdir()):
            continue
        if name == "hf" and _an_export(entry):
            continue
        if trainer is not None and not any(_run_writes(t, name) for t in [trainer, *earlier]):
            return name, "the run there does not write it (its config.json turns that off)"
        if trainer is None:
            return name, (
                f"no geartrain export wrote it (it has no {EXPORT_RECORD})"
                if name == "hf"
                else "no run's config.json there accounts for it"
            )
    return None


def read_only(path: Path) -> bool:
    """Whether ``path`` (which exists) is on a filesystem mounted read-only."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


#: Pseudo file systems: a directory cannot be made there, or is no storage.
PSEUDO_FILE_SYSTEMS = frozenset(
    {"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "configfs", "pstore", "bpf", "devpts"}
)


def _holds_no_files(directory: Path) -> bool:
    """Whether ``directory`` is on a pseudo file system (``/proc``, ``/sys``, by the mount
    table): making a directory there failed only once the run started."""
    try:
        mounts = [line.split() for line in Path("/proc/self/mounts").read_text().splitlines()]
        target = os.path.realpath(directory)
    except OSError:
        return False
    best, fstype = "", ""
    for fields in mounts:
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fstype = point, fields[2]
    return fstype in PSEUDO_FILE_SYSTEMS


class RunDirectoryError(GeartrainError):
    """The output directory cannot be used as asked (it holds a run, is not writable, or
    one of its entries is of the wrong kind)."""


def dead_link(path: Path) -> tuple[Path, str] | None:
    """``(link, how it is said)`` for the first of ``path`` and its parents (from the root
    down) that is a symbolic link leading nowhere: to a path that does not exist, or into a
    loop of links (a directory can be created neither there nor under it); ``None`` when
    there is none."""
    for entry in reversed([path, *path.parents]):
        if not os.path.lexists(entry):
            return None  # neither it nor anything under it exists: all of it can be created
        try:
            os.stat(entry)
        except OSError as exc:
            if not os.path.islink(entry):
                return None  # not a link's doing (permissions): the checks that follow say it
            target = os.readlink(entry)
            if exc.errno == errno.ELOOP:
                return entry, f"a symbolic link to {target} that leads back to itself (a loop of symbolic links)"
            return entry, f"a symbolic link to {target}, which does not exist"
    return None


def name_too_long(path: Path) -> str | None:
    """How ``path`` is longer than the filesystem takes (a name past its NAME_MAX, the whole
    past PATH_MAX), where every call on it would raise ENAMETOOLONG; ``None`` when it is not."""
    absolute = Path(os.path.abspath(path))
    existing = absolute
    while not os.path.isdir(existing) and existing.parent != existing:
        existing = existing.parent
    try:
        name_max, path_max = os.pathconf(existing, "PC_NAME_MAX"), os.pathconf(existing, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    for size in (len(os.fsencode(name)) for name in path.parts):
        if size > name_max:
            return f"has a name of {size} bytes, longer than the {name_max} its filesystem takes"
    if (size := len(os.fsencode(absolute))) >= path_max:
        return f"is {size} bytes long, longer than the system's {path_max}"
    return None


def refuse_unusable_path(path: Path, where: str, choose: str) -> None:
    """Raise :class:`RunDirectoryError` when ``path`` is too long for its filesystem
    (:func:`name_too_long`) or it or one of its parents is a symbolic link leading nowhere
    (:func:`dead_link`), naming it; ``choose`` ends the line."""
    if (too_long := name_too_long(path)) is not None:
        raise RunDirectoryError(f"{where} {too_long}; {choose}")
    if (dead := dead_link(path)) is None:
        return
    link, said = dead
    if link == path:
        raise RunDirectoryError(f"{where} is {said}; {choose}")
    raise RunDirectoryError(f"{where} cannot be created: {link} is {said}; {choose}")


@dataclass
class RunDirectory:
    """``path`` as the output directory of a fresh run (``resume=False``), a continued one
    (``resume=True``) or a replacing one (``overwrite=True``)."""

    path: Path
    resume: bool = False
    overwrite: bool = False

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self.lock: RunLock | None = None
        self.claimed = False
        """Whether :meth:`claim` took the directory (what is in it since is this job's)."""
        self.restored = False
        """Whether :meth:`restore` put the previous run back (what is in it is that run's)."""
        self.not_deleted: str | None = None
        """Why :meth:`commit` could not delete all that was set aside (``None``: it could)."""
        self.identity: tuple[int, int] | None = None
        """The claimed directory's (device, inode): one removed and made again under the job
        (a save's ``mkdir -p`` after ``rm -rf``) is another directory."""
        self.set_aside: list[str] = []
        """The previous run's entries this job's claim moved into :data:`SET_ASIDE` (or found
        there, from a killed ``--overwrite``), until :meth:`commit` or :meth:`restore`."""

    def holds_run(self) -> list[str]:
        """The entries that show ``path`` holds a (started or finished) run."""
        if not self.path.is_dir():
            return []
        return [name for name in _RUN_MARKERS if os.path.lexists(self.path / name)]

    def check(self) -> None:
        """Raise :class:`RunDirectoryError` unless the directory can be used as asked.
        Reads only; changes nothing."""
        where = f"trainer.output_dir '{self.path}'"
        if self.resume and self.overwrite:
            raise RunDirectoryError("--resume and --overwrite exclude each other: continue the run or replace it")
        refuse_unusable_path(self.path, where, "choose another trainer.output_dir")
        if os.path.lexists(self.path) and not self.path.is_dir():
            raise RunDirectoryError(f"{where} is a file, not a directory; choose another trainer.output_dir")
        if self.lock is None:
            probe(self.path)  # a live run's directory is refused first, whatever the mode
        existing = self.path
        while not existing.exists():
            if existing.parent == existing:
                break
            existing = existing.parent
        if not existing.is_dir():
            raise RunDirectoryError(f"{where} cannot be created: {existing} is a file, not a directory")
        if read_only(existing):
            raise RunDirectoryError(
                f"{where} is on a read-only file system ({existing}); nothing was changed. "
                "Choose a writable trainer.output_dir"
            )
        if not os.access(existing, os.W_OK | os.X_OK):
            raise RunDirectoryError(
                f"{where} is not writable ({existing} denies write access); choose another trainer.output_dir"
            )
        if _holds_no_files(existing):
            raise RunDirectoryError(
                f"{where} is on a file system that stores no files ({existing}: /proc, /sys or the like); "
                "choose another trainer.output_dir"
            )
        for name, kind in RUN_ENTRIES.items():
            entry = self.path / name
            if not os.path.lexists(entry):
                continue
            if kind == "dir" and not entry.is_dir():
                raise RunDirectoryError(
                    f"{entry} is a file where geartrain keeps a directory; "
                    "move it away or choose another trainer.output_dir"
                )
            if kind == "file" and not entry.is_file():
                raise RunDirectoryError(
                    f"{entry} is not a regular file (geartrain writes its {name} there); "
                    "move it away or choose another trainer.output_dir"
                )
            if kind == "dir" and not os.access(entry, os.R_OK | os.X_OK):
                raise RunDirectoryError(
                    f"{entry} cannot be read (its permissions deny it); fix them or choose another trainer.output_dir"
                )
            if not os.access(entry, os.W_OK | (os.X_OK if kind == "dir" else 0)):
                raise RunDirectoryError(
                    f"{entry} is not writable; fix its permissions or choose another trainer.output_dir"
                )
        config = self.path / "config.json"
        if config.is_file() and (damage := json_damage(config)) is not None:
            raise RunDirectoryError(
                f"{config} is not readable JSON ({damage}): cut off or edited by hand? Nothing was changed. If it "
                "is this run's, write it again (`geartrain config <job file> [overrides] --json > "
                f"{config}`) or move it away (--resume then goes on without comparing the config with the run's)"
            )
        if config.is_file() and not is_run_config(config):
            raise RunDirectoryError(
                f"{config} is not a training run's config (a model's, or another program's file): a run writes its "
                "own config.json there and --overwrite would remove it; nothing was changed. Choose another "
                "trainer.output_dir"
            )
        metrics = self.path / "metrics.jsonl"
        if metrics.is_file() and not is_run_metrics(metrics):
            raise RunDirectoryError(
                f"{metrics} is not a training run's metrics (its first line is no JSON object with a step): a run "
                "writes its own metrics.jsonl there and --overwrite would remove it; nothing was changed. Choose "
                "another trainer.output_dir"
            )
        checkpoints = self.path / "checkpoints"
        if checkpoints.is_dir():
            self._check_checkpoint_permissions(checkpoints)
        if checkpoints.is_dir() and (foreign := foreign_checkpoints(checkpoints)):
            raise RunDirectoryError(
                f"{checkpoints} holds what no training run saved there ({foreign}: another program's checkpoints?): "
                "a run keeps its checkpoints/ there and --overwrite would remove it; nothing was changed. Choose "
                "another trainer.output_dir"
            )
        if self.path.is_dir() and (foreign := foreign_entry(self.path)):
            name, why = foreign
            others = [m for m in self.holds_run() if m not in ("config.json", name)]
            if others and not os.path.lexists(self.path / "config.json"):
                raise RunDirectoryError(
                    f"{self.path} holds a run ({', '.join(others)}) whose config.json is missing: it is what says "
                    f"whether {name}/ is that run's, so {name}/ may be another program's, and --overwrite would "
                    f"remove it; nothing was changed. Put the run's config.json back, or move {name}/ away, or "
                    "choose another trainer.output_dir"
                )
            raise RunDirectoryError(
                f"{self.path / name} holds what no training run wrote there ({why}; another program's?): a run "
                f"keeps its own {name}/ there and --overwrite would remove it; nothing was changed. Move it away, "
                "or choose another trainer.output_dir"
            )
        if self.overwrite:
            for name in [*RUN_ENTRIES, SET_ASIDE]:
                if (blocked := _undeletable(self.path / name)) is not None:
                    raise RunDirectoryError(
                        f"{blocked} cannot be emptied (its permissions deny it): --overwrite could not delete the "
                        "previous run there; nothing was changed. Fix its permissions, or choose another "
                        "trainer.output_dir"
                    )
        found = self.holds_run()
        if self.resume and os.path.lexists(self.path / SET_ASIDE):
            raise RunDirectoryError(
                f"{self.path} holds a run that an --overwrite set aside in {self.path / SET_ASIDE} and was stopped "
                "before its first step: --resume would continue the stopped run, not that one; nothing was changed. "
                f"Move the entries of {SET_ASIDE} back into {self.path} (in place of the stopped run's) to continue "
                "it with --resume, or pass --overwrite again to replace it"
            )
        if self.resume and not found:
            raise RunDirectoryError(
                f"nothing to resume in {self.path}: it holds no run (no config.json, metrics.jsonl or checkpoints); "
                "check trainer.output_dir, or start a fresh run without --resume"
            )
        if found and not (self.resume or self.overwrite):
            raise RunDirectoryError(
                f"{where} already holds a run ({', '.join(found)}); nothing was changed. "
                "Pass --resume to continue it from its newest checkpoint, or --overwrite to delete it and start "
                "afresh (Python: run_job(config, resume=True) / run_job(config, overwrite=True)), "
                "or choose another trainer.output_dir"
            )

    def _check_checkpoint_permissions(self, checkpoints: Path) -> None:
        """Each role's directory under ``checkpoints`` can be listed (and, for a resumed
        run, which saves there, written), and each of its step directories read: else one
        line naming it, not a ``PermissionError`` from a listing or, after hours of
        training, from a save."""
        for role in sorted(checkpoints.iterdir()):
            if not role.is_dir():
                continue  # foreign_checkpoints names it
            if not os.access(role, os.R_OK | os.X_OK | (os.W_OK if self.resume else 0)):
                said = (
                    "is not readable and writable (the resumed run loads and saves its checkpoints there)"
                    if self.resume
                    else "cannot be read (its permissions deny it)"
                )
                raise RunDirectoryError(f"{role} {said}; fix its permissions or choose another trainer.output_dir")
            for step in sorted(role.iterdir()):
                if step.is_dir() and not os.access(step, os.R_OK | os.X_OK):
                    raise RunDirectoryError(
                        f"{step} cannot be read (its permissions deny it); fix them or choose another "
                        "trainer.output_dir"
                    )

    def removed(self) -> bool:
        """Whether the directory :meth:`claim` took is no longer at its path (removed, or
        removed and made again: what the job wrote there is gone either way)."""
        if self.identity is None:
            return False
        try:
            stat = self.path.stat()
        except OSError:
            return True
        return (stat.st_dev, stat.st_ino) != self.identity

    def claim(self) -> list[str]:
        """Create the directory; with ``overwrite``, move the previous run's entries (only
        those in :data:`RUN_ENTRIES`) into :data:`SET_ASIDE`, where they stay until
        :meth:`commit` deletes them or :meth:`restore` puts them back. Call after every check
        passed. Takes the directory's lock first
        (:class:`~geartrain.trainer.runlock.RunLockedError` if a live run holds it) and keeps
        it until :meth:`release`. Returns the names of the entries set aside."""
        self.check()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # what the checks could not foresee: one line, nothing was changed
            raise RunDirectoryError(
                f"trainer.output_dir '{self.path}' cannot be created ({exc.strerror or exc}); "
                "choose another trainer.output_dir"
            ) from None
        if self.lock is None:
            self.lock = RunLock.acquire(self.path)
        self.claimed = True
        stat = self.path.stat()
        self.identity = (stat.st_dev, stat.st_ino)
        if not self.overwrite:
            return []
        aside = self.path / SET_ASIDE
        present = [name for name in RUN_ENTRIES if os.path.lexists(self.path / name)]
        if aside.is_dir():
            # an earlier --overwrite was killed before its first step: what it set aside is
            # the run to keep; the entries here are the killed run's own, which never trained
            for name in present:
                _remove(self.path / name)
            self.set_aside = sorted(entry.name for entry in aside.iterdir())
            return list(self.set_aside)
        if os.path.lexists(aside):
            _remove(aside)
        aside.mkdir()
        moved: list[str] = []
        try:
            for name in present:
                os.rename(self.path / name, aside / name)
                moved.append(name)
        except OSError as exc:
            for name in moved:  # all or nothing: a half-moved run would be neither
                os.rename(aside / name, self.path / name)
            aside.rmdir()
            raise RunDirectoryError(
                f"--overwrite could not set the previous run's {name} aside in {aside} ({exc.strerror}); "
                "nothing was changed"
            ) from None
        if not moved:
            aside.rmdir()
        self.set_aside = moved
        return list(moved)

    def commit(self) -> bool:
        """The new run has finished a step: delete what ``--overwrite`` set aside (this job's
        claim, or a killed earlier one's). Returns whether anything was set aside. Only an
        ``--overwrite`` job deletes it: a fresh run or ``--resume`` never does. A deletion
        that fails (a file made undeletable since the checks) does not stop the new run:
        ``not_deleted`` says why, and what is left stays in :data:`SET_ASIDE`."""
        aside = self.path / SET_ASIDE
        self.set_aside = []
        self.not_deleted = None
        if not self.overwrite or not os.path.lexists(aside):
            return False
        try:
            _remove(aside)
        except OSError as exc:
            self.not_deleted = f"{exc.strerror or exc} ({exc.filename or aside})"
        return True

    def restore(self) -> list[str]:
        """The new run failed before :meth:`commit`: delete the entries it wrote and move
        the previous run's back from :data:`SET_ASIDE`. Returns their names (empty: this job
        set nothing aside, or committed already)."""
        if not self.set_aside:
            return []
        aside = self.path / SET_ASIDE
        for name in RUN_ENTRIES:
            if os.path.lexists(self.path / name):
                _remove(self.path / name)
        restored = []
        for name in self.set_aside:
            if os.path.lexists(aside / name):
                os.rename(aside / name, self.path / name)
                restored.append(name)
        shutil.rmtree(aside, ignore_errors=True)
        self.set_aside = []
        self.restored = True
        return restored

    def release(self) -> None:
        """Free the directory's lock (if this job took it)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def _undeletable(entry: Path) -> Path | None:
    """The first directory in the tree ``entry`` (a directory, not a link to one) whose
    entries this process may not delete or list (it lacks write, search or read permission),
    or ``None``: a tree ``_remove`` can delete."""
    if not entry.is_dir() or entry.is_symlink():
        return None
    for top, dirs, files in os.walk(entry):
        if (dirs or files) and not os.access(top, os.W_OK | os.X_OK):
            return Path(top)
        for name in dirs:
            sub = Path(top, name)
            if not sub.is_symlink() and not os.access(sub, os.R_OK | os.X_OK):
                return sub
    return None


def _remove(entry: Path) -> None:
    """Delete a file, a symlink (not its target) or a directory tree."""
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry)
    else:
        entry.unlink()
