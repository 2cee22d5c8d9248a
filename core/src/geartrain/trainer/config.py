"""The training job's configuration: one typed section per component.

A job file (TOML or YAML) holds these tables; every field has a default, so the smallest
file names only what differs. ``geartrain check`` and ``geartrain train`` load it with
:func:`load_train_config`::

    [algorithm]   name (grpo | ppo), advantage estimator, clipping, KL, PPO epochs
    [model]       the policy's model (hub id / directory, or a tiny built-in one)
    [actor]       engine = the actor's training engine (backend, optimizer, parallel sizes)
    [reference]   engine for the frozen reference policy (used when a KL term is on)
    [critic]      model + engine of the value model (PPO)
    [rollout]     the inference backend (RolloutConfig) ...
    [sampling]    ... and how it samples during training
    [reward]      a rule function (registered name or dotted path) or a reward model
    [data]        training prompts (DataConfig)
    [validation]  held-out prompts, greedy, every N steps
    [sft]         the optional supervised warm start before RL
    [trainer]     steps, output directory, checkpoints, logging
    [cluster]     where roles run (placement = "inline" | "ray")
    [watchdog]    when a run that trains nothing warns or stops
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from geartrain.algorithms.aggregation import AggMode
from geartrain.config import (
    UNKNOWN_KEY_HINTS,
    EngineConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    OptionalPath,
    ParallelConfig,
    RolloutConfig,
    Section,
)
from geartrain.data.config import DataConfig
from geartrain.errors import ConfigError
from geartrain.limits import MAX_COEF, MAX_SEED, MAX_TIMEOUT_S
from geartrain.trainer.trl_names import trl_key_hints
from geartrain.trainer.watchdog import WatchdogConfig
from geartrain.validation import load_config

UNKNOWN_KEY_HINTS.update(trl_key_hints())  # TRL's names, answered in every section, in files and in Python

#: A deadline in seconds, positive and at most :data:`~geartrain.limits.MAX_TIMEOUT_S`.
PhaseTimeout = Annotated[float, Field(gt=0, le=MAX_TIMEOUT_S)]


class AlgorithmConfig(Section):
    """The RL algorithm. ``grpo`` needs no critic; ``ppo`` trains one (GAE advantages)."""

    name: Literal["grpo", "ppo"] = "grpo"
    """``grpo`` (no critic) or ``ppo`` (a critic and GAE)."""
    advantage: str | None = None
    """A registered advantage estimator (``grpo``, ``dr_grpo``, ``rloo``, ``gae``,
    ``reinforce_plus_plus``, ``remax``, ``grpo_passk``, ``opo``, ``gpg``...); default:
    ``grpo`` for GRPO, ``gae`` for PPO (docs/algorithms.md lists them all)."""
    norm_by_std: bool = True
    """Divide group-relative advantages by the group's standard deviation."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount factor of GAE / returns."""
    lam: float = Field(1.0, ge=0, le=1)
    """GAE's lambda."""
    policy_loss: str = "ppo"
    """A registered policy loss (``ppo`` clip, ``gspo``, ``cispo``, ``gmpo``, ``sapo``,
    ``dppo_tv``...; docs/algorithms.md lists them all)."""
    clip_ratio: float = Field(0.2, gt=0)
    """PPO clip range: the ratio is kept in ``[1 - clip_ratio, 1 + clip_ratio]``."""
    clip_ratio_low: float | None = Field(None, gt=0)
    """Lower clip range (DAPO's clip-higher); default ``clip_ratio``."""
    clip_ratio_high: float | None = Field(None, gt=0)
    """Upper clip range; default ``clip_ratio``."""
    clip_ratio_c: float | None = Field(3.0, gt=1)
    """Dual-clip bound for negative advantages; ``None``: off."""
    loss_agg_mode: AggMode = "token-mean"
    """How per-token losses become one number (``token-mean``, ``seq-mean-token-sum``...)."""
    entropy_coef: float = Field(0.0, ge=-MAX_COEF, le=MAX_COEF)
    """Weight of the entropy bonus in the actor loss."""
    use_kl_loss: bool = False
    """GRPO-style KL loss to the reference policy (needs the reference role)."""
    kl_loss_coef: float = Field(0.001, ge=0)
    """Weight of the KL loss (``use_kl_loss``)."""
    kl_loss_kind: str = "k3"
    """KL estimator of the KL loss (``k1``, ``k2``, ``k3``...)."""
    use_kl_in_reward: bool = False
    """PPO-style KL penalty folded into the token rewards."""
    kl_coef: float = Field(0.001, ge=0)
    """Initial weight of the KL penalty in the reward (``use_kl_in_reward``)."""
    kl_kind: str = "k1"
    """KL estimator of the reward penalty."""
    kl_controller: Literal["fixed", "adaptive"] = "fixed"
    """``fixed`` KL weight, or ``adaptive`` towards ``target_kl``."""
    target_kl: float | None = Field(None, gt=0)
    """Adaptive controller: the KL it steers towards."""
    kl_horizon: int | None = Field(None, gt=0)
    """Adaptive controller: its horizon in samples."""
    tis_cap: float | None = Field(None, gt=0)
    """Truncated importance sampling against the rollout's log-probs; ``None``: off."""
    off_policy_correction: Literal["truncate", "mask"] = "truncate"
    """How IS against the rollout's log-probs corrects each token (with ``tis_cap`` set, or
    off-policy samples): ``truncate`` caps the weight at the cap; ``mask`` (IcePop) drops
    the tokens whose weight lies outside ``[is_mask_low, cap]`` from the gradient."""
    is_mask_low: float = Field(0.5, gt=0)
    """``off_policy_correction = "mask"``: the lowest weight a token keeps."""
    max_staleness: int = Field(0, ge=0)
    """``rollout.placement = "separate"``: how many policy updates the weights that
    generated a sample may lag behind the policy that trains on it. 0: synchronous (each
    step's samples come from the weights of the step before, as colocated). k > 0: the
    replicas generate ahead while the trainer trains, up to ``(k + 1) x data.batch_size``
    GRPO groups outstanding; each step trains the *first finished* ``data.batch_size``
    groups, drops groups more than k versions old (``async/dropped_groups``), and the gap
    is corrected with truncated IS (``tis_cap``, default ``trainer.async_tis_cap``).
    First-finished sampling favours short responses (they finish first; long ones are
    trained staler or dropped): docs/architecture.md, "The bias of first-finished sampling"."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each step's samples (each pass runs ``mini_batches`` optimizer steps)."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per epoch: the step's samples are split into this many mini-batches."""
    critic_warmup_steps: int = Field(0, ge=0)
    """PPO: steps during which only the critic trains."""
    unbiased_var: bool = Field(
        True,
        description="Whitening of advantages (gae, reinforce_plus_plus, reinforce_plus_plus_baseline): "
        "true divides the variance by N - 1 (verl's default), false by N (verl's masked_var(unbiased=False)).",
    )
    tau_pos: float = Field(
        1.0, gt=0, description="SAPO: gate temperature for tokens with a positive advantage (verl: 1.0)."
    )
    tau_neg: float = Field(1.05, gt=0, description="SAPO: gate temperature for the other tokens (verl: 1.05).")
    clip_cov_ratio: float = Field(
        0.0002,
        gt=0,
        le=1,
        description="Clip-Cov: share of the masked tokens whose gradient is cut (at least one; verl: 0.0002).",
    )
    clip_cov_lb: float = Field(1.0, description="Clip-Cov: lower covariance bound of the candidate tokens (verl: 1.0).")
    clip_cov_ub: float = Field(5.0, description="Clip-Cov: upper covariance bound of the candidate tokens (verl: 5.0).")
    kl_cov_ratio: float = Field(
        0.0002,
        gt=0,
        le=1,
        description="KL-Cov: share of the masked tokens, largest covariance first, given the KL penalty "
        "(verl: 0.0002).",
    )
    kl_cov_coef: float = Field(
        0.1, ge=0, description="KL-Cov: coefficient of |log pi - log pi_old| on those tokens (verl's ppo_kl_coef: 0.1)."
    )
    overlong_buffer: int | None = Field(
        None,
        ge=1,
        description="DAPO overlong reward shaping: the last this-many tokens before sampling.max_tokens carry a "
        "linear penalty, 0 down to -overlong_penalty_factor at the limit (added to the score); null: off.",
    )
    overlong_penalty_factor: float = Field(
        1.0, ge=0, description="DAPO overlong reward shaping: the penalty at the length limit."
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO dynamic sampling: drop prompt groups whose rewards are all equal and generate more "
        "prompts until data.batch_size groups are kept (metrics dynamic_sampling/*).",
    )
    dynamic_sampling_max_extra_rounds: int = Field(
        4,
        ge=0,
        description="DAPO dynamic sampling: at most this many extra generation rounds per step; when the cap is "
        "reached the step trains on the groups it has (dynamic_sampling/short = 1).",
    )
    dro_beta: float | None = Field(
        None,
        gt=0,
        description="DRO policy loss: weight of its quadratic log-ratio penalty (verl's dro_beta); needed by "
        "policy_loss = 'dro'.",
    )
    gpg_f_norm: float = Field(1.0, gt=0, description="GPG estimator: the advantage is divided by this (verl's f_norm).")
    otb_handle_zero_tail: bool | None = Field(
        None,
        description="Optimal token baseline estimators: give the single longest response of a group no baseline "
        "past the second-longest one; null: verl's default (off for optimal_token_baseline, on for "
        "tir_optimal_token_baseline).",
    )
    gdpo_reward_keys: list[str] | None = Field(
        None,
        description="GDPO estimator: the reward terms (reward.terms names) normalised one by one; null: every term.",
    )
    gdpo_reward_weights: list[float] | None = Field(
        None, description="GDPO estimator: one weight per entry of gdpo_reward_keys (null: 1 each)."
    )
    value_clip: float | None = Field(
        0.5,
        gt=0,
        description="PPO critic: clip the new values to old value +- this in the value loss "
        "(verl's critic.cliprange_value, default 0.5); null: unclipped 0.5 (V - R)^2.",
    )

    @model_validator(mode="after")
    def _known_algorithms(self) -> AlgorithmConfig:
        # Registered names only (register yours before the config is built); a typo fails
        # here, in `geartrain check`, not at the first step.
        from geartrain.algorithms import ADVANTAGES, POLICY_LOSSES
        from geartrain.algorithms.kl import KL_KINDS

        problems = []
        if self.advantage is not None and self.advantage not in ADVANTAGES:
            known = ", ".join(ADVANTAGES.names())
            problems.append(f"advantage '{self.advantage}' is not a registered estimator ({known})")
        if self.policy_loss not in POLICY_LOSSES:
            known = ", ".join(POLICY_LOSSES.names())
            problems.append(f"policy_loss '{self.policy_loss}' is not a registered policy loss ({known})")
        for key in ("kl_loss_kind", "kl_kind"):
            if getattr(self, key) not in KL_KINDS:
                problems.append(f"{key} '{getattr(self, key)}' is not a KL estimator ({', '.join(KL_KINDS)})")
        if self.gdpo_reward_weights is not None and (
            self.gdpo_reward_keys is None or len(self.gdpo_reward_weights) != len(self.gdpo_reward_keys)
        ):
            problems.append("gdpo_reward_weights needs gdpo_reward_keys, one weight per key")
        if self.kl_controller == "adaptive" and (self.target_kl is None or self.kl_horizon is None):
            problems.append(
                "kl_controller 'adaptive' needs target_kl (the KL it steers towards, e.g. 6.0) and kl_horizon "
                "(its horizon in samples, e.g. 10000)"
            )
        if self.policy_loss == "dro" and self.dro_beta is None:
            problems.append("policy_loss 'dro' needs dro_beta (the weight of its quadratic penalty, e.g. 0.1)")
        if self.estimator == "gae" and self.name != "ppo":
            problems.append("advantage 'gae' needs a critic: set name = 'ppo'")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def estimator(self) -> str:
        return self.advantage or ("gae" if self.name == "ppo" else "grpo")

    @property
    def needs_reference(self) -> bool:
        return self.use_kl_loss or self.use_kl_in_reward


