"""Import a torch.distributed.checkpoint (DCP) directory as an nxdtp checkpoint at any TP size (``nxdtp-merge DCP_DIR
OUT --from-dcp --reshard N``): the DCP checkpoint is read as the TP=1 nxdtp checkpoint of the model its config names
(built on the meta device and sharded by its plan), through ``merge.reshard_source`` with ``DcpSource``s; only the
small JSON files are written, into a temporary directory (docs/checkpoints.md)."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from typing import Any, Dict, List, Optional, Tuple

from ..checkpointing.output_dir import check_output_dir

__all__ = ["import_dcp_resharded"]


def import_dcp_resharded(dcp_dir: str, output_dir: str, new_tp: int, config: Optional[str] = None,
                         force: bool = False, progress: bool = True,
                         pad_to_multiple_of: Optional[int] = None) -> str:
    """Write the nxdtp checkpoint at TP size ``new_tp`` of the DCP checkpoint ``dcp_dir``; return its tag directory.
    ``config``: the model's config.json when ``dcp_dir`` has none; ``pad_to_multiple_of``: the vocabulary multiple
    (default 1)."""
    from ..checkpointing.dcp_import import read_checkpoint
    from ..checkpointing.dcp_io import DcpSource
    from ..checkpointing.index import CheckpointIndex, optim_file, owners_by_name
    from ..checkpointing.merge import check_reshard_arguments, reshard_source
    from ..version import __version__

    check_reshard_arguments(new_tp, pad_to_multiple_of)
    _refuse_distributed_job("import_dcp_resharded")
    checkpoint = read_checkpoint(dcp_dir, config)
    check_output_dir(dcp_dir, output_dir, force)
    entries, parameter_names = _entries_at_tensor_parallel_one(checkpoint.config_path, pad_to_multiple_of or 1)
    model = DcpSource(checkpoint.reader, _model_layout(checkpoint, entries))
    primary = owners_by_name(entries)
    optimizer_layout, optimizer_index, optimizer_json = _optimizer(checkpoint, entries, primary, parameter_names)
    optimizer = DcpSource(checkpoint.reader, optimizer_layout) if optimizer_layout is not None else None
    index = CheckpointIndex(tensor_model_parallel_size=1, data_parallel_size=1, tensors=entries,
                            optimizer=optimizer_index, nxdtp_version=__version__)

    def open_file(relative: str):
        if relative != optim_file(0) or optimizer is None:
            raise FileNotFoundError(f"{dcp_dir} as a TP=1 nxdtp checkpoint has no {relative}")
        return optimizer

    parent = os.path.dirname(os.path.abspath(output_dir))
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(output_dir))}.nxdtp-dcp-", dir=parent)
    try:
        tag_dir = _write_json_files(work, checkpoint.trainer_state, optimizer_json)
        return reshard_source(tag_dir, index, model, output_dir, new_tp, progress=progress,
                              pad_to_multiple_of=pad_to_multiple_of, config=checkpoint.config_path,
                              open_file=open_file, optimizer_source=optimizer, source=os.path.abspath(dcp_dir))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _write_json_files(directory: str, trainer_state: Optional[dict], optimizer_json: Optional[dict]) -> str:
    """Write the tag's JSON files into the tag directory a save of the recorded step would make under ``directory``;
    return that directory."""
    from ..checkpointing import tags
    from ..checkpointing.index import OPTIMIZER_STATE_FILE, TRAINER_STATE_FILE

    trainer_state = {key: value for key, value in (trainer_state or {}).items()
                     if key in ("global_step", "scheduler") and value is not None}
    step = trainer_state.get("global_step")
    tag_dir = os.path.join(directory, tags.tag_for_step(step) if step is not None else "checkpoint")
    files = {TRAINER_STATE_FILE: trainer_state}
    if optimizer_json is not None:
        files[OPTIMIZER_STATE_FILE] = optimizer_json
    for relative, payload in files.items():
        path = os.path.join(tag_dir, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(payload, f, indent=1)
    return tag_dir


def _entries_at_tensor_parallel_one(config_path: str, multiple: int):
    """The index entries ``save`` would write for the config's model at TP size 1, and its parameter names in order,
    from a meta-device model in a world of one process made for it."""
    import torch.distributed as dist

    from .. import topology as ps
    from ..checkpointing.dcp_import import model_class_and_config
    from ..checkpointing.index import split_model_state
    from ..models import parallelize_model
    from ..models.hf_loading import parameters_on_meta
    from ..process_groups import initialize_single_process_world, release_single_process_world

    made_world = not dist.is_initialized()
    initialize_single_process_world()
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=1)
        try:
            model_class, model_config = model_class_and_config(config_path)
            with parameters_on_meta():
                model = model_class(model_config)
            try:
                parallelize_model(model, make_vocab_size_divisible_by=multiple, broadcast_replicated=False)
            except TypeError as e:  # a model nxdtp has no plan for: bad input to this command, not a fault
                raise ValueError(f"{config_path}: {e}; import without --reshard for a dense HF directory") from None
            _, entries = split_model_state(model, model.state_dict(keep_vars=True), 1)
            return entries, [name for name, _ in model.named_parameters()]
        finally:
            ps.destroy_model_parallel()
    finally:
        if made_world:
            release_single_process_world()


def _refuse_distributed_job(what: str) -> None:
    import torch.distributed as dist

    from .. import topology as ps

    if ps.model_parallel_is_initialized() or (dist.is_initialized() and dist.get_world_size() != 1):
        raise RuntimeError(f"{what} shards the model's description in a world of one process of its own: call it "
                           "outside a distributed job (nxdtp-merge does)")


def _model_layout(checkpoint, entries) -> Dict[str, Tuple[str, Any]]:
    """{index key: (DCP key, spec)} for every model tensor, each entry taking the DCP tensor's dtype; the plan's model
    and the config's class must hold the same tensors."""
    from ..checkpointing.index import dtype_name

    saved = checkpoint.reader.saved
    first_name = {alias: name for name, (_, aliases) in checkpoint.expected.items() for alias in [name] + aliases}
    tensors: Dict[str, Tuple[str, Any]] = {}
    for key, entry in entries.items():
        name = next((first_name[k] for k in [key] + entry.aliases if k in first_name), None)
        if name is None:
            raise ValueError(f"the sharded model of {checkpoint.config_path} holds '{key}', which the dense model "
                             "does not: nxdtp cannot map it to the DCP checkpoint's tensors")
        source = checkpoint.sources[name]
        if tuple(saved[source].size) != tuple(entry.spec.unpadded_shape):
            raise ValueError(f"{checkpoint.dcp_dir}: '{source}' has shape {list(saved[source].size)}, but the sharded "
                             f"model's '{key}' is {list(entry.spec.unpadded_shape)} unpadded")
        entry.dtype = dtype_name(saved[source].properties.dtype)
        tensors[key] = (source, entry.spec)
    covered = {first_name[k] for key, entry in entries.items() for k in [key] + entry.aliases if k in first_name}
    left = [name for name in checkpoint.expected if name not in covered]
    if left:
        raise ValueError(f"the sharded model of {checkpoint.config_path} holds no tensor for {left[:5]} of the dense "
                         "model: nxdtp cannot place them in its checkpoint")
    return tensors


