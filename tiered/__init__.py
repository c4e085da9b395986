"""tiered: a GPU-direct tiered checkpoint engine for PyTorch training.

    engine = tiered.Engine.from_config("cluster.yaml")   # or no argument: configs/local.yaml
    handle = engine.save(step, state_dict)               # returns once the state may change
    engine.restore(state_dict)                           # latest committed step, in place

`import tiered` needs no CUDA: GPU modules (nvCOMP, KvikIO) are imported on first GPU use.
"""

from tiered.config import Config, load_config
from tiered.engine import Engine, SaveHandle
from tiered.errors import (BackgroundSaveError, CheckpointNotFoundError, CodecUnavailableError, CollectiveError,
                           ConfigError, CorruptionError, FormatError, SaveFailuresExceeded, StateDictError, TieredError)
from tiered.version import __version__

__all__ = [
    "BackgroundSaveError", "CheckpointNotFoundError", "CodecUnavailableError", "CollectiveError", "Config",
    "ConfigError", "CorruptionError", "Engine", "FormatError", "SaveFailuresExceeded", "SaveHandle", "StateDictError",
    "TieredError", "__version__", "load_config",
]
