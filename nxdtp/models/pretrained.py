"""Build a sharded model from a local Hugging Face directory, each rank reading only its slices: the steps every
family shares. A family supplies how to shard (its plan) and which checkpoint keys may hold a parameter."""

from __future__ import annotations

import logging
import os
from typing import Callable, Iterable

import torch
from torch import nn

from .. import comm
from ..checkpointing.index import INDEX_FILE
from ..plan import broadcast_replicated_state
from .hf_loading import (
    CheckpointReader,
    PretrainedDirectoryError,
    load_sharded_weights,
    materialize_meta_model,
    parameters_on_meta,
)
from .moe import experts_as_module_holds

logger = logging.getLogger(__name__)


def build_from_pretrained(model_dir: str, model_class, config, shard: Callable[[nn.Module], None],
                          candidate_keys: Callable[[str], Iterable[str]], dtype: torch.dtype = torch.float32,
                          device="cpu") -> nn.Module:
    """``model_class(config)`` built on the meta device, sharded by ``shard(model)``, then filled from ``model_dir``.

    Replicated parameters the checkpoint lacks (e.g. a new classification head) are initialised as HF would, then made
    equal across TP ranks; a missing tensor-parallel bias starts at zero as in HF, a missing tensor-parallel weight is
    an error. The model is returned in eval mode, as HF does. Damaged files are a ``PretrainedDirectoryError`` naming
    the file (``hf_loading``), raised on every rank.
    """
    # Fail on a missing checkpoint before building anything. Experts stored one by one (HF's files of MoE models) are
    # read as the module holds them.
    reader = experts_as_module_holds(CheckpointReader(model_dir))
    with parameters_on_meta():
        model = model_class(config)
    shard(model)
    materialize_meta_model(model, device)
    # Parameters only: buffers keep their dtype (HF keeps rotary frequencies in fp32 under a bf16 model).
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.to(dtype)
    # Non-persistent buffers (position ids, rotary frequencies) and parameters missing from the checkpoint get HF's
    # initialisation; everything in the checkpoint is then overwritten by its slice.
    with torch.no_grad():
        for module in model.modules():
            model._init_weights(module)
    # Each rank reads only its own slices, so a read can fail on one rank alone: every rank must learn of it before
    # the broadcast below, which the others would otherwise wait in forever.
    error, missing = None, []
    try:
        missing = load_sharded_weights(model, reader, candidate_keys)
        _initialise_missing_shards(model, model_dir, missing)
    except Exception as e:  # noqa: BLE001 - re-raised on every rank
        error = e
    comm.raise_on_every_rank_if_any_failed(error, f"loading {model_dir}")
    if missing:
        logger.warning("%s: not in the checkpoint, newly initialised: %s", model_dir, missing)
    broadcast_replicated_state(model)
    model.eval()  # as HF's from_pretrained
    return model


def _initialise_missing_shards(model: nn.Module, model_dir: str, missing) -> None:
    """HF's initialisation knows nn.Linear and nn.Embedding, not the parallel layers that replaced them. HF starts
    biases at zero, which needs no slicing; a missing sharded weight cannot be reproduced, so it is an error."""
    sharded_missing = []
    with torch.no_grad():
        for name in missing:
            param = model.get_parameter(name)
            if getattr(param, "tensor_model_parallel", False):
                if name.endswith("bias"):
                    param.zero_()
                else:
                    sharded_missing.append(name)
    if sharded_missing:
        raise PretrainedDirectoryError(f"{model_dir} lacks tensor-parallel parameters {sharded_missing}; nxdtp loads "
                                       "those only from the checkpoint")


def refuse_nxdtp_checkpoint(model_dir: str) -> None:
    """An nxdtp sharded checkpoint (a directory with ``newest``, or one of its tags) is not an HF model directory; say
    how to read it instead of which HF files it lacks."""
    if os.path.isfile(os.path.join(model_dir, "newest")) or os.path.isfile(os.path.join(model_dir, INDEX_FILE)):
        raise ValueError(f"{model_dir} is an nxdtp sharded checkpoint, not a Hugging Face model directory: resume "
                         f"training from it with nxdtp.checkpointing.load({model_dir!r}, model=...), or merge it first "
                         f"(nxdtp-merge {model_dir} OUT_DIR) and call from_pretrained_sharded(OUT_DIR)")
