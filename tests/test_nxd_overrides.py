"""The NxD paths NxD's model files import besides the layers: ``nxdtp.overrides.transformer_overrides`` (rotary
embeddings with NxD's signature, equal to transformers') and ``nxdtp.kernels`` (NKI kernels: importable, refused with
the fallback when called)."""

import pytest
import torch

from nxdtp.kernels.flash_attn import nki_flash_attn_func
from nxdtp.kernels.ring_attention_kernel import nki_ring_attn_func
from nxdtp.overrides.transformer_overrides import apply_rotary_pos_emb


def _inputs():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g)
    cos, sin = torch.randn(10, 8, generator=g), torch.randn(10, 8, generator=g)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 5], [4, 5, 6, 7, 8, 9]])
    return q, k, cos, sin, position_ids


def _reference(q, k, cos, sin):
    """Rotary embedding as RoFormer/Llama define it: x * cos + rotate_half(x) * sin, halves (x1, x2) -> (-x2, x1)."""
    def rotate(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


def test_rotary_equals_the_definition_with_and_without_position_ids():
    q, k, cos, sin, position_ids = _inputs()
    expected = _reference(q, k, cos[position_ids].unsqueeze(1), sin[position_ids].unsqueeze(1))
    for actual, want in zip(apply_rotary_pos_emb(q, k, cos, sin, position_ids, False), expected):
        torch.testing.assert_close(actual, want)
    # NxD's Llama passes cos/sin already taken per position ([batch, seq, dim]) and position_ids=None.
    picked_cos, picked_sin = cos[position_ids], sin[position_ids]
    for actual, want in zip(apply_rotary_pos_emb(q, k, picked_cos, picked_sin, None, False), expected):
        torch.testing.assert_close(actual, want)


def test_rotary_in_the_nki_transposed_layout_is_the_transpose():
    q, k, cos, sin, position_ids = _inputs()
    expected = apply_rotary_pos_emb(q, k, cos, sin, position_ids, False)
    transposed = apply_rotary_pos_emb(q.transpose(-1, -2), k.transpose(-1, -2), cos, sin, position_ids, True, True)
    for actual, want in zip(transposed, expected):
        torch.testing.assert_close(actual, want.transpose(-1, -2))
    # flash attention without transposed inputs is the plain layout
    for actual, want in zip(apply_rotary_pos_emb(q, k, cos, sin, position_ids, True, False), expected):
        torch.testing.assert_close(actual, want)


@pytest.mark.parametrize("kernel,fallback", [(nki_flash_attn_func, "use_flash_attention=False"),
                                             (nki_ring_attn_func, "context_parallel_size=1")])
def test_nki_kernels_are_importable_and_refused_naming_the_fallback(kernel, fallback):
    with pytest.raises(NotImplementedError, match=f"runs only on Neuron devices.*{fallback}"):
        kernel(torch.zeros(1), torch.zeros(1), torch.zeros(1))
