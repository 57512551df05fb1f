"""The one typed configuration of a run (`gspo config` lists every key with its default and meaning)."""

from gspo.config.checks import validate, validate_launch, validate_setup
from gspo.config.loading import describe, field_docs, load_config, save_config, to_dict
from gspo.config.schema import (
    CheckpointConfig,
    Config,
    ConfigError,
    DistributedConfig,
    EvalConfig,
    JudgeConfig,
    LoraConfig,
    ModelConfig,
    RewardModelConfig,
    RolloutConfig,
    ServeConfig,
    TaskConfig,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DistributedConfig",
    "EvalConfig",
    "JudgeConfig",
    "LoraConfig",
    "ModelConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "ServeConfig",
    "TaskConfig",
    "TrainConfig",
    "describe",
    "field_docs",
    "load_config",
    "save_config",
    "to_dict",
    "validate",
    "validate_launch",
    "validate_setup",
]
