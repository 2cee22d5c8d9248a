"""What a job checks before it trains (``geartrain check`` and the start of ``geartrain
train``): every data file exists and parses, the reward function resolves, and every prompt
fits ``rollout.max_model_len``. All problems are collected and raised together, each under
its config path, so a missing reward file is found before the SFT warm start, and an
over-long prompt before a batch draws it."""

from __future__ import annotations

import difflib
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geartrain.agents import EnvironmentRouter, chat_bridge, load_environments
from geartrain.config import ModelConfig
from geartrain.data import PromptDataset
from geartrain.data.sources import HUB_HINT, DataSource, looks_like_hub_id
from geartrain.errors import ConfigError, GeartrainError
from geartrain.hub import hub_unreachable
from geartrain.lora_check import check_lora
from geartrain.modeling import hf_config, load_tokenizer
from geartrain.rewards import RewardTerm, make_term, probe_term
from geartrain.rewards.terms import takes_environments
from geartrain.trainer.accuracy import accuracy_of
from geartrain.trainer.callbacks import load_callbacks
from geartrain.trainer.config import TrainConfig, silent_default_problems
from geartrain.trainer.sft import sft_dataset
from geartrain.user_code import is_file_spec, load_from_file

#: ``sampling.n`` above this gets a note: a group that large is most likely a typo.
LARGE_GROUP = 1024


@dataclass
class Preflight:
    """The checked pieces, for the job to use rather than build twice."""

    tokenizer: Any
    reward: list[RewardTerm] | None = None
    """The reward terms, resolved (``None`` with a reward model)."""
    datasets: dict[str, PromptDataset] = field(default_factory=dict)
    """By config key: ``data.path``, ``validation.path``, ``sft.path``, ``sft.dev_path``."""
    notes: list[str] = field(default_factory=list)
    """Findings that do not stop a run (e.g. responses capped by ``max_model_len``)."""


def resolve_reward(spec: str | Callable[..., Any] | None, base_dir: str | None) -> Any:
    """A registered name / dotted path stays as is; ``file.py:function`` (relative to
    ``base_dir``) is imported from that file."""
    if not isinstance(spec, str) or not is_file_spec(spec):
        return spec
    fn = load_from_file(spec, base_dir, what="reward function", key="reward.function")
    if not callable(fn):
        raise GeartrainError(f"reward function '{spec}' is not callable ({type(fn).__name__})")
    return fn


def _python_reward_specs(
    reward_fn: Any, weights: Sequence[float] | None, batched: bool | None, problems: list[tuple[str, str]]
) -> list[tuple[str, Any, dict[str, Any]]]:
    """``run_job``'s ``reward_fn`` (one function or spec, or a list of them, TRL's
    ``reward_funcs``) with ``reward_weights`` (TRL's, one per function; default 1 each) as
    ``(key, spec, make_term's keywords)``; each term is named after its function (a
    repeated name gets ``_2``, ``_3``...), so each is logged as ``reward/<name>/mean``. A
    function that is neither callable nor a ``"file.py:name"`` spec, and a weight that is no
    finite number, are problems under their argument's name."""
    for i, weight in enumerate(weights or []):
        try:
            finite = math.isfinite(float(weight))
        except (TypeError, ValueError):
            finite = False
        if not finite:
            problems.append((f"reward_weights[{i}]", f"{weight!r} is not a finite number"))
    if problems:
        return []
    for i, fn in enumerate(reward_fn if isinstance(reward_fn, list | tuple) else [reward_fn]):
        if not (callable(fn) or isinstance(fn, str)):
            key = f"reward_fn[{i}]" if isinstance(reward_fn, list | tuple) else "reward_fn"
            problems.append((key, f"{fn!r} ({type(fn).__name__}) is neither a function nor a 'file.py:name' spec"))
    if problems:
        return []
    if not isinstance(reward_fn, list | tuple):
        if weights is not None and len(weights) != 1:
            problems.append(("reward_weights", f"{len(weights)} weights for one reward function"))
        weight = float(weights[0]) if weights else 1.0
        return [("reward.function", reward_fn, {"batched": batched, "weight": weight})]
    if weights is not None and len(weights) != len(reward_fn):
        problems.append(("reward_weights", f"{len(weights)} weights for {len(reward_fn)} reward functions"))
        weights = None
    specs: list[tuple[str, Any, dict[str, Any]]] = []
    seen: dict[str, int] = {}
    for i, fn in enumerate(reward_fn):
        label = fn if isinstance(fn, str) else getattr(fn, "name", None) or getattr(fn, "__name__", "reward")
        label = str(label).rsplit(":", 1)[-1]
        seen[label] = seen.get(label, 0) + 1
        name = label if seen[label] == 1 else f"{label}_{seen[label]}"
        weight = float(weights[i]) if weights is not None else getattr(fn, "weight", 1.0)
        specs.append((f"reward_fn[{i}]", fn, {"name": name, "weight": weight, "batched": batched}))
    return specs


