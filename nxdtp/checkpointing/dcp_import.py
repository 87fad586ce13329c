"""Import a torch.distributed.checkpoint (DCP) directory written by a native job into a dense Hugging Face directory.

``import_dcp(dcp_dir, output_dir)`` (``nxdtp-merge DCP_DIR OUT --from-dcp``) reads what a job using DTensor TP, FSDP2
or TorchTitan's HF-named layout saves with ``dcp.save``: the model's tensors at the top level under the HF model's
``state_dict`` names, and optionally the optimizer state under ``optimizer`` in torch's flattened form
(``optimizer.state.<param>.<field>``, ``optimizer.param_groups.<param>.<hyperparameter>``), which is also what
``nxdtp-merge --to dcp`` writes. It writes

* ``model.safetensors`` with every tensor of the model (each tied tensor once), read from DCP one tensor at a time
  (``dcp.load`` of that key alone, so DCP reassembles the saved chunks, whatever sharding wrote them), and the
  ``config.json`` the model is built from;
* the optimizer state, if there is one, beside it as ``nxdtp-merge`` writes it for a merged nxdtp checkpoint
  (``optimizer.safetensors`` / ``optimizer.json``, module ``dense_optimizer``), which
  ``nxdtp.checkpointing.load_dense_optimizer_state`` restores into a dense model's optimizer or, cut by each
  parameter's TP layout, into a model ``from_pretrained_sharded`` built at any TP size.

The model class is the config's ``architectures[0]``, built on the meta device only to learn the names, shapes and
ties the checkpoint must provide: a tensor the model needs that the checkpoint lacks, one with another shape, or a
model key the model does not have (another naming, such as TorchTitan's own Llama names) is refused naming it, before
anything is written. Output safety is the merge's: a temporary sibling renamed into place, a non-empty ``output_dir``
refused unless ``force``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any, Dict, List, Optional, Tuple

import torch

from .dense import DenseWeightsWriter
from .merge import CONFIG_FILE, DenseOptimizerTensor, _progress, write_dense_optimizer
from .output_dir import check_output_dir, write_atomically

OPTIMIZER_PREFIX = "optimizer."
# What TorchTitan and torch's own examples keep beside the model in the same DCP checkpoint; not model tensors.
NOT_MODEL_PREFIXES = (OPTIMIZER_PREFIX, "lr_scheduler", "train_state", "dataloader", "extra_state")
EXPORT_RECORD_FILE = "nxdtp_dcp_export.json"
BATCH_BYTES = 64 << 20  # tensors read per dcp.load: the import's memory beyond one tensor

__all__ = ["import_dcp", "ImportResult"]


@dataclasses.dataclass
class ImportResult:
    output_dir: str
    model_keys: int
    optimizer_keys: int
    notes: List[str]


def import_dcp(dcp_dir: str, output_dir: str, config: Optional[str] = None, force: bool = False,
               progress: bool = True) -> ImportResult:
    """Write the dense HF directory of the DCP checkpoint ``dcp_dir`` (module docstring); return what was written.
    ``config`` is the model's config.json when ``dcp_dir`` has none beside its files."""
    metadata = _read_metadata(dcp_dir)
    config_path = config if config is not None else os.path.join(dcp_dir, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{config_path} is missing: the import builds the model from its config; pass "
                                "--config CONFIG_JSON (the config.json of the model the job trained)")
    check_output_dir(dcp_dir, output_dir, force)
    expected = _model_tensors(config_path)
    saved = metadata.state_dict_metadata
    layout, sources = _check_model_keys(dcp_dir, saved, expected)
    optimizer_state, notes = _optimizer_state(dcp_dir, saved, expected)
    trainer_state = recorded_trainer_state(dcp_dir, saved)

    def write(staging: str) -> None:
        bar = _progress(len(layout), f"import {os.path.basename(os.path.normpath(dcp_dir))}", progress)
        reader = _BatchedReader(dcp_dir, [(sources[key], dtype, shape) for key, dtype, shape in layout])
        try:
            with DenseWeightsWriter(staging, layout, metadata={"format": "pt"}) as writer:
                for key, dtype, shape in layout:
                    writer.write(key, reader.read(sources[key]))
                    bar.update(1)
        finally:
            bar.close()
        shutil.copyfile(config_path, os.path.join(staging, CONFIG_FILE))
        if optimizer_state:
            write_dense_optimizer(staging, optimizer_state, "dcp", trainer_state, progress)

    write_atomically(output_dir, write)
    return ImportResult(output_dir=output_dir, model_keys=len(layout), optimizer_keys=len(optimizer_state),
                        notes=notes)


