"""The checkpoint index, ``nxdtp_index.json``: per model tensor its layout (``ParamSpec``), dtype and tied aliases, and
every file's record, so merging, resharding and loading need nothing but the directory (docs/checkpoints.md, "The
index")."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from ..errors import DamagedInputError
from ..record import read_note
from ..spec import ParamSpec
from .durable import CHECKSUM, checked_digest, checked_record, write_bytes_durably

FORMAT_VERSION = 1
INDEX_FILE = "nxdtp_index.json"
DONE_FILE = "done"
TRAINER_STATE_FILE = "trainer_state.json"
OPTIMIZER_STATE_FILE = "optim/state.json"
CONFIG_FILE = "config.json"


class CheckpointIntegrityError(DamagedInputError):
    """A checkpoint file is not what its record says: another size or another checksum (flipped bytes, truncation), or
    a ``done`` or index without the records that say it."""


def model_file(tp_rank: int) -> str:
    return f"model/tp_rank_{tp_rank:02d}.safetensors"


def optim_file(tp_rank: int, dp_rank: Optional[int] = None) -> str:
    """A plain optimizer's file of a TP rank, or (``dp_rank`` given) a ZeRO-1 optimizer's file of one shard: the
    state of TP rank ``tp_rank`` cut over the data-parallel group, as DP rank ``dp_rank`` holds it."""
    if dp_rank is None:
        return f"optim/tp_rank_{tp_rank:02d}.safetensors"
    return f"optim/tp_rank_{tp_rank:02d}_dp_rank_{dp_rank:02d}.safetensors"


def is_zero1_optimizer_index(optimizer: Any) -> bool:
    """Whether an index's ``optimizer`` part describes ZeRO-1 state (flat shards over DP, one file per TP x DP rank)."""
    return isinstance(optimizer, dict) and optimizer.get("kind") == "zero1"


def zero1_group_size(optimizer: Any) -> int:
    """How many DP shards each TP rank's optimizer state is cut into: the ZeRO-1 sharding group's size, 1 for plain
    state (one file per TP rank)."""
    return int(optimizer["zero1"]["sharding_group_size"]) if is_zero1_optimizer_index(optimizer) else 1


def optimizer_rank_files(optimizer: Dict[str, Any], tp: int) -> Dict[Tuple[int, int], str]:
    """The optimizer's rank file of each (TP rank, DP rank): plain state's one per TP rank (DP rank 0), ZeRO-1's one per
    TP x DP rank."""
    zero1 = is_zero1_optimizer_index(optimizer)
    return {(rank, k): optim_file(rank, k if zero1 else None) for rank in range(tp)
            for k in range(zero1_group_size(optimizer))}


@dataclasses.dataclass
class TensorEntry:
    """One logical (full) tensor of the model."""

    dtype: str
    spec: ParamSpec
    aliases: List[str] = dataclasses.field(default_factory=list)

    def files(self, tp: int) -> List[str]:
        """The file holding each TP rank's piece; a replicated tensor lives only in TP rank 0's file."""
        return [model_file(r) for r in range(tp)] if self.spec.is_sharded else [model_file(0)]

    def to_json(self) -> Dict[str, Any]:
        return {"dtype": self.dtype, "spec": self.spec.to_dict(), "aliases": self.aliases}

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "TensorEntry":
        return cls(dtype=d["dtype"], spec=ParamSpec.from_dict(d["spec"]), aliases=list(d["aliases"]))


def owners_by_name(entries: Dict[str, TensorEntry]) -> Dict[str, str]:
    """Every name of a stored tensor (its key and its tied aliases) -> the key it is stored under."""
    return {name: key for key, entry in entries.items() for name in [key] + entry.aliases}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in checkpoint index")
    return dtype


def _alias_identity(key: str, value: torch.Tensor) -> object:
    """Equal for two state-dict entries that are one tied tensor."""
    if value.device.type in ("meta", "xla"):
        # XLA and meta tensors expose no storage: ties show as one Parameter object in a
        # ``state_dict(keep_vars=True)`` (a plain state_dict's meta entries are distinct tensors: no ties).
        return id(value)
    return value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), value.dtype


