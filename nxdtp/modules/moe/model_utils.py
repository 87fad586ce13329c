"""NxD's activation table and GLU kinds for the MoE modules."""
from __future__ import annotations

import enum
from typing import Callable, Dict, Union

import torch
import torch.nn.functional as F

ACT2FN: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "leaky_relu": F.leaky_relu,
    "relu": F.relu,
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "tanh": torch.tanh,
}


class GLUType(enum.Enum):
    """How a gated MLP combines its gate and up projections: ``GLU`` is act(s * gate) * (up + b); ``SWIGLU`` is
    gate * act(s * gate) * (up + b), with s ``hidden_act_scaling_factor`` and b ``hidden_act_bias``."""

    GLU = "glu"
    SWIGLU = "swiglu"

    @classmethod
    def validate(cls, glu_type: Union["GLUType", str, None]) -> "GLUType":
        if isinstance(glu_type, cls):
            return glu_type
        if glu_type is None:
            return cls.GLU
        values = [kind.value for kind in cls]
        if glu_type not in values:
            raise ValueError(f"glu_type={glu_type!r} is not supported; valid: {values}")
        return cls(glu_type)


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACT2FN:
        raise ValueError(f"hidden_act={name!r} is not supported; valid: {sorted(ACT2FN)}")
    return ACT2FN[name]
