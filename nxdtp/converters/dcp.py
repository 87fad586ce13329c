"""Import a torch.distributed.checkpoint (DCP) directory into an nxdtp sharded checkpoint at any TP size.

``import_dcp_resharded(dcp_dir, output_dir, new_tp)`` (``nxdtp-merge DCP_DIR OUT --from-dcp --reshard N``) reads what
``import_dcp`` reads (the model's tensors at the top level under the HF ``state_dict`` names, the optimizer state
flattened under ``optimizer``, a TorchTitan step and scheduler) and writes a complete nxdtp checkpoint directory
(``newest``, one tag, index, rank files, trainer state, config) at tensor parallel size ``new_tp``, optimizer included,
that ``nxdtp.checkpointing.load`` reads into a model ``from_pretrained_sharded`` / ``parallelize_model`` built at that
size (with ``make_vocab_size_divisible_by=pad_to_multiple_of``, 1 by default).

It is made only of existing public pieces, in three steps, each into a temporary directory beside ``output_dir``:

1. ``import_dcp`` writes the dense HF directory (model and, if any, ``optimizer.safetensors`` / ``optimizer.json``);
2. in this process, a torch.distributed world of 1 (the in-process world behind ``initialize_fallback_parallel_state``)
   at TP size 1: ``from_pretrained_sharded`` builds the model in fp32, an optimizer of the kind the hyperparameters name
   (Adam / AdamW, SGD; one param group per distinct set of hyperparameters) gets the state through
   ``load_dense_optimizer_state``, and ``nxdtp.checkpointing.save`` writes a TP=1 checkpoint with the step and scheduler
   the DCP recorded; a DCP checkpoint whose floating model tensors are all bfloat16 is saved with ``down_cast_bf16``
   (the model stays bfloat16, the optimizer state full precision: nothing is rounded);
3. ``merge.reshard`` cuts it to ``new_tp`` (each tensor's padding and repeated heads follow its recorded layout, so
   this is exact) into ``output_dir``.

The world is torn down and the temporaries removed in every case; ``output_dir`` is written (atomically, by the
reshard) only at the end, so after any error it is as it was. A non-empty ``output_dir`` is refused unless ``force``.

Cost: step 2 holds the whole model at TP size 1 in this process, in fp32, with its optimizer state: for Adam about
12 bytes per parameter (weights and two moments), plus the dense optimizer state while it is being restored (another
8 bytes per parameter at the peak) and the allocator's slack: about 25 bytes per parameter measured (a 55M-parameter
Llama with AdamW state: peak RSS 2.24 GB against 0.91 GB for the imports alone), against about one tensor for
``import_dcp`` and ``reshard`` alone. Disk: the dense copy and the TP=1 checkpoint beside ``output_dir`` until the
end (about two more copies of the model and its optimizer state).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..checkpointing.output_dir import check_output_dir

__all__ = ["import_dcp_resharded"]

ADAM_KEYS = ("betas", "eps", "weight_decay", "amsgrad")
SGD_KEYS = ("momentum", "dampening", "nesterov")


def import_dcp_resharded(dcp_dir: str, output_dir: str, new_tp: int, config: Optional[str] = None,
                         force: bool = False, progress: bool = True,
                         pad_to_multiple_of: Optional[int] = None) -> str:
    """Write the nxdtp checkpoint at TP size ``new_tp`` of the DCP checkpoint ``dcp_dir`` into ``output_dir`` (module
    docstring); return its tag directory. ``config`` is the model's config.json when ``dcp_dir`` has none; the
    vocabulary is padded to a multiple of ``pad_to_multiple_of * new_tp`` (the model's
    ``make_vocab_size_divisible_by``; default 1)."""
    import torch.distributed as dist

    from .. import parallel_state as ps
    from ..checkpointing.dcp_import import _read_metadata, import_dcp, recorded_trainer_state
    from ..checkpointing.merge import reshard

    if isinstance(new_tp, bool) or not isinstance(new_tp, int) or new_tp < 1:
        raise ValueError(f"new tensor parallel size {new_tp!r} must be an integer >= 1")
    if pad_to_multiple_of is not None and (isinstance(pad_to_multiple_of, bool)
                                           or not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1):
        raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of!r} must be an integer >= 1")
    if ps.model_parallel_is_initialized() or (dist.is_initialized() and dist.get_world_size() != 1):
        raise RuntimeError("import_dcp_resharded builds the model in a world of one process of its own: call it "
                           "outside a distributed job (nxdtp-merge does)")
    check_output_dir(dcp_dir, output_dir, force)
    parent = os.path.dirname(os.path.abspath(output_dir))
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(output_dir))}.nxdtp-dcp-", dir=parent)
    try:
        dense_dir, tp1_dir = os.path.join(work, "dense"), os.path.join(work, "tp1")
        import_dcp(dcp_dir, dense_dir, config=config, progress=progress)
        saved = _read_metadata(dcp_dir).state_dict_metadata  # import_dcp checked it is DCP
        trainer_state = recorded_trainer_state(dcp_dir, saved) or {}
        _save_at_tp1(dense_dir, tp1_dir, trainer_state, pad_to_multiple_of or 1, _all_bf16(saved))
        return reshard(tp1_dir, output_dir, new_tp, force=force, progress=progress,
                       pad_to_multiple_of=pad_to_multiple_of, verify=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _all_bf16(saved: Dict[str, Any]) -> bool:
    """Whether every floating model tensor of the DCP metadata entries ``saved`` is bfloat16."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ..checkpointing.dcp_import import NOT_MODEL_PREFIXES

    dtypes = {meta.properties.dtype for key, meta in saved.items()
              if not key.startswith(NOT_MODEL_PREFIXES) and isinstance(meta, TensorStorageMetadata)
              and meta.properties.dtype.is_floating_point}
    return dtypes == {torch.bfloat16}


