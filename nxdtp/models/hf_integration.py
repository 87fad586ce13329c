"""What every family's plan does last to a parallelized Hugging Face model, so that HF's own methods and habits work
on it as on the dense model (or refuse loudly): one call from each plan's ``finalize``, whatever the family."""

from __future__ import annotations

import sys

from torch import nn

from ..agreement import install_input_check
from ..parallel_state import tensor_parallel_group
from .activation_checkpointing import support_hf_checkpointing
from .generation import support_hf_generation
from .hf_saving import support_save_pretrained


def finish_hf_model(model: nn.Module) -> None:
    """Fit HF's methods to the parallelized ``model``: activation checkpointing replays nxdtp's RNG states;
    ``generate`` decodes from full-vocabulary logits, on the whole sequence (``nxdtp.models.generation``);
    ``save_pretrained`` writes the dense HF directory gathered from the shards; a multi-process accelerate (plain
    ``transformers.Trainer``) driving it is refused at its first training forward; and every forward checks that the
    ranks of the TP group received the same inputs (``nxdtp.agreement``; HF's training loops feed each process its own
    batch unless told otherwise)."""
    support_hf_checkpointing(model)
    support_hf_generation(model)
    support_save_pretrained(model)
    if tensor_parallel_group().size > 1:
        model.register_forward_pre_hook(refuse_foreign_multiprocess_trainers)
    # Last, so the check is the outermost wrapper and sees the call as the user made it.
    install_input_check(model)


TRAINED_BY = "_nxdtp_trained_by"   # set on the model by trainers that handle TP (nxdtp.models.trainer)


def refuse_foreign_multiprocess_trainers(model: nn.Module, args) -> None:
    """A forward pre-hook: refuse a training forward while a multi-process accelerate state is live (plain
    ``transformers.Trainer``, or ``accelerate.Accelerator.prepare``) unless a TP-aware trainer marked the model. Such a
    trainer wraps the model in DDP over the whole world, which broadcasts TP rank 0's shards over the others, and feeds
    each TP rank a different batch: the run would finish and the model be wrong. Costs a dictionary lookup."""
    state = sys.modules.get("accelerate.state")
    if state is None or not model.training or getattr(model, TRAINED_BY, None):
        return
    if state.GradientState._shared_state and state.PartialState._shared_state.get("num_processes", 1) > 1:
        raise RuntimeError(
            f"{type(model).__name__} is tensor-parallel (nxdtp) and is being trained by a multi-process accelerate "
            "setup (transformers.Trainer or Accelerator.prepare), which wraps it in DDP over the tensor-parallel "
            "ranks (overwriting their shards with rank 0's) and gives each of them a different batch. Use "
            "nxdtp.models.trainer.TensorParallelTrainer in place of transformers.Trainer, or nxdtp's own training "
            "loop (docs/wrapping_hf_models.md)")
