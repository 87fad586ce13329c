"""Full-bf16 training with an fp32 master copy of the weights (--bf16).

The model computes in bf16. A deep copy of it in fp32 (the "master model") holds the weights the optimizer updates:
bf16 gradients are accumulated into the master's fp32 gradients, reduced, clipped and applied there, and the result is
cast back into the bf16 model. Keeping the master as a model (not a loose list of tensors) gives its parameters the
same names and TP specs as the model's, so checkpoints save the fp32 weights and name-keyed optimizer state, and merge
and reshard like any other.
"""

from __future__ import annotations

import copy
from typing import List, Tuple

import torch
from torch import nn

from nxdtp import move_model_to_device


class MasterWeights:
    def __init__(self, model: nn.Module):
        """``model`` must still be in fp32; it is cast to bf16 here and the fp32 copy kept as ``self.master``."""
        if next(model.parameters()).dtype != torch.float32:
            raise ValueError(f"MasterWeights needs the fp32 model, got {next(model.parameters()).dtype}")
        self.master = copy.deepcopy(model)
        # nxdtp's layers keep their TP attributes through deepcopy; attributes set by hand on other parameters, and
        # ties on XLA (no shared storage), are restored here.
        move_model_to_device(self.master, next(model.parameters()).device)
        self.model = model.to(torch.bfloat16)
        self.pairs: List[Tuple[nn.Parameter, nn.Parameter]] = self._pair(model, self.master)

    @staticmethod
    def _pair(model: nn.Module, master: nn.Module) -> List[Tuple[nn.Parameter, nn.Parameter]]:
        model_params, master_params = dict(model.named_parameters()), dict(master.named_parameters())
        if model_params.keys() != master_params.keys():
            raise RuntimeError("the master copy's parameters differ from the model's: "
                               f"{sorted(model_params.keys() ^ master_params.keys())[:5]}")
        return [(model_params[name], master_params[name]) for name in model_params]

    def gradients_to_master(self) -> None:
        """Add the bf16 gradients of one micro-batch to the fp32 master gradients, and free them: accumulation over
        micro-batches happens in fp32."""
        for param, master in self.pairs:
            if param.grad is None:
                continue
            if master.grad is None:
                master.grad = param.grad.detach().float()
            else:
                master.grad.add_(param.grad.detach())
            param.grad = None

    @torch.no_grad()
    def master_to_model(self) -> None:
        for param, master in self.pairs:
            param.copy_(master)
