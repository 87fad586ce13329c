"""NxD's trainer API (``neuronx_distributed.trainer``): ``neuronx_distributed_config``, ``initialize_parallel_model``,
``initialize_parallel_optimizer``, ``NxDModel``, ``NxDOptimizer``. docs/nxd_migration.md lists what differs."""

from .model import NxDModel
from .optimizer import NxDOptimizer
from .trainer import initialize_parallel_model, initialize_parallel_optimizer, neuronx_distributed_config

# The checkpoint names (save_checkpoint, load_checkpoint, has_checkpoint, finalize_checkpoint) join from .checkpoint.

__all__ = ["neuronx_distributed_config", "initialize_parallel_model", "initialize_parallel_optimizer", "NxDModel",
           "NxDOptimizer"]
