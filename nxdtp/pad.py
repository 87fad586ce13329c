"""NxD's attention-head padding helpers (``neuronx_distributed.parallel_layers.pad``): ``get_number_of_extra_heads``,
``pad_model`` and ``generate_padding_mask``.

For Hugging Face models ``nxdtp.models.parallelize_model`` pads heads itself (``nxdtp.plan.HeadPadded``), masks the
zero heads and records the padding in the checkpoint specs; these functions are for models built by hand from nxdtp's
layers, with NxD's arguments and results.
"""

from __future__ import annotations

import dataclasses
import enum
import warnings
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from .heads import padded_head_count
from .layers import ColumnParallelLinear, RowParallelLinear
from .utils import hardware


def get_number_of_extra_heads(n_head: int, tp_degree: int) -> int:
    """The zero heads to add so that ``tp_degree`` divides ``n_head``."""
    if tp_degree == 0:   # other ints give NxD's numbers; zero gets a message naming it
        _require_positive("get_number_of_extra_heads", "tp_degree", tp_degree)
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
    _require_positive("pad_model", "n_heads", n_heads)
    _require_positive("pad_model", "tp_degree", tp_degree)
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
        layer.register_param_spec(name, dataclasses.replace(spec, full_shape=tuple(full),
                                                            real_shape=spec.unpadded_shape,
                                                            pad_groups=spec.num_partitions))
    if column:
        layer.output_size_per_partition = grown
        layer.output_size = grown * specs["weight"].num_partitions
    else:
        layer.input_size_per_partition = grown
        layer.input_size = grown * specs["weight"].num_partitions


