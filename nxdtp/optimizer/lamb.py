"""Optimizers whose per-tensor statistics are those of the dense model.

``Lamb`` is LAMB (You et al., 2019, "Large Batch Optimization for Deep Learning"), in the form commonly used for BERT:
Adam moments, decoupled weight decay folded into the update, and a per-tensor trust ratio ``||w|| / ||u||`` that scales
the learning rate of each parameter tensor.

Why the norms are reduced over TP: a parameter with ``tensor_model_parallel=True`` holds only a slice of the dense
tensor. The trust ratio of its *local* slice would differ from the dense tensor's (and from rank to rank), so the TP
model would take a different step from the dense model and its shards would drift apart. Every rank therefore sums the
squared norms of its slices over the TP group, in ONE all-reduce per step for all sharded parameters together (a vector
``[||w_1||^2 .. ||w_n||^2, ||u_1||^2 .. ||u_n||^2]``). Replicated parameters hold the whole tensor on every rank and use
their local norms. Zero rows (a padded vocabulary) add nothing to either norm and get a zero update, so they stay zero.

Under ZeRO-1 (``nxdtp.optimizer.NeuronZero1Optimizer``) Lamb steps the shards of the parameters: each carries its
sharding group as ``zero1_sharding_group``, and the squared norms of all shards are first summed over that group (one
more all-reduce of one vector per step), so the ratios are those of the whole (TP-local) tensors, then over TP as above.

XLA: every rank traces the same graph. Python branches depend only on the parameter structure and the hyper-parameters,
never on tensor values (the trust ratio and the gradient-clipping coefficient are selected with ``torch.where`` /
``clamp``) or on the rank. The step counter is a tensor on the parameter's device, so the bias correction does not turn
into a new graph constant every step.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import comm
from ..grads import clip_coefficient, get_grad_norm
from ..topology import ParallelGroup, expert_parallel_group, tensor_parallel_group


def _is_tp_sharded(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def _zero1_group(params: List[torch.Tensor]):
    """The one ZeRO-1 sharding group of these parameters (shards), or None when they are whole tensors."""
    groups = {getattr(p, "zero1_sharding_group", None) for p in params}
    if len(groups) > 1:
        raise ValueError(f"Lamb: the parameters mix ZeRO-1 shards of different sharding groups (or shards and whole "
                         f"tensors): {sorted(str(g) for g in groups)}; give Lamb one kind (with expert parallelism "
                         "ZeRO-1 shards the experts over the expert data-parallel group and the rest over the "
                         "data-parallel group: use Lamb without ZeRO-1 there)")
    return groups.pop() if groups else None


def _check_hyper_parameters(lr: Any, betas: Any, eps: Any, weight_decay: Any, where: str = "") -> None:
    """Raise ``ValueError`` naming the bad value. ``not (x >= 0)`` also rejects NaN."""
    if isinstance(lr, torch.Tensor):
        raise ValueError(f"Lamb{where}: lr={lr!r} must be a Python float, not a tensor")
    if not float(lr) >= 0.0:
        raise ValueError(f"Lamb{where}: invalid learning rate lr={lr!r}; it must be >= 0")
    if not float(eps) > 0.0:
        raise ValueError(f"Lamb{where}: invalid eps={eps!r}; it must be > 0")
    try:
        beta1, beta2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"Lamb{where}: betas={betas!r} must be a pair (beta1, beta2)") from None
    for k, beta in enumerate((beta1, beta2)):
        if not 0.0 <= float(beta) < 1.0:
            raise ValueError(f"Lamb{where}: invalid beta{k + 1}={beta!r} in betas={tuple(betas)!r}; it must be in "
                             "[0, 1)")
    if not float(weight_decay) >= 0.0:
        raise ValueError(f"Lamb{where}: invalid weight_decay={weight_decay!r}; it must be >= 0")


class Lamb(torch.optim.Optimizer):
    """LAMB with trust ratios equal to those of the dense (unsharded) model under tensor parallelism.

    Per parameter tensor ``w`` with gradient ``g`` (after the optional global clip), at step ``t``::

        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)      # m, v themselves when bias_correction=False
        u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w
        r = ||w|| / ||u||   if ||w|| > 0 and ||u|| > 0   else 1
        r = min(r, 1)       if trust_clip
        w = w - lr * r * u

    In a group with ``weight_decay == 0`` and ``always_adapt=False`` the ratio is 1 (plain Adam), as is common for
    biases and LayerNorm parameters. ``||.||`` is the L2 norm of the *dense* tensor: for parameters with
    ``tensor_model_parallel=True`` the squared norms are summed over the TP group (one all-reduce per step for all
    of them); replicated parameters use their local norms.

    ``max_grad_norm``: when set, every gradient is multiplied by ``min(1, max_grad_norm / (global_grad_norm + 1e-6))``
    before the moments are updated: ``nxdtp.grads.clip_coefficient``, the coefficient and epsilon (``CLIP_EPS``) of
    ``clip_grad_norm`` and of torch's ``clip_grad_norm_``, so the clipped gradient is ``clip_grad_norm``'s to the bit.
    ``global_grad_norm`` is the dense model's L2 norm over all parameters of the optimizer that have a gradient
    (``nxdtp.grads.get_grad_norm``; one more all-reduce). The ``.grad`` tensors themselves are not modified. It is an
    optimizer-wide setting (the norm is global), not a per-group one.

    State per parameter: ``step`` (0-dim fp32 tensor on the parameter's device), ``exp_avg``, ``exp_avg_sq`` (the
    parameter's dtype). Norms and trust ratios are computed in fp32.

    For inspection and tests, after each ``step()``:

    * ``last_trust_ratios``: dict ``{param: 0-dim fp32 tensor}`` with the ratio ``r`` applied to every parameter that
      was updated (1 in groups without adaptation). Not part of ``state_dict()``.
    * ``last_grad_norm``: the dense-model gradient norm before clipping (a 0-dim tensor), or None without
      ``max_grad_norm``.

    Every rank of the TP group must call ``step()`` (it communicates), with the same parameters having gradients. It
    needs an installed topology (``nxdtp.parallel_state.initialize_model_parallel``, or ``simulated_topology`` with
    TP size 1 for a single process).
    """

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, bias_correction: bool = True, trust_clip: bool = False,
                 always_adapt: bool = False, max_grad_norm: Optional[float] = None):
        _check_hyper_parameters(lr, betas, eps, weight_decay)
        if max_grad_norm is not None and not float(max_grad_norm) > 0.0:
            raise ValueError(f"Lamb: invalid max_grad_norm={max_grad_norm!r}; it must be > 0 (or None for no clipping)")
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.last_trust_ratios: Dict[torch.Tensor, torch.Tensor] = {}
        self.last_grad_norm: Optional[torch.Tensor] = None
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, trust_clip=trust_clip, always_adapt=always_adapt)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hyper_parameters(group["lr"], group["betas"], group["eps"], group["weight_decay"],
                                where=f" (parameter group {len(self.param_groups) - 1})")

    # ---- one step ------------------------------------------------------------------------------------------------

    @staticmethod
    def _adapts(group: Dict[str, Any]) -> bool:
        return group["weight_decay"] != 0 or group["always_adapt"]

    @staticmethod
    def _direction(p: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any]) -> torch.Tensor:
        """The update direction ``u`` from the current moments (a new tensor; called twice per step, see ``step``)."""
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        if group["bias_correction"]:
            step = state["step"]
            bias_correction1 = 1.0 - torch.pow(beta1, step)
            bias_correction2 = 1.0 - torch.pow(beta2, step)
            denom = (exp_avg_sq / bias_correction2).sqrt().add_(group["eps"])
            u = (exp_avg / bias_correction1).div_(denom)
        else:
            u = exp_avg / exp_avg_sq.sqrt().add_(group["eps"])
        if group["weight_decay"] != 0:
            u.add_(p.detach(), alpha=group["weight_decay"])
        return u

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        active = self._active_parameters()
        self.last_trust_ratios = {}
        self.last_grad_norm = None
        if not active:
            return loss

        zero1_group = _zero1_group([p for _, p in active])
        coefficient = self._clip_coefficient(active, zero1_group)

        # Pass 1: moments, then the squared norms of w and u. u is not kept (it is recomputed in pass 2), so the
        # step needs at most one parameter-sized temporary at a time instead of one per parameter.
        local_sq: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        for i, (group, p) in enumerate(active):
            self._advance_moments(p, group, coefficient)
            if self._adapts(group):
                local_sq[i] = self._squared_norms(p, self.state[p], group)
        dense_sq = self._dense_squared_norms(active, local_sq, zero1_group)

        # Pass 2: trust ratio and the update.
        for i, (group, p) in enumerate(active):
            if self._adapts(group):
                ratio = self._trust_ratio(*dense_sq[i], group)
            else:
                ratio = torch.ones((), dtype=torch.float32, device=p.device)
            self.last_trust_ratios[p] = ratio
            u = self._direction(p, self.state[p], group)
            scale = (ratio * -group["lr"]).to(device=p.device, dtype=u.dtype)
            p.add_(u.mul_(scale))
        return loss

    def _active_parameters(self) -> List[Tuple[Dict[str, Any], torch.Tensor]]:
        """(group, param) pairs that have a gradient, in a fixed order (the same on every rank).

        Checked before any state changes, so that an error leaves the optimizer as it was.
        """
        active: List[Tuple[Dict[str, Any], torch.Tensor]] = []
        seen = set()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                if id(p) in seen:
                    raise ValueError(f"Lamb: a parameter of shape {tuple(p.shape)} is listed more than once; it would "
                                     "be updated twice")
                seen.add(id(p))
                active.append((group, p))
        return active

    def _clip_coefficient(self, active: List[Tuple[Dict[str, Any], torch.Tensor]],
                          zero1_group) -> Optional[torch.Tensor]:
        """The gradient-clipping factor (and ``last_grad_norm``), or None without ``max_grad_norm``.

        Dense-model norm over every parameter with a gradient (a tied one counts once), and clip_grad_norm's
        coefficient (the same epsilon, nxdtp.grads.CLIP_EPS); no branch on its value.
        """
        if self.max_grad_norm is None:
            return None
        self.last_grad_norm = get_grad_norm([p for _, p in active], zero1_optimizer=zero1_group is not None,
                                            zero1_optimizer_groups=zero1_group)
        return clip_coefficient(self.last_grad_norm, self.max_grad_norm)

    def _advance_moments(self, p: torch.Tensor, group: Dict[str, Any], coefficient: Optional[torch.Tensor]) -> None:
        """One step of the counter and of both Adam moments of ``p``, from its (clipped) gradient."""
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif state["step"].device != p.device or state["step"].dtype != torch.float32:
            # load_state_dict leaves 'step' where it was loaded (the CPU): keep the counter on the device.
            state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
        beta1, beta2 = group["betas"]
        grad = p.grad.detach()
        if coefficient is not None:
            # As clip_grad_norm applies it (an fp32 0-dim factor, the product in the gradient's dtype), so the
            # clipped gradient is clip_grad_norm's to the bit.
            grad = grad * coefficient.to(device=grad.device)
        state["step"].add_(1)
        state["exp_avg"].mul_(beta1).add_(grad, alpha=1.0 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)

    def _squared_norms(self, p: torch.Tensor, state: Dict[str, Any],
                       group: Dict[str, Any]) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(||w||^2, ||u||^2)`` of what this rank holds of ``p``, in fp32; u is dropped on return."""
        u = self._direction(p, state, group)
        w_sq = torch.linalg.vector_norm(p.detach(), dtype=torch.float32).square()
        u_sq = torch.linalg.vector_norm(u, dtype=torch.float32).square()
        return w_sq, u_sq

    @staticmethod
    def _dense_squared_norms(active: List[Tuple[Dict[str, Any], torch.Tensor]],
                             local_sq: Dict[int, Tuple[torch.Tensor, torch.Tensor]],
                             zero1_group) -> Dict[int, Tuple[torch.Tensor, torch.Tensor]]:
        """The local ``(||w||^2, ||u||^2)`` per position in ``active``, made those of the dense tensors.

        At most three all-reduces whatever the number of parameters: one over the ZeRO-1 sharding group, one over TP
        for the sharded parameters, one over the expert-parallel group for the experts (each rank holds other experts
        of the tensor). Replicated parameters keep their local norms.
        """
        local_sq = dict(local_sq)
        if zero1_group is not None and zero1_group.size > 1:
            # ZeRO-1 shards: each rank of the sharding group holds a piece of every tensor; summed over it, the norms
            # are the whole (TP-local) tensors'.
            _sum_over(local_sq, list(local_sq), zero1_group)
        # [||w_1||^2 .. ||w_n||^2, ||u_1||^2 .. ||u_n||^2] of the TP-sharded parameters over TP, then of the experts'
        # over the expert-parallel group.
        _sum_over(local_sq, [i for i in local_sq if _is_tp_sharded(active[i][1])], tensor_parallel_group())
        ep = expert_parallel_group()
        if ep.size > 1:
            _sum_over(local_sq, [i for i in local_sq if getattr(active[i][1], "expert_model_parallel", False)], ep)
        return local_sq

    @staticmethod
    def _trust_ratio(w_sq: torch.Tensor, u_sq: torch.Tensor, group: Dict[str, Any]) -> torch.Tensor:
        """``||w|| / ||u||``, or 1 where either norm is 0, clamped to 1 under ``trust_clip``; no branch on values."""
        w_norm, u_norm = w_sq.sqrt(), u_sq.sqrt()
        one = torch.ones_like(w_norm)
        usable = (w_norm > 0) & (u_norm > 0)
        # The division never sees a zero denominator, so no inf/NaN is produced even where it is not selected.
        ratio = torch.where(usable, w_norm / torch.where(usable, u_norm, one), one)
        if group["trust_clip"]:
            ratio = torch.clamp(ratio, max=1.0)
        return ratio


def _sum_over(local_sq: Dict[int, Tuple[torch.Tensor, torch.Tensor]], positions: List[int],
              group: ParallelGroup) -> None:
    """Replace the squared norms at ``positions`` by their sums over ``group``, in one all-reduce."""
    if not positions:
        return
    device = local_sq[positions[0]][0].device
    stacked = torch.stack([local_sq[i][0].to(device) for i in positions]
                          + [local_sq[i][1].to(device) for i in positions])
    summed = comm.all_reduce(stacked, group, op="sum")
    for k, i in enumerate(positions):
        local_sq[i] = (summed[k], summed[len(positions) + k])


__all__ = ["Lamb"]