class RoleEngine(Section):
    """A role that runs a training engine on the policy's model."""

    engine: EngineConfig = Field(default_factory=EngineConfig)
    """The role's training engine (backend default: the actor's)."""


class ActorConfig(RoleEngine):
    """The policy's training engine, optionally with LoRA adapters."""

    lora: LoraConfig | None = None
    """Train LoRA adapters on the frozen policy instead of all its weights (engines that
    declare ``lora``: ``fsdp``). The SFT warm start still trains every weight; the
    reference policy (a KL term) is then the actor's base with its adapters turned off,
    so no second copy of the model is built."""


class CriticConfig(Section):
    """The value model (PPO). ``model`` defaults to the policy's model with a value head."""

    model: ModelConfig | None = None
    """The value model; ``None``: the policy's model with a value head."""
    engine: EngineConfig = Field(default_factory=lambda: EngineConfig(optim=OptimConfig(lr=1e-5)))
    """The critic's engine (backend default: the actor's)."""


class SamplingConfig(Section):
    """How the rollout samples during training (validation is greedy)."""

    n: int = Field(8, ge=1)
    """Samples per prompt (the GRPO group size)."""
    temperature: float = Field(1.0, ge=0, le=100)
    """Softmax temperature of training samples."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold (``1``: off)."""
    top_k: int = -1
    """Top-k sampling (``-1``: off)."""
    max_tokens: int = Field(64, ge=1)
    """Most response tokens per sample."""
    repetition_penalty: float = Field(1.0, gt=0)
    """Penalty on tokens already in the prompt or response (``1.0``: off); only rollouts that
    have it (``vllm``) take another value, the others refuse it by name."""
    min_p: float = Field(0.0, ge=0, le=1)
    """Drop tokens below ``min_p`` x the top token's probability (``0``: off); only rollouts
    that have it (``vllm``) take another value."""
    stop: list[str] = Field(default_factory=list)
    """Strings that end a sample (kept at its end), besides EOS (the tokenizer's and each
    ``eos_token_id`` of the model's ``generation_config.json``). The rollout stops on the
    token sequence the tokenizer gives each alone (every rollout backend supports this);
    a sample whose text holds one spelled with other tokens is cut right after it, as
    vLLM's text match would (``response/stop_text_cut_ratio`` counts those)."""

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: list[str]) -> list[str]:
        empty = [i for i, text in enumerate(value) if not text]
        if empty:
            raise ValueError(f"sampling.stop[{empty[0]}] is empty: remove it (a stop string must hold text)")
        return value


