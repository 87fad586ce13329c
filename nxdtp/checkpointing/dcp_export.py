"""Export a sharded nxdtp checkpoint to a torch.distributed.checkpoint (DCP) directory (``nxdtp-merge CKPT OUT --to
dcp``): (``TagSource``, ``DcpSink``), keyed as a native job's ``dcp.save`` keys them (docs/checkpoints.md, "Exporting
to torch.distributed.checkpoint")."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Any, Dict, List, Optional, Tuple

from ..spec import ParamSpec
from ..version import __version__
from .dcp_io import EXPORT_RECORD_FILE, LR_SCHEDULER_KEY, OPTIMIZER_KEY, TRAIN_STATE_KEY, DcpSink
from .dense_optimizer import MASTER_PREFIX
from .durable import write_bytes_durably
from .index import CheckpointIndex, is_zero1_optimizer_index
from .merge import (
    DenseOptimizerTensor,
    dense_optimizer_state,
    files_read,
    optimizer_values,
    plan_optimizer,
    read_trainer_state,
    tag_model_source,
    tag_optimizer_source,
)
from .output_dir import write_atomically
from .pipeline import TagSource, stream
from .tag_source import CONFIG_FILE, choose_source, config_source, copy_if_present, progress_bar

# The most bytes of one written chunk (the export's slab): tests lower it to cut small tensors.
CHUNK_BYTES = 64 << 20

__all__ = ["export_dcp", "OPTIMIZER_KEY"]


@dataclasses.dataclass
class ExportResult:
    output_dir: str
    tag_dir: str
    model_keys: int
    optimizer_keys: int
    files: int
    notes: List[str]


def export_dcp(checkpoint_dir: str, output_dir: str, tag: Optional[str] = None, force: bool = False,
               progress: bool = True, config: Optional[str] = None, *, verify: bool = True) -> ExportResult:
    """Write the DCP form of a sharded nxdtp checkpoint to ``output_dir``; return what was written. The arguments are
    ``merge``'s; the tag's ``config.json`` (or ``config``) is copied beside the DCP files, where an import finds it."""
    tag_dir, index, model_files = choose_source(checkpoint_dir, tag, output_dir, force, verify,
                                                lambda tag_dir, index: files_read(index, config))
    config_path = config_source(tag_dir, config)
    optim_files: Dict[str, Any] = {}
    notes: List[str] = []
    try:
        model = tag_model_source(index, model_files, CHUNK_BYTES)
        sink = DcpSink({key: [(name,) for name in [key] + e.aliases] for key, e in index.tensors.items()},
                       {key: e.spec for key, e in index.tensors.items()})
        stream(model, sink, index.tensors)
        optimizer, names, values = _optimizer_source(tag_dir, index, optim_files, notes)
        if optimizer is not None:
            sink.names.update(names)
            sink.specs.update({key: spec for key, (spec, _, _) in optimizer.layout.items()})
            stream(optimizer, sink, optimizer.layout)
        trainer_state = read_trainer_state(tag_dir)
        values.update(torchtitan_states(trainer_state, notes))

        def write(staging: str) -> int:
            with progress_bar(sink.chunk_count(), f"dcp {os.path.basename(tag_dir)}", progress) as bar:
                sink.save(staging, values, bar)
            copy_if_present(config_path, os.path.join(staging, CONFIG_FILE))
            record = {"source": os.path.abspath(tag_dir),
                      "source_tensor_model_parallel_size": index.tensor_model_parallel_size,
                      "nxdtp_version": __version__, "notes": notes}
            if trainer_state is not None:
                record["trainer_state"] = trainer_state
            write_bytes_durably(os.path.join(staging, EXPORT_RECORD_FILE), json.dumps(record, indent=1).encode())
            return sum(1 for name in os.listdir(staging) if name.endswith(".distcp"))

        files = write_atomically(output_dir, write)
    finally:
        model_files.clear()
        optim_files.clear()
    optimizer_keys = sum(1 for path in list(sink.planned) + list(values) if path[0] == OPTIMIZER_KEY)
    return ExportResult(output_dir=output_dir, tag_dir=tag_dir, model_keys=sum(
        1 for path in sink.planned if path[0] != OPTIMIZER_KEY), optimizer_keys=optimizer_keys, files=files,
        notes=notes)


def _optimizer_source(tag_dir: str, index: CheckpointIndex, optim_files: Dict[str, Any], notes: List[str]
                      ) -> Tuple[Optional[TagSource], Dict[str, List[Tuple[str, str]]], Dict[Tuple[str, ...], Any]]:
    """The optimizer's tensors as a source, the DCP path of each (``optimizer``, ``state.<param>.<field>``) and the
    other values by path; the files it reads go to ``optim_files``, why state is left out to ``notes``."""
    if index.optimizer is None:
        notes.append("the checkpoint holds no optimizer state")
        return None, {}, {}
    zero1 = is_zero1_optimizer_index(index.optimizer)
    plan, files, why_not = (dense_optimizer_state if zero1 else plan_optimizer)(tag_dir, index)
    optim_files.update(files)
    if plan is None:
        message = f"{tag_dir}: optimizer state left out of the DCP export: {why_not}"
        warnings.warn(message, stacklevel=3)
        notes.append(message)
        return None, {}, {}
    if zero1:
        notes.append("ZeRO-1's fp32 master weights are left out (the model's tensors are the weights); a plain "
                     "nxdtp-merge writes them beside the HF model")
        source, values = zero1_source(plan)
        names = {key: [(OPTIMIZER_KEY, key)] for key in source.layout}
    else:
        source, values = tag_optimizer_source(index, plan, files, CHUNK_BYTES), optimizer_values(tag_dir)
        names = {key: [(OPTIMIZER_KEY, "state.{}.{}".format(*key.rsplit("/", 1)))] for key in source.layout}
    # JSON made the tuples of torch's optimizers (Adam's betas) lists: give them back.
    return source, names, {(OPTIMIZER_KEY, key): tuple(v) if isinstance(v, list) else v for key, v in values.items()}


def zero1_source(dense_state: Dict[str, Any]) -> Tuple[TagSource, Dict[str, Any]]:
    """ZeRO-1 state (``merge.dense_optimizer_state``) as a source without masters, and the non-tensor values."""
    tensors = {key: t for key, t in dense_state.items()
               if isinstance(t, DenseOptimizerTensor) and not key.startswith(MASTER_PREFIX)}
    tp = max([t.spec.num_partitions for t in tensors.values() if t.spec is not None and t.spec.is_sharded] or [1])
    layout = {key: (t.spec or ParamSpec(full_shape=tuple(t.shape)), t.dtype, list(range(tp)))
              for key, t in tensors.items()}
    values = {key: v for key, v in dense_state.items() if not isinstance(v, DenseOptimizerTensor)}

    def piece(key: str, rank: int):
        tensor = tensors[key]
        return tensor.read_piece(rank) if tensor.spec is not None else tensor.read()

    return TagSource({}, layout, slab_bytes=CHUNK_BYTES, build_piece=piece), values


def torchtitan_states(trainer_state: Optional[dict], notes: List[str]) -> Dict[Tuple[str, ...], Any]:
    """The scheduler's ``last_epoch`` and the step where TorchTitan keeps them, by path, from the tag's trainer state;
    what it lacks is left out with a note."""
    trainer_state = trainer_state or {}
    states: Dict[Tuple[str, ...], Any] = {}
    scheduler = trainer_state.get("scheduler")
    if isinstance(scheduler, dict) and isinstance(scheduler.get("last_epoch"), int):
        states[(LR_SCHEDULER_KEY, "last_epoch")] = scheduler["last_epoch"]
    else:
        notes.append("no LR scheduler state in the checkpoint: 'lr_scheduler' left out")
    step = trainer_state.get("global_step")
    if isinstance(step, int):
        states[(TRAIN_STATE_KEY, "step")] = step
        states[(TRAIN_STATE_KEY, "ntokens_seen")] = int(trainer_state.get("ntokens_seen", 0))
        if "ntokens_seen" not in trainer_state:
            notes.append("train_state.ntokens_seen is 0: nxdtp's checkpoint does not count tokens")
    else:
        notes.append("no 'global_step' in the checkpoint's trainer state: 'train_state' left out")
    return states
