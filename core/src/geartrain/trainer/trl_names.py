"""TRL's ``GRPOConfig`` / ``GRPOTrainer`` names and the geartrain keys that do their job.

One table, two readers: a job that uses one of these names as a key (``trainer.max_steps``,
``algorithm.beta``...) is told the geartrain key instead of a spelling-based "did you
mean" (which points at an unrelated knob: ``max_steps`` -> ``max_staleness``), and
``docs/coming_from_trl.md``'s table of equivalent options is checked against it
(``tests/core/test_config_wording.py``).
"""

from __future__ import annotations

from collections.abc import Mapping

TRL_NAMES: Mapping[str, str] = {
    "train_dataset": "data.path",
    "eval_dataset": "validation.path",
    "eval_steps": "validation.every_n_steps",
    "reward_funcs": "reward.function, or [[reward.functions]]",
    "reward_weights": "the weight of each [[reward.functions]] entry",
    "learning_rate": "actor.engine.optim.lr",
    "lr_scheduler_type": "actor.engine.optim.lr_schedule (constant, cosine, linear)",
    "warmup_steps": "actor.engine.optim.warmup_steps",
    "weight_decay": "actor.engine.optim.weight_decay",
    "max_grad_norm": "actor.engine.optim.clip_grad",
    "num_generations": "sampling.n",
    "per_device_train_batch_size": (
        "data.batch_size, in prompts (TRL counts completions: data.batch_size x sampling.n of them)"
    ),
    "max_prompt_length": "data.max_prompt_length",
    "max_completion_length": "sampling.max_tokens",
    "temperature": "sampling.temperature",
    "top_p": "sampling.top_p",
    "top_k": "sampling.top_k",
    "min_p": "sampling.min_p",
    "repetition_penalty": "sampling.repetition_penalty",
    "stop": "sampling.stop",
    "num_iterations": "algorithm.ppo_epochs",
    "steps_per_generation": "algorithm.mini_batches",
    "epsilon": "algorithm.clip_ratio_low",
    "epsilon_high": "algorithm.clip_ratio_high",
    "beta": "algorithm.use_kl_loss = true with algorithm.kl_loss_coef",
    "loss_type": 'algorithm.loss_agg_mode (for "dr_grpo" also algorithm.advantage = "dr_grpo")',
    "scale_rewards": "algorithm.norm_by_std",
    "max_steps": "trainer.total_steps",
    "save_steps": "trainer.save_every",
    "save_total_limit": "trainer.keep_last",
    "output_dir": "trainer.output_dir",
    "seed": "trainer.seed",
    "log_completions": "trainer.print_completions = N (the console table) and trainer.log_completions = N (a file)",
    "num_completions_to_print": "trainer.print_completions = N",
    "report_to": "trainer.tensorboard (other loggers: trainer.loggers)",
    "use_vllm": 'rollout.backend = "vllm"',
    "vllm_gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "gradient_checkpointing": "actor.engine.gradient_checkpointing",
    "bf16": 'actor.engine.param_dtype = "bfloat16" and rollout.dtype = "bfloat16"',
    "peft_config": "the [actor.lora] section",
    "gradient_accumulation_steps": (
        "actor.engine.max_tokens_per_micro_batch: a step is one optimizer update per mini-batch"
        " (algorithm.mini_batches) whatever its micro-batches, so lower it to use less memory"
    ),
    "push_to_hub": (
        "no key: the run exports <output_dir>/hf (trainer.export_hf); upload that folder with `huggingface-cli upload`"
    ),
    "vllm_mode": 'rollout.placement ("colocated" is TRL\'s "colocate", "separate" its "server")',
    "logging_steps": (
        "trainer.progress (metrics are logged every step, to the run folder and TensorBoard;"
        " sampled completions: trainer.log_completions = N)"
    ),
    "max_tool_calling_iterations": "rollout.agent.max_turns (model turns: TRL's tool-call rounds + 1)",
}
"""TRL's name -> what sets the same thing in a geartrain job (its key paths, and how)."""


def trl_key_hints() -> dict[str, str]:
    """The message for an unknown key that is one of TRL's names, by that name."""
    return {
        name: f"TRL's '{name}' is {target} in geartrain (docs/coming_from_trl.md)" for name, target in TRL_NAMES.items()
    }
