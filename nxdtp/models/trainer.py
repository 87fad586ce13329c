"""Deprecated: ``nxdtp.models.hf_trainer`` (Hugging Face's Trainer for a TP model), so that no one confuses it with
``nxdtp.trainer``, NxD's trainer API."""

import warnings

from .hf_trainer import TensorParallelTrainer

warnings.warn("nxdtp.models.trainer is deprecated and goes in the next release: import TensorParallelTrainer from "
              "nxdtp.models.hf_trainer", DeprecationWarning, stacklevel=2)

__all__ = ["TensorParallelTrainer"]
