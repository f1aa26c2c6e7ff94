"""The run configuration: schema, TOML loading, command-line overrides, validation."""

from archipelago.config.loading import (
    ConfigError,
    config_from_dict,
    config_to_dict,
    load_config,
    load_run_config,
    load_toml,
    parse_overrides,
    split_config_flag,
)
from archipelago.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    FaultToleranceConfig,
    JobConfig,
    LoRAConfig,
    LRSchedulerConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    TrainingConfig,
)
from archipelago.config.validate import advice, data_ranks, validate, validate_for_island

__all__ = [
    "CheckpointConfig", "Config", "ConfigError", "DataConfig", "FaultToleranceConfig", "JobConfig",
    "LRSchedulerConfig", "MetricsConfig", "ModelConfig", "OptimizerConfig", "ParallelismConfig", "LoRAConfig",
    "TrainingConfig", "config_from_dict", "config_to_dict", "load_run_config", "load_config", "load_toml",
    "parse_overrides", "split_config_flag", "advice", "data_ranks", "validate", "validate_for_island",
]