def split_state_dict(state_dict: Dict[str, Any], tp: int, alias_keys: Iterable[str] = (),
                     preferred_keys: Iterable[str] = ()) -> Tuple[Dict[str, torch.Tensor], Dict[str, TensorEntry]]:
    """Separate a model state dict into the tensors to store and their index entries. Keys of one tensor (shared
    storage; on XLA one Parameter object) are one tied tensor, stored under its first key in ``preferred_keys``, else
    its first not in ``alias_keys`` (the keys a model re-ties on loading). A tensor without a spec in its module's
    extra state is replicated."""
    specs: Dict[str, ParamSpec] = {}
    for key, value in state_dict.items():
        if key.endswith("_extra_state") and isinstance(value, dict) and "params" in value:
            prefix = key[: -len("_extra_state")]
            if "split_over_ranks" in value:
                raise ValueError(f"'{prefix.rstrip('.')}' is split over the process group of ranks "
                                 f"{value['split_over_ranks']}, not the tensor-parallel group: nxdtp checkpoints store "
                                 "tensor-parallel shards, so save that module's state yourself (or build it over the "
                                 "tensor-parallel group)")
            for name, spec in value["params"].items():
                specs[prefix + name] = ParamSpec.from_dict(spec)
    if tp > 1 and not specs and any(isinstance(v, torch.Tensor) for v in state_dict.values()):
        # Without specs every tensor would be recorded as replicated, and TP ranks > 0 would lose their shards.
        raise ValueError("the model state dict carries no nxdtp sharding specs ('<module>._extra_state' entries) at "
                         f"tensor_model_parallel_size={tp}: pass the model itself, or its unfiltered state_dict()")
    # Group tied keys first: the spec may belong to any of them (an MLM bias is owned by the decoder module).
    groups: Dict[object, List[str]] = {}
    for key, value in state_dict.items():
        if key.endswith("_extra_state"):
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"model state '{key}' is a {type(value).__name__}, not a tensor; only tensors and nxdtp "
                            "specs can be saved in a model state dict")
        groups.setdefault(_alias_identity(key, value), []).append(key)
    tensors: Dict[str, torch.Tensor] = {}
    entries: Dict[str, TensorEntry] = {}
    alias_keys, preferred_keys = set(alias_keys), set(preferred_keys)
    for keys in groups.values():
        # Stable: the first preferred key leads, else the first non-alias key.
        keys = sorted(keys, key=lambda k: (k not in preferred_keys, k in alias_keys))
        key, value = keys[0], state_dict[keys[0]]
        spec = next((specs[k] for k in keys if k in specs), None) or ParamSpec(full_shape=tuple(value.shape),
                                                                             num_partitions=tp)
        if tuple(value.shape) != spec.local_shape():
            raise ValueError(f"model state '{key}' has shape {list(value.shape)}, but its spec expects the local shape "
                             f"{list(spec.local_shape())}")
        tensors[key] = value.detach()
        entries[key] = TensorEntry(dtype=dtype_name(value.dtype), spec=spec, aliases=keys[1:])
    return tensors, entries


@dataclasses.dataclass
class TiedKeysNote:
    """On a model: the checkpoint keys its ties' owners are stored under, where HF's own choice does not load in every
    supported release (RoBERTa's MLM bias). Written by the encoder plan, read by ``split_model_state``."""
    keys: Tuple[str, ...] = ()


def split_model_state(model: Any, state_dict: Dict[str, Any], tp: int
                      ) -> Tuple[Dict[str, torch.Tensor], Dict[str, TensorEntry]]:
    """``split_state_dict`` with the tied keys named as ``model`` names them (HF's ``_tied_weights_keys``, the plan's
    ``TiedKeysNote``; a state dict names none), so ``save`` and ``save_pretrained`` name every tensor alike."""
    return split_state_dict(state_dict, tp, alias_keys=getattr(model, "_tied_weights_keys", None) or (),
                            preferred_keys=read_note(model, TiedKeysNote).keys)


