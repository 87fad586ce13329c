"""What every family's plan does last to a parallelized Hugging Face model, so that HF's own methods and habits work
on it as on the dense model (or refuse loudly): one call from each plan's ``finalize``, whatever the family."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

from torch import nn

from .activation_checkpointing import support_hf_checkpointing


def finish_hf_model(model: nn.Module) -> None:
    """Fit HF's methods to the parallelized ``model``: activation checkpointing replays nxdtp's RNG states, and
    ``peft.get_peft_model`` shards LoRA adapters like their base layers (``support_peft``)."""
    support_hf_checkpointing(model)
    support_peft()


# ---- PEFT ---------------------------------------------------------------------------------------------------------------
# PEFT dispatches each targeted layer to a LoRA layer by its type and knows nothing of nxdtp's layers. nxdtp adds its
# dispatch (and its checks, and the gathered save) to PEFT's entry points (nxdtp.models.peft_lora.install). PEFT takes
# seconds to import, so nxdtp never imports it for a program that does not: it installs at once if PEFT is imported
# already, else just after PEFT's own import finishes, and not at all if PEFT is not installed.

def support_peft() -> None:
    """Make ``peft.get_peft_model`` (and ``PeftModel.from_pretrained``) work on nxdtp's parallelized models."""
    if "peft" in sys.modules:
        _install_into_peft()
    elif not any(isinstance(finder, _InstallAfterPeftImport) for finder in sys.meta_path):
        if importlib.util.find_spec("peft") is not None:
            sys.meta_path.insert(0, _InstallAfterPeftImport())


def _install_into_peft() -> None:
    from . import peft_lora

    peft_lora.install()


class _InstallAfterPeftImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``peft`` is imported it lets the other finders find it, and runs the install once
    PEFT's package has executed."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "peft":
            return None
        sys.meta_path.remove(self)   # one use; the other finders find the real package
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenInstall(spec.loader)
        return spec


class _ThenInstall(importlib.abc.Loader):
    """PEFT's own loader, followed by the install."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _install_into_peft()

    def __getattr__(self, name):   # resource readers and the like: PEFT's loader answers
        return getattr(self._loader, name)