class RewardFunctionConfig(Section):
    """One of several weighted reward functions (``[[reward.functions]]``)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    """Its metric name: the term is logged as ``reward/<name>/mean``."""
    function: str
    """Like ``reward.function``: a registered name, ``package.module:function`` or
    ``file.py:function`` (relative to the job file)."""
    weight: float = Field(1.0, ge=-MAX_COEF, le=MAX_COEF)
    """Its weight in the sample's reward, ``sum(weight x score)``."""
    batched: bool | None = None
    """``True``: called once per batch, TRL-style ``f(prompts, completions, **columns) ->
    list``; ``None``: detected (a first parameter named ``prompts`` or ``completions``)."""


class RewardConfig(Section):
    """One rule ``function``, several weighted ``functions``, or a reward ``model``. The
    reward contract (arguments, return values, batched functions) is in
    docs/rewards.md."""

    function: str | None = "arithmetic"
    """A registered reward (``arithmetic``, ``gsm8k``, ``math_boxed``...), a dotted path
    ``package.module:function``, or ``path/to/file.py:function`` (relative to the job file).
    A job that names its data must name its reward (no default applies then)."""
    batched: bool | None = None
    """``reward.function`` is batched (TRL's ``f(prompts, completions, **columns) -> list``);
    ``None``: detected from its first parameter's name (``prompts`` or ``completions``)."""
    accuracy: str | None = None
    """What "accuracy" is (``train_acc``, ``val/accuracy``, the accuracy before/after,
    ``sft.stop_at_accuracy``): ``None``, the ``acc`` a function returns, else reward > 0
    (said once on the console when rewards are not 0/1); a key functions return (``"correct"``,
    with several functions ``"<name>/<key>"``) or a ``[[reward.functions]]`` name (its score
    > 0); or ``file.py:function`` / ``package.module:function``, called like a reward function,
    whose value > 0 is a correct sample (:mod:`geartrain.trainer.accuracy`)."""
    functions: list[RewardFunctionConfig] = Field(default_factory=list)
    """Several reward functions, each ``{name, function, weight}``; a sample's reward is the
    weighted sum and each is logged on its own (``reward/<name>/mean``)."""
    model: ModelConfig | None = None
    """A value-head model whose output at the last response token is the score."""
    engine: EngineConfig = Field(default_factory=lambda: EngineConfig(optim=OptimConfig(lr=0.0)))
    """Engine of the reward model (``reward.model``; backend default: the actor's)."""
    timeout_s: float | None = Field(300.0, gt=0, le=MAX_TIMEOUT_S)
    """Time a step's reward calls may take together (per batch); when it runs out, the
    unscored samples get reward 0 and are counted in ``reward/timeouts``. ``None``: no limit."""
    workers: int = Field(0, ge=0)
    """Rule functions: ``0`` scores in the driver process; ``N`` runs them on N Ray actors of
    their own (``cluster.placement = "ray"``; ``cluster.colocate`` does not apply), each
    scoring its share of every batch (whole groups of one prompt's samples) while the others
    score theirs: for reward code that is slow, such as running generated programs or asking
    a judge over the network. Scores, errors and metrics are those of the driver's scoring.
    A reward model's ranks are ``reward.engine.parallel`` instead."""
    resources_per_worker: RankResources | None = None
    """``workers``: what each reward worker reserves (``None``: ``cluster.resources_per_rank``)."""

    @model_validator(mode="after")
    def _one_source(self) -> RewardConfig:
        if self.functions:
            if "function" in self.model_fields_set and self.function:
                raise ValueError("set either reward.function or [[reward.functions]], not both")
            if self.model is not None:
                raise ValueError("set either [[reward.functions]] or reward.model, not both")
            names = [f.name for f in self.functions]
            dup = next((n for n in names if names.count(n) > 1), None)
            if dup is not None:
                raise ValueError(f"two reward.functions are named '{dup}'; give each its own name (its metric name)")
            object.__setattr__(self, "function", None)
            return self
        if self.model is not None and self.function is not None:
            raise ValueError("set either reward.function or reward.model, not both (function = '' to use the model)")
        if self.model is None and not self.function:
            raise ValueError("set reward.function (a rule) or reward.model (a reward model)")
        return self


class ValidationConfig(Section):
    """Held-out prompts scored greedily; ``accuracy`` is the mean of the reward's ``acc``
    extra (or of ``score > 0`` when the reward gives none)."""

    path: OptionalPath = None
    """A ``.jsonl``/``.parquet`` file with the training data's schema; ``None``: no validation."""
    every_n_steps: int = Field(10, ge=0)
    """0: only before the first and after the last step."""
    max_tokens: int | None = Field(None, ge=1)
    """Default: ``sampling.max_tokens``."""
    max_prompts: int | None = Field(None, ge=1)
    """Score only the first N validation prompts."""


