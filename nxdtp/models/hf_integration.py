"""What every family's plan does last to a parallelized Hugging Face model, so that HF's own methods and habits work
on it as on the dense model (or refuse loudly): one call from each plan's ``finalize``, whatever the family."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

from torch import nn

from ..agreement import install_input_check
from ..record import read_record
from ..topology import tensor_parallel_group
from .activation_checkpointing import support_hf_checkpointing
from .generation import support_hf_generation
from .hf_saving import support_save_pretrained


def finish_hf_model(model: nn.Module) -> None:
    """Fit HF's methods to the parallelized ``model``: activation checkpointing replays nxdtp's RNG states;
    ``generate`` decodes from full-vocabulary logits, on the whole sequence (``nxdtp.models.generation``);
    ``save_pretrained`` writes the dense HF directory gathered from the shards; a multi-process accelerate (plain
    ``transformers.Trainer``) driving it is refused at its first training forward; and every forward checks that the
    ranks of the TP group received the same inputs (``nxdtp.agreement``; HF's training loops feed each process its own
    batch unless told otherwise); ``peft.get_peft_model`` shards LoRA adapters like their base layers
    (``support_peft``)."""
    support_hf_checkpointing(model)
    support_hf_generation(model)
    support_save_pretrained(model)
    support_peft()
    if tensor_parallel_group().size > 1:
        model.register_forward_pre_hook(refuse_foreign_multiprocess_trainers)
    # Last, so the check is the outermost wrapper and sees the call as the user made it.
    install_input_check(model)


def refuse_foreign_multiprocess_trainers(model: nn.Module, args) -> None:
    """A forward pre-hook: refuse a training forward while an accelerate training state is live (plain
    ``transformers.Trainer``, or ``accelerate.Accelerator.prepare``) unless a TP-aware trainer marked the model. With
    several processes such a trainer wraps the model in DDP over the whole world, which broadcasts TP rank 0's shards
    over the others, and feeds each TP rank a different batch; with one process (accelerate blind to the torchrun
    world) each rank trains alone with local-shard clipping: the run would finish and the model be wrong. Costs a
    dictionary lookup."""
    state = sys.modules.get("accelerate.state")
    # A trainer that handles TP (nxdtp.models.trainer) names itself in the model's record.
    if state is None or not model.training or read_record(model).trained_by:
        return
    # Any live accelerate training state: with several processes it wraps the model in DDP over the TP ranks; with
    # one (torchrun on CPUs without use_cpu=True, where accelerate does not see the world) every process trains on
    # its own and clips by the norm of its local shards. Neither is right for a TP model.
    if state.GradientState._shared_state and state.PartialState._shared_state:
        processes = state.PartialState._shared_state.get("num_processes", 1)
        raise RuntimeError(
            f"{type(model).__name__} is tensor-parallel (nxdtp) and is being trained by an accelerate setup that is "
            f"not (transformers.Trainer or Accelerator.prepare, {processes} process(es)): with several processes it "
            "wraps the model in DDP over the tensor-parallel ranks (overwriting their shards with rank 0's) and gives "
            "each of them a different batch; with one, every process trains on its own and clips by its local "
            "shards' norm. Use nxdtp.models.trainer.TensorParallelTrainer in place of transformers.Trainer (with "
            "TrainingArguments(use_cpu=True) on CPUs), or nxdtp's own training loop (docs/wrapping_hf_models.md)")


# ---- PEFT ------------------------------------------------------------------------------------------------------------
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
