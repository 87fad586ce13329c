"""What every family's plan does last to a parallelized Hugging Face model, so that HF's own methods and habits work
on it as on the dense model (or refuse loudly): one call from each plan's ``finalize``, whatever the family."""

from __future__ import annotations

import dataclasses
import sys
import warnings
from typing import Optional

from torch import nn

from ..agreement import install_input_check
from ..record import read_note
from ..topology import tensor_parallel_group
from .activation_checkpointing import support_hf_checkpointing
from .generation import support_hf_generation
from .hf_saving import support_save_pretrained
from .logits import support_full_logits


def finish_hf_model(model: nn.Module) -> None:
    """Fit HF's methods to the parallelized ``model``: activation checkpointing replays nxdtp's RNG states; the
    forward returns full-vocabulary logits (``nxdtp.models.logits``); ``generate`` decodes on the whole sequence
    (``nxdtp.models.generation``); ``save_pretrained`` writes the dense HF directory gathered from the shards; a
    multi-process accelerate (plain ``transformers.Trainer``) driving it is refused at its first training forward;
    and every forward checks that the ranks of the TP group received the same inputs (``nxdtp.agreement``; HF's
    training loops feed each process its own batch unless told otherwise); ``peft.get_peft_model`` shards LoRA
    adapters like their base layers (``support_peft``)."""
    support_hf_checkpointing(model)
    support_full_logits(model)
    support_hf_generation(model)
    support_save_pretrained(model)
    support_peft()
    if tensor_parallel_group().size > 1:
        model.register_forward_pre_hook(refuse_foreign_multiprocess_trainers)
    # Last, so the check is the outermost wrapper and sees the call as the user made it.
    install_input_check(model)


@dataclasses.dataclass
class TrainedByNote:
    """On a model: the class name of the trainer that handles TP for it (``nxdtp.models.hf_trainer``), so the guard
    against trainers that do not lets its forward pass."""
    trainer: Optional[str] = None


def refuse_foreign_multiprocess_trainers(model: nn.Module, args) -> None:
    """A forward pre-hook: refuse a training forward while an accelerate training state is live (plain
    ``transformers.Trainer``, or ``accelerate.Accelerator.prepare``) unless a TP-aware trainer marked the model. With
    several processes such a trainer wraps the model in DDP over the whole world, which broadcasts TP rank 0's shards
    over the others, and feeds each TP rank a different batch; with one process (accelerate blind to the torchrun
    world) each rank trains alone with local-shard clipping: the run would finish and the model be wrong. Costs a
    dictionary lookup."""
    state = sys.modules.get("accelerate.state")
    if state is None or not model.training or read_note(model, TrainedByNote).trainer:
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
            "shards' norm. Use nxdtp.models.hf_trainer.TensorParallelTrainer in place of transformers.Trainer (with "
            "TrainingArguments(use_cpu=True) on CPUs), or nxdtp's own training loop (docs/wrapping_hf_models.md)")


# ---- PEFT ------------------------------------------------------------------------------------------------------------
# PEFT dispatches each targeted layer to a LoRA layer by its type and knows nothing of nxdtp's layers. nxdtp adds its
# dispatch (and its checks, and the gathered save) to PEFT's entry points (nxdtp.models.peft_lora.install) when a model
# is parallelized, the call that comes before any get_peft_model on it, whichever of nxdtp and PEFT was imported first.
# Once transformers is loaded (as it is for any HF model), importing PEFT takes about 0.1 s (peft 0.21.2), so the
# install imports it at that call rather than watching imports for it.

def support_peft() -> None:
    """Make ``peft.get_peft_model`` (and ``PeftModel.from_pretrained``) work on nxdtp's parallelized models: wrap
    PEFT's entry points, once per process. Nothing happens where PEFT is not installed; every plan's ``finalize``
    calls it (through ``finish_hf_model``), and calling it again does nothing."""
    try:
        from . import peft_lora  # imports PEFT
    except ImportError as error:
        if error.name == "peft":
            return   # not installed: no get_peft_model to prepare for
        # A PEFT release that cannot be imported here, or whose modules moved: parallelizing still works; LoRA on the
        # model is not prepared, and the warning says why.
        warnings.warn(f"PEFT is installed but nxdtp cannot wrap it ({error}): peft.get_peft_model will not shard LoRA "
                      "adapters on tensor-parallel models; install a supported release (docs/wrapping_hf_models.md, "
                      "LoRA with PEFT)", stacklevel=2)
        return
    peft_lora.install()
