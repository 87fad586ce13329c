"""NxD's ``NxDModel`` (``neuronx_distributed.trainer.model``): the model ``initialize_parallel_model`` returns.

A thin ``nn.Module`` around the parallel model: ``forward`` calls it, ``run_train`` is forward plus backward, the
``named_*`` iterators, ``state_dict`` and ``load_state_dict`` are the module's own (so keys have no ``module.`` prefix),
and any other attribute falls back to the module (``.config``, ``.dtype``, ``generate``, ``save_pretrained``...).
Pipeline parallelism is not provided, so there is one local module: the model itself.
"""

from __future__ import annotations

from typing import Any, Dict

import torch
from torch import nn


def _loss_of(output: Any) -> torch.Tensor:
    """The loss in a forward's output: the output itself, or the ``loss`` of a Hugging Face ``ModelOutput``/dict."""
    if isinstance(output, torch.Tensor):
        return output
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"NxDModel.run_train: the forward returned {type(output).__name__} with no loss tensor; "
                        "return the loss (or an output with .loss, e.g. pass labels= to a Hugging Face model)")
    return loss


class NxDModel(nn.Module):
    """NxD's trainer model wrapper around ``module`` (see the module docstring); ``nxd_config`` is kept as is."""

    def __init__(self, module: nn.Module, nxd_config: Dict[str, Any]):
        super().__init__()
        self.module = module
        self.nxd_config = nxd_config
        self.pp_enabled = nxd_config.get("pipeline_parallel_size", 1) > 1
        if self.pp_enabled:
            raise ValueError(f"NxDModel: pipeline_parallel_size={nxd_config['pipeline_parallel_size']} is not "
                             "supported (nxdtp has no pipeline parallelism); the valid value is 1")
        self.train()

    def __repr__(self) -> str:
        return f"NxDModel({self.module!r})"

    def local_modules(self):
        return [self.module]

    def original_module(self) -> nn.Module:
        return self.module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def run_train(self, *args, **kwargs) -> torch.Tensor:
        """Forward and backward; returns the loss (the forward's output, or its ``loss`` for a Hugging Face output,
        which NxD's does not accept)."""
        loss = _loss_of(self.forward(*args, **kwargs))
        loss.backward()
        return loss

    def run_eval(self, *args, **kwargs):
        raise RuntimeError("NxDModel.run_eval is for pipeline parallelism, which nxdtp does not provide (as in NxD, it "
                           "is only valid with pipeline_parallel_size > 1); call the model under torch.no_grad()")

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    def named_buffers(self, *args, **kwargs):
        return self.module.named_buffers(*args, **kwargs)

    def named_children(self):
        return self.module.named_children()

    def named_modules(self, *args, **kwargs):
        return self.module.named_modules(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)

    @property
    def dtype(self) -> torch.dtype:
        module = self.original_module()
        if hasattr(module, "dtype"):
            return module.dtype
        return next(module.parameters()).dtype

    @property
    def config(self):
        return self.original_module().config

    @property
    def name_or_path(self):
        return self.original_module().name_or_path