def _read_metadata(dcp_dir: str):
    import torch.distributed.checkpoint as dcp

    if not os.path.isdir(dcp_dir):
        raise FileNotFoundError(f"{dcp_dir} does not exist")
    if not os.path.isfile(os.path.join(dcp_dir, ".metadata")):
        raise ValueError(f"{dcp_dir} is not a torch.distributed.checkpoint directory: it has no .metadata file "
                         "(an nxdtp checkpoint is merged without --from-dcp; an NxD one with --from-nxd)")
    try:
        return dcp.FileSystemReader(dcp_dir).read_metadata()
    except Exception as e:  # a damaged .metadata: whatever unpickling raised
        raise ValueError(f"{os.path.join(dcp_dir, '.metadata')} cannot be read as DCP metadata: {e}") from None


def _model_tensors(config_path: str) -> Dict[str, Tuple[Tuple[int, ...], List[str]]]:
    """The model's state_dict as the config's class builds it: {first name of each tensor: (shape, its other
    (tied) names)}."""
    import transformers

    with open(config_path) as f:
        config_dict = json.load(f)
    architectures = config_dict.get("architectures") or []
    if not architectures or not hasattr(transformers, architectures[0]):
        raise ValueError(f"{config_path} names no model class transformers {transformers.__version__} has "
                         f"(architectures={architectures}); the import needs it to know the model's tensors: a config "
                         "the model's save_pretrained wrote names it, or add e.g. \"architectures\": "
                         "[\"LlamaForCausalLM\"]")
    model_class = getattr(transformers, architectures[0])
    model_config = transformers.AutoConfig.for_model(**config_dict)
    with torch.device("meta"):
        model = model_class(model_config)
    tensors: Dict[str, Tuple[Tuple[int, ...], List[str]]] = {}
    first_name: Dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in first_name:
            tensors[first_name[id(tensor)]][1].append(name)
        else:
            first_name[id(tensor)] = name
            tensors[name] = (tuple(tensor.shape), [])
    return tensors


