"""A whole training job: optional SFT warm start, then GRPO/PPO, validation, checkpoints,
metrics, HF export and the curves PNG. ``geartrain train`` calls :func:`train_from_cli`;
Python users call :func:`run_job` with a :class:`TrainConfig` (see
``examples/arithmetic/train.py``)."""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import os
import random
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from geartrain.checkpoint import MARKER, CheckpointManager, export_disk_full, run_disk_full, step_dir_name
from geartrain.cluster import Dispatch, InlinePlacement, Placement, WorkerGroup, make_placement
from geartrain.cluster.dispatch import prompt_batch
from geartrain.config import ModelConfig
from geartrain.data import PromptBatch, PromptDataset, PromptLoader
from geartrain.data.sources import DataSource
from geartrain.errors import CheckpointError, ConfigError, GeartrainError, NonFiniteError, RunDirectoryRemovedError
from geartrain.export import ModelCard, base_model_name, finish_adapter_export, finish_hf_export
from geartrain.manifest import MANIFEST, record_new_files, verify_manifest, write_manifest
from geartrain.rewards import RewardResult
from geartrain.stop_texts import cut_batch_at_stop_texts
from geartrain.trainer.accuracy import Accuracy, accuracy_of
from geartrain.trainer.callbacks import Callbacks, load_callbacks
from geartrain.trainer.completions import CompletionsLogger, console_table, episodes, pick
from geartrain.trainer.config import TrainConfig, load_train_config, revalidated
from geartrain.trainer.config_diff import check_resume_config, diff_configs
from geartrain.trainer.episodes import annotate_episodes, episode_prompt_batch
from geartrain.trainer.export import clear_previous_export, write_export_record
from geartrain.trainer.generation import stop_rules
from geartrain.trainer.interrupt import (
    InterruptWatch,
    RunPosition,
    interrupted_message,
    is_interrupt,
)
from geartrain.trainer.loggers import Fanout, MlflowLogger, WandbLogger
from geartrain.trainer.loss_config import actor_loss_config, critic_loss_config
from geartrain.trainer.metrics import (
    JsonlLogger,
    Progress,
    TensorBoardLogger,
    TqdmLoggingHandler,
    plot_curves,
    read_jsonl,
    step_ranges,
)
from geartrain.trainer.preflight import Preflight, preflight
from geartrain.trainer.rl import RLRoles, RLTrainer
from geartrain.trainer.roles import ActorRolloutWorker, CriticWorker, ReferenceWorker, RewardWorker, SFTWorker
from geartrain.trainer.rundir import SET_ASIDE, RunDirectory, RunDirectoryError, recorded_config
from geartrain.trainer.separate import RolloutReplica, TrainerWorker, VersionedGroup
from geartrain.trainer.sft import observation_renderer, run_sft
from geartrain.trainer.stdout import reader_may_leave
from geartrain.trainer.watchdog import TrainingStalledError, Watchdog, non_finite_stop
from geartrain.types import SamplingParams
from geartrain.workdir import WorkingDirectoryGuard

logger = logging.getLogger("geartrain.trainer")


@dataclass(kw_only=True)
class JobResult:
    accuracy_before: float | None
    accuracy_after: float | None
    steps: int
    output_dir: Path
    seconds: float


def greedy_accuracy(
    group: Any,
    scorer: RewardWorker,
    rows: list[Any],
    tokenizer: Any,
    cfg: TrainConfig,
    accuracy: Accuracy | None = None,
) -> float:
    """Greedy accuracy (``reward.accuracy``: :mod:`geartrain.trainer.accuracy`) of
    ``group``'s current policy on ``rows`` (its ``generate`` syncs the weights first);
    responses end at ``sampling.stop`` strings as the RL step's do."""
    stop_ids, stop_sequences = stop_rules(cfg, tokenizer)  # as the RL step's responses end
    sampling = SamplingParams(
        n=1,
        temperature=0.0,
        max_tokens=cfg.sampling.max_tokens,
        stop_token_ids=stop_ids,
        stop_sequences=stop_sequences,
        seed=0,
    )
    if cfg.rollout.agent is not None:  # greedy episodes: the answer is the last model turn
        prompts = PromptBatch(rows=rows, indices=list(range(len(rows))), epoch=-1)
        batch = group.call(
            "run_episodes",
            episode_prompt_batch(prompts, cfg.data.ground_truth_key),
            sampling,
            cfg.rollout.agent,
            cfg.base_dir,
            dispatch=Dispatch.DP,
        )
        batch, _ = annotate_episodes(batch, prompts, 1)
    else:
        batch = group.call("generate", prompt_batch([r.prompt_ids for r in rows]), sampling, dispatch=Dispatch.DP)
        cut_batch_at_stop_texts(batch, tokenizer, cfg.sampling.stop)
        mask = batch["response_mask"].bool()
        texts = tokenizer.batch_decode(
            [batch["input_ids"][i][mask[i]].tolist() for i in range(len(batch))], skip_special_tokens=True
        )
        batch["response_text"] = texts
        batch["ground_truth"] = [r.ground_truth for r in rows]
        batch["prompt"] = [r.prompt for r in rows]
        batch["data_meta"] = [r.meta for r in rows]
        batch["prompt_messages"] = [r.messages for r in rows]
    result = RewardResult.from_rows(scorer.score(batch))
    values = (accuracy or accuracy_of(cfg))(result, batch)
    return sum(values) / max(len(values), 1)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (2**32))
    except ImportError:  # pragma: no cover
        pass


