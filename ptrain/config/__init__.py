"""Typed run configuration: dataclasses registered in Hydra's ConfigStore, and validation.

`RunConfig` is the root; each Hydra group (model, data, algo, optim, mesh, logging,
checkpoint) is backed by one dataclass whose fields are documented where declared.
`choices` holds every named option a field takes; `seeds` derives the component seeds
from the top-level `seed`. Option groups that a function takes whole (PolicyLossConfig,
SamplingConfig, AdvantageConfig) are classes of their own that `algo.grpo` extends.
"""

from ptrain.config.advantages import AdvantageConfig
from ptrain.config.algo import AlgoConfig, DPOAlgoConfig, SFTAlgoConfig
from ptrain.config.choices import STAGE_KINDS
from ptrain.config.data import DataConfig, GeneratedTaskConfig
from ptrain.config.distributed import DistributedConfig
from ptrain.config.mesh import MeshConfig
from ptrain.config.model import ModelConfig
from ptrain.config.optim import OptimConfig
from ptrain.config.outputs import CheckpointConfig, LoggingConfig
from ptrain.config.policy_loss import PolicyLossConfig
from ptrain.config.run import ConfigError, RunConfig, register_configs, stage_config, to_run_config
from ptrain.config.sampling import SamplingConfig
from ptrain.config.stages import StageConfig
from ptrain.config.train import TrainConfig

__all__ = [
    "AdvantageConfig",
    "AlgoConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "DPOAlgoConfig",
    "GeneratedTaskConfig",
    "LoggingConfig",
    "MeshConfig",
    "ModelConfig",
    "OptimConfig",
    "PolicyLossConfig",
    "RunConfig",
    "SFTAlgoConfig",
    "SamplingConfig",
    "STAGE_KINDS",
    "StageConfig",
    "TrainConfig",
    "register_configs",
    "stage_config",
    "to_run_config",
]
