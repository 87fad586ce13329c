"""Import a torch.distributed.checkpoint (DCP) directory into an nxdtp sharded checkpoint at any TP size.

``import_dcp_resharded(dcp_dir, output_dir, new_tp)`` (``nxdtp-merge DCP_DIR OUT --from-dcp --reshard N``) reads what
``import_dcp`` reads (the model's tensors at the top level under the HF ``state_dict`` names, the optimizer state
flattened under ``optimizer``, a TorchTitan step and scheduler) and writes a complete nxdtp checkpoint directory
(``newest``, one tag, index, rank files, trainer state, config) at tensor parallel size ``new_tp``, optimizer included,
that ``nxdtp.checkpointing.load`` reads into a model ``from_pretrained_sharded`` / ``parallelize_model`` built at that
size (with ``make_vocab_size_divisible_by=pad_to_multiple_of``, 1 by default) and an optimizer of the class that saved
the state.

The DCP checkpoint is handed to ``merge.reshard_source`` as the TP=1 nxdtp checkpoint that model would save at TP size
1, without building the model's weights or writing that checkpoint:

1. the model the config names is built with its parameters on the meta device and sharded by its plan at TP size 1, in
   a world of one process of its own: its index entries (each tensor's spec with its padding and head-layout records,
   ties) are what ``save`` would write for it, with each tensor's dtype as the DCP checkpoint holds it;
2. its rank files are readers over the DCP checkpoint (``TensorParallelOneView``) that cut each new rank's piece
   themselves (``pieces``): a tensor within the import's budget (``dcp_import.BATCH_BYTES``) is read whole, with the
   small tensors after it, and cut; a larger one is read piece by piece in slabs of at most the budget
   (``ParamSpec.piece_parts``: one DCP read of boxes of the dense tensor per slab), unless the job saved it in chunks
   larger than the budget, which a DCP read loads whole whatever part of them is asked for: then it is read whole
   once. The optimizer's rank file does the same for state shaped like its parameter and gives scalar state ('step')
   to every rank as saved. Only the small JSON files (trainer state, the optimizer's groups) are written, into a
   temporary directory beside ``output_dir`` that is removed in every case;
3. ``reshard_source`` cuts every tensor for ``new_tp`` (its padding and repeated KV heads by its recorded layout, so
   exactly) into ``output_dir``, one tensor at a time, atomically at the end: after any error it is as it was.

The optimizer's groups come from torch's flattened hyperparameters (``param_groups.<param>.<name>``): one group per
distinct set of values, in the order of the model's parameters, so per-parameter weight decay survives (build the
loading optimizer's groups in that order). Nothing is rebuilt: the state of any torch optimizer whose state is shaped
like its parameter, plus scalars, comes across (Adam, AdamW, SGD, Adagrad, RMSprop, ...); load it into an optimizer
of the saving class. State of another shape (Adafactor's factored moments) has no layout to cut by and is refused, as
is a hyperparameter that is a tensor. A hyperparameter the saving torch did not have (``decoupled_weight_decay`` before
torch 2.6) keeps the loading optimizer's own value (``nxdtp.checkpointing.load``).

Cost: a slab of at most the budget per large tensor plus the saved chunk being read (a tensor saved in larger chunks:
the tensor and its chunk), and the small tensors read together; not the model. On disk only ``output_dir``. A
non-empty ``output_dir`` is refused unless ``force``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from typing import Any, Dict, List, Optional, Tuple

from ..checkpointing.output_dir import check_output_dir

__all__ = ["import_dcp_resharded", "TensorParallelOneView"]


def import_dcp_resharded(dcp_dir: str, output_dir: str, new_tp: int, config: Optional[str] = None,
                         force: bool = False, progress: bool = True,
                         pad_to_multiple_of: Optional[int] = None) -> str:
    """Write the nxdtp checkpoint at TP size ``new_tp`` of the DCP checkpoint ``dcp_dir`` into ``output_dir`` (module
    docstring); return its tag directory. ``config`` is the model's config.json when ``dcp_dir`` has none; the
    vocabulary is padded to a multiple of ``pad_to_multiple_of * new_tp`` (the model's
    ``make_vocab_size_divisible_by``; default 1)."""

    from ..checkpointing.dcp_import import read_checkpoint
    from ..checkpointing.merge import check_reshard_arguments, reshard_source

    check_reshard_arguments(new_tp, pad_to_multiple_of)
    _refuse_distributed_job("import_dcp_resharded")
    checkpoint = read_checkpoint(dcp_dir, config)
    check_output_dir(dcp_dir, output_dir, force)
    view = TensorParallelOneView(checkpoint, pad_to_multiple_of or 1)
    parent = os.path.dirname(os.path.abspath(output_dir))
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(output_dir))}.nxdtp-dcp-", dir=parent)
    try:
        tag_dir = view.write_json_files(work)
        return reshard_source(tag_dir, view.index, view.model_reader, output_dir, new_tp, progress=progress,
                              pad_to_multiple_of=pad_to_multiple_of, config=checkpoint.config_path,
                              open_file=view.open_file, optimizer_source=view.optimizer_reader,
                              source=os.path.abspath(dcp_dir))
    finally:
        shutil.rmtree(work, ignore_errors=True)


class TensorParallelOneView:
    """A checked DCP checkpoint (``dcp_import.read_checkpoint``) as the TP=1 nxdtp checkpoint of the model its config
    names, built at TP size 1 with vocabulary multiple ``multiple``: ``index`` (what ``save`` would record), the model
    rank file (``model_reader``) and the optimizer's (``open_file``) as readers that read the DCP checkpoint when asked,
    and the JSON files (``write_json_files``). Module docstring, steps 1 and 2."""

    def __init__(self, checkpoint, multiple: int):
        from ..checkpointing.index import CheckpointIndex
        from ..version import __version__

        self.checkpoint = checkpoint
        entries, parameter_names = _entries_at_tensor_parallel_one(checkpoint.config_path, multiple)
        self.model_reader = _DcpRankFile(checkpoint, _model_sources(checkpoint, entries))
        primary = {alias: key for key, entry in entries.items() for alias in [key] + entry.aliases}
        self.optimizer_reader, optimizer_index, self.optimizer_json = _optimizer(checkpoint, entries, primary,
                                                                               parameter_names)
        self.index = CheckpointIndex(tensor_model_parallel_size=1, data_parallel_size=1, tensors=entries,
                                     optimizer=optimizer_index, nxdtp_version=__version__)

    def open_file(self, relative: str):
        from ..checkpointing.index import optim_file

        if relative != optim_file(0) or self.optimizer_reader is None:
            raise FileNotFoundError(f"{self.checkpoint.dcp_dir} as a TP=1 nxdtp checkpoint has no {relative}")
        return self.optimizer_reader

    def write_json_files(self, directory: str) -> str:
        """Write the tag directory's JSON files (trainer state, the optimizer's groups) into ``directory``, in the tag
        directory a save of the recorded step would make; return that tag directory."""
        from ..checkpointing import tags
        from ..checkpointing.save_load import OPTIMIZER_STATE_FILE, TRAINER_STATE_FILE

        trainer_state = {key: value for key, value in (self.checkpoint.trainer_state or {}).items()
                         if key in ("global_step", "scheduler") and value is not None}
        step = trainer_state.get("global_step")
        tag_dir = os.path.join(directory, tags.tag_for_step(step) if step is not None else "checkpoint")
        files = {TRAINER_STATE_FILE: trainer_state}
        if self.optimizer_json is not None:
            files[OPTIMIZER_STATE_FILE] = self.optimizer_json
        for relative, payload in files.items():
            path = os.path.join(tag_dir, relative)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                json.dump(payload, f, indent=1)
        return tag_dir


def _entries_at_tensor_parallel_one(config_path: str, multiple: int):
    """The index entries ``save`` would write for the config's model sharded at TP size 1 (vocabulary multiple
    ``multiple``), and its parameter names in order: the model is built with its parameters on the meta device, in a
    world of one process made for it and torn down after."""
    import torch.distributed as dist

    from .. import parallel_state as ps
    from ..checkpointing.dcp_import import model_class_and_config
    from ..checkpointing.index import split_model_state
    from ..models import parallelize_model
    from ..models.hf_loading import parameters_on_meta
    from ..process_groups import initialize_single_process_world, release_single_process_world

    _refuse_distributed_job("TensorParallelOneView")
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

    from .. import parallel_state as ps

    if ps.model_parallel_is_initialized() or (dist.is_initialized() and dist.get_world_size() != 1):
        raise RuntimeError(f"{what} shards the model's description in a world of one process of its own: call it "
                           "outside a distributed job (nxdtp-merge does)")


def _model_sources(checkpoint, entries) -> Dict[str, Tuple[str, Any]]:
    """{index key: (DCP key, spec)} for every model tensor; each entry takes the DCP tensor's dtype. The plan's model
    and the config's class must hold the same tensors (a plan renaming one would be a defect: refused, naming it)."""
    from ..checkpointing.index import dtype_name

    saved = checkpoint.metadata.state_dict_metadata
    first_name = {alias: name for name, (_, aliases) in checkpoint.expected.items() for alias in [name] + aliases}
    tensors: Dict[str, Tuple[str, Any]] = {}
    for key, entry in entries.items():
        name = next((first_name[k] for k in [key] + entry.aliases if k in first_name), None)
        if name is None:
            raise ValueError(f"the sharded model of {checkpoint.config_path} holds '{key}', which the dense model "
                             "does not: nxdtp cannot map it to the DCP checkpoint's tensors")
        source = checkpoint.sources[name]
        meta = saved[source]
        if tuple(meta.size) != tuple(entry.spec.unpadded_shape):
            raise ValueError(f"{checkpoint.dcp_dir}: '{source}' has shape {list(meta.size)}, but the sharded model's "
                             f"'{key}' is {list(entry.spec.unpadded_shape)} unpadded")
        entry.dtype = dtype_name(meta.properties.dtype)
        tensors[key] = (source, entry.spec)
    covered = {first_name[k] for key, entry in entries.items() for k in [key] + entry.aliases if k in first_name}
    left = [name for name in checkpoint.expected if name not in covered]
    if left:
        raise ValueError(f"the sharded model of {checkpoint.config_path} holds no tensor for {left[:5]} of the dense "
                         "model: nxdtp cannot place them in its checkpoint")
    return tensors


