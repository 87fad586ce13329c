"""Sharded checkpoints that describe themselves (format: docs/checkpoints.md).

``save(checkpoint_dict, output_dir)`` and ``load(chkpt_path, model_or_optimizer)`` keep NxD's call form; ``merge`` and
``reshard`` (tools/merge_checkpoints.py) need nothing but the checkpoint directory.
"""

from .dense_optimizer import load_dense_optimizer_state
from .index import FORMAT_VERSION, CheckpointIndex
from .lock import CheckpointLockedError
from .save_load import (
    ensure_directory_exists,
    get_sharded_model_dict,
    list_tags,
    load,
    read_model_shard,
    restore_rng,
    save,
)
from .tags import CheckpointIntegrityError, newest_tag, resolve_tag

__all__ = ["save", "load", "ensure_directory_exists", "get_sharded_model_dict", "list_tags", "newest_tag",
           "resolve_tag", "read_model_shard", "restore_rng", "CheckpointIndex", "FORMAT_VERSION",
           "CheckpointIntegrityError", "CheckpointLockedError", "load_dense_optimizer_state"]
