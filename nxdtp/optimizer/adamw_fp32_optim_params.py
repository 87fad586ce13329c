"""``AdamW_FP32OptimParams``: NxD's AdamW (``neuronx_distributed.utils.adamw_fp32_optim_params``), the AdamW of
Hugging Face's former ``transformers.AdamW`` that NxD's Llama and GPT-NeoX recipes use, with its moments in fp32.

It differs from ``torch.optim.AdamW`` in three ways, so a recipe tuned with it gives other numbers under torch's:

* ``eps`` defaults to 1e-6 and is added to ``sqrt(v)``, not to the bias-corrected ``sqrt(v / (1 - beta2^t))``: the
  bias corrections are folded into the step size, ``lr * sqrt(1 - beta2^t) / (1 - beta1^t)`` (none with
  ``correct_bias=False``, as BERT's original recipe);
* the decoupled weight decay is applied *after* the Adam update, to the updated weight
  (``p -= lr * weight_decay * p``), where torch decays before;
* ``step`` is a Python integer in the state.

"FP32 optim params": the moments are kept in fp32 whatever the parameter's dtype (float64 for float64 parameters) and
the update is computed in that precision before it is written into the parameter. NxD keeps the moments in the
gradient's dtype unless ``XLA_DOWNCAST_BF16=1``; for fp32 parameters, and for the fp32 master shards of
``NeuronZero1Optimizer`` (its usual inner optimizer), the two are the same. For bf16 parameters without ZeRO-1 the
parameter itself stays bf16 (no master copy): use ``NeuronZero1Optimizer`` for fp32 master weights.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Optional, Tuple

import torch


class AdamW_FP32OptimParams(torch.optim.Optimizer):  # noqa: N801 (NxD's name)
    """NxD 2.29's signature. ``no_deprecation_warning``, ``differentiable`` and ``capturable`` are accepted for NxD
    compatibility and change nothing (``capturable`` is kept in the param groups, as NxD does)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, correct_bias: bool = True,
                 no_deprecation_warning: bool = True, differentiable: bool = False, capturable: bool = False):
        if not lr >= 0.0:
            raise ValueError(f"AdamW_FP32OptimParams: lr={lr!r} must be >= 0.0")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"AdamW_FP32OptimParams: betas[{i}]={beta!r} must be in [0.0, 1.0)")
        if not eps >= 0.0:
            raise ValueError(f"AdamW_FP32OptimParams: eps={eps!r} must be >= 0.0")
        if not weight_decay >= 0.0:
            raise ValueError(f"AdamW_FP32OptimParams: weight_decay={weight_decay!r} must be >= 0.0")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      correct_bias=correct_bias, capturable=capturable))

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW_FP32OptimParams does not support sparse gradients")
                precision = torch.float64 if p.dtype == torch.float64 else torch.float32
                grad = p.grad.to(precision)
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(grad)
                    state["exp_avg_sq"] = torch.zeros_like(grad)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                state["step"] += 1
                exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                step_size = group["lr"]
                if group["correct_bias"]:
                    step_size *= math.sqrt(1.0 - beta2 ** state["step"]) / (1.0 - beta1 ** state["step"])
                weight = p.to(precision)   # the parameter itself when it is already in this precision
                weight.addcdiv_(exp_avg, exp_avg_sq.sqrt().add_(group["eps"]), value=-step_size)
                if group["weight_decay"] > 0.0:
                    weight.mul_(1.0 - group["lr"] * group["weight_decay"])
                if weight is not p:
                    p.copy_(weight)
        return loss


__all__ = ["AdamW_FP32OptimParams"]
