"""NxD's attention-head padding helpers (``neuronx_distributed.parallel_layers.pad``): ``get_number_of_extra_heads``,
``pad_model`` and ``generate_padding_mask``.

For Hugging Face models ``nxdtp.models.parallelize_model`` pads heads itself (``nxdtp.plan.HeadPadded``), masks the
zero heads and records the padding in the checkpoint specs; these functions are for models built by hand from nxdtp's
layers, with NxD's arguments and results.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from .heads import kv_replicas, padded_head_count
from .layers import ColumnParallelLinear, RowParallelLinear


def get_number_of_extra_heads(n_head: int, tp_degree: int) -> int:
    """The zero heads to add so that ``tp_degree`` divides ``n_head``."""
    return padded_head_count(n_head, n_head, tp_degree) - n_head


def pad_model(model: nn.Module, tp_degree: int, n_heads: int, wrapped_classes: Iterable[type] = (),
              pad_hook_fn: Optional[Callable[[nn.Module, float], None]] = None) -> nn.Module:
    """Grow every ColumnParallelLinear's output rows and every RowParallelLinear's input columns by
    ``(n_heads + extra) / n_heads`` with zeros at the end of each rank's shard, as NxD does, and return the model.

    Only modules inside instances of ``wrapped_classes`` are padded when it is given (typically the attention class).
    ``pad_hook_fn(module, ratio)`` is called on every module that is padded or lies inside a wrapped one, so it can fix
    head counts the module keeps. Call it while each layer still holds the whole projection (TP size 1, before the
    checkpoint is sharded): each rank's shard is then the projection with its zero heads at the end. The specs record
    the padding per rank, so merging strips it; resharding such a checkpoint is refused.
    """
    if n_heads <= 0 or tp_degree <= 0:
        raise ValueError(f"pad_model needs positive n_heads and tp_degree, got n_heads={n_heads}, tp_degree={tp_degree}")
    ratio = (n_heads + get_number_of_extra_heads(n_heads, tp_degree)) / n_heads
    wrapped = tuple(wrapped_classes)

    def visit(module: nn.Module, inside: bool) -> None:
        for child in module.children():
            visit(child, inside or isinstance(child, wrapped))
        if inside:
            if pad_hook_fn is not None:
                pad_hook_fn(module, ratio)
            if ratio != 1 and isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                _pad_shard(module, ratio)

    visit(model, not wrapped or isinstance(model, wrapped))
    return model


def _pad_shard(layer: nn.Module, ratio: float) -> None:
    column = isinstance(layer, ColumnParallelLinear)
    dim = 0 if column else 1
    specs = layer.param_specs()
    if specs["weight"].stride != 1:
        raise ValueError(f"pad_model cannot pad {type(layer).__name__} with stride={specs['weight'].stride} (a fused "
                         "projection): its zero rows would land inside one of the fused parts")
    local = layer.weight.shape[dim]
    grown = int(local * ratio)
    sharded = [name for name in ("weight", "bias") if getattr(layer, name, None) is not None
               and specs[name].partition_dim == dim]
    for name in sharded:
        spec, param = specs[name], getattr(layer, name)
        padding = list(param.shape)
        padding[dim] = grown - local
        value = torch.cat([param.detach(), param.new_zeros(padding)], dim=dim)
        setattr(layer, name, nn.Parameter(value, requires_grad=param.requires_grad))
        full = list(spec.full_shape)
        full[dim] = grown * spec.num_partitions
        # Each rank's shard is one group: its real rows, then its zero rows.
        layer.register_param_spec(name, dataclasses.replace(spec, full_shape=tuple(full), real_shape=spec.unpadded_shape,
                                                            pad_groups=spec.num_partitions))
    if column:
        layer.output_size_per_partition = grown
        layer.output_size = grown * specs["weight"].num_partitions
    else:
        layer.input_size_per_partition = grown
        layer.input_size = grown * specs["weight"].num_partitions


def generate_padding_mask(num_heads: int, num_heads_with_pad: int, num_kv_heads: int, tp_degree: int, tp_rank: int,
                          hardware_type=None) -> torch.Tensor:
    """True for this rank's real query heads, False for its zero heads (a bool tensor of the rank's head count).

    The layout is nxdtp's (``nxdtp.heads``): KV head copies on adjacent ranks, each query group padded at its end, and
    without grouped KV heads the zero heads after the real ones. For grouped heads that is the layout NxD uses on
    Trainium2 (``hardware_type`` None or "trn2"); "trn1" gives NxD's Trainium1 layout (the KV heads' copies tiled:
    every KV head before any second copy), for checkpoints made that way.
    """
    kind = getattr(hardware_type, "value", hardware_type)
    if kind not in (None, "trn1", "trn2"):
        raise ValueError(f"hardware_type={hardware_type!r} is not supported: use None or 'trn2' (adjacent KV copies, "
                         "nxdtp's layout) or 'trn1' (tiled KV copies)")
    if not 0 <= tp_rank < tp_degree:
        raise ValueError(f"tp_rank={tp_rank} is outside tensor parallel degree {tp_degree}")
    expected = padded_head_count(num_heads, num_kv_heads, tp_degree)
    if num_heads_with_pad != expected:
        raise ValueError(f"num_heads_with_pad={num_heads_with_pad} is not the padding nxdtp uses for {num_heads} heads "
                         f"and {num_kv_heads} KV heads at tensor parallel degree {tp_degree}: {expected}")
    per_rank = num_heads_with_pad // tp_degree
    if num_kv_heads == num_heads:
        return torch.arange(tp_rank * per_rank, (tp_rank + 1) * per_rank) < num_heads
    replicas = kv_replicas(num_kv_heads, tp_degree)
    copies_per_rank = num_kv_heads * replicas // tp_degree
    group, padded_group = num_heads // num_kv_heads, num_heads_with_pad // num_kv_heads
    share = padded_group // replicas   # query heads of one KV copy
    mask = []
    for local_copy in range(copies_per_rank):
        copy_index = tp_rank * copies_per_rank + local_copy
        # Adjacent layout: copy i is replica i % replicas of KV head i // replicas; tiled: of KV head i % kv_heads.
        replica = copy_index % replicas if kind != "trn1" else copy_index // num_kv_heads
        mask += [replica * share + position < group for position in range(share)]
    return torch.tensor(mask, dtype=torch.bool)
