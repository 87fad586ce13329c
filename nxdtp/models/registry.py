"""The model families nxdtp has hand-written plans for: the one list of them (``nxdtp.models.family`` says what a
family declares)."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

from . import bert, gpt2, llama, roberta
from .family import DEFAULT_OLDEST_TRANSFORMERS, Family

FAMILIES: Tuple[Family, ...] = (bert.FAMILY, roberta.FAMILY, gpt2.FAMILY, llama.FAMILY)

_BY_CLASS: Dict[str, Family] = {name: family for family in FAMILIES for name in family.classes}


def family_of(model_class_name: str) -> Optional[Family]:
    """The family whose plan supports the HF class named ``model_class_name``, or None."""
    return _BY_CLASS.get(model_class_name)


def supported_models() -> list:
    """Every HF model class name a hand-written plan supports, sorted."""
    return sorted(_BY_CLASS)


def oldest_transformers(family_name: str) -> Tuple[int, int]:
    """The oldest transformers release the plan of the family named ``family_name`` supports (the default for plans
    that are not a registered family, such as HF's own tp_plan)."""
    return next((family.oldest_transformers for family in FAMILIES if family.name == family_name),
                DEFAULT_OLDEST_TRANSFORMERS)


def families_with_older_transformers() -> Tuple[Family, ...]:
    """The families whose plans also support releases older than the default (for messages)."""
    return tuple(family for family in FAMILIES if family.oldest_transformers < DEFAULT_OLDEST_TRANSFORMERS)
