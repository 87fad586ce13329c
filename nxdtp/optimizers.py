"""Deprecated: ``nxdtp.optimizer`` is the one optimizer package (``nxdtp.optimizer.Lamb``, also ``nxdtp.Lamb``)."""

import warnings

from .optimizer.lamb import Lamb

warnings.warn("nxdtp.optimizers is deprecated and goes in the next release: import Lamb from nxdtp.optimizer (or "
              "nxdtp)", DeprecationWarning, stacklevel=2)

__all__ = ["Lamb"]