def _optimizer(checkpoint, entries, primary: Dict[str, str], parameter_names: List[str]):
    """The optimizer's rank file layout at TP 1, its index part and its JSON part, as ``save`` writes them for state
    keyed by name (all None without optimizer state)."""
    from ..checkpointing.merge import DenseOptimizerTensor

    tensors: Dict[str, Tuple[str, Any]] = {}
    fields: Dict[str, List[str]] = {}
    scalars: Dict[str, Dict[str, Any]] = {}
    hyper: Dict[str, Dict[str, Any]] = {}
    for flat, value in checkpoint.optimizer_state.items():  # sorted: each parameter's fields together
        kind, _, rest = flat.partition(".")
        param, field = rest.rsplit(".", 1)
        if kind == "param_groups":
            _check_hyperparameter(checkpoint.dcp_dir, flat, value)
            hyper.setdefault(param, {})[field] = value
        elif isinstance(value, DenseOptimizerTensor):
            spec = entries[primary[param]].spec
            shaped = tuple(value.shape) == tuple(spec.unpadded_shape)
            if not shaped and math.prod(value.shape) > 1 and spec.is_sharded:
                raise ValueError(f"{checkpoint.dcp_dir}: optimizer state 'optimizer.{flat}' has shape "
                                 f"{list(value.shape)}, neither its parameter's {list(spec.unpadded_shape)} nor a "
                                 "scalar, so it cannot be cut by the parameter's tensor-parallel layout (a factored "
                                 "optimizer such as Adafactor); import without --reshard for a dense HF directory")
            # State shaped like its parameter is laid out as the parameter; scalar state ('step') goes as saved.
            tensors[f"{param}/{field}"] = (f"optimizer.{flat}", spec if shaped else None)
            fields.setdefault(param, []).append(field)
        else:
            scalars.setdefault(param, {})[field] = value
    if not hyper:
        return None, None, None
    stateful = sorted(set(fields) | set(scalars))
    without_group = [param for param in stateful if param not in hyper]
    if without_group:
        raise ValueError(f"{checkpoint.dcp_dir}: the optimizer holds state for {without_group[:5]} but no "
                         "hyperparameters (optimizer.param_groups.<param>.*): not torch's flattened optimizer state")
    not_parameters = sorted(set(hyper) - set(parameter_names))
    if not_parameters:
        raise ValueError(f"{checkpoint.dcp_dir}: the optimizer names {not_parameters[:5]}, which are not parameter "
                         "names of the model (a tied tensor's state goes under its first name)")
    groups: List[Dict[str, Any]] = []
    signatures: Dict[str, int] = {}
    for name in (n for n in parameter_names if n in hyper):
        signature = json.dumps(sorted(hyper[name].items()))
        if signature not in signatures:
            signatures[signature] = len(groups)
            groups.append({**hyper[name], "params": []})
        groups[signatures[signature]]["params"].append(name)
    position = {name: i for i, name in enumerate(name for group in groups for name in group["params"])}
    index = {"keyed_by": "name", "params": {param: {"param_index": position[param], "tensors": fields.get(param, [])}
                                            for param in stateful}}
    return tensors, index, {"param_groups": groups, "scalars": scalars}


def _check_hyperparameter(dcp_dir: str, flat: str, value: Any) -> None:
    """The groups go into a JSON file, as ``save`` writes them: a hyperparameter must be a JSON value."""
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        raise ValueError(f"{dcp_dir}: hyperparameter 'optimizer.{flat}' is a {type(value).__name__}, not a plain "
                         "value (a tensor learning rate or betas); --reshard writes the groups as JSON: import "
                         "without --reshard and restore the state with load_dense_optimizer_state") from None