def _shutdown(roles: RLRoles) -> None:
    done: list[WorkerGroup] = []
    for group in (roles.actor, roles.reference, roles.critic, roles.reward, roles.rollout):
        if group is not None and not any(group is d for d in done):  # LoRA: the reference may be the actor's group
            group.shutdown()
            done.append(group)


def reference_weight_bytes(model: ModelConfig) -> int:
    """Bytes of the weights a separate reference engine would hold (counted on the meta
    device: nothing is allocated)."""
    from geartrain.modeling import build_hf_model

    module = build_hf_model(model, meta=True)
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _due(step: int, every: int, total: int) -> bool:
    return step == total or (every > 0 and step % every == 0)


class Job:
    """Builds the roles for ``config`` and runs them; see :func:`run_job`."""

    def __init__(
        self,
        config: TrainConfig,
        *,
        resume: bool = False,
        overwrite: bool = False,
        reward_fn: Callable[..., Any] | Sequence[Any] | None = None,
        reward_weights: Sequence[float] | None = None,
        callbacks: Sequence[Any] = (),
        echo: Callable[[str], None] = print,
        data: DataSource | None = None,
        validation_data: DataSource | None = None,
    ) -> None:
        self.config = config
        self.resume = resume
        self.rundir = RunDirectory(Path(config.trainer.output_dir), resume=resume, overwrite=overwrite)
        self.reward_fn = reward_fn
        self.reward_weights = reward_weights
        self.extra_callbacks = list(callbacks)
        self.callbacks = Callbacks([])
        self.data, self.validation_data = data, validation_data
        self.echo = echo
        self.out = Path(config.trainer.output_dir)
        self.workdir = WorkingDirectoryGuard()
        """Where relative paths resolve; user code that moves the process elsewhere is undone."""
        self.ckpt_root = self.out / "checkpoints"
        self.algo_label = config.algorithm.name.upper()
        self.placement: Placement | None = None
        self._said_callback_files = False
        self.driver = InlinePlacement()
        """Roles that run in the driver whatever the placement (a rule reward), without call
        deadlines (a reward has its own ``reward.timeout_s``)."""
        self.position = RunPosition(self.out)
        """The step in progress and the newest complete checkpoint (Ctrl-C names them)."""

    def _results_a_restart_replaces(self) -> list[str]:
        """What a run started again in the output directory would replace that a run stopped
        before its first checkpoint does not have: the final export, and the metrics of
        RL steps past step 0."""
        found = []
        if (self.out / "hf").exists():
            found.append("final export (hf/)")
        steps: set[int] = set()
        try:
            with open(self.out / "metrics.jsonl", encoding="utf-8", errors="replace") as metrics:
                for line in metrics:
                    with contextlib.suppress(ValueError, TypeError, AttributeError):
                        record = json.loads(line)
                        if record.get("phase") == "rl" and int(record.get("step", 0)) > 0:
                            steps.add(int(record["step"]))
        except OSError:
            pass
        if steps:
            found.append(f"metrics of {len(steps)} RL step(s) (metrics.jsonl, up to step {max(steps)})")
        return found

    def _placement(self) -> Placement:
        """Where the roles run (``cluster.placement``), created on first use."""
        if self.placement is None:
            self.placement = make_placement(self.config.cluster, log_dir=str(self.out / "logs"))
        return self.placement

    # ------------------------------------------------------------------ phases
    def _latest_checkpoint(self) -> Path | None:
        """The checkpoint to resume from (``None``: start afresh). Only reads: the newest
        intact checkpoint (damaged ones are reported and passed over) and the check of the
        new config against the run's saved one."""
        if not self.resume:
            return None
        critic = self.ckpt_root / "critic" if self.config.algorithm.name == "ppo" else None

        def critic_problems(path: Path) -> list[str]:
            if critic is None:
                return []
            try:
                CheckpointManager.check_complete(critic / path.name)
            except CheckpointError as exc:
                return [f"its critic checkpoint: {exc}"]
            return []

        latest = CheckpointManager(self.ckpt_root / "actor").latest_intact(self.echo, also=critic_problems)
        if latest is None:
            replaced = self._results_a_restart_replaces()
            if replaced:
                raise RunDirectoryError(
                    f"--resume: no complete checkpoint under {self.ckpt_root / 'actor'} (none was saved yet, or they "
                    f"were removed), but {self.out} holds the run's {' and '.join(replaced)}: starting over would "
                    "replace them; nothing was changed. Pass --overwrite to start the run again (the previous one is "
                    "kept aside until the new one's first step), or choose another trainer.output_dir"
                )
            self.echo(f"--resume: no complete checkpoint under {self.ckpt_root / 'actor'}; starting from scratch")
            return None
        saved = self.out / "config.json"
        recorded = recorded_config(latest)
        if saved.is_file() or recorded is not None:
            old = recorded
            if saved.is_file():
                try:
                    written = json.loads(saved.read_text(encoding="utf-8"))
                except (UnicodeDecodeError, ValueError) as exc:
                    if recorded is None:
                        raise CheckpointError(
                            f"{saved} is unreadable ({exc}); cannot compare the config of the run to resume"
                        ) from None
                    written = recorded
                if recorded is None:
                    old = written
                elif edited := [c.key for c in diff_configs(recorded, written) if c.verdict == "refused"]:
                    self.echo(
                        f"--resume: {saved} differs from the config {latest.name} was saved with in "
                        f"{', '.join(edited[:5])}{', ...' if len(edited) > 5 else ''} (edited since?); "
                        "the checkpoint's is the one compared"
                    )
            changes = check_resume_config(old, self.config.model_dump(mode="json"), str(self.out))
            if changes:
                self.echo(f"--resume: the config differs from the run's in {len(changes)} setting(s), all applied:")
                for change in changes:
                    self.echo(f"  {change.line()}")
        else:
            self.echo(f"--resume: {saved} is missing, so the config cannot be compared with the run's")
        reached, total = CheckpointManager.step_of(latest), self.config.trainer.total_steps
        if total < reached:
            raise ConfigError(
                [
                    (
                        "trainer.total_steps",
                        f"{total} is below the step this run already reached ({reached}, its checkpoint "
                        f"{latest.name}): nothing would train, and its export would be step {reached}'s",
                    )
                ],
                f"--resume of {self.out}",
                notes=[
                    f"give trainer.total_steps={reached} or more to resume it; to keep step {reached} as it is, "
                    f"`geartrain export {self.out} DIR` exports it"
                ],
            )
        return latest

    def _sft(self, pre: Preflight, jsonl: JsonlLogger, tb: Fanout | None) -> ModelConfig:
        cfg = self.config
        tokenizer = pre.tokenizer
        sft_dir = self.out / "sft_model"
        dataset = pre.datasets["sft.path"]
        # the warm start trains every weight; LoRA adapters go on the model it produces
        engine = cfg.actor.engine.model_copy(update={"optim": cfg.sft.optim, "lora": None})
        dev = pre.datasets.get("sft.dev_path")
        group = self._placement().group(
            "actor",
            SFTWorker,
            engine,
            cfg.model,
            cfg.rollout if dev is not None else None,
            world_size=engine.parallel.world_size,
            pool="actor",
            seed=cfg.trainer.seed,
        )
        evaluate = None
        if dev is not None:
            scorer = RewardWorker(self.reward_fn, None, None, timeout_s=cfg.reward.timeout_s, ctx=None)  # type: ignore[arg-type]
            accuracy = accuracy_of(cfg)
            evaluate = lambda: greedy_accuracy(group, scorer, dev.rows, tokenizer, cfg, accuracy)  # noqa: E731
        progress = Progress(cfg.sft.steps, 0, "sft", cfg.trainer.progress)

        def on_step(step: int, metrics: dict[str, float]) -> None:
            record = {"phase": "sft", "step": step, **metrics}
            self._stop_if_removed()
            jsonl.write(record)
            if tb is not None:
                tb.write(record)
            progress.update(loss=metrics.get("sft/loss", float("nan")))

        start = time.perf_counter()
        steps, last = run_sft(
            group,
            dataset,
            cfg.sft,
            tokenizer,
            on_step,
            evaluate,
            render_observation=observation_renderer(cfg.rollout.agent, tokenizer),
        )
        progress.close()
        group.call("export_hf", str(sft_dir), tokenizer)
        write_manifest(sft_dir)  # a resume reads the warm start back: it is checked like a checkpoint
        group.shutdown()
        dev_note = f", dev accuracy {100 * last['sft/dev_accuracy']:.1f}%" if "sft/dev_accuracy" in last else ""
        self.echo(f"SFT warm start: {steps} steps in {time.perf_counter() - start:.1f}s{dev_note} -> {sft_dir}")
        return self._sft_model()

    def _trackers(self, resume: bool) -> list[Any]:
        """The W&B and MLflow loggers ``trainer.loggers`` names."""
        t = self.config.trainer
        name = t.run_name or self.out.resolve().name
        config = self.config.model_dump(mode="json")
        starts: dict[str, Callable[[], Any]] = {
            "wandb": lambda: WandbLogger(
                self.out, project=t.project, name=name, config=config, mode=t.wandb_mode, resume=resume
            ),
            "mlflow": lambda: MlflowLogger(
                self.out, project=t.project, name=name, config=config, tracking_uri=t.mlflow_tracking_uri
            ),
        }
        out: list[Any] = []
        for key, start in starts.items():
            if key not in t.loggers:
                continue
            try:
                out.append(start())
            except GeartrainError:
                raise
            except Exception as exc:  # noqa: BLE001 - a tracker's library: any failure is one line
                for started in out:
                    started.close()
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                raise GeartrainError(
                    f"trainer.loggers: '{key}' failed to start ({type(exc).__name__}: {first}); "
                    "fix it or leave it out of trainer.loggers"
                ) from None
        return out

    def _sft_model(self) -> ModelConfig:
        """The SFT warm start as the policy (and reference) to build, once its files match
        its manifest."""
        sft_dir = self.out / "sft_model"
        if not (sft_dir / "config.json").exists():
            raise CheckpointError(
                f"{sft_dir} is missing: the SFT warm start of this run did not finish; start afresh with --overwrite"
            )
        problems = verify_manifest(sft_dir, exclude=frozenset())
        if problems:
            raise CheckpointError(
                f"{sft_dir} (the SFT warm start, this run's reference policy) is damaged: {'; '.join(problems)}; "
                "restore it from a copy, or start afresh with --overwrite"
            )
        m = self.config.model
        return ModelConfig(path=str(sft_dir.resolve()), dtype=m.dtype, attn_implementation=m.attn_implementation)

    def build_roles(self, policy: ModelConfig) -> RLRoles:
        """The RL roles for ``policy`` (the configured model or the SFT warm start's) on
        this job's placement: the actor with its rollout, and the reference, critic and
        reward roles the config needs. The caller shuts them down."""
        cfg = self.config
        placement, seed = self._placement(), cfg.trainer.seed

        def pool(role: str) -> str | None:  # colocated roles live in the actor's ranks
            return "actor" if role in cfg.cluster.colocate else None

        separate = cfg.rollout.placement == "separate"
        actor: WorkerGroup = placement.group(
            "actor",
            TrainerWorker if separate else ActorRolloutWorker,
            cfg.actor.engine,
            policy,
            cfg.rollout,
            actor_loss_config(cfg),
            free_memory=cfg.trainer.free_memory,
            async_rollout=cfg.trainer.async_rollout,
            world_size=cfg.actor.engine.parallel.world_size,
            pool="actor",
            seed=seed,
        )
        rollout = None
        if separate:  # the replicas: processes of their own, each a whole inference engine
            actor = VersionedGroup(actor)
            rollout = placement.group(
                "rollout",
                RolloutReplica,
                cfg.rollout,
                policy,
                world_size=cfg.rollout.replicas,
                pool="rollout",
                seed=seed,
                resources=cfg.rollout.resources_per_replica,
            )
        reference, reference_call = None, "compute_log_probs"
        if cfg.builds_reference and cfg.actor.lora is not None:
            # the reference equals the initial policy = the actor's base with its adapters off
            reference, reference_call = actor, "compute_ref_log_probs"
            saved = reference_weight_bytes(policy)
            self.echo(
                f"reference policy: the actor's base with LoRA adapters off "
                f"(no second copy: {saved / 2**20:.1f} MiB saved)"
            )
        elif cfg.builds_reference:
            reference = placement.group(
                "reference",
                ReferenceWorker,
                cfg.reference.engine,
                policy,
                world_size=cfg.reference.engine.parallel.world_size,
                pool=pool("reference"),
                seed=seed,
            )
        critic = None
        if cfg.builds_critic:
            critic_model = cfg.critic.model or policy.model_copy(update={"value_head": True})
            critic = placement.group(
                "critic",
                CriticWorker,
                cfg.critic.engine,
                critic_model,
                critic_loss_config(cfg),
                world_size=cfg.critic.engine.parallel.world_size,
                pool=pool("critic"),
                seed=seed,
            )
        if cfg.reward.model is None and cfg.reward.workers > 0:  # rule functions on Ray actors of their own
            reward: WorkerGroup = placement.group(
                "reward",
                RewardWorker,
                self.reward_fn,
                None,
                None,
                timeout_s=cfg.reward.timeout_s,
                world_size=cfg.reward.workers,
                pool="reward",
                seed=seed,
                resources=cfg.reward.resources_per_worker,
            )
        elif cfg.reward.model is None:  # a rule function needs no model: it runs in the driver
            reward = self.driver.group(
                "reward", RewardWorker, self.reward_fn, None, None, timeout_s=cfg.reward.timeout_s, seed=seed
            )
        else:
            reward = placement.group(
                "reward",
                RewardWorker,
                None,
                cfg.reward.engine,
                cfg.reward.model,
                timeout_s=cfg.reward.timeout_s,
                world_size=cfg.reward.engine.parallel.world_size,
                pool=pool("reward"),
                seed=seed,
            )
        return RLRoles(
            actor=actor,
            reward=reward,
            reference=reference,
            critic=critic,
            reference_call=reference_call,
            rollout=rollout,
        )

    def _data(self, pre: Preflight) -> tuple[PromptLoader, PromptDataset | None]:
        return PromptLoader.from_config(pre.datasets["data.path"]), pre.datasets.get("validation.path")

    def _save(self, roles: RLRoles, trainer: RLTrainer, step: int, accuracy_before: float | None) -> None:
        self._stop_if_removed()
        keep = self.config.trainer.keep_last
        extra = {
            "step": step,
            "loader": trainer.loader_state(),
            "accuracy_before": accuracy_before,
            "kl_coef": trainer.kl_ctrl.value if trainer.kl_ctrl is not None else None,
            "python_random": random.getstate(),
            "sft_model": self._sft_fingerprint(),
            # read by `geartrain export` from the checkpoint's engine.json, not from config.json
            "record": {
                "base_model": self.config.model.model_dump(mode="json"),
                "algorithm": self.config.algorithm.name,
                # what --resume compares a new config with: config.json may be edited by hand
                "config": self.config.model_dump(mode="json"),
            },
        }
        if roles.critic is not None:
            roles.critic.call("save_checkpoint", str(self.ckpt_root / "critic"), step, {"step": step}, keep)
        roles.actor.call("save_checkpoint", str(self.ckpt_root / "actor"), step, extra, keep)
        self.position.checkpoint = step  # only once the save returned: it is complete on disk
        saved = self.ckpt_root / "actor" / step_dir_name(step)
        self.callbacks("on_save", step, saved)
        # a callback keeping its own state in the checkpoint (as TRL's on_save users do) made
        # it "damaged" (a file its manifest does not list): what callbacks add is recorded
        added = record_new_files(saved, exclude=frozenset({MARKER}))
        if added and not self._said_callback_files:
            self._said_callback_files = True
            self.echo(
                f"note: the on_save callbacks added {', '.join(added[:3])}{', ...' if len(added) > 3 else ''} to "
                f"{saved.name}: recorded in its manifest (a file changed after that makes the checkpoint damaged)"
            )

    def _export(self, roles: RLRoles, tokenizer: Any, total: int, last_validation: dict[str, Any]) -> Path:
        """The final policy as ``<output_dir>/hf`` (a LoRA run: its adapter directory), in
        place of what an earlier export of the run wrote there."""
        clear_previous_export(self.out / "hf")
        path = Path(roles.actor.call("export_hf", str(self.out / "hf"), tokenizer))
        if (path / "adapter_config.json").is_file():
            finish_adapter_export(path)
        if (path / "config.json").is_file():  # a LoRA export is an adapter directory
            final = {k: v for k, v in last_validation.items() if k.startswith("val/")}
            card = ModelCard(
                base_model=base_model_name(self.config.model), algorithm=self.algo_label, steps=total, metrics=final
            )
            finish_hf_export(path, card, tokenizer)
        write_export_record(path, total, self.out)
        return path

    def settle_position(self) -> None:
        """After an interruption: the newest checkpoint complete on disk becomes
        ``position.checkpoint`` (an interrupt landing between a save's completion and the
        line that records it would otherwise name the one before)."""
        if not self.rundir.claimed or self.rundir.restored:  # what is there is not this run's
            return
        if self.rundir.removed():  # removed under the running job (rm -rf): none of it is left
            self.position.gone = True
            self.position.checkpoint = None
            return
        latest = CheckpointManager(self.ckpt_root / "actor").latest()
        newest = CheckpointManager.step_of(latest) if latest is not None else None
        if newest is None or newest > (self.position.checkpoint or -1) or not self._saved(self.position.checkpoint):
            self.position.checkpoint = newest  # a newer one completed, or the one recorded was removed

    def _stop_if_removed(self) -> None:
        """Raise :class:`RunDirectoryRemovedError` when the output directory was removed under
        the job (checked before each write of metrics and each save: a save would make a
        directory of its own again, holding a checkpoint and no beginning)."""
        if self.rundir.removed():
            self.position.gone, self.position.checkpoint = True, None
            raise RunDirectoryRemovedError(
                f"{self.out} was removed while the job ran (noticed at step {self.position.step}): "
                "its checkpoints and metrics went with it, so the job stopped; start it again"
            )

    def _saved(self, step: int | None) -> bool:
        """Whether the actor's checkpoint of ``step`` is still complete on disk."""
        done = CheckpointManager(self.ckpt_root / "actor").complete()
        return step is None or any(CheckpointManager.step_of(path) == step for path in done)

    def _commit_overwrite(self) -> None:
        """A step is done: what ``--overwrite`` set aside is deleted (once)."""
        if not self.rundir.commit():
            return
        if self.rundir.not_deleted is None:
            self.echo(f"--overwrite: deleted the previous run (set aside in {self.out / SET_ASIDE} until now)")
        else:
            self.echo(
                f"--overwrite: could not delete all of the previous run: {self.rundir.not_deleted}; what is left "
                f"of it is in {self.out / SET_ASIDE}: delete that by hand (before any --resume of this run)"
            )

    def _restore_overwritten(self) -> None:
        """The job failed before its first step: the previous run that ``--overwrite`` set
        aside goes back (nothing is lost to a run that did not start)."""
        try:
            restored = self.rundir.restore()
        except OSError as exc:  # the job's own error comes next; this one must not hide it
            self.echo(f"--overwrite: could not put the previous run back ({exc}); it is in {self.out / SET_ASIDE}")
            return
        if restored:
            self.echo(
                f"--overwrite: this run failed before its first step; the previous run's {', '.join(restored)} "
                f"are back in {self.out}"
            )

    def _sft_fingerprint(self) -> str | None:
        """SHA-256 of the SFT warm start's manifest (``None``: the run has none). Saved with
        every checkpoint, so a resume notices a warm start swapped for another run's."""
        manifest = self.out / "sft_model" / MANIFEST
        return (
            hashlib.sha256(manifest.read_bytes()).hexdigest()
            if self.config.sft.enabled and manifest.is_file()
            else None
        )

    def _load(self, roles: RLRoles, trainer: RLTrainer, path: Path) -> tuple[int, float | None]:
        extra = roles.actor.call("load_checkpoint", str(path))
        saved, now = extra.get("sft_model"), self._sft_fingerprint()
        if saved is not None and saved != now:
            raise CheckpointError(
                f"{self.out / 'sft_model'} is not the SFT warm start checkpoint {path} was trained from (its manifest "
                "differs from the one recorded at the save): the reference policy would change under the run. "
                "Put the run's own sft_model/ back, or start afresh with --overwrite"
            )
        step = int(extra["step"])
        if roles.critic is not None:
            critic_path = self.ckpt_root / "critic" / path.name
            roles.critic.call("load_checkpoint", str(CheckpointManager.check_complete(critic_path)))
        trainer.loader.load_state_dict(extra["loader"])
        if trainer.kl_ctrl is not None and extra.get("kl_coef") is not None:
            trainer.kl_ctrl.value = float(extra["kl_coef"])
        if extra.get("python_random") is not None:
            random.setstate(extra["python_random"])
        return step, extra.get("accuracy_before")

    # ------------------------------------------------------------------ the job
    def run(self) -> JobResult:
        """Run the job; every rank the placement started is stopped at the end, also on an
        error or Ctrl-C."""
        try:
            try:
                result = self._run()
            except BaseException as exc:
                if self.placement is not None:
                    # ranks may be mid-call: stop them without waiting. Inline roles hold this
                    # process's engines and torch.distributed group: released here, so a job
                    # run next in the same process starts clean
                    self.placement.close(graceful=False)
                self.driver.close(graceful=False)
                self._restore_overwritten()
                if isinstance(exc, NonFiniteError):
                    raise non_finite_stop(exc, self.position.step, self.position.checkpoint) from None
                full = run_disk_full(exc, self.out, self.position.checkpoint)
                if full is not None:  # a full disk under any of the run's own writes is one line
                    raise full from None
                raise
            if self.placement is not None:
                self.placement.close()
            self.driver.close()
        finally:
            self.rundir.release()  # the directory's lock, held from claim() to the end
        return result

    def _run(self) -> JobResult:
        cfg = self.config
        started = time.perf_counter()
        if cfg.trainer.torch_threads:
            torch.set_num_threads(cfg.trainer.torch_threads)
        _seed_everything(cfg.trainer.seed)
        # Every check reads only; the output directory is claimed (and, with --overwrite,
        # the previous run deleted) after all of them passed.
        self.rundir.check()
        pre = preflight(
            cfg,
            reward_fn=self.reward_fn,
            reward_weights=self.reward_weights,
            data=self.data,
            validation_data=self.validation_data,
        )
        for note in pre.notes:
            self.echo(f"note: {note}")
        try:
            self.callbacks = Callbacks(load_callbacks([*cfg.trainer.callbacks, *self.extra_callbacks], cfg.base_dir))
        except GeartrainError as exc:
            raise ConfigError([("trainer.callbacks", str(exc))]) from None
        self.reward_fn = pre.reward
        tokenizer = pre.tokenizer
        latest = self._latest_checkpoint()
        if latest is not None:
            self.position.step = self.position.checkpoint = CheckpointManager.step_of(latest)
        set_aside = self.rundir.claim()
        if self.rundir.lock is not None and (note := self.rundir.lock.stale_note()):
            self.echo(note)
        if set_aside:
            self.echo(
                f"--overwrite: the previous run's {', '.join(set_aside)} set aside in {self.out / SET_ASIDE}; "
                "deleted once this run's first step is done, put back if it fails before"
            )
        (self.out / "config.json").write_text(cfg.model_dump_json(indent=2))
        self._placement()  # ranks start once every check passed (a local Ray instance takes seconds)
        resume_step = CheckpointManager.step_of(latest) if latest is not None else None
        jsonl = JsonlLogger(self.out / "metrics.jsonl", resume_step=resume_step)
        if jsonl.missing_rl_steps:
            self.echo(
                f"--resume: {jsonl.path} has no record of step(s) {step_ranges(jsonl.missing_rl_steps)} "
                f"(cut or edited since they were trained); its curves will have a gap there"
            )
        tb = (
            TensorBoardLogger(
                self.out / "tensorboard", purge_step=(resume_step + 1) if resume_step is not None else None
            )
            if cfg.trainer.tensorboard and "tensorboard" in cfg.trainer.loggers
            else None
        )
        sinks = Fanout([x for x in (tb, *self._trackers(resume_step is not None)) if x is not None])

        completions = (
            CompletionsLogger(
                self.out / "completions.jsonl",
                cfg.trainer.log_completions,
                seed=cfg.trainer.seed,
                resume_step=resume_step,
                tensorboard=tb.writer if tb is not None else None,
            )
            if cfg.trainer.log_completions
            else None
        )

        loader, val = self._data(pre)
        if cfg.sft.enabled:
            policy = self._sft(pre, jsonl, sinks) if latest is None else self._sft_model()
        else:
            policy = cfg.model
        roles = self.build_roles(policy)
        trainer = RLTrainer(cfg, roles, tokenizer, loader, val.rows if val is not None else None)

        def log(record: dict[str, Any]) -> None:
            self._stop_if_removed()
            jsonl.write(record)
            sinks.write(record)

        last_validation: dict[str, Any] = {}
        if latest is not None:
            start, accuracy_before = self._load(roles, trainer, latest)
            self.position.step = self.position.checkpoint = start
            self.echo(f"resumed from {latest} (step {start})")
            if cfg.rollout.placement == "separate" and cfg.algorithm.max_staleness > 0:
                self.echo(
                    f"separate rollout: the samples in flight at the checkpoint were not saved; they are discarded, "
                    f"and steps {start + 1}.. generate theirs again from the checkpoint's weights"
                )
        else:
            start = 0
            val0 = trainer.validate()
            last_validation = dict(val0)
            if completions is not None and val0:
                completions.validation(0, trainer.last_validation)
            accuracy_before = val0.get("val/accuracy")
            if val0:
                self.callbacks("on_evaluate", 0, dict(val0))
            log(
                {
                    "phase": "rl",
                    "step": 0,
                    **val0,
                    "data/prompts": float(len(loader.dataset)),
                    "data/filtered": float(loader.dataset.num_filtered),
                }
            )
            if cfg.trainer.save_every > 0:
                self._save(roles, trainer, 0, accuracy_before)

        total = cfg.trainer.total_steps
        progress = Progress(total, start, cfg.algorithm.name, cfg.trainer.progress)
        watchdog = Watchdog(cfg.watchdog, temperature=cfg.sampling.temperature, n=cfg.sampling.n)
        accuracy_after = None
        for step in range(start + 1, total + 1):
            self.position.step = step
            metrics = trainer.step(step)
            self.workdir.restore("code the step ran (an environment, a tool, a reward)")
            if completions is not None:
                completions.train(step, trainer.last_batch)
            if cfg.trainer.print_completions:  # TRL's console table of a few samples
                picked = pick(len(trainer.last_batch), cfg.trainer.print_completions, cfg.trainer.seed, step)
                progress.write(console_table(episodes(trainer.last_batch, picked, step=step, kind="train")))
            if _due(step, cfg.validation.every_n_steps, total):
                val_metrics = trainer.validate()
                last_validation = dict(val_metrics)
                metrics.update(val_metrics)
                if completions is not None and val_metrics:
                    completions.validation(step, trainer.last_validation)
                accuracy_after = metrics.get("val/accuracy", accuracy_after)
                if val_metrics:
                    self.callbacks("on_evaluate", step, dict(val_metrics))
            log({"phase": "rl", "step": step, **metrics})
            self.callbacks("on_step_end", step, dict(metrics))
            self.workdir.restore("a callback (on_evaluate, on_step_end)")
            try:
                watchdog.observe(step, metrics)  # after logging, so the step that stops the run is on record
            except TrainingStalledError:
                progress.close()
                jsonl.close()
                sinks.close()
                _shutdown(roles)
                raise
            self._commit_overwrite()
            # an episode's return: the reward function's score plus its environment's rewards
            reward = metrics.get("reward/mean", 0.0) + metrics.get("agent/env_reward_mean", 0.0)
            shown = {"reward": reward, "train_acc": metrics.get("reward/accuracy", 0.0)}
            if "val/accuracy" in last_validation:
                shown["val_acc"] = last_validation["val/accuracy"]  # the latest validation's, labelled as such
            progress.update(**shown)
            if _due(step, cfg.trainer.save_every, total):
                self._save(roles, trainer, step, accuracy_before)
        progress.close()
        try:
            watchdog.finish()  # a run shorter than a streak's limit that trained nothing is no success
        except TrainingStalledError:
            jsonl.close()
            sinks.close()
            _shutdown(roles)
            raise
        if accuracy_after is None and start >= total:  # resumed a finished run
            last_validation = trainer.validate()
            accuracy_after = last_validation.get("val/accuracy")

        jsonl.close()
        if completions is not None:
            completions.close()
        sinks.close()
        self._stop_if_removed()  # the export and the curves would make a directory of their own
        if cfg.trainer.export_hf:
            try:
                path = self._export(roles, tokenizer, total, last_validation)
            except BaseException as exc:  # a full disk (any form of it) is one line; the checkpoints stay
                full = export_disk_full(exc, self.out / "hf", self.out)
                if full is None:
                    raise
                raise full from None
            self.echo(f"exported the policy to {path}")
        if cfg.trainer.plot:
            try:
                png = plot_curves(
                    read_jsonl(self.out / "metrics.jsonl"),
                    self.out / "curves.png",
                    title=f"{self.algo_label} ({self.out.name})",
                )
                self.echo(f"curves: {png}")
            except Exception as exc:  # noqa: BLE001 - an optional picture must not fail a finished run
                # (an MPLBACKEND matplotlib does not know raises at its import)
                if run_disk_full(exc, self.out, None) is not None:
                    raise
                self.echo(
                    f"note: the curves were not drawn ({_failed(exc).removeprefix('failed (')}; the run is complete"
                )
        _shutdown(roles)
        self._commit_overwrite()  # a job of no steps (total_steps = 0) ends here
        seconds = time.perf_counter() - started
        self.echo(f"metrics: {self.out / 'metrics.jsonl'} ({seconds:.1f}s)")
        if accuracy_before is not None:
            self.echo(f"accuracy before {self.algo_label}: {100 * accuracy_before:.1f}%")
        if accuracy_after is not None:
            self.echo(f"accuracy after {self.algo_label}: {100 * accuracy_after:.1f}%")
        end = {"accuracy_before": accuracy_before, "accuracy_after": accuracy_after, "output_dir": str(self.out)}
        self.callbacks("on_train_end", total, end)
        return JobResult(
            accuracy_before=accuracy_before,
            accuracy_after=accuracy_after,
            steps=total,
            output_dir=self.out,
            seconds=seconds,
        )


