"""torch_xla's xser checkpoint format, emulated without torch_xla, for the NxD-import tests.

``torch_xla.utils.serialization.save`` (NxD's ``save_xser=True`` / ``use_xser=True``) pickles the object with every
device tensor replaced by a ``TensorReference(tid)`` and writes tensor ``tid`` to ``<path>.tensors/tensor_<tid>.pt``.
Here every tensor counts as a device tensor except optimizer ``step`` counters, which NxD keeps on the CPU.
"""

from __future__ import annotations

import os
import pickle
import types

import torch


class Reference:
    """Pickled under torch_xla's name, with torch_xla's state: what ``xser.save`` leaves in place of a tensor."""

    def __init__(self, tid):
        self.tid = tid


class _XserPickler(pickle._Pickler):
    def save_global(self, obj, name=None):
        if obj is Reference:
            self.write(pickle.GLOBAL + b"torch_xla.utils.serialization\nTensorReference\n")
            self.memoize(obj)
            return
        super().save_global(obj, name)


XSER_PICKLE = types.SimpleNamespace(Pickler=_XserPickler, __name__="xser_pickle")


def xser_save(data, path):
    """Write ``data`` at ``path`` the way ``xser.save`` does; tensors that are one object (ties) share a reference,
    numbered in the order they are first met."""
    folder = path + ".tensors"
    os.mkdir(folder)
    ids = {}

    def reference(tensor):
        if id(tensor) not in ids:
            ids[id(tensor)] = len(ids)
            torch.save(tensor, os.path.join(folder, f"tensor_{ids[id(tensor)]}.pt"))
        return Reference(ids[id(tensor)])

    def convert(value, key=None):
        if isinstance(value, torch.Tensor):
            return value if key == "step" else reference(value)
        if isinstance(value, dict):
            return type(value)((k, convert(v, k)) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return type(value)(convert(v) for v in value)
        return value

    torch.save(convert(data), path, pickle_module=XSER_PICKLE)
