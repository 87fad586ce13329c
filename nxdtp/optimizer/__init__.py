"""Optimizers (NxD's ``neuronx_distributed.optimizer``): ``NeuronZero1Optimizer`` (ZeRO-1: optimizer state and fp32
master weights sharded over data parallelism), ``Lamb`` (also ``nxdtp.Lamb``) and NxD's
``AdamW_FP32OptimParams`` (HF's former AdamW, moments in fp32)."""

from .adamw_fp32_optim_params import AdamW_FP32OptimParams
from .lamb import Lamb
from .zero_redundancy_optimizer import NeuronZero1Optimizer, optimizer_state_bytes

__all__ = ["NeuronZero1Optimizer", "Lamb", "AdamW_FP32OptimParams", "optimizer_state_bytes"]