def run_job(
    config: TrainConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    reward_fn: Callable[..., Any] | Sequence[Any] | None = None,
    reward_weights: Sequence[float] | None = None,
    data: DataSource | None = None,
    validation_data: DataSource | None = None,
    callbacks: Sequence[Any] = (),
) -> JobResult:
    """Run ``config`` end to end. An ``output_dir`` that holds a run is refused unless
    ``resume`` (continue from its newest intact checkpoint under
    ``<output_dir>/checkpoints``, with the config checked against the run's) or
    ``overwrite`` (replace the previous run: set aside once every check passed, deleted after
    the first step, put back if the job fails before). ``reward_fn``
    overrides ``reward.function`` / ``[[reward.functions]]`` (per-sample or batched:
    docs/rewards.md): one function, or a list of them (TRL's ``reward_funcs``), each
    weighted by ``reward_weights`` (TRL's; default 1 each) and logged as
    ``reward/<function name>/mean``; ``callbacks`` (objects with some of
    :class:`~geartrain.trainer.callbacks.Callback`'s methods) run after those of
    ``trainer.callbacks``; ``data`` and
    ``validation_data`` (a ``datasets.Dataset``, a list of dicts or a path) replace
    ``data.path`` and ``validation.path``. ``config`` is checked again as a whole first (it
    may have been changed since it was built). One job runs in a process at a time: a second
    started while one runs (another thread) is refused, as the two would share the process's
    random generators and torch state and neither would be the job it seeds."""
    if not _ONE_JOB.acquire(blocking=False):
        raise GeartrainError(
            "another job is running in this process: jobs share the process's random generators and torch "
            "state, so two at once would both be wrong; run them one after another, or in processes of their own"
        )
    try:
        return Job(
            revalidated(config),
            resume=resume,
            overwrite=overwrite,
            reward_fn=reward_fn,
            reward_weights=reward_weights,
            data=data,
            validation_data=validation_data,
            callbacks=callbacks,
        ).run()
    finally:
        _ONE_JOB.release()


