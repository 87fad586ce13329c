"""NxD's trainer API (``neuronx_distributed.trainer``) over nxdtp's core. Checkpoints: ``nxdtp.trainer.checkpoint``."""

from .checkpoint import finalize_checkpoint, has_checkpoint, load_checkpoint, save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "has_checkpoint", "finalize_checkpoint"]
