"""Import a torch.distributed.checkpoint (DCP) directory into a dense Hugging Face directory (``nxdtp-merge DCP_DIR OUT
--from-dcp``): (``DcpSource``, ``DenseSink``), the optimizer state beside it; the config's model class says which
tensors the checkpoint must hold (docs/checkpoints.md, "Importing from torch.distributed.checkpoint")."""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any, Dict, List, Optional, Tuple

import torch

from .dcp_io import EXPORT_RECORD_FILE, DcpReader, DcpSource, read_metadata
from .dense import DenseWeightsWriter
from .durable import read_json
from .merge import DenseOptimizerTensor, write_dense_optimizer
from .output_dir import check_output_dir, write_atomically
from .pipeline import DenseSink, stream
from .tag_source import CONFIG_FILE, progress_bar

OPTIMIZER_PREFIX = "optimizer."
# What TorchTitan and torch's own examples keep beside the model in the same DCP checkpoint; not model tensors.
NOT_MODEL_PREFIXES = (OPTIMIZER_PREFIX, "lr_scheduler", "train_state", "dataloader", "extra_state")
# The most bytes read at once: small tensors are read together up to it, larger ones in slabs of it (tests lower it).
BATCH_BYTES = 64 << 20

__all__ = ["import_dcp", "ImportResult"]


@dataclasses.dataclass
class ImportResult:
    output_dir: str
    model_keys: int
    optimizer_keys: int
    notes: List[str]


@dataclasses.dataclass
class DcpCheckpoint:
    """A DCP checkpoint checked against the model its config names: ``expected`` (first name -> (shape, tied names)),
    ``sources`` (the DCP key of each), ``source``, the flattened ``optimizer_state``, ``notes`` and
    ``trainer_state``."""
    dcp_dir: str
    config_path: str
    reader: DcpReader
    expected: Dict[str, Tuple[Tuple[int, ...], List[str]]]
    sources: Dict[str, str]
    source: DcpSource
    optimizer_state: Dict[str, Any]
    notes: List[str]
    trainer_state: Optional[dict]


def read_checkpoint(dcp_dir: str, config: Optional[str] = None) -> DcpCheckpoint:
    """Open ``dcp_dir`` and check it holds every tensor of the model its config (beside it, or ``config``) names, with
    the model's shapes, and nothing else; read nothing large yet."""
    metadata = read_metadata(dcp_dir)
    reader = DcpReader(dcp_dir, metadata, BATCH_BYTES)
    config_path = config if config is not None else os.path.join(dcp_dir, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{config_path} is missing: the import builds the model from its config; pass "
                                "--config CONFIG_JSON (the config.json of the model the job trained)")
    expected = _model_tensors(config_path)
    sources = _check_model_keys(dcp_dir, reader.saved, expected)
    tensors = sorted(key for key, meta in reader.saved.items() if key.startswith(OPTIMIZER_PREFIX)
                     and hasattr(meta, "chunks"))
    source = DcpSource(reader, {**{name: (key, None) for name, key in sources.items()},
                                **{key[len(OPTIMIZER_PREFIX):]: (key, None) for key in tensors}})
    optimizer_state, notes = _optimizer_state(dcp_dir, reader.saved, expected, source)
    return DcpCheckpoint(dcp_dir=dcp_dir, config_path=config_path, reader=reader, expected=expected, sources=sources,
                         source=source, optimizer_state=optimizer_state, notes=notes,
                         trainer_state=_export_record_trainer_state(dcp_dir)
                         or _torchtitan_trainer_state(dcp_dir, reader.saved))


def import_dcp(dcp_dir: str, output_dir: str, config: Optional[str] = None, force: bool = False,
               progress: bool = True) -> ImportResult:
    """Write the dense HF directory of the DCP checkpoint ``dcp_dir``; return what was written. ``config`` is the
    model's config.json when ``dcp_dir`` has none beside its files."""
    checkpoint = read_checkpoint(dcp_dir, config)
    check_output_dir(dcp_dir, output_dir, force)
    source = checkpoint.source
    layout = [(name, source.dtype(name), shape) for name, (shape, _) in checkpoint.expected.items()]

    def write(staging: str) -> None:
        with progress_bar(len(layout), f"import {os.path.basename(os.path.normpath(dcp_dir))}", progress) as bar:
            with DenseWeightsWriter(staging, layout, metadata={"format": "pt"}) as writer:
                stream(source, DenseSink(writer), checkpoint.expected, bar=bar)
        shutil.copyfile(checkpoint.config_path, os.path.join(staging, CONFIG_FILE))
        if checkpoint.optimizer_state:
            write_dense_optimizer(staging, checkpoint.optimizer_state, "dcp", checkpoint.trainer_state, progress)

    write_atomically(output_dir, write)
    return ImportResult(output_dir=output_dir, model_keys=len(layout), optimizer_keys=len(checkpoint.optimizer_state),
                        notes=checkpoint.notes)


