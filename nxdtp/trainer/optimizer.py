"""NxD's ``NxDOptimizer`` (``neuronx_distributed.trainer.optimizer``): the optimizer ``initialize_parallel_optimizer``
returns.

It wraps the optimizer it is given (``nxdtp.optimizer.NeuronZero1Optimizer`` or a plain torch optimizer) and shows its
``param_groups``, ``state`` and ``defaults``, so LR schedulers and checkpoints work on it. ``step()``:

1. with ``sequence_parallel``, sums over the TP group the gradients of sequence-parallel parameters a model built
   itself (``nxdtp.grads.allreduce_sequence_parallel_gradients``; models sharded by an nxdtp plan sum them in backward);
2. without ZeRO-1, averages every gradient (``.grad``, or ``main_grad`` where there is no ``.grad``) over the
   data-parallel group (``bucket_allreduce_gradients``) and, with ``grad_clipping``, clips by the global norm at
   ``max_grad_norm`` (``clip_grad_norm``), keeping the pre-clip norm in ``grad_norm``; ZeRO-1 does both itself;
3. steps the wrapped optimizer (with ZeRO-1, ``grad_norm`` is then its norm).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from .. import grads, parallel_state


class NxDOptimizer(torch.optim.Optimizer):
    """NxD's trainer optimizer wrapper (see the module docstring). ``grad_norm`` is None before the first step, and
    without clipping. ``zero_grad`` keeps zero gradients by default (``set_to_none=False``), as NxD's."""

    def __init__(self, optimizer: torch.optim.Optimizer, nxd_config: Dict[str, Any]):
        # Like NxD's, the wrapper does not run Optimizer.__init__: its groups and state are the wrapped optimizer's.
        self.optimizer = optimizer
        self.nxd_config = nxd_config
        self._grad_norm: Optional[torch.Tensor] = None
        self.params: List[torch.Tensor] = [p for group in self.param_groups for p in group["params"]]

    def __repr__(self) -> str:
        return f"NxDOptimizer({self.optimizer!r})"

    @property
    def grad_norm(self) -> Optional[torch.Tensor]:
        return self._grad_norm

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, state) -> None:
        self.optimizer.state = state

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, param_groups) -> None:
        self.optimizer.param_groups = param_groups

    @property
    def defaults(self):
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults) -> None:
        self.optimizer.defaults = defaults

    def add_param_group(self, param_group) -> None:
        self.optimizer.add_param_group(param_group)
        self.params = [p for group in self.param_groups for p in group["params"]]

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = False) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getstate__(self):
        return self.optimizer.__getstate__()

    def __setstate__(self, state) -> None:
        self.optimizer.__setstate__(state)

    def _gradients(self, experts: bool = True) -> List[torch.Tensor]:
        out = []
        for p in self.params:
            if not experts and getattr(p, "expert_model_parallel", False):
                continue
            if p.grad is not None:
                out.append(p.grad)
            elif getattr(p, "main_grad", None) is not None:
                out.append(p.main_grad)
        return out

    def step(self, closure=None):
        grads.allreduce_context_parallel_gradients(self)   # context-parallel size 1: nothing to reduce, as in NxD
        if self.nxd_config["sequence_parallel"]:
            grads.allreduce_sequence_parallel_gradients(self)
        optimizer_config = self.nxd_config["optimizer_config"]
        if not optimizer_config["zero_one_enabled"]:
            grads.bucket_allreduce_gradients(self._gradients())
            if parallel_state.get_expert_model_parallel_size() > 1:   # NxD's second pass: the non-expert gradients
                grads.bucket_allreduce_gradients(self._gradients(experts=False), reduce_over_ep_group=True)
            if optimizer_config["grad_clipping"]:
                self._grad_norm = grads.clip_grad_norm(self.params, optimizer_config["max_grad_norm"])
        result = self.optimizer.step(closure=closure)
        if optimizer_config["zero_one_enabled"]:
            self._grad_norm = self.optimizer.grad_norm
        return result
