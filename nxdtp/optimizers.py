"""``nxdtp.optimizers.Lamb``, where it has always been importable; the optimizers live in ``nxdtp.optimizer``."""

from .optimizer.lamb import Lamb

__all__ = ["Lamb"]