class SFTConfig(Section):
    """The supervised warm start, run once before RL (skipped on resume)."""

    enabled: bool = False
    """Run the warm start before RL."""
    path: OptionalPath = None
    """Rows with ``prompt`` and ``response`` (the target text, EOS appended)."""
    response_key: str = "response"
    """Field of a row that holds the target response."""
    steps: int = Field(100, ge=1)
    """Most SFT optimizer steps."""
    batch_size: int = Field(32, ge=1)
    """Rows per SFT step."""
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-3, weight_decay=0.0))
    """Optimizer of the warm start (its ``total_steps`` is ``sft.steps``)."""
    max_prompts: int | None = Field(None, ge=1)
    """Train on only the first N rows (a deliberately weak warm start)."""
    seed: int = Field(0, ge=0, le=MAX_SEED)
    """Seed of the warm start's data order (default: ``trainer.seed``)."""
    dev_path: OptionalPath = None
    """Prompts (with ``ground_truth``) the warm start is scored on, greedily, every
    ``eval_every`` steps; a split of the *training* data, never the validation set."""
    eval_every: int = Field(25, ge=1)
    """Score the dev prompts every N steps."""
    stop_at_accuracy: float | None = Field(None, gt=0, le=1)
    """Stop the warm start once the dev accuracy reaches this (after ``min_steps``), so RL
    starts from a policy that is partly right; ``steps`` stays the upper bound."""
    min_steps: int = Field(0, ge=0)
    """Steps before ``stop_at_accuracy`` may stop the warm start."""

    @model_validator(mode="after")
    def _stop_needs_a_dev_set(self) -> SFTConfig:
        # the dev accuracy is measured only on dev_path's prompts: without them the stop
        # could never act, and the warm start would run all of `steps` without a word
        if self.enabled and self.stop_at_accuracy is not None and self.dev_path is None:
            raise ValueError(
                "stop_at_accuracy stops the warm start on the accuracy measured on sft.dev_path, "
                "which is not set (it would never stop early): set sft.dev_path or remove sft.stop_at_accuracy"
            )
        return self


class TrainerConfig(Section):
    """The RL loop: its length, output directory, seed, checkpoints, logging and speed knobs."""

    total_steps: int = Field(10, ge=1)
    """RL steps (one batch of prompts each)."""
    output_dir: str = "outputs/run"
    """Metrics (``metrics.jsonl``), TensorBoard logs, checkpoints, the curves PNG and the
    exported model go here (relative paths: to the working directory; ``~`` is the home
    directory)."""

    @field_validator("output_dir")
    @classmethod
    def _output_dir_not_empty(cls, value: str) -> str:
        # '' is Path('.'): an unset shell variable (trainer.output_dir=$OUT) would put the run's
        # files into the working directory beside whatever is there, with no word
        if not value.strip():
            raise ValueError(
                "is empty (an unset shell variable?); give a directory ('.' if the working directory is really meant)"
            )
        try:  # config.json, metrics and the model card record the path as UTF-8 JSON
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"holds a byte that is not UTF-8 (0x{ord(value[exc.start]) & 0xFF:02x} at character {exc.start + 1}); "
                "give a directory whose name is UTF-8"
            ) from None
        # '~' as data.path and every other path setting take it (a shell expands it only unquoted)
        return os.path.expanduser(value) if value.startswith("~") else value

    seed: int = Field(0, ge=0, le=MAX_SEED)
    """Seed of everything random in the job: the model's initialisation (tiny and preset
    models), the data order, the SFT warm start's order and every sampling seed, unless a
    section sets its own ``seed`` (``model.seed``, ``data.seed``, ``sft.seed``)."""
    save_every: int = Field(0, ge=0)
    """Checkpoint every N steps (0: only at the end)."""
    keep_last: int = Field(2, ge=1)
    """Checkpoints kept on disk (older ones are deleted)."""
    progress: bool = True
    """Show a progress bar."""
    tensorboard: bool = True
    """Write TensorBoard logs (when ``loggers`` names ``tensorboard``)."""
    loggers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(default_factory=lambda: ["tensorboard"])
    """Where metrics go besides ``metrics.jsonl``: ``tensorboard``, ``wandb`` (Weights & Biases,
    the ``wandb`` extra), ``mlflow`` (the ``mlflow`` extra)."""
    project: str = "geartrain"
    """W&B project / MLflow experiment name."""
    run_name: str | None = None
    """W&B / MLflow run name; default: the output directory's name."""
    wandb_mode: Literal["online", "offline", "disabled"] | None = None
    """W&B mode; ``offline`` needs no network (``wandb sync`` uploads later); ``None``:
    W&B's own default (``WANDB_MODE``)."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking server or store; default: ``<output_dir>/mlruns`` (local, no network)."""
    plot: bool = True
    """Write the PNG of curves at the end."""
    callbacks: list[str] = Field(default_factory=list)
    """Code run after each step, validation and checkpoint and at the end (TRL's
    ``TrainerCallback``): ``file.py:Name`` (relative to the job file) or
    ``package.module:Name``, a class built with no arguments or an object
    (:mod:`geartrain.trainer.callbacks`)."""
    print_completions: int = Field(0, ge=0)
    """Print this many of each step's samples on the console as a table (TRL's
    ``log_completions`` table): prompt, completion, reward, each reward function's score and
    the advantage."""
    log_completions: int = Field(0, ge=0)
    """Write this many sampled episodes of every step (prompt, response, reward, each reward
    function's value, advantage), and every greedy validation output, to
    ``<output_dir>/completions.jsonl`` and a TensorBoard text table; ``0``: none."""
    export_hf: bool = True
    """Write the final policy as a Hugging Face directory (``<output_dir>/hf``)."""
    free_memory: bool = False
    """Hybrid engine: offload the actor while the rollout generates and release the rollout
    while the actor trains (each switch measured in the step's metrics)."""
    torch_threads: int | None = Field(None, ge=1, le=1024)
    """``torch.set_num_threads`` for the driver process (``None``: torch's default); at most
    1024 (100000 threads crashed the process)."""
    async_rollout: bool = False
    """Overlap generation with training (one-step off-policy): the rollout generates the
    next steps' samples on a thread of its own, with the weights of an earlier step, while
    the actor trains; each thread runs torch ops with ``torch_threads`` intra-op threads.
    The gap is corrected with truncated importance sampling against the rollout's
    log-probs (``algorithm.tis_cap``, default ``async_tis_cap``). Per-sample staleness and
    IS weights are recorded in ``metrics.jsonl`` (``samples/staleness``,
    ``samples/is_weight``)."""
    max_staleness: int = Field(1, ge=1)
    """Async rollout: how many policy updates a batch's weights may lag behind the policy
    that trains on it (the number of steps generated ahead)."""
    async_tis_cap: float = Field(2.0, gt=0)
    """Async rollout: the IS weight cap when ``algorithm.tis_cap`` is not set."""
    prefetch_generation: bool = True
    """On a placement whose ranks are other processes (``cluster.placement = "ray"``), send
    the next step's generation right behind the actor's update (one optimizer step that
    reuses its log-probs, see ``reuse_update_log_probs``), so that the ranks start it as
    soon as the update ends while the driver logs the step: the same samples from the same
    weights as sending it at the next step's start (synchronous, on-policy), one round trip
    to the ranks fewer on the step's critical path."""
    reuse_update_log_probs: bool = True
    """When a batch gets exactly one optimizer step (``algorithm.ppo_epochs = 1``,
    ``mini_batches = 1``) and no KL penalty is folded into the reward, take the old
    log-probs from the update's own forward (detached) instead of a separate forward:
    the same training, one forward fewer. ``false``: always run the separate forward."""