def _resolve_reward(
    config: TrainConfig,
    reward_fn: Any | None,
    problems: list[tuple[str, str]],
    reward_weights: Sequence[float] | None = None,
) -> list[RewardTerm] | None:
    """The job's reward terms (``None`` with a reward model); each one that does not resolve
    or whose signature does not fit is a problem under its key. ``reward_fn`` (Python's
    ``run_job``) replaces the job's ``reward.function`` / ``[[reward.functions]]``."""
    reward = config.reward
    if reward_fn is not None:
        specs = _python_reward_specs(reward_fn, reward_weights, reward.batched, problems)
        if not specs:  # the functions or their weights are wrong: named, nothing to probe
            return None
    elif reward.model is not None:
        return None
    elif reward.functions:
        specs = [
            (f"reward.functions[{i}].function", f.function, {"name": f.name, "weight": f.weight, "batched": f.batched})
            for i, f in enumerate(reward.functions)
        ]
    else:
        specs = [("reward.function", reward.function, {"batched": reward.batched})]
    terms = []
    for key, spec, how in specs:
        try:
            how.setdefault("name", spec if isinstance(spec, str) else None)
            how["truth_column"] = config.data.ground_truth_key
            terms.append(make_term(resolve_reward(spec, config.base_dir), **how))
        except GeartrainError as exc:
            problems.append((key, str(exc)))
    return terms if len(terms) == len(specs) else None


def _probe_rewards(
    config: TrainConfig,
    terms: list[RewardTerm],
    dataset: PromptDataset,
    problems: list[tuple[str, str]],
    notes: list[str] | None = None,
) -> None:
    """Call every reward term on the first rows, with each row's ground truth as the
    response (a dummy a run could produce), as step 1 would (within ``reward.timeout_s``,
    as a run's batch: a function that hangs is a note, not a hang). A row that every term returns
    ``None`` for has no reward (a run counts it as a failed sample): on every probed row
    that is a problem, on some a note."""
    rows = dataset.rows[:4]
    truths = ["" if r.ground_truth is None else r.ground_truth for r in rows]
    unscored = set(range(len(rows)))
    refused = False
    for i, term in enumerate(terms):
        key = f"reward.functions[{i}].function" if config.reward.functions else "reward.function"
        if config.rollout.agent is not None and term.batched and takes_environments(term.fn):
            unscored = set()  # it reads the environments episodes leave: none exist before the run
            continue
        absent: list[int] = []
        problem = probe_term(
            term,
            truths,
            truths,
            [r.prompt for r in rows],
            [dict(r.meta) for r in rows],
            [r.where for r in rows],
            notes,
            absent,
            [r.messages for r in rows],
            timeout_s=config.reward.timeout_s,
            max_steps=config.trainer.total_steps,
        )
        unscored &= set(absent)
        if len(terms) > 1 and rows and len(set(absent)) == len(rows) and not problem and notes is not None:
            notes.append(
                f"{key}: '{term.name}' returned None for every probed row ({len(rows)}): a function that always "
                "does scores nothing (None leaves it out of a sample's reward)"
            )
        if problem:
            refused = True
            problems.append((key, f"'{term.name}' {problem}"))
    if unscored and not refused:
        key = "reward.functions" if config.reward.functions else "reward.function"
        first = rows[min(unscored)].where
        what = (
            f"every reward function returned None on {len(unscored)} of {len(rows)} probed rows (first: {first}): "
            "a run scores such a sample 0 and counts it in reward/errors"
        )
        if len(unscored) == len(rows):
            problems.append((key, f"{what}; return a score for the samples a function applies to"))
        elif notes is not None:
            notes.append(f"{key}: {what}")


