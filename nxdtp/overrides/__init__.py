"""NxD's ``neuronx_distributed.overrides``: replacements for transformers functions that NxD's model files import."""
