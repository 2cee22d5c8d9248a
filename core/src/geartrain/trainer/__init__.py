"""The training job: configuration, roles, the SFT warm start and the GRPO/PPO loop.

from geartrain.trainer import load_train_config, run_job
result = run_job(load_train_config("examples/arithmetic/grpo.toml"))
"""

from geartrain.trainer.config import TrainConfig, load_train_config
from geartrain.trainer.run import JobResult, run_job, train_from_cli

__all__ = ["JobResult", "TrainConfig", "load_train_config", "run_job", "train_from_cli"]