def _loggers_installed(config: TrainConfig, problems: list[tuple[str, str]]) -> None:
    """Each optional logger's library can be imported and the logger can start: W&B online
    has credentials, an MLflow server answers (before anything is claimed or deleted)."""
    import importlib.util

    from geartrain.trainer.loggers import INSTALL, tracker_problems

    missing = [name for name in config.trainer.loggers if name in INSTALL and importlib.util.find_spec(name) is None]
    for name in missing:
        problems.append(("trainer.loggers", f"'{name}' is not installed; install it: {INSTALL[name]}"))
    t = config.trainer
    usable = [name for name in t.loggers if name not in missing]
    for problem in tracker_problems(usable, t.wandb_mode, t.mlflow_tracking_uri):
        problems.append(("trainer.loggers", problem))


def _positions_fit(config: TrainConfig, problems: list[tuple[str, str]]) -> None:
    """``rollout.max_model_len`` within the model's ``max_position_embeddings`` (past it the
    positions are ones the model never saw: sampling goes on, quietly wrong)."""
    try:
        hf = hf_config(config.model)
    except Exception:  # noqa: BLE001 - the tokenizer's load and _model_builds report a model that cannot be read
        return
    text = getattr(hf, "text_config", None) or hf
    positions = getattr(text, "max_position_embeddings", None)
    if isinstance(positions, int) and config.rollout.max_model_len > positions:
        problems.append(
            (
                "rollout.max_model_len",
                (
                    f"{config.rollout.max_model_len} exceeds the model's max_position_embeddings={positions}; "
                    f"set rollout.max_model_len <= {positions}"
                ),
            )
        )


def _tokenizer_problem(config: TrainConfig, exc: BaseException) -> str:
    """One line for a tokenizer that does not load (transformers' message spans lines),
    naming the directory it was read from and the files such a directory lacks."""
    source = config.model.tokenizer or config.model.path
    why = (
        " ".join(line.strip() for line in str(exc).splitlines() if line.strip())[:500].rstrip(".") or type(exc).__name__
    )
    hint = ""
    if source is not None and Path(source).is_dir():
        wanted = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        if not any((Path(source) / name).is_file() for name in wanted):
            hint = f"; {source} holds no tokenizer files ({', '.join(wanted)}): set model.tokenizer to one that does"
    return f"cannot load the tokenizer{f' of {source}' if source else ''}: {why}{hint}"


def adapter_not_model_problem(path: str) -> str | None:
    """What is wrong with ``path`` when it is a LoRA adapter directory (PEFT's
    ``adapter_config.json`` and no model ``config.json``: a LoRA run's ``hf/`` export) given
    where a model belongs, else ``None``; transformers says "Unrecognized model" there."""
    directory = Path(os.path.expanduser(path))
    if not (directory / "adapter_config.json").is_file() or (directory / "config.json").is_file():
        return None
    try:
        adapter = json.loads((directory / "adapter_config.json").read_text(encoding="utf-8"))
        base = adapter.get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    return (
        f"'{path}' is a LoRA adapter (PEFT's adapter_config.json{f', base model {base!r}' if base else ''}), not a "
        "model: give its base model as model.path (with actor.lora to train an adapter again), or the merged "
        "model a LoRA run exports with actor.lora.export_merged = true (merged/, beside its adapter)"
    )


