"""The one record of what nxdtp notes on objects it does not own: HF modules it wired, activations it gathered.

Every note is a declared, documented field of ``NxdtpRecord`` (not an attribute of its own, found only by grepping
for its string), and an object carries at most one record, under one key of its ``__dict__``: not a submodule, a
parameter or a buffer, so state dicts and parameter names stay HF's; ``copy.deepcopy`` and pickling copy it with the
object.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Optional, Tuple

_KEY = "_nxdtp_record"


@dataclasses.dataclass
class NxdtpRecord:
    """Every note nxdtp may keep on a module or a tensor. Who writes each field, and who reads it:"""

    # Buffers that differ by TP rank on purpose (masks of real heads or channels): ``broadcast_replicated_state``
    # leaves them alone. Written by ``HeadPadded`` and the parallel Conv2d layers.
    rank_local_buffers: Tuple[str, ...] = ()
    # Checkpoint keys a tie's owner is stored under, where HF's own choice does not load in every supported release
    # (RoBERTa's MLM bias). Written by the encoder plan on the model, read by ``nxdtp.checkpointing.save``.
    tied_keys_to_store: Tuple[str, ...] = ()
    # The model class's forward signature, for the encoder plan's loss wrapper to bind the user's arguments.
    forward_signature: Optional[inspect.Signature] = None
    # The input check of ``nxdtp.agreement.install_input_check`` on a model.
    input_check: Any = None
    # ``generation_mode`` runs a sequence-parallel model with the sequence whole: set on every module meanwhile, it
    # makes the sequence-parallel wrappers act as plain TP ones.
    whole_sequence: bool = False
    # How deeply ``generation_mode`` is entered on a model, and whether it suspended sequence parallelism there.
    generation_depth: int = 0
    generation_suspends_sequence_parallelism: bool = False
    # The trainer (class name) that handles TP for a model, so the forward's guard against HF's plain Trainer passes.
    trained_by: Optional[str] = None
    # The checkpoint function HF's gradient checkpointing assigned to a module, wrapped to replay nxdtp's RNG.
    checkpoint_function: Any = None
    # On an activation gathered along the sequence: the shard it was gathered from, and how to gather it again, so a
    # column-parallel layer may keep only the shard for backward (``nxdtp.sequence_parallel_linear``).
    sequence_shard: Any = None


def record_of(target: Any) -> NxdtpRecord:
    """``target``'s record, made empty on first use."""
    record = target.__dict__.get(_KEY)
    if record is None:
        record = target.__dict__[_KEY] = NxdtpRecord()
    return record


def read_record(target: Any) -> NxdtpRecord:
    """``target``'s record for reading: its own, or, when it has none (an object nxdtp never touched, or one without a
    ``__dict__`` such as a plain state dict), a new empty one that is not attached to it, so every field reads as its
    default and nothing is made on ``target``. Write through ``record_of``."""
    record = getattr(target, "__dict__", {}).get(_KEY)
    return record if record is not None else NxdtpRecord()
