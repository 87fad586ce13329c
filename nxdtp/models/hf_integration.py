"""What every family's plan does last to a parallelized Hugging Face model, so that HF's own methods and habits work
on it as on the dense model (or refuse loudly): one call from each plan's ``finalize``, whatever the family."""

from __future__ import annotations

from torch import nn

from .activation_checkpointing import support_hf_checkpointing
from .hf_saving import support_save_pretrained


def finish_hf_model(model: nn.Module) -> None:
    """Fit HF's methods to the parallelized ``model``: activation checkpointing replays nxdtp's RNG states, and
    ``save_pretrained`` writes the dense HF directory gathered from the shards."""
    support_hf_checkpointing(model)
    support_save_pretrained(model)
