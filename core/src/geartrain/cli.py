"""The geartrain command: plugins, check, config, train, export, bench."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from geartrain.errors import GeartrainError


def _cmd_plugins(args: argparse.Namespace) -> int:
    from geartrain.plugins import ALLOW_LIST_ENV, list_plugins

    infos = list_plugins()
    allowed = os.environ.get(ALLOW_LIST_ENV)
    if args.json:
        print(json.dumps([i.as_dict() for i in infos], indent=2))
    else:
        print(plugins_text(infos) if infos or allowed is None else "no plugins loaded")
    if allowed is not None:  # the list is what the variable lets load, not what is installed
        print(
            f"note: {ALLOW_LIST_ENV}={allowed!r} loads only the plugins it names; unset it to list every installed one",
            file=sys.stderr,
        )
    return 0


def plugins_text(infos: Sequence[Any], width: int = 80) -> str:
    """The installed plugins, one block each, every line within ``width`` columns."""
    import textwrap

    blocks = []
    for i in infos:
        status = "ok" if i.error is None else f"error: {i.error}"
        head = f"{i.name} ({i.kind}) from {i.distribution or i.source} {i.version or ''}".rstrip()
        lines = textwrap.wrap(head, width, subsequent_indent="    ")
        for label, text in (
            ("status", status),
            ("capabilities", ", ".join(i.capabilities) or "-"),
            ("hooks", ", ".join(i.hooks)),
        ):
            lines += textwrap.wrap(f"{label}: {text}", width, initial_indent="  ", subsequent_indent="    ")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) if blocks else "no plugins installed"


def _cmd_check(args: argparse.Namespace) -> int:
    from geartrain.config import field_description
    from geartrain.errors import ConfigError
    from geartrain.trainer.config import TrainConfig, load_train_config

    try:
        config = load_train_config(args.config, args.overrides, check_plugins=not args.no_plugins)
    except ConfigError as exc:  # say what each key is for, under the problem
        lines = [f"error: {exc}"]
        for path, _ in exc.problems:
            description = field_description(TrainConfig, path)
            if description:
                lines.append(f"  {path} is: {description}")
        print("\n".join(lines), file=sys.stderr)
        return 2
    if not args.config_only:
        from geartrain.trainer.preflight import preflight
        from geartrain.trainer.rundir import RunDirectory

        RunDirectory(Path(config.trainer.output_dir), resume=args.resume, overwrite=args.overwrite).check()

        pre = preflight(config)
        for note in pre.notes:
            print(f"note: {note}")
        sizes = ", ".join(f"{key} {len(ds)} rows" for key, ds in pre.datasets.items())
        if pre.reward is None:
            reward = "a reward model resolves"
        else:
            names = ", ".join(f"'{t.name}'" for t in pre.reward)
            reward = f"reward {names} resolves and scores the first rows"
        print(f"checked: {reward}; {sizes} parse and fit rollout.max_model_len={config.rollout.max_model_len}")
    print(
        f"{args.config}: ok ({config.algorithm.name} with actor engine "
        f"'{config.actor.engine.backend}' and rollout '{config.rollout.backend}')"
    )
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    """``geartrain config [JOB] [overrides]``: the effective config (every value the job
    runs with, defaults included) as TOML; ``--schema``: every field with its default and
    description (``--json``: the JSON schema / the config as JSON)."""
    from geartrain.config import describe_fields
    from geartrain.trainer.config import TrainConfig, load_train_config

    if args.schema:
        given = [a for a in (args.config, *args.overrides) if a]
        if given:
            raise GeartrainError(
                f"geartrain config --schema describes the fields of every job and takes no job file or "
                f"overrides (got {' '.join(given)}): drop --schema to print this job's values"
            )
        if args.json:
            print(json.dumps(TrainConfig.model_json_schema(), indent=2))
            return 0
        for row in describe_fields(TrainConfig):
            print(f"{row.path} ({row.type}, default {row.default})\n    {plain(row.description)}")
        return 0
    config = load_train_config(args.config, args.overrides, check_plugins=False)
    data = config.model_dump(mode="json", exclude={"base_dir"})
    print(json.dumps(data, indent=2) if args.json else to_toml(data))
    return 0


def plain(text: str) -> str:
    """Docstring text for a terminal: reStructuredText roles and literals as plain words
    (``x`` -> x, :func:`a.b` -> a.b)."""
    import re

    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", text)
    return re.sub(r"``([^`]+)``", r"\1", text)


def to_toml(data: dict[str, Any]) -> str:
    """``data`` (a config dump) as TOML: tables for sections, ``# key = null`` for unset values."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items() if x is not None) + " }"
        return repr(v)

    out: list[str] = []

    def table(prefix: str, node: dict[str, Any]) -> None:
        scalars = {k: v for k, v in node.items() if not isinstance(v, dict) or not v or k == "config_overrides"}
        if prefix and scalars:
            out.append(f"\n[{prefix}]")
        for k, v in scalars.items():
            out.append(f"# {k} = null" if v is None else f"{k} = {value(v)}")
        for k, v in node.items():
            if k not in scalars:
                table(f"{prefix}.{k}" if prefix else k, v)

    table("", data)
    return "\n".join(out).lstrip("\n") + "\n"