def generate_padding_mask(num_heads: int, num_heads_with_pad: int, num_kv_heads: int, tp_degree: int, tp_rank: int,
                          hardware_type=None) -> torch.Tensor:
    """True for rank ``tp_rank``'s real query heads, False for its zero heads: a bool tensor of
    ``num_heads_with_pad / tp_degree`` entries, NxD's mask for every argument that describes a model.

    NxD's rule, where each rank holds ``n = num_heads_with_pad / tp_degree`` query heads, each KV head has
    ``g = num_heads / num_kv_heads`` real ones, and a KV head's (or a rank's) real query heads come before its zeros:

    * Trainium2 (``hardware.TRN2``, "trn2", or None): a KV head's copies are on adjacent ranks. Blocks of
      ``R = max(tp_degree / num_kv_heads, 1)`` ranks share ``k = num_kv_heads * R / tp_degree`` KV heads; the rank at
      position ``c = tp_rank % R`` of its block holds the block's query heads ``c*n .. c*n + n - 1``, of which those
      below ``g * k`` are real. So with 8 KV heads at TP 4 (two per rank), 24 heads padded to 32 mask heads 6 and 7 of
      every rank; with 48 heads padded to 64 at TP 32, the last rank of each block of 4 is all padding.
    * Trainium1 (``hardware.TRN1``, "trn1", and the aliases "trn1n", "inf2"): the copies are tiled (every KV head
      before any second copy). The rank holds round ``b = tp_rank // num_kv_heads`` of its KV head's copies and that
      head's query heads ``b*n .. b*n + n - 1``, of which those below ``g`` are real.

    The rule describes a layout when ``tp_degree`` is a multiple of ``num_kv_heads`` or, on Trainium2 only, a divisor.
    Otherwise NxD's mask does not mark ``num_heads`` real heads (Trainium1 assumes one KV head per rank; without
    grouping, 6 heads padded to 8 at TP 4 give each rank one real head); nxdtp returns the same mask, so a model trained
    with NxD's keeps its behaviour, and warns. nxdtp's plans pad such models their own way (``nxdtp.heads``).

    ``hardware_type`` None: NxD asks torch_neuronx for the platform; nxdtp has none to ask and uses Trainium2's rule,
    the layout of its ``GQAQKVColumnParallelLinear`` and plans. Enum members are read by value, so NxD's own
    ``hardware`` enum works too. Trainium3, a custom platform and other values raise ``UnexpectedHardwareTypeError``
    (a ``RuntimeError`` like NxD's and a ``ValueError``); a zero ``tp_degree`` or ``num_kv_heads`` raises an error that
    is also a ``ZeroDivisionError``, as NxD's division does. Arguments that describe no padded model (heads not a
    multiple of the KV heads, fewer padded heads than heads, padded heads that ``tp_degree`` does not divide, a rank
    outside the degree) raise ``ValueError``, where NxD returns an arbitrary mask.
    """
    kind = _hardware_kind(hardware_type)
    _check_padding_mask_arguments(num_heads, num_heads_with_pad, num_kv_heads, tp_degree, tp_rank)
    per_rank, group = num_heads_with_pad // tp_degree, num_heads // num_kv_heads
    if kind == "trn2":
        block_ranks = max(tp_degree // num_kv_heads, 1)
        describes_layout = tp_degree % num_kv_heads == 0 or num_kv_heads % tp_degree == 0
        first = per_rank * (tp_rank % block_ranks)
        real = group * (num_kv_heads * block_ranks // tp_degree)
    else:
        describes_layout = tp_degree % num_kv_heads == 0
        first = per_rank * (tp_rank // num_kv_heads)
        real = group
    if not describes_layout:
        # NxD returns this mask without a word; the warning names why it cannot be a model's whole set of heads.
        warnings.warn(f"generate_padding_mask: with num_kv_heads={num_kv_heads} and tp_degree={tp_degree}, NxD's "
                      f"{kind} rule describes no head layout (it needs tp_degree to be a multiple of num_kv_heads"
                      f"{' or a divisor' if kind == 'trn2' else ''}); its mask, returned here as NxD returns it, does "
                      f"not mark num_heads={num_heads} real heads over the ranks", UserWarning, stacklevel=2)
    return torch.arange(first, first + per_rank) < real


def _check_padding_mask_arguments(num_heads: int, num_heads_with_pad: int, num_kv_heads: int, tp_degree: int,
                                  tp_rank: int) -> None:
    """Refuse, by name, arguments of ``generate_padding_mask`` that describe no padded model."""
    for name, value, nxd_divides in (("num_heads", num_heads, False), ("num_heads_with_pad", num_heads_with_pad, False),
                                     ("num_kv_heads", num_kv_heads, True), ("tp_degree", tp_degree, True)):
        _require_positive("generate_padding_mask", name, value, nxd_divides)
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"generate_padding_mask: num_heads={num_heads} is not a multiple of "
                         f"num_kv_heads={num_kv_heads}")
    if num_heads_with_pad < num_heads:
        raise ValueError(f"generate_padding_mask: num_heads_with_pad={num_heads_with_pad} is fewer than "
                         f"num_heads={num_heads}")
    if num_heads_with_pad % tp_degree != 0:
        raise ValueError(f"generate_padding_mask: num_heads_with_pad={num_heads_with_pad} is not a multiple of "
                         f"tp_degree={tp_degree}, so the ranks cannot hold whole heads")
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_degree:
        raise ValueError(f"generate_padding_mask: tp_rank={tp_rank!r} is outside tensor parallel degree {tp_degree}: "
                         f"use 0 to {tp_degree - 1}")


class UnexpectedHardwareTypeError(ValueError, RuntimeError):
    """``generate_padding_mask`` got a hardware type it has no layout for.

    NxD raises ``RuntimeError`` here and nxdtp raised ``ValueError`` before, so callers written for either keep
    catching it."""


class _ZeroDivisorError(ValueError, ZeroDivisionError):
    """A zero where NxD divides (so its callers catch ``ZeroDivisionError``), reported with the argument's name."""


def _require_positive(function: str, name: str, value, nxd_divides: bool = True) -> None:
    """Refuse ``value`` unless it is an int >= 1; a zero that NxD divides by raises what NxD's division raises too."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        zero_divisor = nxd_divides and value == 0 and not isinstance(value, bool)
        error = _ZeroDivisorError if zero_divisor else ValueError
        raise error(f"{function}: {name}={value!r} must be a positive int")


def _hardware_kind(hardware_type) -> str:
    """"trn1" or "trn2": the rule for ``hardware_type`` (a ``hardware`` member, NxD's, a platform name or None)."""
    if hardware_type is None:
        return "trn2"
    name = hardware_type.value if isinstance(hardware_type, enum.Enum) else hardware_type
    try:
        kind = hardware(name) if isinstance(name, str) else None
    except ValueError:
        kind = None
    if kind not in (hardware.TRN1, hardware.TRN2):
        raise UnexpectedHardwareTypeError(
            f"Unexpected hardware_type {hardware_type!r} for generate_padding_mask: use hardware.TRN1 or 'trn1' "
            "(Trainium1, KV copies tiled; also 'trn1n', 'inf2'), or hardware.TRN2, 'trn2' or None (Trainium2, KV "
            "copies on adjacent ranks)")
    return kind.value
