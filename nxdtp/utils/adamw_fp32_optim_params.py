"""NxD's path ``neuronx_distributed.utils.adamw_fp32_optim_params``, so that ``from
neuronx_distributed.utils.adamw_fp32_optim_params import AdamW_FP32OptimParams`` changes only its prefix. The
optimizer itself is ``nxdtp.optimizer.AdamW_FP32OptimParams``; this module is a name for it, in the optimizer layer."""

from ..optimizer.adamw_fp32_optim_params import AdamW_FP32OptimParams

__all__ = ["AdamW_FP32OptimParams"]