def _cmd_export(args: argparse.Namespace) -> int:
    from geartrain.trainer.export import export_checkpoint
    from geartrain.trainer.interrupt import InterruptWatch

    watch = InterruptWatch()
    try:
        with watch:
            out, step = export_checkpoint(
                args.checkpoint, args.out_dir, overwrite=args.overwrite, trust_remote_code=args.trust_remote_code
            )
    except KeyboardInterrupt:
        if not watch.terminated:
            raise
        with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone (EIO)
            print(f"\n{watch.how}", file=sys.stderr)
        return watch.exit_status
    print(f"exported step {step} of {args.checkpoint} to {out}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from geartrain.trainer.run import train_from_cli

    return train_from_cli(args.config, args.overrides, resume=args.resume, overwrite=args.overwrite)


def _cmd_bench_memory(args: argparse.Namespace) -> int:
    from geartrain.bench_memory import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    from geartrain import __version__

    parser = argparse.ArgumentParser(prog="geartrain", description=__doc__)
    parser.add_argument("--version", action="version", version=f"geartrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plugins", help="list installed plugins (engines, rollouts, extensions)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_cmd_plugins)

    p = sub.add_parser(
        "check",
        help="validate a job without training: the config (and its backends' sections), "
        "its data files, reward function and prompt lengths",
    )
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", default=[], help="dotted overrides, e.g. actor.engine.optim.lr=1e-5")
    p.add_argument(
        "--no-plugins",
        action="store_true",
        help="skip the backend sections (a GPU job checked where its plugins are not installed)",
    )
    p.add_argument(
        "--config-only",
        action="store_true",
        help="check the config alone, not its output directory, data files, reward function and prompt "
        "lengths (a job checked where its data is not)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="check it as 'train --resume' would run it")
    mode.add_argument("--overwrite", action="store_true", help="check it as 'train --overwrite' would run it")
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser(
        "config",
        help="print a job's effective configuration (defaults included), or with --schema "
        "every field, its default and meaning",
    )
    p.add_argument("config", nargs="?", help="the job file (none: the defaults)")
    p.add_argument("overrides", nargs="*", default=[], help="dotted overrides, e.g. trainer.total_steps=10")
    p.add_argument("--schema", action="store_true", help="print every field with its default and description")
    p.add_argument("--json", action="store_true", help="print JSON (the config, or with --schema the JSON schema)")
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser("export", help="write a checkpoint (or a run's newest) as a Hugging Face model directory")
    p.add_argument("checkpoint", help="<output_dir>/checkpoints/actor/step_N, or a run's output_dir")
    p.add_argument("out_dir", help="the directory to write (config, weights, tokenizer, model card)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a previous geartrain export in out_dir (only its own files are removed)",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let the run's model run its own code (transformers' trust_remote_code); never taken from the run",
    )
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("train", help="run a training job from a config file")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", default=[], help="dotted overrides, e.g. trainer.total_steps=10")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--resume", action="store_true", help="continue the run in trainer.output_dir from its newest intact checkpoint"
    )
    mode.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run in trainer.output_dir (set aside after every check passed, deleted after the first step)",
    )
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("bench", help="measurements on this machine")
    # the metavar names the choices in "required" errors (argparse names the dest otherwise)
    bench = p.add_subparsers(dest="bench", required=True, metavar="{memory}")
    from geartrain.bench_memory import add_arguments

    m = bench.add_parser(
        "memory",
        help="peak memory per phase of a GRPO step (rollout, old log-probs, update) on a "
        "model preset, and the largest preset that trains here (--largest)",
    )
    add_arguments(m)
    m.set_defaults(func=_cmd_bench_memory)
    # each command's own parser, so that an error after parsing shows that command's usage
    for command in (*sub.choices.values(), m):
        command.set_defaults(command_parser=command)
    return parser


def _torch_environment_problem() -> str | None:
    """Why torch cannot be imported under this environment's ``TORCH_LOGS`` (``None``: it can,
    or the variable is unset): torch checks it at import and raised a 38-line traceback."""
    value = os.environ.get("TORCH_LOGS")
    if value is None:
        return None
    try:
        import torch  # noqa: F401 - the import is the check
    except ValueError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"torch refuses TORCH_LOGS={value!r} ({first}); unset it, or see TORCH_LOGS=help for valid names"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    for stream in (sys.stdout, sys.stderr):
        # a character the terminal's encoding lacks (a path in PYTHONIOENCODING=ascii) is
        # written escaped: a line about a run must not be what fails it
        with contextlib.suppress(AttributeError, ValueError, OSError):
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
    try:
        os.getcwd()
    except FileNotFoundError:  # else torch's import fails first, naming itself (MKL cannot load libtorch_cpu)
        print(
            "error: the working directory no longer exists (it was removed after the shell entered it); "
            "cd to an existing directory and run the command again",
            file=sys.stderr,
        )
        return 2
    if problem := _torch_environment_problem():
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        rc = _main(argv)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return rc
    except BrokenPipeError:  # `geartrain plugins | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports it


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # overrides may follow options (``check job.toml --no-plugins a.b=1``)
    if extra and hasattr(args, "overrides") and not any(e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args) or 0)
    except GeartrainError as exc:
        from geartrain.errors import without_ansi

        print(f"error: {without_ansi(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before a job started (train reports its own step)
        print("\ninterrupted", file=sys.stderr)
        return 130
    except OSError as exc:
        if exc.errno != errno.ENAMETOOLONG:
            raise
        # a path the user gave (a data file, a reward file, a directory) that no filesystem
        # call can take; wherever it is first touched, it is bad input, not a failure
        print(f"error: {exc.filename}: too long a path ({exc.strerror}); give a shorter one", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