def _save_at_tp1(dense_dir: str, checkpoint_dir: str, trainer_state: Dict[str, Any], multiple: int,
                 down_cast_bf16: bool) -> None:
    """Build the dense directory's model (and optimizer) at TP size 1 in a world of one, and save it with nxdtp."""
    import torch.distributed as dist

    from .. import parallel_state as ps
    from ..checkpointing import save
    from ..checkpointing.dense_optimizer import DENSE_OPTIMIZER_VALUES, load_dense_optimizer_state
    from ..models import from_pretrained_sharded
    from ..process_groups import initialize_single_process_world, release_single_process_world

    made_world = not dist.is_initialized()
    initialize_single_process_world()
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=1)
        try:
            model = from_pretrained_sharded(dense_dir, make_vocab_size_divisible_by=multiple)
            checkpoint: Dict[str, Any] = {"model": model}
            if os.path.isfile(os.path.join(dense_dir, DENSE_OPTIMIZER_VALUES)):
                optimizer = _optimizer_for(dense_dir, model)
                recorded = load_dense_optimizer_state(dense_dir, model, optimizer)
                trainer_state = {**trainer_state, **recorded}
                checkpoint["optimizer"] = optimizer
            for key in ("global_step", "scheduler"):
                if trainer_state.get(key) is not None:
                    checkpoint[key] = trainer_state[key]
            save(checkpoint, checkpoint_dir, down_cast_bf16=down_cast_bf16)
        finally:
            ps.destroy_model_parallel()
    finally:
        if made_world:
            release_single_process_world()


def _optimizer_for(dense_dir: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    """An optimizer of the kind the saved hyperparameters name over the parameters that have saved state, with one
    param group per distinct set of hyperparameters (torch restores a group's values from its first parameter)."""
    import json

    from ..checkpointing.dense_optimizer import DENSE_OPTIMIZER_VALUES

    path = os.path.join(dense_dir, DENSE_OPTIMIZER_VALUES)
    with open(path) as f:
        record = json.load(f)
    values = record["values"]
    hyper: Dict[str, Dict[str, Any]] = {}
    for key, value in values.items():
        if key.startswith("param_groups."):
            param, name = key[len("param_groups."):].rsplit(".", 1)
            hyper.setdefault(param, {})[name] = value
    found = sorted({name for names in hyper.values() for name in names})
    optimizer_class = _optimizer_class(found, hyper)
    groups: List[Tuple[str, List[torch.nn.Parameter]]] = []
    for name, param in model.named_parameters():
        if name not in hyper:
            continue
        signature = repr(sorted(hyper[name].items()))
        for seen, params in groups:
            if seen == signature:
                params.append(param)
                break
        else:
            groups.append((signature, [param]))
    if not groups:
        raise ValueError(f"{dense_dir}: the optimizer state names none of the model's parameters")
    # lr and the rest are placeholders: load_dense_optimizer_state gives every group the checkpoint's values.
    optimizer = optimizer_class([{"params": params} for _, params in groups], lr=1e-3)
    # A hyperparameter this torch's class has and the saving torch's did not (decoupled_weight_decay before 2.6, ...)
    # keeps the class's default: torch's loader wants every group key; the file is this import's temporary copy.
    names = {id(param): name for name, param in model.named_parameters()}
    missing = {f"param_groups.{names[id(param)]}.{key}": list(value) if isinstance(value, tuple) else value
               for group in optimizer.param_groups for key, value in group.items() if key != "params"
               for param in group["params"] if f"param_groups.{names[id(param)]}.{key}" not in values}
    if missing:
        record["values"] = {**values, **missing}
        with open(path, "w") as f:
            json.dump(record, f)
    return optimizer


def _optimizer_class(found: List[str], hyper: Dict[str, Dict[str, Any]]) -> type:
    names = set(found)
    if set(ADAM_KEYS) <= names:
        # torch >= 2.6 records which one (AdamW is Adam with decoupled weight decay); before, both held the same
        # state and hyperparameters, and either restores them alike.
        decoupled = {values.get("decoupled_weight_decay", True) for values in hyper.values()}
        return torch.optim.AdamW if decoupled == {True} else torch.optim.Adam
    if set(SGD_KEYS) <= names:
        return torch.optim.SGD
    raise ValueError(f"cannot tell which torch optimizer saved this state from its hyperparameters {found}: the DCP "
                     "import with --reshard rebuilds Adam, AdamW or SGD; import without --reshard and load the state "
                     "with load_dense_optimizer_state into your own optimizer")
