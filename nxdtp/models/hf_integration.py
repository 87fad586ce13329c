"""What every family's plan does last to a parallelized Hugging Face model, so that HF's own methods and habits work
on it as on the dense model (or refuse loudly): one call from each plan's ``finalize``, whatever the family."""

from __future__ import annotations

from torch import nn

from ..agreement import install_input_check
from .activation_checkpointing import support_hf_checkpointing


def finish_hf_model(model: nn.Module) -> None:
    """Fit HF's methods to the parallelized ``model``: activation checkpointing replays nxdtp's RNG states, and every
    forward checks that the ranks of the TP group received the same inputs (``nxdtp.agreement``; HF's training loops
    feed each process its own batch unless told otherwise)."""
    support_hf_checkpointing(model)
    # Last, so the check is the outermost wrapper and sees the call as the user made it.
    install_input_check(model)