@dataclasses.dataclass
class CheckpointIndex:
    tensor_model_parallel_size: int
    data_parallel_size: int
    tensors: Dict[str, TensorEntry]
    optimizer: Optional[Dict[str, Any]] = None  # param name -> {"state": [fields], "spec": ...}; None if not saved
    nxdtp_version: str = ""
    format_version: int = FORMAT_VERSION
    # Relative path -> {"size": bytes, "xxh3_64": 16 hex digits} of every other file of the tag. Every tag on disk
    # records them (``read`` refuses one without); None only for an index a converter builds in memory.
    files: Optional[Dict[str, Dict[str, Any]]] = None
    # Relative path of a safetensors file -> {"header": a file record of its header, "tensors": {name: xxh3_64}}, so
    # a reader verifies just the tensors it reads; required on disk as ``files`` is.
    tensor_checksums: Optional[Dict[str, Dict[str, Any]]] = None

    def to_json(self) -> Dict[str, Any]:
        return {"format_version": self.format_version, "nxdtp_version": self.nxdtp_version,
                "tensor_model_parallel_size": self.tensor_model_parallel_size,
                "data_parallel_size": self.data_parallel_size,
                "tensors": {k: e.to_json() for k, e in self.tensors.items()}, "optimizer": self.optimizer,
                **({"files": self.files} if self.files is not None else {}),
                **({"tensor_checksums": self.tensor_checksums} if self.tensor_checksums is not None else {})}

    def write(self, tag_dir: str) -> Dict[str, Any]:
        """Write the index file and ``fsync`` it; return its record (size, checksum), which ``done`` holds."""
        return write_bytes_durably(os.path.join(tag_dir, INDEX_FILE), json.dumps(self.to_json(), indent=1).encode())

    @classmethod
    def read(cls, tag_dir: str) -> "CheckpointIndex":
        path = os.path.join(tag_dir, INDEX_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: {tag_dir} is not an nxdtp checkpoint tag")
        try:
            with open(path, "rb") as f:
                d = json.loads(f.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is damaged: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"{path} is damaged: not a JSON object")
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(f"{path} has format_version={version!r}; this nxdtp reads format version {FORMAT_VERSION}")
        absent = [field for field in ("files", "tensor_checksums") if d.get(field) is None]
        if absent:
            raise CheckpointIntegrityError(
                f"{path} records no {' and no '.join(repr(f) for f in absent)}: an nxdtp checkpoint index records "
                f"the size and {CHECKSUM} of every file of its tag ('files') and of each safetensors header and "
                f"tensor ('tensor_checksums'), so its files can be verified")
        try:
            return cls(tensor_model_parallel_size=int(d["tensor_model_parallel_size"]),
                       data_parallel_size=int(d["data_parallel_size"]),
                       tensors={k: TensorEntry.from_json(e) for k, e in d["tensors"].items()},
                       optimizer=d.get("optimizer"), nxdtp_version=d.get("nxdtp_version", ""), format_version=version,
                       files=_records(d.get("files"), "files", checked_record),
                       tensor_checksums=_records(d.get("tensor_checksums"), "tensor_checksums", _contents_record))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{path} is damaged: missing or malformed field {e}") from None


def _records(value: Any, field: str, check: Callable[[Any], Dict[str, Any]]) -> Optional[Dict[str, Dict[str, Any]]]:
    """The index's ``field`` (relative path -> record) as read from JSON, each record checked by ``check``."""
    if value is None:
        return None
    records = {}
    for name, record in dict(value).items():
        try:
            records[str(name)] = check(record)
        except ValueError as e:
            raise ValueError(f"{field!r} entry {name!r}: {e}"[:300]) from None
    return records


def _contents_record(record: Any) -> Dict[str, Any]:
    """A safetensors file's ``tensor_checksums`` record, if well formed; ``ValueError`` naming what is wrong if not."""
    if not isinstance(record, dict) or set(record) != {"header", "tensors"} or not isinstance(record["tensors"], dict):
        raise ValueError(f"a contents record is {{'header': a file record, 'tensors': {{name: {CHECKSUM}}}}}, got "
                         f"{record!r}")
    return {"header": checked_record(record["header"]),
            "tensors": {str(key): checked_digest(digest) for key, digest in record["tensors"].items()}}
