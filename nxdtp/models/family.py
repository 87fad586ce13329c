"""The record each model family declares: one ``FAMILY = Family(...)`` at the end of its file (``bert.py``,
``roberta.py``, ``gpt2.py``, ``llama.py``), listed once in ``nxdtp.models.registry``. Everything that maps an HF class
to nxdtp's handling of it reads this record, so a new family is its file plus one line in the registry.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Tuple

from ..plan import Plan

DEFAULT_OLDEST_TRANSFORMERS = (4, 48)


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