def _vocabulary_problem(
    model: ModelConfig, module: Any, tokenizer: Any, what: str = "the model"
) -> tuple[str, str] | None:
    """A tokenizer with more tokens than the model has embedding rows: its ids past the last
    row cannot be embedded, and the rollout refused the first prompt holding one, at step 0,
    naming neither the tokenizer nor the model's size. (Fewer is fine: models round their
    vocabulary up.)"""
    embeddings = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    try:
        tokens = len(tokenizer) if tokenizer is not None else None
    except TypeError:
        return None
    if not isinstance(rows, int) or tokens is None or tokens <= rows:
        return None
    key = "model.tokenizer" if model.tokenizer is not None else "model"
    return (
        key,
        f"the tokenizer has {tokens:,} tokens and {what} embeds {rows:,} (its vocab_size): ids past {rows - 1:,} "
        "cannot be embedded; use the model's own tokenizer, or a model whose vocab_size is at least the tokenizer's",
    )


def _read_under_another_name(model: ModelConfig, key: str, value: Any, base: dict[str, Any]) -> bool:
    """Whether the override ``key`` changes another setting of the config it is given to (a
    legacy name its constructor converts: ``rope_theta`` into ``rope_parameters``)."""
    try:
        one = hf_config(model.model_copy(update={"config_overrides": {key: value}})).to_dict()
    except Exception:  # noqa: BLE001 - a config that cannot be made: the build names it
        return True
    missing = object()
    return any(base.get(name, missing) != setting for name, setting in one.items() if name != key)


#: A run this long with no checkpoint before its end is said (an interrupt loses all of it).
UNSAVED_STEPS = 50


def _critic_reads_the_tokens(config: TrainConfig, problems: list[tuple[str, str]], tokenizer: Any) -> None:
    """A PPO critic of a model of its own (``critic.model``) embeds the policy's tokens: one
    with a smaller vocabulary failed at step 1 in an 80-line IndexError."""
    from geartrain.modeling import build_hf_model

    critic = config.critic.model
    if config.algorithm.name != "ppo" or critic is None:
        return
    try:
        module = build_hf_model(critic.model_copy(update={"value_head": True}), meta=True)
    except Exception as exc:  # noqa: BLE001 - transformers' own validation: any failure is the config's
        lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
        problems.append(("critic.model", f"the critic cannot be built as configured ({' '.join(lines[:2])[:300]})"))
        return
    if (problem := _vocabulary_problem(critic, module, tokenizer, "the critic's model")) is not None:
        problems.append(("critic.model", problem[1]))


def _output_among_data(config: TrainConfig) -> list[tuple[str, str]]:
    """``trainer.output_dir`` equal to, or inside, a data directory of the job: the run's
    metrics.jsonl and completions.jsonl would be read as data by the next run, which then
    refused the directory for its run's subdirectories."""
    out = os.path.realpath(os.path.expanduser(config.trainer.output_dir))  # as the job takes it
    problems = []
    for key, value in (
        ("data.path", config.data.path),
        ("validation.path", config.validation.path),
        ("sft.path", config.sft.path),
        ("sft.dev_path", config.sft.dev_path),
    ):
        if not isinstance(value, str):
            continue
        data = os.path.realpath(os.path.expanduser(config.resolve(value) or value))
        if os.path.isdir(data) and (out == data or out.startswith(data.rstrip(os.sep) + os.sep)):
            problems.append(
                (
                    "trainer.output_dir",
                    f"{out} is {'the' if out == data else 'inside the'} data directory of {key} ({data}): the run's "
                    "files (metrics.jsonl, completions.jsonl...) would be read as data; choose a directory elsewhere",
                )
            )
    return problems