class RankResources(Section):
    """What Ray reserves for each rank (one Ray actor)."""

    cpus: float = Field(1.0, gt=0)
    """CPU cores per rank; the rank's torch/OpenMP threads follow it (at least 1)."""
    gpus: float = Field(0.0, ge=0)
    """GPUs per rank; with GPUs the ranks use NCCL, otherwise gloo."""


class ClusterConfig(Section):
    """Where the roles' ranks run."""

    placement: Literal["inline", "ray"] = "inline"
    """``inline``: every role is one rank in the driver process (the fast default).
    ``ray``: each role's worker group has ``parallel`` product ranks, each a Ray actor."""
    address: str | None = None
    """``ray``: join this cluster (``auto``, or ``host:port``); ``None`` starts a local Ray
    instance for the job and stops it at the end."""
    resources_per_rank: RankResources = Field(default_factory=RankResources)
    """``ray``: what each rank reserves."""
    colocate: list[Literal["reference", "critic", "reward"]] = Field(
        default_factory=lambda: ["reference", "critic", "reward"]
    )
    """``ray``: roles hosted in the actor's ranks (the same processes as actor and rollout;
    their parallel sizes must then multiply to the actor's). The others get ranks of their
    own. A rule-function reward has no model and always runs in the driver."""
    balance_tokens: bool = True
    """Balance each data-parallel split by token count (as verl does); ``False``: plain
    contiguous slices."""
    startup_timeout_s: float = Field(600.0, gt=0, le=MAX_TIMEOUT_S)
    """``ray``: how long the ranks may take to be scheduled, start their processes and
    rendezvous (as long as a build call may take: on a 2-core machine at load 12 a rank's
    process took over 120 s to start; a rank that started and then stops is caught sooner,
    by ``heartbeat_timeout_s``)."""
    heartbeat_timeout_s: float = Field(30.0, gt=0, le=MAX_TIMEOUT_S)
    """``ray``: a rank whose heartbeat (a thread in each rank, every second) stops for this
    long while the driver waits on it is reported as hung, by rank, with its last log lines
    (a stopped process, one stuck holding the GIL, an unreachable node)."""
    call_timeout_s: dict[Literal["build", "step", "checkpoint"], PhaseTimeout] = Field(
        default_factory=lambda: {"build": 600.0, "step": 1800.0, "checkpoint": 900.0}
    )
    """The longest one call of each phase may take (``build``: a role's workers;
    ``checkpoint``: save, load, export; ``step``: everything else). ``ray``: the driver then
    reports the ranks that did not answer, even with their heartbeats going. ``inline``: the
    call, running in the driver's own process, is stopped by an error raised inside it (or,
    stuck outside Python, by ending the process once as long again passed, at most a minute
    more), naming the call and where it was; exit 2 either way."""


class RolloutSection(RolloutConfig):
    """The rollout of a training job: the inference engine (:class:`RolloutConfig`) and
    where its replicas run."""

    placement: Literal["colocated", "separate"] = "colocated"
    """``colocated``: a replica in each actor rank (the hybrid engine: weights synced inside
    the process). ``separate`` (needs ``cluster.placement = "ray"``): ``replicas`` Ray
    actors of their own, each a whole inference engine; the trainer ranks hold none, and
    new weights reach the replicas by a bucketed broadcast after each update
    (:mod:`geartrain.trainer.separate`)."""
    replicas: int = Field(1, ge=1)
    """``separate``: rollout replicas; each generates its share of every step's prompts."""
    resources_per_replica: RankResources | None = None
    """``separate``: what each replica reserves (``None``: ``cluster.resources_per_rank``)."""
    replica_restarts: int = Field(0, ge=0)
    """``separate``: how many times in the whole run a replica that died (killed, out of
    memory, crashed) is replaced by a new one, which gets the trainer's newest weights and the
    dead one's requests in flight (a warning line, and ``separate/replica_restarts`` in the
    metrics). 0: a dead replica ends the run, naming it."""


