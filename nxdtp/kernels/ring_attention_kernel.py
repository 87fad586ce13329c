"""NxD's ``neuronx_distributed.kernels.ring_attention_kernel``: importable, not provided (see ``nxdtp.kernels``)."""

from . import neuron_only_kernel

nki_ring_attn_func = neuron_only_kernel(
    "nxdtp.kernels.ring_attention_kernel.nki_ring_attn_func",
    "Ring attention serves context parallelism, which nxdtp does not do (context_parallel_size=1); with CP at 1 the "
    "model's own attention runs.")

__all__ = ["nki_ring_attn_func"]