def unknown_overrides(model: ModelConfig) -> list[tuple[str, str]]:
    """A problem for each key of ``model.config_overrides`` its model's config does not have
    or whose value is a non-finite number:
    transformers keeps any key given to a config and nothing reads a misspelled one, so the
    model was built with the default and the typo was written into the export's config.json."""
    if not model.config_overrides:
        return []
    try:
        base = hf_config(model.model_copy(update={"config_overrides": {}}))
    except Exception:  # noqa: BLE001 - a config that cannot be read: named elsewhere
        return []
    settings = sorted(base.to_dict())
    known = set(settings) | {name for name in dir(base) if not name.startswith("_")}
    problems = []
    for key, value in model.config_overrides.items():
        values = value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            # a NaN rope_theta built a model whose first step blamed the learning rate
            problems.append((f"model.config_overrides.{key}", f"{value!r} holds a number that is not finite"))
        if key not in known and not _read_under_another_name(model, key, value, base.to_dict()):
            close = difflib.get_close_matches(key, settings, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            problems.append(
                (
                    f"model.config_overrides.{key}",
                    f"not a setting of the {base.model_type} model's config (nothing would read it){hint}",
                )
            )
    return problems


def _model_builds(
    config: TrainConfig, problems: list[tuple[str, str]], notes: list[str], tokenizer: Any = None
) -> None:
    """The policy can be built as configured: its architecture builds (on the meta device:
    nothing is allocated; ``config_overrides`` of the wrong type are named; query heads a
    whole multiple of key/value heads), its safetensors files' headers read, an inline job's
    weights fit this machine's memory, and a local model's pickle weights hold only tensors
    (read without running code), and LoRA adapts layers of it (:func:`check_lora`). Each is
    one line before anything is claimed."""
    from geartrain.modeling import (
        build_hf_model,
        missing_weights_problem,
        pickled_weights_problem,
        weight_shapes_problem,
    )
    from geartrain.weight_files import unreadable_safetensors_problem

    model = config.model
    if model.path is not None and (
        problem := missing_weights_problem(model.path)
        or pickled_weights_problem(model.path)
        or unreadable_safetensors_problem(model.path)
    ):
        problems.append(("model.path", problem))
        return
    try:
        hf_config(model)
    except OSError:
        return  # a model that cannot be read: the tokenizer's load (or the engine's) says so
    except Exception:  # noqa: BLE001 - a config that cannot be made: the build below names it
        pass
    if unknown := unknown_overrides(model):
        problems += unknown
        return
    try:
        module = build_hf_model(model, meta=True)
    except Exception as exc:  # noqa: BLE001 - transformers' own validation: any failure is the config's
        lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
        why = " ".join(lines[:2])[:300] or type(exc).__name__
        problems.append(("model", f"the model cannot be built as configured ({type(exc).__name__}: {why})"))
        return
    if model.path is not None and (problem := weight_shapes_problem(model.path, module)):
        problems.append(("model.path", problem))
        return
    if (problem := _vocabulary_problem(model, module, tokenizer)) is not None:
        problems.append(problem)
        return
    text = getattr(module.config, "text_config", None) or module.config
    heads, kv_heads = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads > 0 and heads % kv_heads:
        problems.append(
            (
                "model",
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}: grouped-query "
                "attention shares each key/value head among a whole number of query heads; check "
                "model.config_overrides",
            )
        )
        return
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    params = sum(p.numel() for p in module.parameters())
    if config.actor.lora is not None:  # wraps the module in place: its sizes are the base model's, taken above
        lora = check_lora(module, config.actor.lora)
        problems += lora.problems
        notes += lora.notes
    if config.cluster.placement != "inline":
        return  # ranks on other machines: their memory is not this one's
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    overrides = ", ".join(f"{k}={v}" for k, v in model.config_overrides.items()) or "none"
    if weights > memory:
        problems.append(
            (
                "model",
                f"the model has {params:,} parameters ({weights / 2**30:,.1f} GiB of {model.dtype} weights), more "
                f"than this machine's {memory / 2**30:,.1f} GiB of memory; check model.config_overrides ({overrides})",
            )
        )
        return
    room = address_space_left()
    trained = weights * TRAINED_COPIES
    if room is not None and trained > room:
        problems.append(
            (
                "model",
                f"training the model's {params:,} parameters takes at least {trained / 2**30:,.1f} GiB (its weights, "
                f"their gradients and Adam's two moments), more than the {room / 2**30:,.1f} GiB this process may "
                f"still map under its address-space limit (ulimit -v); raise the limit or check "
                f"model.config_overrides ({overrides})",
            )
        )


