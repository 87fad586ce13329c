"""Building blocks above nxdtp's parallel layers, at the paths of NxD's ``neuronx_distributed.modules``."""
