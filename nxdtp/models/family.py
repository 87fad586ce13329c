"""The record each model family declares: one ``FAMILY = Family(...)`` at the end of its file (``bert.py``,
``roberta.py``, ``gpt2.py``, ``llama.py``), listed once in ``nxdtp.models.registry``. Everything that maps an HF class
to nxdtp's handling of it reads this record, so a new family is its file plus one line in the registry.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Tuple

from ..plan import Plan

DEFAULT_OLDEST_TRANSFORMERS = (4, 48)

# Family name -> the oldest transformers release its plan supports, filled as each family file defines its FAMILY
# (the package imports every family file, through the registry, before any plan is made): the version check reads it
# here, below the family files, which it is called from.
_OLDEST_TRANSFORMERS: Dict[str, Tuple[int, int]] = {}


@dataclasses.dataclass(frozen=True)
class Family:
    """One HF model family as nxdtp shards it.

    ``name``: for messages ("BERT", "Llama-family"). ``classes``: the HF model class names its plan supports.
    ``plan(sequence_parallel, make_vocab_size_divisible_by, pad_heads)``: its ``Plan``. ``checkpoint_keys(name)``:
    the keys an HF checkpoint may store parameter ``name`` under (with or without the base model's prefix, legacy
    names). ``oldest_transformers``: the oldest transformers release (major, minor) the plan is written and tested
    against; every family supports up to the newest 5.x.
    """

    name: str
    classes: Tuple[str, ...]
    plan: Callable[..., Plan]
    checkpoint_keys: Callable[[str], List[str]]
    oldest_transformers: Tuple[int, int] = DEFAULT_OLDEST_TRANSFORMERS

    def __post_init__(self):
        _OLDEST_TRANSFORMERS[self.name] = self.oldest_transformers


def oldest_transformers(family_name: str) -> Tuple[int, int]:
    """The oldest transformers release the plan of the family named ``family_name`` supports (the default for plans
    that are not a family's, such as HF's own tp_plan)."""
    return _OLDEST_TRANSFORMERS.get(family_name, DEFAULT_OLDEST_TRANSFORMERS)


def families_with_older_transformers() -> List[str]:
    """The names of the families whose plans also support releases older than the default (for messages)."""
    return [name for name, oldest in _OLDEST_TRANSFORMERS.items() if oldest < DEFAULT_OLDEST_TRANSFORMERS]
