"""Attention-head arithmetic for tensor parallelism: how many times KV heads are repeated and how many zero query
heads are added so that a TP degree divides them. Plans, checkpoint resharding and NxD's padding helpers all use these
functions, so a model, its checkpoints and its masks always agree on the layout.

The layout (HF's grouping: query head ``q`` attends with KV head ``q // (heads / kv_heads)``):

* KV heads: each is repeated ``kv_replicas`` times in a row (copies of one head on adjacent ranks), so that TP divides
  the copies. Each rank then holds whole copies.
* Query heads: the ``heads / kv_heads`` query heads of each KV head (its *group*) are split evenly over that head's
  copies; when the copies do not divide the group, the group is padded with zero heads at its end. Without grouped KV
  heads (``kv_heads == heads``), zero heads are instead appended to Q, K and V alike at the end.
"""

from __future__ import annotations

import math

from .rounding import round_up


def kv_replicas(kv_heads: int, tp: int) -> int:
    """How many times each KV head is repeated so that ``tp`` divides the copies (1 when it already divides them)."""
    return 1 if kv_heads % tp == 0 else math.lcm(kv_heads, tp) // kv_heads


def padded_group_size(heads: int, kv_heads: int, tp: int) -> int:
    """The query heads per KV head after padding: the group size rounded up to a multiple of the KV head's copies."""
    if heads % kv_heads != 0:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    replicas = kv_replicas(kv_heads, tp)
    return round_up(heads // kv_heads, replicas)


def padded_head_count(heads: int, kv_heads: int, tp: int) -> int:
    """The query heads after zero-head padding at TP degree ``tp`` (``heads`` when none is needed)."""
    if kv_heads == heads:
        return round_up(heads, tp)
    return kv_heads * padded_group_size(heads, kv_heads, tp)


def padded_rows(real_rows: int, head_dim: int, groups: int, tp: int, stride: int = 1) -> int:
    """The rows of a head-padded projection at degree ``tp`` given its real rows, head size and padding groups: with
    ``stride`` > 1 (fused Q|K|V, one group per part) each part is padded like heads without grouping; otherwise 1 group
    means zero heads at the end, and more groups are the query groups of grouped KV heads."""
    heads = real_rows // head_dim
    if stride > 1:
        return stride * padded_head_count(heads // stride, heads // stride, tp) * head_dim
    kv_heads = heads if groups == 1 else groups
    return padded_head_count(heads, kv_heads, tp) * head_dim