def placement_problems(config: TrainConfig) -> list[tuple[str, str]]:
    """What ``config``'s placement cannot run: with ``inline`` a role on more than one rank;
    with ``ray`` a colocated role whose parallel sizes do not multiply to the ranks it gets
    (the actor's). Each problem names the key, the product and the fix."""
    cluster = config.cluster
    roles: list[tuple[str, str, ParallelConfig]] = [("actor", "actor.engine.parallel", config.actor.engine.parallel)]
    if config.algorithm.needs_reference:
        roles.append(("reference", "reference.engine.parallel", config.reference.engine.parallel))
    if config.algorithm.name == "ppo":
        roles.append(("critic", "critic.engine.parallel", config.critic.engine.parallel))
    if config.reward.model is not None:
        roles.append(("reward", "reward.engine.parallel", config.reward.engine.parallel))
    problems = []
    actor_ranks = config.actor.engine.parallel.world_size
    for role, key, parallel in roles:
        product = parallel.world_size
        sizes = f"dp*sp*tp*pp = {parallel.dp}*{parallel.sp}*{parallel.tp}*{parallel.pp} = {product}"
        if cluster.placement == "inline" and product > 1:
            problems.append(
                (
                    key,
                    f"{sizes} ranks, but cluster.placement = 'inline' runs every role on 1 rank; "
                    'set cluster.placement = "ray" (e.g. the override cluster.placement=ray) to run '
                    f"{product} ranks, or make the product 1",
                )
            )
        elif cluster.placement == "ray" and role != "actor" and role in cluster.colocate and product != actor_ranks:
            problems.append(
                (
                    key,
                    f"{sizes}, but '{role}' is colocated with the actor (cluster.colocate) and gets "
                    f"its {actor_ranks} ranks; make the product {actor_ranks}, or remove '{role}' from "
                    "cluster.colocate to give it ranks of its own",
                )
            )
    if config.reward.workers > 0:
        if config.reward.model is not None:
            problems.append(
                (
                    "reward.workers",
                    "runs rule functions on workers of their own; a reward model's ranks "
                    "are reward.engine.parallel: drop reward.workers",
                )
            )
        elif cluster.placement != "ray":
            problems.append(
                (
                    "reward.workers",
                    f"{config.reward.workers} reward workers run as Ray actors; set "
                    'cluster.placement = "ray" (the override cluster.placement=ray), or reward.workers = 0 '
                    "to score in the driver",
                )
            )
    if config.rollout.replica_restarts and config.rollout.placement != "separate":
        problems.append(
            (
                "rollout.replica_restarts",
                "replaces dead replicas of the separate rollout only (a colocated rollout dies with its "
                'actor rank); set rollout.placement = "separate", or rollout.replica_restarts = 0',
            )
        )
    if config.rollout.placement == "separate":
        if cluster.placement != "ray":
            problems.append(
                (
                    "rollout.placement",
                    "'separate' runs the replicas as Ray actors of their own; "
                    'set cluster.placement = "ray" (the override cluster.placement=ray)',
                )
            )
        if config.trainer.async_rollout:
            problems.append(
                (
                    "trainer.async_rollout",
                    "the separate rollout overlaps generation itself "
                    "(algorithm.max_staleness); set trainer.async_rollout = false",
                )
            )
        if config.trainer.free_memory:
            problems.append(
                (
                    "trainer.free_memory",
                    "the separate rollout shares no memory with the trainer; set trainer.free_memory = false",
                )
            )
        if config.rollout.agent is not None:
            problems.append(
                (
                    "rollout.agent",
                    "multi-turn episodes run in the colocated rollout only for now; "
                    'use rollout.placement = "colocated" with rollout.agent',
                )
            )
        if config.actor.lora is not None:
            problems.append(
                (
                    "actor.lora",
                    "the separate rollout receives merged full weights only for now; "
                    'drop actor.lora or use rollout.placement = "colocated"',
                )
            )
    elif config.algorithm.max_staleness > 0:
        problems.append(
            (
                "algorithm.max_staleness",
                "bounds the staleness of the separate rollout; set "
                'rollout.placement = "separate", or trainer.async_rollout for the colocated one',
            )
        )
    if cluster.placement == "ray" and config.trainer.async_rollout:
        problems.append(
            (
                "trainer.async_rollout",
                "the async rollout runs on one rank only for now; "
                'set trainer.async_rollout = false with cluster.placement = "ray"',
            )
        )
    return problems


#: Advantage estimators whose baseline is the group of samples of one prompt: with
#: ``sampling.n = 1`` each degenerates to the raw score (no baseline), so the job is refused.
GROUP_BASELINE_ESTIMATORS = frozenset(
    {"grpo", "dr_grpo", "rloo", "grpo_passk", "opo", "gpg", "reinforce_plus_plus_baseline"}
)


