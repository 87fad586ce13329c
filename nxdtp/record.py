"""Notes nxdtp keeps on objects it does not own (HF modules it wired, activations it gathered), each typed and kept by
the feature that owns it.

A feature declares its note as a dataclass whose every field has a default, in its own module (the input check's in
``nxdtp.agreement``, generation's in ``nxdtp.models.generation``, ...), and reads and writes it here by its class:
``note_of(model, InputCheckNote).check = ...``. An object's notes live under one key of its ``__dict__``, one per note
class: not a submodule, a parameter or a buffer, so state dicts and parameter names stay HF's; ``copy.deepcopy`` and
pickling copy them with the object.
"""

from __future__ import annotations

from typing import Any, Type, TypeVar

_KEY = "_nxdtp_notes"

Note = TypeVar("Note")


def note_of(target: Any, kind: Type[Note]) -> Note:
    """``target``'s note of class ``kind``, made with the class's defaults on first use: the one to write through."""
    notes = target.__dict__.setdefault(_KEY, {})
    note = notes.get(kind)
    if note is None:
        note = notes[kind] = kind()
    return note


def read_note(target: Any, kind: Type[Note]) -> Note:
    """``target``'s note of class ``kind`` for reading: its own or, when it has none (an object nxdtp never touched, or
    one without a ``__dict__`` such as a plain state dict), a new one with the defaults that is not attached, so
    nothing is made on ``target``. Write through ``note_of``."""
    note = getattr(target, "__dict__", {}).get(_KEY, {}).get(kind)
    return note if note is not None else kind()
