"""NxD's ``neuronx_distributed.kernels`` paths, so model files written for NxD import unchanged but for the package
name. The NKI kernels themselves run only on Neuron devices (NeuronCore compilers and their kernel library); nxdtp
does not provide them. Calling one raises, naming the fallback every such model file has: its own attention (eager or
SDPA), which computes the same result (docs/nxd_migration.md)."""

from __future__ import annotations


def neuron_only_kernel(kernel: str, fallback: str):
    """A stand-in for an NKI kernel: importable, and raising ``NotImplementedError`` naming ``fallback`` when called."""
    def refuse(*args, **kwargs):
        raise NotImplementedError(f"{kernel} is an NKI kernel, which runs only on Neuron devices; nxdtp does not "
                                  f"provide it. {fallback}")

    refuse.__name__ = kernel.rsplit(".", 1)[-1]
    refuse.__qualname__ = refuse.__name__
    return refuse
