"""The model families nxdtp has hand-written plans for: the one list of them (``nxdtp.models.family`` says what a
family declares)."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

from . import bert, gpt2, llama, moe, roberta
from .family import Family

FAMILIES: Tuple[Family, ...] = (bert.FAMILY, roberta.FAMILY, gpt2.FAMILY, llama.FAMILY, moe.FAMILY)

_BY_CLASS: Dict[str, Family] = {name: family for family in FAMILIES for name in family.classes}


def family_of(model_class_name: str) -> Optional[Family]:
    """The family whose plan supports the HF class named ``model_class_name``, or None."""
    return _BY_CLASS.get(model_class_name)


def supported_models() -> list:
    """Every HF model class name a hand-written plan supports, sorted."""
    return sorted(_BY_CLASS)