class TrainConfig(Section):
    """The whole job."""

    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    model: ModelConfig = Field(default_factory=lambda: ModelConfig(tiny="qwen2"))
    actor: ActorConfig = Field(default_factory=ActorConfig)
    reference: RoleEngine = Field(default_factory=lambda: RoleEngine(engine=EngineConfig(optim=OptimConfig(lr=0.0))))
    critic: CriticConfig = Field(default_factory=CriticConfig)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)
    base_dir: str | None = None
    """Directory relative data/reward paths are resolved against; set to the job file's
    directory by :func:`load_train_config`."""

    unknown_key_hints: ClassVar[Mapping[str, str]] = UNKNOWN_KEY_HINTS
    """An unknown key (in any section) that is one of TRL's names is answered with the
    geartrain key that does its job rather than a spelling-based "did you mean"."""

    # ------------------------------------------------------------------ roles
    @property
    def builds_reference(self) -> bool:
        """Whether the job builds the reference role (a KL term needs it)."""
        return self.algorithm.needs_reference

    @property
    def builds_critic(self) -> bool:
        """Whether the job builds the critic (PPO)."""
        return self.algorithm.name == "ppo"

    def backend_sections(self) -> Iterator[tuple[str, EngineConfig | RolloutConfig]]:
        """The engine and rollout sections of the roles this job builds, with their paths;
        only these are checked against the installed backends."""
        yield "actor.engine", self.actor.engine
        yield "rollout", self.rollout
        if self.builds_reference:
            yield "reference.engine", self.reference.engine
        if self.builds_critic:
            yield "critic.engine", self.critic.engine
        if self.reward.model is not None:
            yield "reward.engine", self.reward.engine

    def rollout_needs(self) -> list[tuple[str, str]]:
        """``(key, capability)`` for each sampling option this job sets that the rollout must
        declare (checked with the backend sections)."""
        needs = []
        if self.sampling.repetition_penalty != 1.0:
            needs.append(("sampling.repetition_penalty", "repetition_penalty"))
        if self.sampling.min_p > 0:
            needs.append(("sampling.min_p", "min_p"))
        return needs

    def engine_needs(self) -> list[tuple[str, str, str]]:
        """``(engine section, key, capability)`` for each setting of this job that the
        section's engine must declare (checked with the backend sections)."""
        from geartrain.algorithms import get_advantage

        if getattr(get_advantage(self.algorithm.estimator), "needs_sum_pi_squared", False):
            return [("actor.engine", "algorithm.advantage", "sum_pi_squared")]
        return []

    def optimizer_steps(self) -> dict[str, tuple[OptimConfig, int, str]]:
        """Each trained optimizer's section (by path) with the number of optimizer steps the
        job takes and how that number follows from the trainer; ``optim.total_steps`` must
        equal it."""
        sections = {
            "actor.engine.optim": self.actor.engine.optim,
            "critic.engine.optim": self.critic.engine.optim,
            "sft.optim": self.sft.optim,
        }
        counts = optimizer_step_counts(self.algorithm, self.trainer, self.sft)
        return {path: (sections[path], steps, how) for path, (steps, how) in counts.items()}

    @model_validator(mode="before")
    @classmethod
    def _fill_decay_horizons(cls, data: Any) -> Any:
        """Give an ``optim`` table written without ``total_steps`` the job's number of
        optimizer steps before the table validates (a decaying schedule needs it)."""
        if not isinstance(data, dict):
            return data
        try:
            algo = _as_section(data.get("algorithm"), AlgorithmConfig)
            trainer = _as_section(data.get("trainer"), TrainerConfig)
            sft = _as_section(data.get("sft"), SFTConfig)
        except ValidationError:
            return data  # the fields themselves are wrong: validation reports them
        data = dict(data)
        for path, (steps, _) in optimizer_step_counts(algo, trainer, sft).items():
            node: Any = data
            for key in path.split("."):
                node = node.get(key) if isinstance(node, dict) else None
            if isinstance(node, dict) and "total_steps" not in node and steps > 0:
                _set_path(data, tuple(path.split(".")), {**node, "total_steps": steps})
        return data

    @model_validator(mode="after")
    def _derived_settings(self) -> TrainConfig:
        """Roles follow the actor's backend unless they name one, and each optimizer's
        ``total_steps`` is the number of optimizer steps the job takes (derived when unset;
        a different value is refused)."""
        actor_backend = self.actor.engine.backend
        lora = self.actor.lora or self.actor.engine.lora
        if lora is not None:
            if self.actor.lora is not None and self.actor.engine.lora not in (None, lora):
                raise ValueError("actor.engine.lora: set LoRA once, as actor.lora (actor.engine.lora differs from it)")
            object.__setattr__(self.actor, "lora", lora)
            object.__setattr__(self.actor.engine, "lora", lora)
            if lora.sync == "adapter" and self.rollout.max_lora_rank is None:
                object.__setattr__(self.rollout, "max_lora_rank", lora.rank)
        for section in (self.reference.engine, self.critic.engine, self.reward.engine):
            if "backend" not in section.model_fields_set and section.backend != actor_backend:
                object.__setattr__(section, "backend", actor_backend)
        problems = []
        algo, total = self.algorithm, self.trainer.total_steps
        if algo.name == "ppo" and algo.critic_warmup_steps and total and algo.critic_warmup_steps >= total:
            problems.append(
                f"algorithm.critic_warmup_steps: {algo.critic_warmup_steps} warm-up steps of the critic leave none of "
                f"the {total} steps (trainer.total_steps) to the actor, which would never train; lower it below "
                "trainer.total_steps"
            )
        for path, (optim, steps, how) in self.optimizer_steps().items():
            if problems:
                break
            if optim.total_steps is None and steps > 0:
                object.__setattr__(optim, "total_steps", steps)
            elif optim.total_steps != steps:
                problems.append(
                    f"{path}.total_steps: {optim.total_steps} disagrees with the {steps} optimizer steps this job "
                    f"takes ({how}); leave it unset to derive it"
                )
        if problems:  # one "key.path: message" line each (see validation_problems)
            raise ValueError("\n".join(problems))
        return self

    @field_validator("rollout", mode="before")
    @classmethod
    def _rollout_section(cls, value: Any) -> Any:
        """A plain :class:`RolloutConfig` (as the engine tests and Python users build it) is
        the colocated rollout's section."""
        if isinstance(value, RolloutConfig) and not isinstance(value, RolloutSection):
            return RolloutSection(**dict(value))
        return value

    @model_validator(mode="after")
    def _seeds_follow_the_trainer(self) -> TrainConfig:
        """``trainer.seed`` seeds everything random (model initialisation, the data order, the
        SFT warm start's order; sampling derives its seeds from it) unless a section sets its
        own ``seed``."""
        seed = self.trainer.seed
        for owner, name in (
            (self, "model"),
            (self, "data"),
            (self, "sft"),
            (self.critic, "model"),
            (self.reward, "model"),
        ):
            section = getattr(owner, name)
            if section is not None and "seed" not in section.model_fields_set and section.seed != seed:
                object.__setattr__(owner, name, section.model_copy(update={"seed": seed}))
        return self

    @model_validator(mode="after")
    def _no_silent_defaults(self) -> TrainConfig:
        problems = silent_default_problems(self, data_given="data" in self.model_fields_set)
        if problems:
            raise ValueError("\n".join(f"{key}: {message}" for key, message in problems))
        return self

    @model_validator(mode="after")
    def _placement_fits(self) -> TrainConfig:
        problems = placement_problems(self)
        if problems:
            raise ValueError("\n".join(f"{key}: {message}" for key, message in problems))
        return self

    @model_validator(mode="after")
    def _agent_fits(self) -> TrainConfig:
        if self.rollout.agent is not None and self.trainer.async_rollout:
            raise ValueError(
                "rollout.agent: multi-turn episodes do not run with trainer.async_rollout yet; "
                "set trainer.async_rollout = false"
            )
        named = [self.reward.function] + [f.function for f in self.reward.functions]
        if self.rollout.agent is None and "environment" in named:
            raise ValueError(
                "reward: the 'environment' reward scores multi-turn episodes by their environment's rewards; "
                "this job has no [rollout.agent] (set rollout.agent.environment, or name another reward)"
            )
        return self

    @model_validator(mode="after")
    def _async_fits(self) -> TrainConfig:
        if self.trainer.async_rollout and self.trainer.free_memory:
            raise ValueError("trainer.async_rollout generates while the actor trains: set trainer.free_memory = false")
        return self

    @model_validator(mode="after")
    def _groups_fit(self) -> TrainConfig:
        algo = self.algorithm
        if self.trainer.async_rollout and (algo.dynamic_sampling or algo.estimator == "remax"):
            what = "algorithm.dynamic_sampling" if algo.dynamic_sampling else "algorithm.advantage = 'remax'"
            raise ValueError(
                f"{what} generates extra rounds inside the step: not supported with trainer.async_rollout yet"
            )
        if self.sampling.n < 2 and (algo.dynamic_sampling or algo.estimator in GROUP_BASELINE_ESTIMATORS):
            if algo.dynamic_sampling:
                raise ValueError(
                    f"algorithm.dynamic_sampling compares the samples of a prompt: set sampling.n >= 2 "
                    f"(it is {self.sampling.n})"
                )
            raise ValueError(
                f"algorithm.advantage = '{algo.estimator}' takes its baseline from the other samples of the "
                f"same prompt, so with sampling.n = {self.sampling.n} it would train with no baseline at all: "
                "set sampling.n >= 2, or choose an estimator that needs no group (reinforce_plus_plus, or remax)"
            )
        samples = self.data.batch_size * self.sampling.n
        if algo.mini_batches > samples:
            raise ValueError(
                f"algorithm.mini_batches ({algo.mini_batches}) exceeds the samples of a step, data.batch_size "
                f"({self.data.batch_size}) x sampling.n ({self.sampling.n}) = {samples}: each mini-batch is one "
                "optimizer step and needs a sample; lower algorithm.mini_batches"
            )
        if algo.overlong_buffer is not None and algo.overlong_buffer > self.sampling.max_tokens:
            raise ValueError(
                f"algorithm.overlong_buffer ({algo.overlong_buffer}) exceeds "
                f"sampling.max_tokens ({self.sampling.max_tokens})"
            )
        return self

    @model_validator(mode="after")
    def _lengths_fit(self) -> TrainConfig:
        # Only when the prompt budget was chosen: the data section's default (512) is a
        # generic cap, not a promise about this job's prompts.
        need = self.data.max_prompt_length + self.sampling.max_tokens
        if "max_prompt_length" in self.data.model_fields_set and need > self.rollout.max_model_len:
            raise ValueError(
                f"data.max_prompt_length ({self.data.max_prompt_length}) + sampling.max_tokens "
                f"({self.sampling.max_tokens}) = {need} exceeds rollout.max_model_len ({self.rollout.max_model_len}); "
                "longer prompts are dropped by the data loader, so lower max_prompt_length or raise max_model_len"
            )
        return self

    def resolve(self, path: str | None) -> str | None:
        """``path`` with ``~`` expanded, made absolute against ``base_dir`` (``None`` stays ``None``)."""
        if path is None:
            return None
        expanded = Path(os.path.expanduser(path))
        if self.base_dir is None or expanded.is_absolute():
            return str(expanded)
        return str(Path(self.base_dir) / expanded)