#: copies of the weights that training holds at least: weights, gradients, Adam's two moments
TRAINED_COPIES = 4


def address_space_left() -> int | None:
    """Bytes this process may still map under ``RLIMIT_AS`` (``ulimit -v``), or ``None``
    when there is no such limit (or it cannot be read)."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft == resource.RLIM_INFINITY:
            return None
        with open("/proc/self/status", encoding="ascii") as status:
            mapped = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    except (ImportError, OSError, ValueError, StopIteration):
        return None
    return max(soft - mapped, 0)


def _fit(
    key: str,
    dataset: PromptDataset,
    config: TrainConfig,
    max_tokens: int,
    problems: list[tuple[str, str]],
    notes: list[str],
) -> None:
    limit = config.rollout.max_model_len
    lengths = [(len(r.prompt_ids), r.where) for r in dataset.rows]
    crash = [(n, w) for n, w in lengths if n >= limit]
    if crash:
        n, where = max(crash)
        problems.append(
            (
                key,
                (
                    f"{len(crash)} of {len(lengths)} prompts have >= rollout.max_model_len={limit} tokens, "
                    f"leaving no room to generate (longest: {n} tokens, {where}); "
                    f"set data.max_prompt_length={limit - max_tokens} to drop them or raise rollout.max_model_len"
                ),
            )
        )
    capped = [(n, w) for n, w in lengths if n < limit and n + max_tokens > limit]
    if capped:
        n, where = max(capped)
        notes.append(
            f"{key}: {len(capped)} of {len(lengths)} prompts leave fewer than {max_tokens} tokens to generate within "
            f"rollout.max_model_len={limit} (longest: {n} tokens, {where}); their responses are cut short"
        )


def _batch_fits(dataset: PromptDataset, config: TrainConfig, problems: list[tuple[str, str]]) -> None:
    """The loader's own refusal, found by ``check`` too: with ``drop_last`` a batch larger than
    the data is never full, so no step could run."""
    size = config.data.batch_size
    if config.data.drop_last and size > len(dataset):
        problems.append(
            (
                "data.batch_size",
                f"{size} is larger than the {len(dataset)} prompts of data.path ({dataset.source}), so no batch is "
                "ever full; lower data.batch_size or set data.drop_last=false",
            )
        )


def _environment_tools(factory: Callable[[], Any], timeout_s: float | None) -> list[dict[str, Any]]:
    """The tool specs (``tools``) of one environment built by ``factory``; a constructor
    that raises is the environment's problem, named as such. Its ``close()`` gets
    ``timeout_s`` (``rollout.agent.step_timeout_s``)."""
    from geartrain.agents.runner import close_environment, environment_stop_texts

    try:
        env = factory()
    except Exception as exc:  # noqa: BLE001 - a user's constructor: any failure is reported
        raise GeartrainError(f"building the environment raised {type(exc).__name__}: {exc}") from None
    try:
        environment_stop_texts(env)  # as the episodes' runner reads them
        try:
            tools = getattr(env, "tools", None) or ()
            return [dict(t) for t in tools]
        except Exception as exc:  # noqa: BLE001 - a user's property: any failure is reported
            raise GeartrainError(
                f"{type(env).__name__}.tools must be a list of tool specs (dicts); reading it raised "
                f"{type(exc).__name__}: {exc}"
            ) from None
    finally:
        close_environment(env, timeout_s)  # closing a probe must not fail or hold up start-up, as an episode's


def preflight(
    config: TrainConfig,
    *,
    reward_fn: Callable[..., Any] | Sequence[Any] | None = None,
    reward_weights: Sequence[float] | None = None,
    tokenizer: Any | None = None,
    data: DataSource | None = None,
    validation_data: DataSource | None = None,
) -> Preflight:
    """Check ``config``'s data, reward and prompt lengths; raise :class:`ConfigError`
    listing every problem, or return the checked pieces. ``data`` / ``validation_data``
    (a ``datasets.Dataset`` or a list of dicts) replace ``data.path`` / ``validation.path``."""
    problems: list[tuple[str, str]] = []
    for key, path in (("model.path", config.model.path), ("model.tokenizer", config.model.tokenizer)):
        if tokenizer is None and (why := hub_unreachable(path)) is not None:
            raise ConfigError(
                [
                    (
                        key,
                        f"'{path}' is no file or directory here, and as a hub repository it cannot be fetched: {why}. "
                        f"Download it where there is a network (`hf download {path} --local-dir DIR`) and set "
                        f"{key}=DIR, or set HF_HUB_OFFLINE=1 to use a cached copy",
                    )
                ]
            )
    if config.model.path is not None and (adapter := adapter_not_model_problem(config.model.path)) is not None:
        raise ConfigError([("model.path", adapter)])  # its tokenizer or config would fail, naming neither
    try:
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model)
    except (OSError, ValueError) as exc:
        raise ConfigError([("model", _tokenizer_problem(config, exc))]) from None
    result = Preflight(tokenizer=tokenizer)
    _model_builds(config, problems, result.notes, tokenizer)
    _critic_reads_the_tokens(config, problems, tokenizer)
    _positions_fit(config, problems)
    _loggers_installed(config, problems)
    result.reward = _resolve_reward(config, reward_fn, problems, reward_weights)
    problems += _output_among_data(config)
    if config.trainer.callbacks:  # as the run loads them: `check` said ok to callbacks train refused
        try:
            load_callbacks(config.trainer.callbacks, config.base_dir)
        except GeartrainError as exc:
            problems.append(("trainer.callbacks", str(exc)))
    keys = config.algorithm.gdpo_reward_keys
    if keys and result.reward is not None:
        names = [term.name for term in result.reward]
        if unknown := [key for key in keys if key not in names]:
            problems.append(
                (
                    "algorithm.gdpo_reward_keys",
                    f"{unknown} name no reward function of the job; its functions: {names} (each "
                    "[[reward.functions]] entry's name, or each function given to run_job by its name)",
                )
            )
    if config.reward.accuracy is not None and ":" in config.reward.accuracy:
        try:
            accuracy_of(config)
        except GeartrainError as exc:
            problems.append(("reward.accuracy", str(exc)))
    data_given = data is not None or "data" in config.model_fields_set
    problems += silent_default_problems(config, data_given=data_given, reward_given=reward_fn is not None)

    # PromptDataset's keyword arguments for a multi-turn job: the environment's tool specs for
    # the chat template (tools, or environment_tools per name for named environments)
    dataset_kwargs: dict[str, Any] = {}
    if config.rollout.agent is not None:
        dataset_kwargs["prompt_optional"] = True  # the environment may own the task (its reset supplies it)
        agent = config.rollout.agent
        try:
            factory = load_environments(
                agent.environment, kwargs=agent.environment_kwargs, key=agent.environment_key, base_dir=config.base_dir
            )
            if isinstance(factory, EnvironmentRouter):
                dataset_kwargs["environment_tools"] = {
                    name: _environment_tools(f, agent.step_timeout_s) for name, f in factory.factories.items()
                }
                dataset_kwargs["environment_key"] = agent.environment_key
            else:
                dataset_kwargs["tools"] = _environment_tools(factory, agent.step_timeout_s)
        except GeartrainError as exc:
            problems.append(("rollout.agent.environment", str(exc)))
        if agent.chat_template:
            try:  # as the episodes render every observation (templates that refuse a role fail here)
                chat_bridge(tokenizer, ["observation"], agent.observation_role)
            except GeartrainError as exc:
                problems.append(("rollout.agent.chat_template", str(exc)))

    data_cfg = config.data.model_copy(update={"path": config.resolve(config.data.path)})
    sources: list[tuple[str, Any, Callable[[Any], PromptDataset]]] = [
        (
            "data.path",
            data if data is not None else data_cfg.path,
            lambda p: PromptDataset(p, tokenizer, data_cfg, **dataset_kwargs),
        ),
        (
            "validation.path",
            validation_data if validation_data is not None else config.resolve(config.validation.path),
            lambda p: PromptDataset(p, tokenizer, data_cfg, **dataset_kwargs),
        ),
    ]
    raw_paths = {
        "data.path": config.data.path,
        "validation.path": config.validation.path,
        "sft.path": config.sft.path,
        "sft.dev_path": config.sft.dev_path,
    }
    if config.sft.enabled:
        sources.append(
            (
                "sft.path",
                config.resolve(config.sft.path),
                lambda p: sft_dataset(config.sft, p, tokenizer, config.data, **dataset_kwargs),
            )
        )
        sources.append(
            (
                "sft.dev_path",
                config.resolve(config.sft.dev_path),
                lambda p: PromptDataset(p, tokenizer, config.data.model_copy(update={"path": p}), **dataset_kwargs),
            )
        )
    for key, path, build in sources:
        if path is None:
            if key == "data.path" or (key == "sft.path" and config.sft.enabled):
                problems.append((key, "is not set; give a .jsonl/.json/.parquet/.csv file or a directory"))
            continue
        raw = raw_paths.get(key)
        if isinstance(path, str) and isinstance(raw, str) and not Path(path).exists() and looks_like_hub_id(raw):
            problems.append(
                (key, f"'{raw}' is not a file or directory here; if it is a Hugging Face hub id, {HUB_HINT}")
            )
            continue
        try:
            result.datasets[key] = build(path)
        except GeartrainError as exc:
            problems.append((key, str(exc)))

    if result.reward is not None and "data.path" in result.datasets:
        _probe_rewards(config, result.reward, result.datasets["data.path"], problems, result.notes)
    for key in ("data.path", "sft.dev_path"):
        if key in result.datasets:
            _fit(key, result.datasets[key], config, config.sampling.max_tokens, problems, result.notes)
    if "validation.path" in result.datasets:
        max_tokens = config.validation.max_tokens or config.sampling.max_tokens
        _fit("validation.path", result.datasets["validation.path"], config, max_tokens, problems, result.notes)
    if "data.path" in result.datasets:
        _batch_fits(result.datasets["data.path"], config, problems)
    if problems:
        raise ConfigError(problems, "the job's model, data and reward (nothing was trained or changed)")
    unused = [k for k in ("max_staleness", "async_tis_cap") if k in config.trainer.model_fields_set]
    if unused and not config.trainer.async_rollout:  # ignored without a word before
        result.notes.append(
            f"trainer.{' and trainer.'.join(unused)} set the async rollout, which is off (trainer.async_rollout = "
            "false): they have no effect"
        )
    same = config.data.path is not None and config.validation.path is not None
    if same and os.path.realpath(config.resolve(config.validation.path)) == os.path.realpath(
        config.resolve(config.data.path)
    ):
        result.notes.append(
            f"validation.path is data.path ({config.data.path}): the validation accuracy is measured on training "
            "prompts, not held-out ones"
        )
    if config.trainer.save_every == 0 and (steps := config.trainer.total_steps) >= UNSAVED_STEPS:
        result.notes.append(
            f"trainer.save_every = 0: the run saves its only checkpoint after its last step ({steps}); "
            "stopped before (Ctrl-C, a crash) it starts over: set trainer.save_every to keep its progress"
        )
    if config.sampling.n > LARGE_GROUP:
        result.notes.append(
            f"sampling.n={config.sampling.n} samples per prompt: each step generates and scores "
            f"{config.sampling.n * config.data.batch_size} responses (sampling.n x data.batch_size); "
            "GRPO groups are usually 4 to 64"
        )
    return result