def _check_model_keys(dcp_dir: str, saved: Dict[str, Any], expected):
    """The layout to write [(name, dtype, shape)] and, per name, the DCP key holding it (a tied tensor may be saved
    under any of its names); everything wrong is refused before anything is written."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    model_keys = {key for key in saved if not key.startswith(NOT_MODEL_PREFIXES)}
    known = {alias for name, (_, aliases) in expected.items() for alias in [name] + aliases}
    unknown = sorted(model_keys - known)
    if unknown:
        raise ValueError(f"{dcp_dir} holds tensors the model does not have: {unknown[:5]} ({len(unknown)} in all); "
                         "the import reads HF state_dict names (TorchTitan's own names need its converter first)")
    layout, sources, missing = [], {}, []
    for name, (shape, aliases) in expected.items():
        source = next((key for key in [name] + aliases if key in saved), None)
        if source is None:
            missing.append(name)
            continue
        meta = saved[source]
        if not isinstance(meta, TensorStorageMetadata):
            raise ValueError(f"{dcp_dir}: '{source}' is not a tensor in the checkpoint")
        if tuple(meta.size) != shape:
            raise ValueError(f"{dcp_dir}: '{source}' has shape {list(meta.size)}, but the model's is {list(shape)}")
        layout.append((name, meta.properties.dtype, shape))
        sources[name] = source
    if missing:
        raise ValueError(f"{dcp_dir} lacks tensors the model needs: {missing[:5]} ({len(missing)} in all)")
    return layout, sources


class _BatchedReader:
    """Reads the tensors ``items`` [(DCP key, dtype, shape)] in that order, ``dcp.load``-ing the next ones together
    up to ``budget_bytes`` (at least one) and handing each out once: one ``dcp.load`` per tensor costs a planning round
    and a metadata read each (most of an import's time for small tensors), and loading everything at once would hold
    the whole checkpoint."""

    def __init__(self, dcp_dir: str, items: List[Tuple[str, torch.dtype, Tuple[int, ...]]],
                 budget_bytes: int = BATCH_BYTES):
        self.dcp_dir, self.items, self.budget = dcp_dir, list(items), budget_bytes
        self.position = {key: i for i, (key, _, _) in enumerate(self.items)}
        self.cache: Dict[str, torch.Tensor] = {}

    def read(self, key: str) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        if key not in self.cache:
            batch, size = {}, 0
            for name, dtype, shape in self.items[self.position[key]:]:
                nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                if batch and size + nbytes > self.budget:
                    break
                batch[name] = torch.empty(shape, dtype=dtype)
                size += nbytes
            dcp.load(batch, checkpoint_id=self.dcp_dir, no_dist=True)
            self.cache.update(batch)
        return self.cache.pop(key)


def _load_values(dcp_dir: str, keys: List[str]) -> Dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    holder: Dict[str, Any] = dict.fromkeys(keys)
    dcp.load(holder, checkpoint_id=dcp_dir, no_dist=True)
    return holder


def _optimizer_state(dcp_dir: str, saved: Dict[str, Any], expected) -> Tuple[Dict[str, Any], List[str]]:
    """The optimizer's flattened state: tensors read when written, other values read now. Keys must name model
    parameters by their first name, as torch's flattened optimizer state dict does."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    state: Dict[str, Any] = {}
    keys = sorted(key for key in saved if key.startswith(OPTIMIZER_PREFIX))
    if not keys:
        return state, ["the checkpoint holds no optimizer state under 'optimizer'"]
    # write_dense_optimizer reads the tensors in this order
    values: List[str] = []
    reader = _BatchedReader(dcp_dir, [(key, saved[key].properties.dtype, tuple(saved[key].size)) for key in keys
                                      if isinstance(saved[key], TensorStorageMetadata)])
    for key in keys:
        flat = key[len(OPTIMIZER_PREFIX):]
        kind, _, rest = flat.partition(".")
        param = rest.rsplit(".", 1)[0]
        if kind not in ("state", "param_groups") or param not in expected:
            raise ValueError(f"{dcp_dir}: optimizer entry '{key}' is not torch's flattened optimizer state of a "
                             "model parameter (optimizer.state.<param>.<field> or "
                             "optimizer.param_groups.<param>.<hyperparameter>)")
        meta = saved[key]
        if isinstance(meta, TensorStorageMetadata):
            shape, dtype = tuple(meta.size), meta.properties.dtype
            state[flat] = DenseOptimizerTensor(shape=shape, dtype=dtype, read=lambda key=key: reader.read(key))
        else:
            values.append(key)
    if values:  # small pickled values (hyperparameters, 'step' of some optimizers): all in one dcp.load
        holder = _load_values(dcp_dir, values)
        for key in values:
            value = holder[key]
            state[key[len(OPTIMIZER_PREFIX):]] = list(value) if isinstance(value, tuple) else value
    return {key: state[key] for key in sorted(state)}, []


def recorded_trainer_state(dcp_dir: str, saved: Dict[str, Any]) -> Optional[dict]:
    """The step and scheduler the DCP checkpoint ``dcp_dir`` (its metadata's ``saved`` entries) records: an nxdtp
    export's record beside its files, else TorchTitan's places; None when it records neither."""
    return _export_record_trainer_state(dcp_dir) or _torchtitan_trainer_state(dcp_dir, saved)


def _torchtitan_trainer_state(dcp_dir: str, saved: Dict[str, Any]) -> Optional[dict]:
    """The step and scheduler a native (TorchTitan-layout) job keeps under ``train_state.step`` and
    ``lr_scheduler.last_epoch``, as nxdtp's trainer state: ``{"global_step": ..., "scheduler": {"last_epoch": ...}}``
    (torch's LambdaLR.load_state_dict takes that; the optimizer's groups carry the learning rates)."""
    keys = [key for key in ("train_state.step", "lr_scheduler.last_epoch") if key in saved]
    if not keys:
        return None
    values = _load_values(dcp_dir, keys)
    state: Dict[str, Any] = {}
    if "train_state.step" in values:
        state["global_step"] = int(values["train_state.step"])
    if "lr_scheduler.last_epoch" in values:
        state["scheduler"] = {"last_epoch": int(values["lr_scheduler.last_epoch"])}
    return state


def _export_record_trainer_state(dcp_dir: str) -> Optional[dict]:
    """The trainer state an nxdtp export recorded beside its DCP files (scheduler, step), if this is one."""
    path = os.path.join(dcp_dir, EXPORT_RECORD_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f).get("trainer_state")