def silent_default_problems(
    config: TrainConfig, *, data_given: bool, reward_given: bool | None = None
) -> list[tuple[str, str]]:
    """A job that names its own data must name its model and its reward too: the defaults
    (a tiny random model, the ``arithmetic`` reward) exist to try the pipeline, and on
    someone's own data they would train nonsense (reward 0 every step) without a word.
    ``data_given``: the job's data was named (a ``data`` section, or data passed to
    :func:`geartrain.run_job`); ``reward_given``: a reward function was passed in code
    (``None``: check only the model; the config alone cannot know)."""
    if not data_given:
        return []
    problems = []
    if "model" not in config.model_fields_set:
        problems.append(
            (
                "model.path",
                'not set: name the policy to train, model.path = "<hub id or directory>" '
                '(or model.tiny = "qwen2" for a tiny random model that only tries the pipeline)',
            )
        )
    named = "reward" in config.model_fields_set and bool(
        {"function", "model", "functions"} & config.reward.model_fields_set
    )
    if reward_given is False and not named:
        problems.append(
            (
                "reward.function",
                "not set: name how responses are scored, reward.function = "
                '"my_reward.py:score" (a file next to the job file), a registered name (arithmetic, gsm8k, '
                'math_boxed) or "package.module:function"; or [[reward.functions]] / reward.model',
            )
        )
    return problems


def optimizer_step_counts(algo: AlgorithmConfig, trainer: TrainerConfig, sft: SFTConfig) -> dict[str, tuple[int, str]]:
    """Optimizer steps each trained role takes in a job, by the path of its ``optim``
    section, with the arithmetic as text: one RL step runs ``ppo_epochs x mini_batches``
    optimizer steps on the actor (none during PPO's critic warm-up) and on the critic; the
    SFT warm start runs at most ``sft.steps``."""
    per_step = algo.ppo_epochs * algo.mini_batches
    per = f"algorithm.ppo_epochs ({algo.ppo_epochs}) x algorithm.mini_batches ({algo.mini_batches})"
    total = trainer.total_steps
    counts = {"actor.engine.optim": (total * per_step, f"trainer.total_steps ({total}) x {per}")}
    if algo.name == "ppo":
        warm = algo.critic_warmup_steps
        if warm:
            counts["actor.engine.optim"] = (
                max(total - warm, 0) * per_step,
                f"(trainer.total_steps ({total}) - algorithm.critic_warmup_steps ({warm})) x {per}",
            )
        counts["critic.engine.optim"] = (total * per_step, f"trainer.total_steps ({total}) x {per}")
    if sft.enabled:
        counts["sft.optim"] = (sft.steps, f"sft.steps ({sft.steps})")
    return counts


def _as_section(raw: Any, schema: type[Section]) -> Any:
    return raw if isinstance(raw, schema) else schema.model_validate(raw if raw is not None else {})


def _set_path(data: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """``data[path[0]]...[path[-1]] = value``, copying the dicts on the way (the caller's
    input is not modified)."""
    node = data
    for key in path[:-1]:
        node[key] = dict(node.get(key) or {})
        node = node[key]
    node[path[-1]] = value


def load_train_config(
    path: str | Path | None, overrides: Sequence[str] = (), *, check_plugins: bool = True
) -> TrainConfig:
    """Read a job file, apply ``key.path=value`` overrides and validate everything,
    including each backend's own ``options`` against the installed plugin's schema (skip
    that with ``check_plugins=False``, e.g. to check a GPU job on a machine without vLLM).
    Raises :class:`geartrain.ConfigError` listing every problem with its path."""
    try:
        base = {"base_dir": str(Path(path).resolve().parent)} if path is not None else {}
    except (RuntimeError, OSError) as exc:  # a loop of symbolic links: Path.resolve's RuntimeError
        raise ConfigError([("", f"cannot be read ({exc})")], str(path)) from None
    return load_config(TrainConfig, path, overrides, defaults=base, check_plugins=check_plugins)


def _explicit(model: BaseModel) -> dict[str, Any]:
    """``model``'s settings that were given (to it, or to a section of it since: a section
    left at its default whose field was then assigned counts), as plain data; what validators
    derived is left out, to be derived again. (``model_dump(exclude_unset=True)`` drops a
    default section whole, assigned fields and all.)"""
    data: dict[str, Any] = {}
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            nested = _explicit(value)
            if name in model.model_fields_set or nested:
                data[name] = nested
        elif name in model.model_fields_set:
            data[name] = _plain(value)
    return data


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def revalidated(config: TrainConfig) -> TrainConfig:
    """``config`` checked again as a whole, for a config changed after it was built (Python's
    ``config.algorithm.mini_batches = 100000``: assignment checks the one field, not the rules
    between fields, so a change the command line refuses ran: a step that never finished, GRPO
    with no baseline, a stale learning-rate schedule). Returns ``config`` itself when checking
    it again changes nothing; raises :class:`ConfigError` naming every problem."""
    from geartrain.config import validate_config
    from geartrain.validation import check_backends

    source = "the TrainConfig given to run_job (changed after it was built?)"
    data = _explicit(config)
    try:
        fresh = validate_config(TrainConfig, data, source)
    except ConfigError as exc:
        # an optimizer's total_steps derived when the config was built disagrees with the
        # steps the changed config takes: derived again (as for a config built anew); any
        # other problem is what the change broke, named without that line in the way
        stale = [path for path, _ in exc.problems if path.endswith("optim.total_steps")]
        if not stale:
            raise
        for path in stale:
            node: Any = data
            for key in path.split(".")[:-1]:
                node = node.get(key, {}) if isinstance(node, dict) else {}
            if isinstance(node, dict):
                node.pop("total_steps", None)
        fresh = validate_config(TrainConfig, data, source)
    if fresh.model_dump() == config.model_dump():
        return config
    return check_backends(fresh, source)