#: Held while a job runs (see :func:`run_job`).
_ONE_JOB = threading.Lock()


def _failed(exc: BaseException) -> str:
    """The closing line's "failed (RuntimeError: the first line of its message)"."""
    lines = str(exc).strip().splitlines()
    return f"failed ({type(exc).__name__}: {lines[0][:120]})" if lines else f"failed ({type(exc).__name__})"


def exit_at_once_on_sigint(status: int) -> None:
    """From now on Ctrl-C ends the process at once with ``status``, saying nothing more.
    Registered with ``atexit`` by an interrupted job (so it runs before the atexit callbacks
    registered earlier, and a caller of :func:`train_from_cli` keeps its own handler until
    the interpreter exits): the job has stopped and said where it stands, and a second Ctrl-C
    while the interpreter winds down (atexit callbacks, progress bars' destructors) would
    print "Exception ignored ... KeyboardInterrupt" tracebacks after the job's last line."""

    def leave(signum: int, frame: Any) -> None:
        os._exit(status)

    with contextlib.suppress(ValueError):  # not the main thread: leave Python's handling as it is
        signal.signal(signal.SIGINT, leave)


def train_from_cli(config_path: str, overrides: Sequence[str], resume: bool = False, overwrite: bool = False) -> int:
    """``geartrain train CONFIG [overrides] [--resume | --overwrite]``."""
    handler = TqdmLoggingHandler()  # through tqdm: a warning never glues onto the progress bar
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    logging.captureWarnings(True)  # warnings.warn goes the same way
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the job's own progress bar is the one to read
    config = load_train_config(config_path, overrides)
    job = Job(config, resume=resume, overwrite=overwrite)
    watch = InterruptWatch()
    try:
        with watch, reader_may_leave():  # `geartrain train ... | head`: the run goes on without its reader
            job.run()
    except BaseException as exc:
        if not (is_interrupt(exc) or watch.seen):
            if not isinstance(exc, Exception) or isinstance(exc, GeartrainError):
                raise  # a GeartrainError is bad input: the CLI's one line, exit 2
            # a genuine failure (a bug, here or in a plugin): its traceback, then where the
            # run stands, as an interruption says it
            traceback.print_exc()
            traceback.clear_frames(exc.__traceback__)  # what they hold (a progress bar) closes now, not after the line
            job.settle_position()
            with contextlib.suppress(OSError):
                print(f"\n{interrupted_message(job.position, _failed(exc))}", file=sys.stderr, flush=True)
            return 1
        logging.disable(logging.CRITICAL)  # nothing may follow the one line (threads winding down)
        job.settle_position()
        with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone (EIO)
            print(f"\n{interrupted_message(job.position, watch.how)}", file=sys.stderr, flush=True)
        atexit.register(exit_at_once_on_sigint, watch.exit_status)  # runs first at exit: atexit is LIFO
        return watch.exit_status
    return 0
