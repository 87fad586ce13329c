"""Resuming a ``TensorParallelTrainer`` checkpoint at another TP or DP size.

A Trainer checkpoint (``checkpoint-N``) holds Trainer's own files and an nxdtp tag saved at the run's TP and DP sizes.
At another DP size the tag loads as it is: its shards are per TP rank, and every DP rank reads the same ones. At another
TP size its shards are cut anew: rank 0 writes the tag resharded to this run's TP size into the run's output directory
(``resharded-tp<N>-checkpoint-<step>``, with ``nxdtp.checkpointing.reshard``, the pipeline ``nxdtp-merge --reshard``
runs; atomically, kept for later resumes, and not a ``checkpoint-*`` name Trainer would rotate) and every rank loads
that. The weights, the optimizer state and the scheduler
continue exactly; Trainer restores the step and skips the batches already seen, so with the same global batch (DP size
x per-device batch x accumulation steps) every step sees the samples it would have seen.

Random states belong to a layout (one per rank, the TP tracker's per TP rank). They are restored when the layout is
the saved one; otherwise every generator is re-seeded by a rule, ``seed + global_step`` (``args.seed``, the step
resumed at), the same on every run that resumes there, and the log says so.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random

import numpy

from .. import comm
from ..checkpointing import CheckpointIndex
from ..checkpointing.merge import RESHARD_FILE, reshard
from ..checkpointing.save_load import rng_file
from ..random import model_parallel_xla_manual_seed
from ..topology import data_parallel_group, get_topology, tensor_parallel_group

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ResumeSource:
    """Where a resume reads the nxdtp tag from: ``directory`` (the Trainer checkpoint, or the reshard beside its tag)
    holding ``tag``; ``same_layout``: saved at this run's TP and DP sizes, so its random states are this run's."""
    directory: str
    tag: str
    same_layout: bool


def checkpoint_at_this_size(checkpoint_dir: str, tag: str, output_dir: str) -> ResumeSource:
    """The tag ``tag`` of the Trainer checkpoint ``checkpoint_dir`` at this run's TP size, resharded into
    ``output_dir`` first when it was saved at another (module docstring). A collective: every rank calls it."""
    index = CheckpointIndex.read(os.path.join(checkpoint_dir, tag))
    tp, dp = tensor_parallel_group().size, data_parallel_group().size
    if index.tensor_model_parallel_size == tp:
        # A tag resharded by nxdtp-merge keeps the source's DP size but none of its RNG files.
        rng_saved = os.path.isfile(os.path.join(checkpoint_dir, tag, rng_file(get_topology().rank)))
        return ResumeSource(checkpoint_dir, tag, index.data_parallel_size == dp and rng_saved)
    resharded = os.path.join(output_dir, f"resharded-tp{tp}-{os.path.basename(os.path.normpath(checkpoint_dir))}")
    outcome = "done"
    if get_topology().rank == 0:   # one rank decides and writes; every rank then takes part in one gather
        try:
            _reshard_unless_done(checkpoint_dir, tag, resharded, index.tensor_model_parallel_size, tp)
        except Exception as error:   # every rank must learn of it, or the others would go on alone
            outcome = f"{type(error).__name__}: {error}"
    outcome = comm.all_gather_object(outcome)[0]
    if outcome != "done":
        raise RuntimeError(f"resuming from {checkpoint_dir} at tensor_model_parallel_size={tp}: resharding its {tag} "
                           f"(saved at tensor_model_parallel_size={index.tensor_model_parallel_size}) failed on rank "
                           f"0: {outcome}")
    return ResumeSource(resharded, tag, False)


def _reshard_unless_done(checkpoint_dir: str, tag: str, resharded: str, saved_tp: int, tp: int) -> None:
    """Write ``resharded`` (the tag at ``tp``) unless a complete one of this very source is there: one resharded from
    another run's checkpoint of the same name is replaced."""
    source = os.path.abspath(os.path.join(checkpoint_dir, tag))
    record = os.path.join(resharded, tag, RESHARD_FILE)
    if os.path.isfile(record):
        with open(record) as f:
            if json.load(f).get("source") == source:
                return
    logger.warning("%s was saved at tensor_model_parallel_size=%d; resharding it to %d in %s", checkpoint_dir,
                   saved_tp, tp, resharded)
    reshard(checkpoint_dir, resharded, tp, tag=tag, progress=False, force=True)


def reseed_by_rule(seed: int, global_step: int) -> None:
    """Seed Python's, NumPy's and torch's generators and the TP tracker with ``seed + global_step`` (the tracker's
    TP-sharded state with its per-TP-rank offset, ``model_parallel_xla_manual_seed``), and say so."""
    value = seed + global_step
    random.seed(value)
    numpy.random.seed(value % 2 ** 32)
    model_parallel_xla_manual_seed(value)   # torch.manual_seed: every device's default generator too
    if get_topology().rank == 0:
        logger.warning("resuming at another layout than the checkpoint's: its random states belong to the old ranks, "
                       "so every generator is re-seeded with seed + global_step = %d + %d = %d", seed, global_step,
                       value)
