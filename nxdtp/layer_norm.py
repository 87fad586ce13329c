"""NxD's ``parallel_layers.layer_norm`` path: the sequence-parallel LayerNorm lives in nxdtp.layers."""

from .layers import LayerNorm

__all__ = ["LayerNorm"]
