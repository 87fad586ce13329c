"""NxD's ``neuronx_distributed.kernels.flash_attn``: importable, not provided (see ``nxdtp.kernels``)."""

from . import neuron_only_kernel

nki_flash_attn_func = neuron_only_kernel(
    "nxdtp.kernels.flash_attn.nki_flash_attn_func",
    "Turn flash attention off in the model (NxD's Llama and GPT-NeoX files: config.use_flash_attention=False, the "
    "examples' --use_flash_attention 0); the model's own attention computes the same result.")

__all__ = ["nki_flash_attn_func"]
