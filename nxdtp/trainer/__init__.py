"""NxD's trainer API (``neuronx_distributed.trainer``): ``neuronx_distributed_config``, ``initialize_parallel_model``,
``initialize_parallel_optimizer``, ``NxDModel``, ``NxDOptimizer``. docs/nxd_migration.md lists what differs.
Checkpoints: ``nxdtp.trainer.checkpoint``."""

from .checkpoint import finalize_checkpoint, has_checkpoint, load_checkpoint, save_checkpoint
from .model import NxDModel
from .optimizer import NxDOptimizer
from .trainer import initialize_parallel_model, initialize_parallel_optimizer, neuronx_distributed_config

__all__ = ["neuronx_distributed_config", "initialize_parallel_model", "initialize_parallel_optimizer", "NxDModel",
           "NxDOptimizer", "save_checkpoint", "load_checkpoint", "has_checkpoint", "finalize_checkpoint"]