def _optimizer(checkpoint, entries, primary: Dict[str, str], parameter_names: List[str]):
    """The optimizer's rank file at TP 1 (a reader), its index part and its JSON part, as ``save`` writes them for a
    live optimizer keyed by parameter name (all None without optimizer state)."""
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
    return _DcpRankFile(checkpoint, tensors), index, {"param_groups": groups, "scalars": scalars}


def _check_hyperparameter(dcp_dir: str, flat: str, value: Any) -> None:
    """The groups go into a JSON file, as ``save`` writes them: a hyperparameter must be a JSON value."""
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        raise ValueError(f"{dcp_dir}: hyperparameter 'optimizer.{flat}' is a {type(value).__name__}, not a plain "
                         "value (a tensor learning rate or betas); --reshard writes the groups as JSON: import "
                         "without --reshard and restore the state with load_dense_optimizer_state") from None


class _TensorShape:
    """What merge asks of ``get_slice``: the shape, without reading the tensor."""

    def __init__(self, shape):
        self.shape = list(shape)

    def get_shape(self) -> List[int]:
        return list(self.shape)


class _DcpRankFile:
    """The tensors of the DCP checkpoint as the TP=1 nxdtp checkpoint holds them: ``tensors`` maps each key to (DCP
    key, spec or None). As a pipeline source, the dense tensors by box (``read_boxes``); as the optimizer's rank file
    that reshard's plan reads (``keys``, ``get_slice``, ``dtype``, ``get_tensor``, as ``SafetensorsFileReader``),
    ``get_tensor`` reads the DCP tensor (batched with the keys after it, in this order, which is the order reshard
    reads them) and lays it out by its spec."""

    def __init__(self, checkpoint, tensors: Dict[str, Tuple[str, Any]]):
        from ..checkpointing.dcp_import import BatchedReader

        self.saved = checkpoint.metadata.state_dict_metadata
        self.tensors = tensors
        self.reader = BatchedReader(checkpoint.rows, [source for source, _ in tensors.values()])
        self._whole = (None, None)  # (DCP key, tensor) read whole, kept while its boxes are read

    def keys(self):
        return self.tensors.keys()

    def get_slice(self, key: str) -> _TensorShape:
        source, spec = self.tensors[key]
        return _TensorShape(spec.full_shape if spec is not None else self.saved[source].size)

    def dtype(self, key: str):
        return self.saved[self.tensors[key][0]].properties.dtype

    def get_tensor(self, key: str):
        source, spec = self.tensors[key]
        value = self.reader.read(source)
        return value if spec is None else spec.full_from_dense(value)

    # ---- as a pipeline source (``nxdtp.checkpointing.pipeline.TensorSource``): the dense tensors, by box ----

    @property
    def slab_bytes(self) -> int:
        return self.reader.rows.budget

    def spec(self, key: str):
        return self.tensors[key][1] or _replicated(self.saved[self.tensors[key][0]].size)

    def read_boxes(self, key: str, boxes):
        """Boxes of the dense tensor ``key``. A tensor within the import's read budget is read whole once (with
        those after it) and cut; a larger one is read box by box, so it is never whole in memory, unless the job
        saved it in chunks over the budget, which every read would load again: it is read whole once."""
        source, _ = self.tensors[key]
        rows = self.reader.rows
        if self.reader.in_ranges(source) and not rows.chunks_over_budget(source):
            return rows.read_boxes(source, boxes)
        if self._whole[0] != source:
            self._whole = (source, None)   # the previous tensor goes before this one is read
            self._whole = (source, self.reader.read(source))
        return [_box_of(self._whole[1], box) for box in boxes]


def _replicated(size):
    from ..spec import ParamSpec

    return ParamSpec(full_shape=tuple(size))


def _box_of(tensor, box):
    offsets, sizes = box
    for dim, (start, length) in enumerate(zip(offsets, sizes)):
        tensor = tensor.narrow(dim, start, length)
    return tensor
