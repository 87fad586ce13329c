"""NxD's ``neuronx_distributed.overrides.transformer_overrides``: rotary position embedding with NxD's signature.

NxD's Llama file applies rotary embeddings through this ``apply_rotary_pos_emb(q, k, cos, sin, position_ids,
flash_attn, transpose_nki_inputs=True)`` instead of transformers'. Without flash attention it is transformers' rotation
(q * cos + rotate_half(q) * sin, cos/sin picked by ``position_ids`` when given). With flash attention and transposed
NKI inputs, q and k arrive as [batch, heads, head_dim, seq] and the rotation runs along the head_dim axis there.
"""

from __future__ import annotations

import torch

__all__ = ["apply_rotary_pos_emb", "rotate_half"]


def rotate_half(x: torch.Tensor, flash_attn: bool, transpose: bool) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the head dimension (dim -1, or dim -2 in NKI's transposed
    layout)."""
    dim = -2 if flash_attn and transpose else -1
    first, second = x.chunk(2, dim=dim)
    return torch.cat((-second, first), dim=dim)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids,
                         flash_attn: bool, transpose_nki_inputs: bool = True):
    if position_ids is not None:  # cos/sin hold every position: take the batch's, [batch, seq, dim]
        cos, sin = cos[position_ids], sin[position_ids]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over the heads
    transposed = flash_attn and transpose_nki_inputs
    if transposed:
        cos, sin = cos.transpose(-1, -2), sin.transpose(-1, -2)
    return (q * cos + rotate_half(q, flash_attn, transposed) * sin,
            k * cos + rotate_half(k, flash_attn, transposed) * sin)
