"""Optimizers (NxD's ``neuronx_distributed.optimizer``): ``NeuronZero1Optimizer`` (ZeRO-1: optimizer state and fp32
master weights sharded over data parallelism) and ``Lamb`` (also importable as ``nxdtp.optimizers.Lamb``)."""

from .lamb import Lamb
from .zero_redundancy_optimizer import NeuronZero1Optimizer, optimizer_state_bytes

__all__ = ["NeuronZero1Optimizer", "Lamb", "optimizer_state_bytes"]
