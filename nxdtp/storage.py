"""What a rank's tensors hold in memory: storages, not element counts.

A slice of a tensor is a view that keeps the whole storage it was cut from alive, so a rank's shard made by slicing a
dense weight would hold the dense weight. ``owning`` is the one place that turns a piece into a tensor of its own, and
``held_bytes`` is the one measure of what a set of tensors holds (each distinct storage counted once, whole).
"""

from __future__ import annotations

from typing import Iterable

import torch


def owns_its_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is laid out contiguously over a storage of exactly its own bytes, so that holding it holds
    nothing else. A tensor without a storage (XLA reports its base's size for a view) answers by the same rule."""
    expected = tensor.numel() * tensor.element_size()
    return (tensor.is_contiguous() and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == expected)


def owning(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when it owns its storage, otherwise a contiguous copy that does: a rank's piece of a larger
    tensor, kept as a view, would keep the larger tensor's storage alive for as long as the piece lives."""
    if owns_its_storage(tensor):
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of the distinct storages behind ``tensors``, each counted once and whole: what holding them costs.
    Tied parameters share a storage and count once; a view counts its base's storage."""
    # A storage is known by its implementation's address (_cdata), not data_ptr: every meta storage has data_ptr 0.
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())
