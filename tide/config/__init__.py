"""The configuration: its schema (one frozen dataclass per component) and the strict YAML loader.

Nothing here imports another TIDE module: every other part reads its section from here.
"""

from tide.config.loader import ConfigError, from_dict, load_config, to_dict
from tide.config.schema import (
                                CollectConfig,
                                Component,
                                ControlConfig,
                                CoordinatorComponent,
                                DraftConfig,
                                ModelConfig,
                                RollbackConfig,
                                RuntimeConfig,
                                ServeComponent,
                                ServeConfig,
                                SlurmConfig,
                                SpeculationConfig,
                                StoreConfig,
                                TideConfig,
                                TrainComponent,
                                TrainConfig,
                                UntilConfig,
                                WorkloadConfig,
                                check,
)

__all__ = [
    "CollectConfig", "Component", "ConfigError", "ControlConfig", "CoordinatorComponent", "DraftConfig",
    "ModelConfig", "RollbackConfig", "RuntimeConfig", "ServeComponent", "ServeConfig", "SlurmConfig",
    "SpeculationConfig", "StoreConfig", "TideConfig", "TrainComponent", "TrainConfig", "UntilConfig",
    "WorkloadConfig", "check", "from_dict", "load_config", "to_dict",
]
