"""The one rounding rule behind every padded size (vocabularies, partition-padded channels, zero heads, ZeRO-1's flat
shards): ``round_up(size, multiple)``. A layer, a plan and a checkpoint reshard that round the same size the same way
agree on shapes by construction."""

from __future__ import annotations


def round_up(size: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is at least ``size``."""
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise ValueError(f"round_up: multiple={multiple!r} must be an int >= 1")
    return -(-size // multiple) * multiple