def _model_tensors(config_path: str) -> Dict[str, Tuple[Tuple[int, ...], List[str]]]:
    """The model's state_dict as the config's class builds it: {first name: (shape, its tied names)}."""
    model_class, model_config = model_class_and_config(config_path)
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


def model_class_and_config(config_path: str):
    """The transformers class the config names (``architectures[0]``) and the config object, or a ValueError saying
    what to add."""
    import transformers

    config_dict = read_json(config_path)
    architectures = config_dict.get("architectures") or []
    if not architectures or not hasattr(transformers, architectures[0]):
        raise ValueError(f"{config_path} names no model class transformers {transformers.__version__} has "
                         f"(architectures={architectures}); the import needs it to know the model's tensors: a config "
                         "the model's save_pretrained wrote names it, or add e.g. \"architectures\": "
                         "[\"LlamaForCausalLM\"]")
    return getattr(transformers, architectures[0]), transformers.AutoConfig.for_model(**config_dict)


def _check_model_keys(dcp_dir: str, saved: Dict[str, Any], expected) -> Dict[str, str]:
    """Each model tensor's first name -> the DCP key holding it (a tied tensor may be saved under any of its names);
    everything wrong is refused before anything is written."""
    model_keys = {key for key in saved if not key.startswith(NOT_MODEL_PREFIXES)}
    known = {alias for name, (_, aliases) in expected.items() for alias in [name] + aliases}
    unknown = sorted(model_keys - known)
    if unknown:
        raise ValueError(f"{dcp_dir} holds tensors the model does not have: {unknown[:5]} ({len(unknown)} in all); "
                         "the import reads HF state_dict names (TorchTitan's own names need its converter first)")
    sources, missing = {}, []
    for name, (shape, aliases) in expected.items():
        source = next((key for key in [name] + aliases if key in saved), None)
        if source is None:
            missing.append(name)
        elif not hasattr(saved[source], "chunks"):
            raise ValueError(f"{dcp_dir}: '{source}' is not a tensor in the checkpoint")
        elif tuple(saved[source].size) != shape:
            raise ValueError(f"{dcp_dir}: '{source}' has shape {list(saved[source].size)}, but the model's is "
                             f"{list(shape)}")
        else:
            sources[name] = source
    if missing:
        raise ValueError(f"{dcp_dir} lacks tensors the model needs: {missing[:5]} ({len(missing)} in all)")
    return sources


def _load_values(dcp_dir: str, keys: List[str]) -> Dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    holder: Dict[str, Any] = dict.fromkeys(keys)
    dcp.load(holder, checkpoint_id=dcp_dir, no_dist=True)
    return holder


def _optimizer_state(dcp_dir: str, saved: Dict[str, Any], expected, source: DcpSource
                     ) -> Tuple[Dict[str, Any], List[str]]:
    """The optimizer's flattened state, sorted: tensors read from ``source`` when written (in slabs of rows), other
    values now. Keys must name model parameters by their first name, as torch's flattened state dict does."""
    keys = sorted(key for key in saved if key.startswith(OPTIMIZER_PREFIX))
    if not keys:
        return {}, ["the checkpoint holds no optimizer state under 'optimizer'"]
    state: Dict[str, Any] = {}
    for key in keys:
        flat = key[len(OPTIMIZER_PREFIX):]
        kind, _, rest = flat.partition(".")
        if kind not in ("state", "param_groups") or rest.rsplit(".", 1)[0] not in expected:
            raise ValueError(f"{dcp_dir}: optimizer entry '{key}' is not torch's flattened optimizer state of a "
                             "model parameter (optimizer.state.<param>.<field> or "
                             "optimizer.param_groups.<param>.<hyperparameter>)")
        if flat in source.layout:
            state[flat] = DenseOptimizerTensor.of_source(source, flat)
    values = [key for key in keys if key[len(OPTIMIZER_PREFIX):] not in source.layout]
    if values:  # small pickled values (hyperparameters, 'step' of some optimizers): all in one dcp.load
        for key, value in _load_values(dcp_dir, values).items():
            state[key[len(OPTIMIZER_PREFIX):]] = list(value) if isinstance(value, tuple) else value
    return {key: state[key] for key in sorted(state)}, []


def _torchtitan_trainer_state(dcp_dir: str, saved: Dict[str, Any]) -> Optional[dict]:
    """The step and scheduler TorchTitan keeps under ``train_state.step`` and ``lr_scheduler.last_epoch``, as nxdtp's
    trainer state (``global_step``, ``scheduler.last_epoch``); None when it records neither."""
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
    """The trainer state an nxdtp export recorded beside its DCP files, if this is one."""
    path = os.path.join(dcp_dir, EXPORT_RECORD_FILE)
    if not os.path.isfile(path):
        return None
    return read_json(path).get("trainer_state")
