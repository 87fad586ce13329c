"""nxdtp: tensor parallelism for PyTorch with neuronx-distributed's public names."""

__version__ = "0.1.0"
