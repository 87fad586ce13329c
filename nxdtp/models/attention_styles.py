"""The styles of an attention block's Q, K, V and output projections for any head counts, shared by every plan whose
attention has separate ``q_proj``-like projections: KV heads repeated when TP exceeds or does not divide them, zero
heads when TP does not divide the query heads (``nxdtp.heads`` gives the layout). The projections always record their
head layout, so a checkpoint saved at one degree can be resharded to one that needs copies or zero heads.
"""

from __future__ import annotations

import logging

from ..heads import kv_replicas, padded_group_size, padded_head_count
from ..plan import ColumnParallel, HeadPadded, KVReplicatedColumnParallel, RowParallel

logger = logging.getLogger(__name__)


class HeadsNotDivisibleError(ValueError):
    """TP does not divide the attention heads and zero heads were not allowed (``pad_heads=False``); callers whose
    users spell that switch another way (the trainer API's ``pad_model``) re-raise it with their own advice."""


def attention_projection_styles(model_name: str, heads: int, kv_heads: int, head_dim: int, tp: int, pad_heads: bool,
                                column: ColumnParallel, row: RowParallel) -> tuple:
    """The styles ``(q, k, v, o)`` for the projections, given the plan's plain ``column`` and ``row`` styles (the entry
    region and sequence-parallel options stay the plan's). Refuses, naming the values, head counts it cannot lay out,
    and zero heads when ``pad_heads`` is False; warns with the count when it adds them."""
    if heads % kv_heads != 0:
        raise ValueError(f"{model_name} num_attention_heads={heads} is not a multiple of "
                         f"num_key_value_heads={kv_heads}")
    padded = padded_head_count(heads, kv_heads, tp)
    if padded != heads:
        if not pad_heads:
            raise HeadsNotDivisibleError(
                f"{model_name} num_attention_heads={heads} (num_key_value_heads={kv_heads}) is not divisible by "
                f"tensor_model_parallel_size={tp}; choose a tensor_model_parallel_size that divides it, or pass "
                "pad_heads=True")
        logger.warning("%s: num_attention_heads=%d (num_key_value_heads=%d) at tensor_model_parallel_size=%d: padding "
                       "with %d zero heads to %d", model_name, heads, kv_heads, tp, padded - heads, padded)
    if kv_heads == heads:
        # Without grouped KV heads, K and V get the same zero heads as Q, at the end.
        q = HeadPadded(column, head_dim, padded, dim=0)
        return q, q, q, HeadPadded(row, head_dim, padded, dim=1)
    # With grouped KV heads, the KV heads are repeated until TP divides them, and each query group gets the zero heads
    # that split it evenly over its KV head's copies.
    kv = KVReplicatedColumnParallel(head_dim=head_dim, replicas=kv_replicas(kv_heads, tp),
                                    input_in_tensor_parallel_region=column.input_in_tensor_parallel_region)
    return (HeadPadded(column, head_dim, padded, dim=0, groups=kv_heads), kv, kv,
            HeadPadded(row, head_dim, padded, dim=1, groups=kv_heads))


def local_kv_groups(heads: int, kv_heads: int, tp: int) -> int:
    """Query heads per local KV head (HF attention's ``num_key_value_groups`` on each rank): unchanged by an even
    split, smaller when KV heads are repeated."""
    if kv_heads == heads:
        return 1   # with or without zero heads, every query head has its own KV head
    return padded_group_size(heads, kv_heads, tp) // kv_replicas(kv_heads, tp)
