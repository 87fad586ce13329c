"""What every family's plan does last to a parallelized Hugging Face model, so that HF's own methods and habits work
on it as on the dense model (or refuse loudly): one call from each plan's ``finalize``, whatever the family."""

from __future__ import annotations

from torch import nn

from .activation_checkpointing import support_hf_checkpointing
from .generation import support_hf_generation


def finish_hf_model(model: nn.Module) -> None:
    """Fit HF's methods to the parallelized ``model``: activation checkpointing replays nxdtp's RNG states;
    ``generate`` decodes from full-vocabulary logits, on the whole sequence (``nxdtp.models.generation``)."""
    support_hf_checkpointing(model)
    support_hf_generation(model)
