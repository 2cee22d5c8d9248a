"""What changed between the config a run was started with and the one it is resumed with.

``--resume`` compares the new config with the run's saved ``config.json`` and lists every
difference, each with a verdict: *applied* (the setting takes effect from the next step) or
*refused* (it cannot apply to a run in progress: the model, the data, the algorithm, the
optimizer state restored from the checkpoint...). A resume with any refused change stops
before anything is loaded or changed; nothing is ignored silently.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from geartrain.errors import ConfigError

Verdict = Literal["applied", "refused"]

#: ``(key prefix, verdict, why)``; the longest matching prefix decides. A key no rule
#: covers is refused: only settings known to be safe to change mid-run are applied.
RULES: list[tuple[str, Verdict, str]] = [
    ("model", "refused", "the checkpoint holds this model's weights"),
    ("critic.model", "refused", "the checkpoint holds the critic's weights"),
    ("data", "refused", "the data loader's position is tied to the dataset, its order and filtering"),
    ("algorithm", "refused", "the run's objective cannot change mid-run"),
    ("sft", "refused", "the SFT warm start of this run already ran"),
    ("reference", "refused", "the reference policy is the run's starting policy"),
    ("actor.engine", "refused", "the actor's engine state is restored from the checkpoint"),
    ("critic.engine", "refused", "the critic's engine state is restored from the checkpoint"),
    ("actor.engine.optim", "refused", "the optimizer and LR schedule are restored from the checkpoint"),
    ("critic.engine.optim", "refused", "the optimizer and LR schedule are restored from the checkpoint"),
    ("actor.engine.parallel", "applied", "the engine reshards the checkpoint onto the new ranks (FSDP's DCP does)"),
    ("critic.engine.parallel", "applied", "the engine reshards the checkpoint onto the new ranks (FSDP's DCP does)"),
    ("reference.engine.parallel", "applied", "the reference is rebuilt from the starting policy on the new ranks"),
    (
        "actor.engine.optim.total_steps",
        "applied",
        "the LR schedule's horizon follows trainer.total_steps; its position comes from the checkpoint",
    ),
    (
        "critic.engine.optim.total_steps",
        "applied",
        "the LR schedule's horizon follows trainer.total_steps; its position comes from the checkpoint",
    ),
    ("actor.engine.max_tokens_per_micro_batch", "applied", "micro-batching does not change the result"),
    ("critic.engine.max_tokens_per_micro_batch", "applied", "micro-batching does not change the result"),
    ("actor.engine.gradient_checkpointing", "applied", "recomputation does not change the result"),
    ("critic.engine.gradient_checkpointing", "applied", "recomputation does not change the result"),
    ("actor.lora", "refused", "the checkpoint holds adapters of this rank and these targets, trained with this scale"),
    (
        "actor.engine.lora",
        "refused",
        "the checkpoint holds adapters of this rank and these targets, trained with this scale",
    ),
    ("actor.lora.sync", "applied", "how the adapters reach the rollout; the rollout is rebuilt"),
    ("actor.engine.lora.sync", "applied", "how the adapters reach the rollout; the rollout is rebuilt"),
    ("actor.lora.export_merged", "applied", "takes effect at the export"),
    ("actor.engine.lora.export_merged", "applied", "takes effect at the export"),
    ("trainer.seed", "refused", "the remaining steps' sampling seeds derive from it"),
    ("trainer.output_dir", "applied", "the run was found in the new directory"),
    ("trainer", "applied", "takes effect from the next step"),
    ("validation", "applied", "takes effect at the next validation"),
    ("sampling", "applied", "takes effect from the next step"),
    ("rollout", "applied", "the rollout is rebuilt and gets the checkpoint's weights"),
    ("reward", "applied", "takes effect from the next step"),
    ("cluster", "applied", "the roles are placed anew and load the checkpoint"),
    ("watchdog", "applied", "takes effect from the next step"),
]
#: Keys never compared: where the job file lives is not a setting.
IGNORED = ("base_dir",)


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any
    verdict: Verdict
    reason: str

    def line(self) -> str:
        return f"{self.key}: {json.dumps(self.old)} -> {json.dumps(self.new)} ({self.verdict}: {self.reason})"


_MISSING = "<not set>"


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and not value and prefix:
        return {}  # an empty table is no setting: its keys given later are "<not set>" before
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def _rule(key: str) -> tuple[Verdict, str]:
    best: tuple[int, Verdict, str] = (-1, "refused", "not known to be safe to change in a run in progress")
    for prefix, verdict, why in RULES:
        if (key == prefix or key.startswith(prefix + ".")) and len(prefix) > best[0]:
            best = (len(prefix), verdict, why)
    return best[1], best[2]


def diff_configs(saved: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    """Every leaf that differs between two config dicts (as ``model_dump(mode="json")``
    gives them), sorted by key, each with its verdict."""
    a, b = _flatten(saved), _flatten(new)
    changes = []
    for key in sorted(set(a) | set(b)):
        if key.split(".")[0] in IGNORED:
            continue
        old, now = a.get(key, _MISSING), b.get(key, _MISSING)
        if old != now:
            verdict, why = _rule(key)
            if (
                key.startswith("sft.")
                and key != "sft.enabled"
                and not a.get("sft.enabled")
                and not b.get("sft.enabled")
            ):
                verdict, why = "applied", "no effect: the run has no SFT warm start (sft.enabled = false)"
            changes.append(Change(key, old, now, verdict, why))
    return _options_of_a_new_backend(changes)


def _options_of_a_new_backend(changes: list[Change]) -> list[Change]:
    """A section whose backend changed gets the new backend's options: its ``options.*``
    differences (every default of both, 22 lines for torch -> vllm) are one line."""
    for backend in [c for c in changes if c.key.endswith(".backend")]:
        section = backend.key.removesuffix(".backend")
        options = [c for c in changes if c.key.startswith(f"{section}.options.")]
        if len(options) < 2:
            continue
        verdicts = {c.verdict for c in options}
        verdict: Verdict = "refused" if "refused" in verdicts else "applied"
        why = next(c.reason for c in options if c.verdict == verdict)
        merged = Change(
            f"{section}.options",
            f"{backend.old}'s ({len([c for c in options if c.old != _MISSING])} settings)",
            f"{backend.new}'s ({len([c for c in options if c.new != _MISSING])} settings)",
            verdict,
            why,
        )
        changes = [c for c in changes if c not in options]
        changes.insert(changes.index(backend) + 1, merged)
    return changes


def check_resume_config(saved: dict[str, Any], new: dict[str, Any], source: str) -> list[Change]:
    """The changes of a resume; raises :class:`ConfigError` listing every change (the
    refused ones as the problems) when any is refused."""
    changes = diff_configs(saved, new)
    refused = [c for c in changes if c.verdict == "refused"]
    if refused:
        problems = [(c.key, f"{json.dumps(c.old)} -> {json.dumps(c.new)}: refused, {c.reason}") for c in refused]
        applied = [c for c in changes if c.verdict == "applied"]
        notes = ["would be applied: " + "; ".join(c.line() for c in applied)] if applied else []
        notes.append(
            "revert the refused settings to resume, or start a new run (another trainer.output_dir, "
            "or --overwrite; e.g. from this run's export with model.path=<output_dir>/hf)"
        )
        raise ConfigError(problems, f"--resume of {source}: the config differs from the run's", notes=notes)
    return changes
