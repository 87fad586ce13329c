"""``save`` and ``load`` in NxD's call form, writing and reading the self-describing sharded format
(docs/checkpoints.md). Each step ends with every rank learning whether any rank failed, so ``done`` exists only once
every file is complete and a failure on one rank raises on all."""

from __future__ import annotations

import base64
import copy
import dataclasses
import functools
import io
import json
import os
import pickle
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from .. import comm
from ..agreement import check_replicated_agree
from ..random import get_rng_state, get_xla_rng_tracker, set_rng_state
from ..spec import FlatShardLayout, ParamSpec, ShardedModule
from ..topology import data_parallel_group, expert_parallel_group, get_topology, tensor_parallel_group
from ..utils import move_all_tensor_to_cpu
from ..version import __version__
from . import integrity, tags
from .durable import ChecksummedWriter, fsync_tree, make_directories, read_json, write_bytes_durably
from .experts import (
    GatheredWhenWritten,
    expert_specs,
    gather_without_writing,
    indexed_by_experts,
    keep_this_ranks_experts,
    written_value,
)
from .fused_state import Fused, fuse_state, fused_by_position, split_state, with_fused_tensors
from .index import (
    CONFIG_FILE,
    OPTIMIZER_STATE_FILE,
    TRAINER_STATE_FILE,
    CheckpointIndex,
    TensorEntry,
    dtype_from_name,
    is_zero1_optimizer_index,
    model_file,
    optim_file,
    optimizer_rank_files,
    owners_by_name,
    split_model_state,
)
from .lock import TagLock
from .safetensors_stream import StreamingSafetensorsWriter
from .tag_source import open_rank_file
from .unwrap import is_zero1

# Checkpoint entries that are not JSON (NxD's guide saves an optimizer state dict and a loss tensor beside the model):
# one torch.save file per TP rank, since such values may differ between TP ranks.
EXTRA_FILE = "extra/tp_rank_{:02d}.pt"
LIVE_OR_STATE_KEYS = ("model", "optimizer", "scheduler")


# ---- NxD's helpers ---------------------------------------------------------------------------------------------------

def ensure_directory_exists(filename: str) -> None:
    """Create the directory that will hold ``filename``, with its parents (NxD's name); nothing if it exists. A bare
    file name (no directory part) needs none."""
    directory = os.path.dirname(os.fspath(filename))
    if directory:
        os.makedirs(directory, exist_ok=True)


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False")


def _check_default(function: str, name: str, value: Any, default: Any, why: str) -> None:
    _check_bool(name, value)
    if value != default:
        raise ValueError(f"{function}(): {name}={value!r} is not supported by nxdtp, only {name}={default!r}: {why}")


def _invoke_preshard_hooks(module: nn.Module, state_dict: Dict[str, Any], prefix: str = "") -> None:
    """NxD's convention: a module with a ``preshard_hook(state_dict, prefix + "weight")`` method rewrites its own
    entries of the full state dict (and its children are left to it); other modules are searched recursively."""
    if hasattr(module, "preshard_hook"):
        module.preshard_hook(state_dict, prefix + "weight")
        return
    for name, child in module.named_children():
        _invoke_preshard_hooks(child, state_dict, prefix + name + ".")


def sharding_specs(model: nn.Module, tp: int) -> Dict[int, ParamSpec]:
    """The spec of every TP-sharded tensor of ``model``, by tensor identity (tied keys share it): the modules' own, else
    NxD's attributes set by hand. A fused parameter has none: its parts have theirs."""
    specs: Dict[int, ParamSpec] = {}
    for module in model.modules():
        if isinstance(module, ShardedModule):
            for name, spec in module.param_specs().items():
                tensor = getattr(module, name, None)
                if tensor is not None and spec.is_sharded:
                    specs[id(tensor)] = spec
    for tensor in list(model.parameters()) + list(model.buffers()):
        if hasattr(tensor, "fused_parts"):
            continue
        if id(tensor) not in specs and getattr(tensor, "tensor_model_parallel", False):
            dim = tensor.partition_dim % tensor.dim()
            full = list(tensor.shape)
            full[dim] *= tp
            specs[id(tensor)] = ParamSpec(full_shape=tuple(full), partition_dim=dim,
                                          stride=getattr(tensor, "partition_stride", 1), num_partitions=tp)
    return specs


def get_sharded_model_dict(model: nn.Module, model_state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """Turn a full state dict of ``model`` into this TP rank's, in place, and return it (NxD's name). A full tensor may
    have the dense or the padded full shape; replicated tensors, keys the model lacks and keys the dict lacks are
    left as they are; an nxdtp spec in the dict is replaced by the model's own; NxD's ``preshard_hook`` runs first."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"get_sharded_model_dict needs the model (an nn.Module), got {type(model).__name__}")
    if not isinstance(model_state_dict, dict):
        raise TypeError(f"model_state_dict must be a dict of full tensors, got {type(model_state_dict).__name__}")
    group = tensor_parallel_group()
    _invoke_preshard_hooks(model, model_state_dict)
    specs = sharding_specs(model, group.size)
    for key, current in model.state_dict(keep_vars=True).items():
        if key not in model_state_dict:
            continue
        if key.endswith("_extra_state"):
            owner = key[: -len("_extra_state")].rstrip(".")
            if isinstance(model.get_submodule(owner) if owner else model, ShardedModule):
                model_state_dict[key] = current
            continue
        spec = specs.get(id(current)) if isinstance(current, torch.Tensor) else None
        if spec is None:
            continue
        value = model_state_dict[key]
        shape = tuple(value.shape)
        if shape == tuple(spec.full_shape):
            full = value
        elif shape == tuple(spec.unpadded_shape):
            full = spec.full_from_dense(value)
        else:
            hint = (" It has this rank's shard shape: is the state dict sharded already?"
                    if shape == tuple(spec.local_shape()) else "")
            raise ValueError(f"get_sharded_model_dict: '{key}' has shape {list(shape)}, but a full tensor of it has "
                             f"the dense shape {list(spec.unpadded_shape)} or the padded shape "
                             f"{list(spec.full_shape)}.{hint}")
        model_state_dict[key] = spec.local_of_full(full, group.rank, expert_parallel_group().rank)
    return model_state_dict


# ---- save ------------------------------------------------------------------------------------------------------------

def save(checkpoint: Dict[str, Any], output_dir: str, save_serially: bool = True, save_xser: bool = False,
         down_cast_bf16: bool = False, master_dp_only: bool = True, *, tag: Optional[str] = None,
         keep_last: Optional[int] = None, check_replicated: bool = True) -> str:
    """Save a training checkpoint (NxD's dict: ``model``, ``optimizer``, ``scheduler``, ``global_step`` and other
    values; JSON ones go to the trainer state, others to one ``torch.save`` file per TP rank); return the tag
    directory. The tag defaults to ``step_<global_step>``, else the first free ``checkpoint``, ``checkpoint_1``, ...;
    ``keep_last`` keeps that many complete tags; ``down_cast_bf16`` stores floating model tensors as bfloat16.
    Replicated tensors are written from TP rank 0, so first every one is checked equal across the TP group
    (``check_replicated``; ``DivergenceError`` on every rank otherwise). ``save_serially`` changes nothing (every
    writer streams one tensor at a time); ``save_xser=True`` and ``master_dp_only=False`` are refused."""
    if not isinstance(save_serially, bool):
        raise TypeError(f"save_serially={save_serially!r} must be True or False (it is NxD's third parameter; pass "
                        "tag= and keep_last= by keyword)")
    _check_default("save", "save_xser", save_xser, False, "nxdtp writes its own self-describing safetensors format "
                   "(docs/checkpoints.md); NxD's xser layout is read only by nxdtp-merge --from-nxd")
    _check_default("save", "master_dp_only", master_dp_only, True, "the DP replicas of a TP rank hold the same "
                   "values, and nxdtp writes them once, from DP rank 0")
    job = prepare_save(checkpoint, output_dir, tag=tag, keep_last=keep_last, down_cast_bf16=down_cast_bf16,
                       check_replicated=check_replicated)
    write_save(job)
    return job.tag_dir


@dataclasses.dataclass
class SaveJob:
    """One save, prepared (``prepare_save``) and not yet written (``write_save``). ``to_host()`` makes it independent of
    the live objects, so it may be written while training goes on (``async_save``)."""

    output_dir: str
    tag: str
    tag_dir: str
    keep_last: Optional[int]
    lock: Optional[TagLock]
    tensors: Dict[str, torch.Tensor]          # model tensors by index key (this rank writes some of them)
    entries: Dict[str, TensorEntry]
    optimizer_tensors: Optional[Dict[str, torch.Tensor]]
    optimizer_index: Optional[Dict[str, Any]]
    extras: Dict[str, Any]                     # entries stored per TP rank with torch.save
    json_files: Dict[str, bytes]               # relative path -> contents: this rank's RNG file; on rank 0 the others
    # ZeRO-1: this rank's (sharding rank, replica rank). Only replica 0 of each shard writes it, named by the shard.
    zero1_place: Optional[Tuple[int, int]] = None

    def writes_model(self) -> bool:
        return data_parallel_group().rank == 0

    def writes_optimizer(self) -> bool:
        if self.optimizer_tensors is None:
            return False
        if self.zero1_place is not None:
            return self.zero1_place[1] == 0
        return data_parallel_group().rank == 0

    def optimizer_file(self) -> str:
        """This rank's optimizer file: its TP rank's, and with ZeRO-1 state its shard's (the sharding rank)."""
        tp_rank = tensor_parallel_group().rank
        return optim_file(tp_rank, None if self.zero1_place is None else self.zero1_place[0])

    def to_host(self) -> None:
        """Copy every tensor this rank writes to host memory (each a copy of its own, even on the CPU), and drop the
        references to the others: a host snapshot that later training steps cannot change."""
        tp_rank = tensor_parallel_group().rank
        # Experts split over ranks are gathered now (a collective, so on every rank, each tensor in turn).
        self.tensors = _host_copies(self.tensors, lambda k: self.writes_model() and (
            self.entries[k].spec.is_sharded or tp_rank == 0))
        if self.optimizer_tensors is not None:
            self.optimizer_tensors = _host_copies(self.optimizer_tensors, lambda k: self.writes_optimizer())
        self.extras = copy.deepcopy(self.extras) if self.writes_model() else {}


def _host_copies(tensors: Dict[str, Any], kept: Callable[[str], bool]) -> Dict[str, torch.Tensor]:
    """Host copies of the tensors ``kept`` names, each ``GatheredWhenWritten`` one gathered on the way (every rank
    takes part in each gather, in order, kept or not)."""
    copies = {}
    for key, tensor in tensors.items():
        if isinstance(tensor, GatheredWhenWritten) or kept(key):
            value = written_value(tensor)
            if kept(key):
                copies[key] = value.detach().to("cpu", copy=True)
    return copies


def prepare_save(checkpoint: Dict[str, Any], output_dir: str, *, tag: Optional[str] = None,
                 keep_last: Optional[int] = None, down_cast_bf16: bool = False, check_replicated: bool = True,
                 pickled_keys: Tuple[str, ...] = ()) -> SaveJob:
    """Collective: the first two phases of ``save`` (nothing written yet but the tag directory): every rank prepares
    what it will write, the replicated tensors are compared, rank 0 takes the tag's lock. ``pickled_keys``: entries
    stored with ``torch.save`` even when they are JSON, so they come back as they were."""
    if not isinstance(checkpoint, dict) or "model" not in checkpoint:
        raise ValueError("save() takes a dict with at least a 'model' entry (a module or its state_dict()), got "
                         f"{type(checkpoint).__name__}" + (f" with keys {sorted(checkpoint)}"
                                                           if isinstance(checkpoint, dict) else ""))
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last={keep_last} must be >= 1 (or None to keep every tag)")
    _check_bool("check_replicated", check_replicated)
    for key, value in checkpoint.items():
        if key != "optimizer":
            _refuse_zero1(value, f"save(): checkpoint[{key!r}]")
    if tag is None:
        if "global_step" in checkpoint:
            tag = tags.tag_for_step(checkpoint["global_step"])
        else:  # rank 0's view of the directory names it for every rank
            tag = comm.all_gather_object(tags.first_free(output_dir, "checkpoint"))[0]
    tags.check_tag_name(tag)
    tag_dir = os.path.join(output_dir, tag)
    lock = TagLock(output_dir, tag) if get_topology().rank == 0 else None
    try:
        return _prepare_phases(checkpoint, output_dir, tag, tag_dir, lock, down_cast_bf16, keep_last,
                               check_replicated, pickled_keys)
    except BaseException:
        if lock is not None:
            lock.release()  # only if rank 0 took it
        raise


def _prepare_phases(checkpoint: Dict[str, Any], output_dir: str, tag: str, tag_dir: str, lock: Optional[TagLock],
                    down_cast_bf16: bool, keep_last: Optional[int], check_replicated: bool,
                    pickled_keys: Tuple[str, ...]) -> SaveJob:
    """Phases 0 and 1 of the durability protocol of docs/checkpoints.md ("Crash consistency")."""
    topology, tp_group = get_topology(), tensor_parallel_group()
    model = checkpoint["model"]
    # Each phase ends with every rank learning whether any rank failed (_agree), never with a bare barrier: a rank that
    # raised alone would leave its peers waiting in the next collective, or writing into a tag that rank 0 refused.
    error: Optional[BaseException] = None
    job: Optional[SaveJob] = None
    try:
        # keep_vars: tied parameters stay one object, which is how ties are recognised on XLA (no storage pointers).
        model_state = model.state_dict(keep_vars=True) if isinstance(model, nn.Module) else model
        optimizer_tensors, optimizer_index, optimizer_json, zero1_place = _optimizer_payload(
            checkpoint.get("optimizer"), model)
        trainer_state, extras = _trainer_payload(checkpoint, pickled_keys)
        # Before anything below can fail on one rank, and before only some ranks read tensors to the host.
        comm.materialize(list(model_state.values()) + list((optimizer_tensors or {}).values()))
        extras = move_all_tensor_to_cpu(extras)  # on every rank: a pending XLA graph must not run on one alone
        # A tie's owner is stored under a key the model loads directly, or under the one its plan names.
        tensors, entries = split_model_state(model, model_state, tp_group.size)
        _describe_zero1_specs(optimizer_index, entries)
        if down_cast_bf16:
            # The cast happens on the host while writing: on XLA a device-side cast would be a graph that only the
            # writing ranks run.
            for key, entry in entries.items():
                if tensors[key].is_floating_point():
                    entry.dtype = "bfloat16"
        json_files = _json_files(topology.rank, model, optimizer_json, trainer_state)
        job = SaveJob(output_dir=output_dir, tag=tag, tag_dir=tag_dir, keep_last=keep_last, lock=lock,
                      tensors=tensors, entries=entries, optimizer_tensors=optimizer_tensors,
                      optimizer_index=optimizer_index, extras=extras, json_files=json_files, zero1_place=zero1_place)
    except Exception as e:  # noqa: BLE001 - re-raised on every rank by _agree
        error = e
    # Every rank must reach the replicated check (a collective), so the failures above are agreed on first.
    _agree(error, f"saving {tag_dir}")
    try:
        _defer_expert_gathers(job, model)
        if check_replicated:
            # Before anything is written: replicated tensors are stored from TP rank 0 only. The check raises the
            # same error on every rank of a TP group whose copies differ.
            check_replicated_agree({k: t for k, t in job.tensors.items() if not job.entries[k].spec.is_sharded},
                                   tp_group, what=f"saving {tag_dir}")
        if lock is not None:
            make_directories(output_dir)
            # The lock first: a save that completes this tag meanwhile has released it, and is then seen as complete.
            lock.acquire()
            if os.path.isdir(tag_dir) and tags.is_complete(tag_dir):
                raise FileExistsError(f"checkpoint tag {tag_dir} already exists and is complete; choose another tag")
            # A previous crashed save of this tag may have left files; its missing 'done' kept it from being loaded.
            make_directories(tag_dir)
    except Exception as e:  # noqa: BLE001 - re-raised on every rank by _agree
        error = e
        if lock is not None:
            # Only rank 0 runs anything after taking the lock: released before the agreement, so when the refusal
            # is raised on any rank the lock is gone.
            lock.release()
    _agree(error, f"saving {tag_dir}")
    return job


def _defer_expert_gathers(job: SaveJob, model: Any) -> None:
    """Tensors whose experts are split over ranks, and their plain optimizer state, are stored with every expert: each
    becomes a ``GatheredWhenWritten`` and its index entry the spec of every expert."""
    specs: Dict[str, ParamSpec] = {}
    for key, entry in job.entries.items():
        if entry.spec.expert_partitions > 1:
            specs.update({name: entry.spec for name in [key] + entry.aliases})
            job.tensors[key] = GatheredWhenWritten(job.tensors[key], entry.spec)
            entry.spec = entry.spec.with_all_experts()
    if not specs or job.optimizer_tensors is None:
        return
    if job.optimizer_index.get("keyed_by") != "name":
        what = "an optimizer state dict alone" if isinstance(model, nn.Module) else "a model state dict"
        raise ValueError(f"save(): the model's experts are split over expert-parallel ranks ('{next(iter(specs))}', "
                         f"...), and {what} does not say which optimizer state belongs to them; pass the model and "
                         "the optimizer themselves (save({'model': model, 'optimizer': optimizer}))")
    for key, value in job.optimizer_tensors.items():
        name, _, field = key.rpartition("/")
        spec = specs.get(name)
        if spec is None or value.dim() == 0:
            continue
        if not indexed_by_experts(value, spec, spec.local_shape()[0]):
            raise NotImplementedError(f"save(): the optimizer state '{field}' of '{name}' has shape "
                                      f"{list(value.shape)}, not indexed by this rank's {spec.local_shape()[0]} "
                                      "experts along dim 0, so it cannot be stored with every expert")
        job.optimizer_tensors[key] = GatheredWhenWritten(value, spec)


def _json_files(rank: int, model: Any, optimizer_json: Optional[Dict[str, Any]],
                trainer_state: Dict[str, Any]) -> Dict[str, bytes]:
    """This rank's JSON files of a save, encoded now so that the job holds the state of this moment: its RNG states,
    and on rank 0 the optimizer's JSON part, the trainer state and the model's config."""
    json_files = {rng_file(rank): _json_bytes(_rng_payload())}
    if rank == 0:
        if optimizer_json is not None:
            json_files[OPTIMIZER_STATE_FILE] = _json_bytes(optimizer_json)
        json_files[TRAINER_STATE_FILE] = _json_bytes(trainer_state)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "to_json_string"):
            payload = json.loads(config.to_json_string())
            # As HF's save_pretrained records it, so the merged model loads by its class name.
            payload["architectures"] = payload.get("architectures") or [type(model).__name__]
            json_files[CONFIG_FILE] = _json_bytes(payload)
    return json_files


def write_save(job: SaveJob) -> None:
    """Collective: the last phases of ``save``: every rank writes and ``fsync``s its files; rank 0 writes the index,
    ``done``, ``newest``, prunes and releases the lock; every rank raises if any failed."""
    topology, tp_group, dp_group = get_topology(), tensor_parallel_group(), data_parallel_group()
    tag_dir, lock = job.tag_dir, job.lock
    error: Optional[BaseException] = None
    written: Dict[str, dict] = {}  # relative path -> record (size, checksum) of every file this rank wrote
    contents: Dict[str, dict] = {}  # relative path -> records of a safetensors file's header and tensors
    try:
        error = _write_rank_files(job, tp_group.rank, written, contents)
        _agree(error, f"saving {tag_dir}")  # every rank's files are written and fsynced before 'done' says so
        # The records reach rank 0, which writes the index (the agreement above gathers error reports only).
        records = comm.all_gather_object((written, contents))

        try:
            if topology.rank == 0:
                files = {relative: record for per_rank, _ in records for relative, record in per_rank.items()}
                parts = {relative: record for _, per_rank in records for relative, record in per_rank.items()}
                index = CheckpointIndex(tensor_model_parallel_size=tp_group.size, data_parallel_size=dp_group.size,
                                        tensors=job.entries, optimizer=job.optimizer_index,
                                        nxdtp_version=__version__, files=dict(sorted(files.items())),
                                        tensor_checksums=dict(sorted(parts.items())))
                index_record = index.write(tag_dir)
                # Every directory of the tag (model/, optim/, rng/, extra/, the tag itself), whoever created its
                # entries.
                fsync_tree(tag_dir)
                tags.mark_done(tag_dir, index_record)
                tags.set_newest(job.output_dir, job.tag)
                if job.keep_last is not None:
                    tags.prune(job.output_dir, job.keep_last, protect=job.tag)
        except Exception as e:  # noqa: BLE001
            error = e
    finally:
        if lock is not None:
            lock.release()  # before the agreement: when save returns on any rank, the tag is unlocked
    _agree(error, f"saving {tag_dir}")


def _write_rank_files(job: SaveJob, tp_rank: int, written: Dict[str, dict], contents: Dict[str, dict]
                      ) -> Optional[BaseException]:
    """This rank's files of the save (records into ``written`` and ``contents``); the first failure, returned. Every
    gather of experts this rank owes its expert-parallel group runs whatever failed, so no peer waits alone."""
    error: Optional[BaseException] = None

    def attempt(step: Callable[[], None]) -> None:
        nonlocal error
        if error is None:
            try:
                step()
            except Exception as e:  # noqa: BLE001 - returned, then raised on every rank
                error = e

    def write(relative: str, write_file: Callable[[str], Tuple[dict, dict]]) -> None:
        written[relative], contents[relative] = write_file(os.path.join(job.tag_dir, relative))

    if job.writes_model():
        attempt(lambda: write(model_file(tp_rank), lambda path: _write_tensors(path, job.tensors, {
            k: dtype_from_name(e.dtype) for k, e in job.entries.items() if e.spec.is_sharded or tp_rank == 0})))
        if job.extras:
            attempt(lambda: _write_extras(job, tp_rank, written))
    else:
        gather_without_writing(job.tensors)
    if job.writes_optimizer() and error is None:
        # ZeRO-1: each shard of the TP rank's optimizer state is written once, by the first of its replicas (every DP
        # rank when sharding over the DP group).
        attempt(lambda: write(job.optimizer_file(), lambda path: _write_tensors(path, job.optimizer_tensors, {
            k: t.dtype for k, t in job.optimizer_tensors.items()})))
    else:
        gather_without_writing(job.optimizer_tensors or {})
    for relative, payload in job.json_files.items():
        attempt(lambda relative=relative, payload=payload: _write_json(job.tag_dir, relative, payload, written))
    return error


def _write_json(tag_dir: str, relative: str, payload: bytes, written: Dict[str, dict]) -> None:
    path = os.path.join(tag_dir, relative)
    make_directories(os.path.dirname(path))
    written[relative] = write_bytes_durably(path, payload)


def _write_extras(job: SaveJob, tp_rank: int, written: Dict[str, dict]) -> None:
    relative = EXTRA_FILE.format(tp_rank)
    make_directories(os.path.dirname(os.path.join(job.tag_dir, relative)))
    with ChecksummedWriter(os.path.join(job.tag_dir, relative)) as f:
        torch.save(job.extras, f)
    written[relative] = f.record()


# Raise on every rank if any rank failed; also a barrier when none did.
_agree = comm.raise_on_every_rank_if_any_failed


def _write_tensors(path: str, tensors: Dict[str, Any], dtypes: Dict[str, torch.dtype]) -> Tuple[dict, dict]:
    """One safetensors file of the ``tensors`` that ``dtypes`` names (the model's: this TP rank's pieces, plus on TP
    rank 0 every replicated tensor; the optimizer's: all), each cast on the host to its dtype there and in memory one
    at a time; returns the file's record and its contents record (header and tensors). Every tensor is read even
    after a failure: a read may be a gather an expert-parallel group waits in."""
    mine = [(k, t, dtypes[k]) for k, t in tensors.items() if k in dtypes]
    error: Optional[BaseException] = None
    writer: Optional[StreamingSafetensorsWriter] = None
    try:
        make_directories(os.path.dirname(path))
        writer = StreamingSafetensorsWriter(path, [(k, dtype, tuple(t.shape)) for k, t, dtype in mine])
    except Exception as e:  # noqa: BLE001 - raised below, once every gather has run
        error = e
    for key, value, dtype in mine:
        tensor = written_value(value).detach().to("cpu").to(dtype)
        if error is None:
            try:
                writer.write(key, tensor)
            except Exception as e:  # noqa: BLE001
                error = e
        del tensor
    if error is not None:
        if writer is not None:
            writer.abandon()
        raise error
    writer.close()
    return writer.record(), writer.contents_record()


def _json_bytes(payload: Any) -> bytes:
    """A JSON file's contents as nxdtp writes them (written with ``write_bytes_durably``: fsynced before 'done')."""
    return json.dumps(payload, indent=1).encode()


def _trainer_payload(checkpoint: Dict[str, Any], pickled_keys: Tuple[str, ...] = ()
                     ) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The JSON entries (the trainer state, scheduler included) and the others (and those named in ``pickled_keys``),
    which are stored per TP rank."""
    payload, extras = {}, {}
    scheduler = checkpoint.get("scheduler")
    if scheduler is not None:
        payload["scheduler"] = scheduler.state_dict() if hasattr(scheduler, "state_dict") else scheduler
    for key, value in checkpoint.items():
        if key in LIVE_OR_STATE_KEYS:
            continue
        if key in pickled_keys:
            extras[key] = value
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            extras[key] = value
        else:
            payload[key] = value
    try:
        json.dumps(payload)
    except TypeError as e:
        raise TypeError(f"the scheduler state must be JSON-serialisable: {e}") from None
    return payload, extras


# ---- optimizer -------------------------------------------------------------------------------------------------------

def _refuse_zero1(value: Any, what: str) -> None:
    """ZeRO-1 state is sharded over DP. Under ``checkpoint['optimizer']`` every rank writes its shards; any other
    entry is written once per TP rank (from DP rank 0), which would silently drop the other DP ranks' shards."""
    if is_zero1(value):
        raise ValueError(
            f"{what} is a ZeRO-1 optimizer (NeuronZero1Optimizer) or its state dict, whose state is sharded over data "
            "parallelism; other entries than 'optimizer' are written once per TP rank, which would keep one DP rank's "
            "shards only. Pass it as checkpoint['optimizer'] (the optimizer itself, with the model: save({'model': "
            "model, 'optimizer': optimizer})), where every DP rank writes its own shards")


# The key under which a ZeRO-1 parameter's fp32 master shard is stored beside its state fields.
ZERO1_MASTER_FIELD = "zero1_master"


def _describe_zero1_specs(optimizer_index: Optional[Dict[str, Any]], entries: Dict[str, TensorEntry]) -> None:
    """Record in a ZeRO-1 optimizer index, per parameter, the TP spec (full shapes, how TP cut it) of its model
    tensor, beside the DP layout: the index then says every cut of the state."""
    if not is_zero1_optimizer_index(optimizer_index) or optimizer_index["keyed_by"] != "name":
        return
    owners = owners_by_name(entries)
    for name, info in optimizer_index["params"].items():
        if name in owners:
            info["spec"] = entries[owners[name]].spec.to_dict()


def _optimizer_payload(optimizer, model) -> Tuple[Optional[Dict[str, torch.Tensor]], Optional[Dict], Optional[Dict],
                                                 Optional[Tuple[int, int]]]:
    """Optimizer tensors keyed ``<param>/<field>``, the index, the JSON part, and ZeRO-1's (sharding rank, replica
    rank). With a live optimizer and model, state is keyed by parameter name (reshardable); a state dict alone by
    index (reloads at the same TP degree only). Plain and ZeRO-1 state differ only in the per-parameter entries."""
    if optimizer is None:
        return None, None, None, None
    names: Dict[int, str] = {}
    fused: Dict[int, Fused] = {}
    if isinstance(optimizer, torch.optim.Optimizer) and isinstance(model, nn.Module):
        by_identity = {id(p): n for n, p in model.named_parameters()}
        flat = [p for group in optimizer.param_groups for p in group["params"]]
        names = {i: by_identity.get(id(p), str(i)) for i, p in enumerate(flat)}
        fused = fused_by_position(optimizer, model)
    state_dict = optimizer.state_dict() if hasattr(optimizer, "state_dict") else optimizer
    tensors: Dict[str, torch.Tensor] = {}
    scalars: Dict[str, Dict[str, Any]] = {}
    zero1, place = is_zero1(optimizer), None
    if zero1:
        # ZeRO-1 keeps a fused parameter's state whole (its flat shards mix the parts' rows), under its own name.
        head, params, place = _zero1_params(state_dict, names, fused, tensors, scalars)
        fused = {}
    else:
        head, params = {}, {}
        for param_id, fields in state_dict["state"].items():
            i = int(param_id)
            # A fused parameter's state is saved as its parts', which the checkpoint's model tensors describe.
            pieces = (split_state(fields, tuple(flat[i].shape), fused[i][1]) if i in fused
                      else [(names.get(i, str(param_id)), fields)])
            for name, part_fields in pieces:
                params[name] = {"param_index": i, "tensors": _store_fields(name, part_fields, tensors, scalars)}
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [name for i in g["params"] for name in _saved_names(int(i), names, fused)]}
              for g in state_dict["param_groups"]]
    index = {**({"kind": "zero1"} if zero1 else {}), "keyed_by": "name" if names else "index", **head,
             "params": params}
    return tensors, index, {"param_groups": groups, "scalars": scalars}, place


def _zero1_params(state_dict: Dict[str, Any], names: Dict[int, str], fused: Dict[int, Fused],
                  tensors: Dict[str, torch.Tensor], scalars: Dict[str, Dict[str, Any]]):
    """A ZeRO-1 optimizer's part of the index (its ``zero1`` record, the entries by saved name) and this rank's
    (sharding rank, replica rank); its shards (state and master weights) stored into ``tensors`` and ``scalars``."""
    info = state_dict.get("zero1")
    masters = state_dict.get("sharded_master_weights")
    if not isinstance(info, dict) or masters is None:
        raise ValueError("save(): checkpoint['optimizer'] is a ZeRO-1 state dict without its layout ('zero1') or "
                         "master weights ('sharded_master_weights'); pass the NeuronZero1Optimizer itself, or its "
                         "state_dict() as nxdtp makes it")
    index: Dict[str, Dict[str, Any]] = {}
    base_state = state_dict["base_state"]
    for i, layout in enumerate(FlatShardLayout.from_dict(d) for d in info["layouts"]):
        name = names.get(i, str(i))
        fields = base_state.get(i, base_state.get(str(i), {}))
        if ZERO1_MASTER_FIELD in fields:
            raise ValueError(f"save(): the inner optimizer's state of '{name}' has a field {ZERO1_MASTER_FIELD!r}, "
                             "the name nxdtp stores ZeRO-1 master weights under")
        tensors[f"{name}/{ZERO1_MASTER_FIELD}"] = masters[i] if i in masters else masters[str(i)]
        stored = _store_fields(name, fields, tensors, scalars)
        # A flat shard of the parameter (exp_avg, momentum, ...) is re-cut on loading; anything else ('step') is the
        # same on every DP rank and copied.
        entry = {"param_index": i, "shape": list(layout.shape), "layout": layout.to_dict(),
                 "master": ZERO1_MASTER_FIELD, "tensors": stored,
                 "flat": [f for f in stored if fields[f].dim() == 1 and fields[f].numel() == layout.shard_numel]}
        if i in fused:
            # Its flat shards mix the parts' rows, which no model tensor's spec lays out: it resumes at this TP size,
            # and merge and reshard refuse it by name (the parts are recorded for their message).
            entry["fused_parts"] = [[part, rows] for part, rows in fused[i][1]]
        index[name] = entry
    head = {"zero1": {"layout": "flat", "sharding_group_size": int(info["sharding_group_size"]),
                      "optimizer_dtype": info["optimizer_dtype"]}}
    return head, index, (int(info["sharding_rank"]), int(info.get("replica_rank", 0)))


def _store_fields(name: str, fields: Dict[str, Any], tensors: Dict[str, torch.Tensor],
                  scalars: Dict[str, Dict[str, Any]]) -> List[str]:
    """Put one parameter's state tensors into ``tensors`` (keyed ``<param>/<field>``) and its other values (Adam's
    ``step`` as a number) into ``scalars``; return the names of the tensor fields."""
    stored = [field for field, value in fields.items() if isinstance(value, torch.Tensor)]
    tensors.update({f"{name}/{field}": fields[field] for field in stored})
    for field, value in fields.items():
        if field not in stored:
            scalars.setdefault(name, {})[field] = value
    return stored


def _saved_names(i: int, names: Dict[int, str], fused: Dict[int, Fused]) -> List[str]:
    """The names a parameter's optimizer state is saved under: its own, or a fused parameter's parts'."""
    return [part for part, _ in fused[i][1]] if i in fused else [names.get(i, str(i))]


def _optimizer_state_dict(tag_dir: str, checkpoint_index: CheckpointIndex, tp_rank: int,
                          optimizer: torch.optim.Optimizer, model: Optional[nn.Module], verify: bool,
                          model_state: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, Any]:
    """The state dict ``optimizer.load_state_dict`` takes, from this TP rank's optimizer files: plain state as saved,
    ZeRO-1 state re-cut to the live layout (or gathered whole for a plain optimizer), plain state keyed by name cut
    into ZeRO-1 shards with masters from the model tensors."""
    index = checkpoint_index.optimizer
    saved_zero, target = is_zero1_optimizer_index(index), _Zero1Target.of(optimizer)
    _check_convertible(tag_dir, index, saved_zero, optimizer)
    saved = read_json(os.path.join(tag_dir, OPTIMIZER_STATE_FILE))
    position = _positions_by_name(index, optimizer, model)
    live_params = [p for group in optimizer.param_groups for p in group["params"]]
    # Fused parameters' state is saved as their parts' (fused_state): each part's is read whole and they are joined.
    fused = fused_by_position(optimizer, model) if position else {}
    part_slots = {part: slot for slot, (_, parts) in fused.items() for part, _ in parts if part not in position}
    model_state = with_fused_tensors(model_state, fused)
    experts = _split_experts(tag_dir, model if position else None, target)

    @functools.lru_cache(maxsize=None)
    def files(dp_rank: Optional[int] = None) -> _RankFile:
        """The plain optimizer's file, or the ZeRO-1 file of DP shard ``dp_rank``, opened (and its header verified)
        once, when first needed."""
        return _RankFile(tag_dir, checkpoint_index, optim_file(tp_rank, dp_rank), verify)

    state: Dict[int, Dict[str, Any]] = {}
    masters: Dict[int, torch.Tensor] = {}
    given: Dict[int, Dict[str, Dict[str, Any]]] = {}
    for name, info in index["params"].items():
        if name in part_slots:
            slot = part_slots[name]
            rows = dict(fused[slot][1])[name]
            shape = (rows,) + tuple(live_params[slot].shape[1:])
            fields = _read_state(tag_dir, name, info, shape, files, None)[0]
            given.setdefault(slot, {})[name] = {**fields, **saved["scalars"].get(name, {})}
            continue
        slot = _slot_of(tag_dir, name, info, index["keyed_by"] == "name", position, len(live_params))
        spec = experts.get(name)
        shape = tuple(live_params[slot].shape) if spec is None else spec.with_all_experts().local_shape()
        fields, master = _read_state(tag_dir, name, info, shape, files, target, model_state)
        if spec is not None:   # its moments and any other state indexed by the experts, as saved: every expert
            keep_this_ranks_experts(fields, {field: spec for field, value in fields.items()
                                             if indexed_by_experts(value, spec, spec.full_shape[0])})
        if master is not None:
            masters[slot] = master
        fields.update(saved["scalars"].get(name, {}))
        state[slot] = fields
    for slot, parts in given.items():
        state[slot] = _fused_fields(tag_dir, fused[slot], parts, tuple(live_params[slot].shape), target, masters,
                                    slot, model_state)
    groups = _param_groups(tag_dir, optimizer, saved["param_groups"], {**part_slots, **position})
    if target is None:
        return {"state": state, "param_groups": groups}
    _complete_masters(tag_dir, masters, live_params, position, saved_zero, model_state, target)
    return {"state": {}, "param_groups": groups, "base_state": state, "sharded_master_weights": masters,
            "shape_info": {i: tuple(p.shape) for i, p in enumerate(live_params)}}


def _split_experts(tag_dir: str, model: Optional[nn.Module], target: Optional["_Zero1Target"]
                   ) -> Dict[str, ParamSpec]:
    """The specs of ``model``'s tensors whose experts are split over ranks (their state is read whole, then this
    rank's experts kept), by name; refused for a ZeRO-1 optimizer, whose expert shards are cut over another group."""
    experts = expert_specs(model) if model is not None else {}
    if experts and target is not None:
        raise NotImplementedError(f"{tag_dir}: loading optimizer state into a ZeRO-1 optimizer whose experts are split "
                                  f"over expert-parallel ranks ('{next(iter(experts))}', ...) is not supported yet; "
                                  "load it into a plain optimizer, or at expert_model_parallel_size=1")
    return experts


def _fused_fields(tag_dir: str, fused: Fused, parts: Dict[str, Dict[str, Any]], shape: Tuple[int, ...],
                  target: Optional["_Zero1Target"], masters: Dict[int, torch.Tensor], slot: int,
                  model_state: Optional[Dict[str, torch.Tensor]]) -> Dict[str, Any]:
    """A fused parameter's state joined from its parts' whole TP-local state; for a ZeRO-1 optimizer cut to this
    rank's flat shard, with its master shard (into ``masters``) from the checkpoint's model tensors of the parts."""
    fields = fuse_state(tag_dir, fused, parts, shape)
    if target is None:
        return fields
    masters[slot] = target.master_from_model(tag_dir, fused[0], shape, model_state)
    return {field: target.shard_of(value) if isinstance(value, torch.Tensor) and tuple(value.shape) == shape
            else value for field, value in fields.items()}


@dataclasses.dataclass(frozen=True)
class _Zero1Target:
    """The layout a live ZeRO-1 optimizer keeps its state in: its sharding group's size, this rank's place in it, and
    the dtype of its master weights."""

    group_size: int
    rank: int
    dtype: torch.dtype

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> Optional["_Zero1Target"]:
        """The target of a ZeRO-1 optimizer; None for a plain one, which takes whole TP-local tensors."""
        if not is_zero1(optimizer):
            return None
        return cls(optimizer.sharding_group.size, optimizer.sharding_group.rank, optimizer.optimizer_dtype)

    def shard_of(self, value: torch.Tensor) -> torch.Tensor:
        """This rank's flat shard of a whole TP-local tensor, in the master weights' dtype."""
        return FlatShardLayout(tuple(value.shape), self.group_size).shard_of(value.to(self.dtype), self.rank)

    def master_from_model(self, tag_dir: str, name: str, shape: Tuple[int, ...],
                          model_state: Optional[Dict[str, torch.Tensor]]) -> torch.Tensor:
        """A master shard from the checkpoint's model tensor (converting a plain optimizer's state), so the master
        weights are the saved weights whichever of model and optimizer is loaded first."""
        if model_state is None or name not in model_state:
            raise ValueError(f"{tag_dir}: converting a non-ZeRO optimizer's state to a ZeRO-1 optimizer needs the "
                             f"saved model tensor '{name}' for its master weights; pass the model to load() as well")
        value = model_state[name]
        if tuple(value.shape) != shape:
            raise ValueError(f"{tag_dir}: the saved model tensor '{name}' has shape {list(value.shape)}, the "
                             f"optimizer's parameter {list(shape)}")
        return self.shard_of(value)


def _check_convertible(tag_dir: str, index: Dict[str, Any], saved_zero: bool, optimizer: torch.optim.Optimizer
                       ) -> None:
    """Refuse plain state keyed by index for a ZeRO-1 optimizer, before any file is read: its master weights would
    come from the model's tensors, and without names nothing says which tensor belongs to which parameter."""
    if is_zero1(optimizer) and not saved_zero and index["keyed_by"] != "name":
        raise ValueError(f"{tag_dir}: the checkpoint holds the state of a non-ZeRO optimizer keyed by parameter index, "
                         f"which cannot be cut for a ZeRO-1 optimizer ({type(optimizer).__name__}): its master weights "
                         "cannot be matched to the model's tensors. Save live objects (save({'model': model, "
                         "'optimizer': optimizer})) to convert, or load it into the same kind of optimizer")


def _positions_by_name(index: Dict[str, Any], optimizer: torch.optim.Optimizer, model: Optional[nn.Module]
                       ) -> Dict[str, int]:
    """For state keyed by parameter name: each model parameter's position among the optimizer's parameters (empty
    for state keyed by index, which is loaded by position)."""
    if index["keyed_by"] != "name":
        return {}
    if model is None:
        raise ValueError("this optimizer state is keyed by parameter name: pass the model to load() as well")
    by_identity = {id(p): n for n, p in model.named_parameters()}
    flat = [p for group in optimizer.param_groups for p in group["params"]]
    return {by_identity[id(p)]: i for i, p in enumerate(flat) if id(p) in by_identity}


def _slot_of(tag_dir: str, name: str, info: Dict[str, Any], keyed_by_name: bool, position: Dict[str, int],
             n_live: int) -> int:
    """The position among the optimizer's parameters that saved parameter ``name`` loads into, checked."""
    if keyed_by_name and name not in position:
        raise ValueError(f"{tag_dir}: the checkpoint has optimizer state for parameter '{name}', which the "
                         "model passed to load() does not have (or the optimizer does not hold)")
    slot = position.get(name, info["param_index"])
    if not 0 <= slot < n_live:
        raise ValueError(f"{tag_dir}: the checkpoint has optimizer state for parameter index {slot}, but the "
                         f"optimizer holds {n_live} parameters")
    return slot


def _read_state(tag_dir: str, name: str, info: Dict[str, Any], shape: Tuple[int, ...],
                files: Callable[..., _RankFile], target: Optional[_Zero1Target],
                model_state: Optional[Dict[str, torch.Tensor]] = None
                ) -> Tuple[Dict[str, Any], Optional[torch.Tensor]]:
    """One parameter's saved state, plain or ZeRO-1 (flat shards over the saved group, ``info["layout"]``): whole
    TP-local tensors for a plain optimizer (``target`` None, no master); for a ZeRO-1 one, parameter-shaped or flat
    state cut or re-cut to this rank's flat shard, with its master shard (from the saved masters, or from the saved
    model tensor when the state is plain)."""
    saved = FlatShardLayout.from_dict(info["layout"]) if "layout" in info else None
    if saved is not None and tuple(saved.shape) != shape:
        raise ValueError(f"{tag_dir}: parameter '{name}' was saved with the TP-local shape {list(saved.shape)}, the "
                         f"optimizer's parameter has {list(shape)}; reshard the checkpoint to this tensor parallel "
                         "size first (nxdtp-merge CKPT OUT --reshard N)")
    live = FlatShardLayout(shape, target.group_size) if target is not None else None
    sources = live.source_ranks(saved, target.rank) if live is not None and saved is not None else []
    # A field that is not flat (such as a step counter) is whole in every shard: read it from a file this rank opens
    # anyway.
    first = sources[0] if len(sources) else 0

    def read(field: str, k: int) -> torch.Tensor:
        return files(None if saved is None else k).get_tensor(f"{name}/{field}")

    fields: Dict[str, Any] = {}
    for field in info["tensors"]:
        if saved is None or field not in info["flat"]:
            value = read(field, first)
            is_param = saved is None and target is not None and tuple(value.shape) == shape
            fields[field] = target.shard_of(value) if is_param else value
        elif live is None:
            fields[field] = saved.full_from_shards([read(field, k) for k in range(saved.group_size)])
        else:
            fields[field] = live.shard_from(saved, lambda k, f=field: read(f, k), target.rank, target.dtype)
    if target is None:
        return fields, None
    if saved is None:
        return fields, target.master_from_model(tag_dir, name, shape, model_state)
    return fields, live.shard_from(saved, lambda k: read(info["master"], k), target.rank, target.dtype)


def _param_groups(tag_dir: str, optimizer: torch.optim.Optimizer, saved_groups: List[Dict[str, Any]],
                  position: Dict[str, int]) -> List[Dict[str, Any]]:
    """The saved parameter groups matched with the optimizer's, parameters as positions; a hyperparameter the saved
    group lacks (newer torch) keeps the live value."""
    if len(optimizer.param_groups) != len(saved_groups):
        raise ValueError(f"{tag_dir}: the optimizer has {len(optimizer.param_groups)} parameter groups, the checkpoint "
                         f"{len(saved_groups)}")
    groups = []
    for live, group in zip(optimizer.param_groups, saved_groups):
        # JSON turned tuples (Adam's betas) into lists: give them back the live optimizer's type.
        group = {k: tuple(v) if isinstance(v, list) and isinstance(live.get(k), tuple) else v for k, v in group.items()}
        kept = {k: v for k, v in live.items() if k != "params"}
        params = [position.get(p, p if isinstance(p, int) else int(p) if p.isdigit() else p) for p in group["params"]]
        # A fused parameter's parts are saved as three names of its one position; and torch pairs a group's saved
        # parameters with its live ones in order, so the positions go in the live order (the saved one differs where
        # a fused layer's parts, Q's weight, K's, V's, then the biases, load into separate parameters).
        params = list(dict.fromkeys(params))
        if all(isinstance(p, int) for p in params):
            params.sort()
        groups.append({**kept, **group, "params": params})
    return groups


def _complete_masters(tag_dir: str, masters: Dict[int, torch.Tensor], live_params: List[torch.Tensor],
                      position: Dict[str, int], saved_zero: bool, model_state: Optional[Dict[str, torch.Tensor]],
                      target: _Zero1Target) -> None:
    """Give every parameter of a ZeRO-1 optimizer a master shard, or raise naming those left without one."""
    missing = [i for i in range(len(live_params)) if i not in masters]
    if not missing:
        return
    if not saved_zero:  # parameters without optimizer state: their masters come from the model all the same
        names = {i: n for n, i in position.items()}
        for i in missing:
            if i in names:
                masters[i] = target.master_from_model(tag_dir, names[i], tuple(live_params[i].shape), model_state)
        missing = [i for i in missing if i not in masters]
    if missing:
        raise ValueError(f"{tag_dir}: the checkpoint has no master weights for the optimizer's parameters "
                         f"{missing[:5]} (by position); it was saved from another model or optimizer")


# ---- RNG -------------------------------------------------------------------------------------------------------------

def _encode(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        buffer = io.BytesIO()
        torch.save(value, buffer)
        return {"tensor": base64.b64encode(buffer.getvalue()).decode()}
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"tensor"}:
        return torch.load(io.BytesIO(base64.b64decode(value["tensor"])), weights_only=True)
    return value


def _rng_payload() -> Dict[str, Any]:
    return {"default": {k: _encode(v) for k, v in get_rng_state().items()},
            "tracker": {name: {k: _encode(v) for k, v in state.items()}
                        for name, state in get_xla_rng_tracker().get_states().items()}}


def rng_file(rank: int) -> str:
    return f"rng/rank_{rank:05d}.json"


def restore_rng(tag_dir: str, rank: int) -> None:
    path = os.path.join(tag_dir, rng_file(rank))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file {path} is missing: the tag has no RNG states for rank {rank} (a "
                                "resharded checkpoint has none: they belong to the old layout); load it with "
                                "restore_rng_states=False")
    payload = read_json(path)
    set_rng_state({k: _decode(v) for k, v in payload["default"].items()})
    get_xla_rng_tracker().set_states({name: {k: _decode(v) for k, v in state.items()}
                                      for name, state in payload["tracker"].items()})


# ---- load ------------------------------------------------------------------------------------------------------------

class _RankFile:
    """A safetensors file of the tag, opened for ``load``; with ``verify``, its header is verified before parsing and
    each tensor as it is read (files without such records were verified whole first)."""

    def __init__(self, tag_dir: str, index: CheckpointIndex, relative: str, verify: bool):
        self.path = os.path.join(tag_dir, relative)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"checkpoint file {self.path} is missing")
        self._checks = integrity.TensorChecks.of(tag_dir, index, relative) if verify else None
        if self._checks is not None:
            self._checks.check_header()
        self._handle = open_rank_file(self.path)

    def get_tensor(self, key: str) -> torch.Tensor:
        try:
            tensor = self._handle.get_tensor(key)
        except Exception as e:
            raise ValueError(f"checkpoint file {self.path} cannot give '{key}': {e}") from None
        if self._checks is not None:
            self._checks.check(key, tensor)
        return tensor


def read_model_shard(tag_dir: str, index: CheckpointIndex, tp_rank: int, verify: bool = False
                     ) -> Dict[str, torch.Tensor]:
    """This TP rank's model state dict (tied aliases included) from its own file and TP rank 0's replicated tensors;
    ``verify`` checks each tensor read against the index."""
    state: Dict[str, torch.Tensor] = {}
    files = {relative: _RankFile(tag_dir, index, relative, verify)
             for relative in sorted({model_file(tp_rank), model_file(0)})}
    for key, entry in index.tensors.items():
        relative = model_file(tp_rank) if entry.spec.is_sharded else model_file(0)
        tensor = files[relative].get_tensor(key)
        if tuple(tensor.shape) != entry.spec.local_shape():
            raise ValueError(f"'{key}' in {relative} has shape {list(tensor.shape)}, the index says "
                             f"{list(entry.spec.local_shape())}")
        state[key] = tensor
        for alias in entry.aliases:
            state[alias] = tensor
    return state


def load(chkpt_path: str, model: Optional[nn.Module] = None, model_or_optimizer=None,
         model_key: Optional[str] = "model", load_xser: bool = False, sharded: bool = True, strict: bool = True,
         master_dp_only: bool = True, weights_only: bool = False, *, tag: Optional[str] = None,
         optimizer: Optional[torch.optim.Optimizer] = None, scheduler=None, restore_rng_states: bool = False,
         verify: bool = True) -> Optional[Dict[str, Any]]:
    """Load a checkpoint saved by ``save`` into live objects; return the trainer state and this TP rank's other entries.
    NxD's positional forms work (``load(dir, model)``, ``load(dir, optimizer)``); ``chkpt_path`` is a checkpoint
    directory (newest intact tag, damaged ones skipped with a warning) or one tag directory. The TP degree must
    match. ``verify`` checks every file read against the index (``CheckpointIntegrityError``). ``sharded=False``
    reads one full ``torch.save`` file (under ``model_key``, or all of it with ``model_key=None``) and cuts it with
    ``get_sharded_model_dict``. Pickles are read with ``weights_only=True``; ``load_xser=True`` and
    ``master_dp_only=False`` are refused."""
    _check_load_flags(load_xser, master_dp_only, sharded, weights_only, restore_rng_states, verify)
    model, optimizer = _model_and_optimizer(model, model_or_optimizer, optimizer)
    if not sharded:
        return _load_full(chkpt_path, model, model_key, strict, tag=tag, optimizer=optimizer, scheduler=scheduler,
                          restore_rng_states=restore_rng_states)
    if model_key != "model":
        raise ValueError(f"model_key={model_key!r} is not supported; nxdtp checkpoints store the model as 'model' "
                         "(other keys apply to sharded=False files)")
    # The step's pending graph runs here on every rank, not inside whatever this load does first on one rank only.
    comm.materialize(_live_tensors(model, optimizer))
    reads = _Reads(model, optimizer, restore_rng_states)
    # Every rank reads only its own files, so a missing or damaged file may fail one rank: _agree makes all raise.
    tag_dir, read, error = _agreed_read(chkpt_path, tag, verify, reads)
    trainer_state: Dict[str, Any] = {}
    if is_zero1(optimizer):
        # A ZeRO-1 optimizer's load_state_dict gathers its master shards over DP (a collective): every rank must get
        # there, so a failure on one rank is agreed on first.
        _agree(error, f"loading {chkpt_path}")
    if error is None:
        try:
            trainer_state = _load_into_live_objects(read, tag_dir, chkpt_path, model, optimizer, scheduler, strict,
                                                    restore_rng_states)
        except Exception as e:  # noqa: BLE001 - re-raised on every rank by _agree
            error = e
    _agree(error, f"loading {chkpt_path}")
    return trainer_state


def _check_load_flags(load_xser: Any, master_dp_only: Any, sharded: Any, weights_only: Any, restore_rng_states: Any,
                      verify: Any) -> None:
    """Refuse NxD's options nxdtp has no use for, and flags that are not bools, before anything is read."""
    _check_default("load", "load_xser", load_xser, False, "nxdtp checkpoints are safetensors files; NxD's xser "
                   "checkpoints are imported with nxdtp-merge --from-nxd")
    _check_default("load", "master_dp_only", master_dp_only, True, "nxdtp writes each TP shard once, from DP rank 0, "
                   "and every DP rank reads that file")
    flags = dict(sharded=sharded, weights_only=weights_only, restore_rng_states=restore_rng_states, verify=verify)
    for name, value in flags.items():
        _check_bool(name, value)


def _model_and_optimizer(model: Any, model_or_optimizer: Any, optimizer: Optional[torch.optim.Optimizer]
                         ) -> Tuple[Optional[nn.Module], Optional[torch.optim.Optimizer]]:
    """The model and the optimizer among ``load``'s NxD-style arguments, refusing two different ones of a kind."""
    candidates, model = (("model", model), ("model_or_optimizer", model_or_optimizer)), None
    for argument, value in candidates:
        # NxD's ``model`` is an older name of model_or_optimizer: an optimizer passed there is the optimizer.
        if value is None:
            continue
        if isinstance(value, torch.optim.Optimizer):
            if optimizer is not None and optimizer is not value:
                raise ValueError(f"load() got two optimizers: {argument}= and optimizer=")
            optimizer = value
        elif isinstance(value, nn.Module):
            if model is not None and model is not value:
                raise ValueError("load() got two models: model= and model_or_optimizer=")
            model = value
        else:
            raise TypeError(f"{argument} must be an nn.Module or an optimizer, got {type(value).__name__}")
    return model, optimizer


def _load_into_live_objects(read: "_Read", tag_dir: str, output_dir: str, model: Optional[nn.Module],
                            optimizer: Optional[torch.optim.Optimizer], scheduler: Any, strict: bool,
                            restore_rng_states: bool) -> Dict[str, Any]:
    """Put what this rank read into the model, optimizer, scheduler and RNGs; return the trainer state."""
    if model is not None:
        model.load_state_dict(read.model_state, strict=strict)
    if is_zero1(optimizer):
        # Its load_state_dict is a collective: no rank enters it unless every rank's model loaded.
        _agree(None, f"loading {output_dir}")
    if optimizer is not None:
        optimizer.load_state_dict(read.optimizer_state)
    trainer_state = read.trainer_state
    if scheduler is not None and "scheduler" in trainer_state:
        scheduler.load_state_dict(trainer_state["scheduler"])
    if restore_rng_states:
        restore_rng(tag_dir, get_topology().rank)
    return trainer_state


@dataclasses.dataclass
class _Reads:
    """What ``load`` reads on this rank: the files, and their contents in memory before anything live changes."""

    model: Optional[nn.Module]
    optimizer: Optional[torch.optim.Optimizer]
    rng: bool

    def files(self, tag_dir: str, index: CheckpointIndex) -> List[str]:
        """The files of ``tag_dir`` this rank reads (those that exist or are recorded; a missing one that is not
        recorded is refused later by the reader that needs it)."""
        topology, tp_rank = get_topology(), tensor_parallel_group().rank
        wanted = [TRAINER_STATE_FILE, EXTRA_FILE.format(tp_rank)]
        if self.model is not None:
            wanted += sorted({model_file(tp_rank), model_file(0)})
        if self.optimizer is not None and index.optimizer is not None:
            wanted += _optimizer_files(index, tp_rank, self.optimizer) + [OPTIMIZER_STATE_FILE]
            if (self.model is None and is_zero1(self.optimizer) and not is_zero1_optimizer_index(index.optimizer)):
                wanted += sorted({model_file(tp_rank), model_file(0)})  # the master weights of a conversion
        if self.rng:
            wanted.append(rng_file(topology.rank))
        recorded = index.files or {}
        return [f for f in wanted if f in recorded or os.path.exists(os.path.join(tag_dir, f))]

    def read(self, tag_dir: str, index: CheckpointIndex, verify: bool) -> "_Read":
        tp_group = tensor_parallel_group()
        if index.tensor_model_parallel_size != tp_group.size:
            raise ValueError(
                f"{tag_dir} was saved with tensor_model_parallel_size={index.tensor_model_parallel_size}, but this run "
                f"has tensor_model_parallel_size={tp_group.size}. Reshard it first: python tools/merge_checkpoints.py "
                f"{os.path.dirname(tag_dir)} OUT_DIR --reshard {tp_group.size}")
        read = _Read()
        if self.model is not None:
            state = read_model_shard(tag_dir, index, tp_group.rank, verify)
            read.model_state = {k: v.to(dtype_from_name(index.tensors[k].dtype)) if k in index.tensors else v
                                for k, v in state.items()}
            keep_this_ranks_experts(read.model_state, expert_specs(self.model))
        if self.optimizer is not None:
            if index.optimizer is None:
                raise ValueError(f"{tag_dir} holds no optimizer state")
            model_state = read.model_state
            if (model_state is None and is_zero1(self.optimizer) and not is_zero1_optimizer_index(index.optimizer)
                    and index.optimizer.get("keyed_by") == "name"):
                model_state = read_model_shard(tag_dir, index, tp_group.rank, verify)
            read.optimizer_state = _optimizer_state_dict(tag_dir, index, tp_group.rank, self.optimizer, self.model,
                                                         verify, model_state)
        read.trainer_state = read_json(os.path.join(tag_dir, TRAINER_STATE_FILE))
        extra_path = os.path.join(tag_dir, EXTRA_FILE.format(tp_group.rank))
        if os.path.isfile(extra_path):
            read.trainer_state.update(_torch_load(extra_path))
        return read


def _optimizer_files(index: CheckpointIndex, tp_rank: int, optimizer: torch.optim.Optimizer) -> List[str]:
    """The optimizer files of ``index`` this rank reads: its TP rank's file, or with ZeRO-1 state the DP shards of it
    that overlap this rank's shards (a ZeRO-1 optimizer at any DP size), or all of them (a plain optimizer)."""
    info = index.optimizer
    if not is_zero1_optimizer_index(info) or not is_zero1(optimizer):
        return [name for (rank, _), name in optimizer_rank_files(info, tp_rank + 1).items() if rank == tp_rank]
    ranks = {0}
    size, rank = optimizer.sharding_group.size, optimizer.sharding_group.rank
    for param in info["params"].values():
        saved = FlatShardLayout.from_dict(param["layout"])
        ranks.update(FlatShardLayout(saved.shape, size).source_ranks(saved, rank))
    return [optim_file(tp_rank, k) for k in sorted(ranks)]


@dataclasses.dataclass
class _Read:
    model_state: Optional[Dict[str, torch.Tensor]] = None
    optimizer_state: Optional[Dict[str, Any]] = None
    trainer_state: Dict[str, Any] = dataclasses.field(default_factory=dict)


def _agreed_read(path: str, tag: Optional[str], verify: bool, reads: _Reads
                 ) -> Tuple[str, Optional[_Read], Optional[BaseException]]:
    """Collective: the tag every rank loads, and this rank's reading of it (or its error). Rank 0 picks the candidate;
    damage found by any rank in an unnamed tag moves all ranks to the next one, a named tag raises. Nothing live
    changes before this returns."""
    root = get_topology().rank == 0
    problems: List[str] = []
    candidates = integrity.intact_candidates(path, tag, problems, verify_index=verify) if root else None
    while True:
        choice, error = None, None
        if root:
            try:
                tag_dir, _, named = next(candidates)
                choice = (tag_dir, named)
            except Exception as e:  # noqa: BLE001 - re-raised on every rank by _agree
                error = e
        _agree(error, f"loading {path}")
        tag_dir, named = comm.all_gather_object(choice)[0]
        damage, read, read_error = None, None, None
        try:
            index = integrity.read_index(tag_dir, verify)
            if verify:
                integrity.verify_files(tag_dir, index, reads.files(tag_dir, index), tensors_as_read=True)
        except Exception as e:  # noqa: BLE001 - damage: the index, or a file's size or checksum
            damage = e
        if damage is None:
            try:
                read = reads.read(tag_dir, index, verify)
            except tags.CheckpointIntegrityError as e:  # a header or tensor failed its checksum as it was read
                damage = e
            except Exception as e:  # noqa: BLE001 - the caller's to raise
                read_error = e
        reports = comm.all_gather_object(None if damage is None else f"{type(damage).__name__}: {damage}")
        failed = {rank: report for rank, report in enumerate(reports) if report is not None}
        if not failed:
            return tag_dir, read, read_error
        if named:
            _agree(damage, f"loading {path}")
        if root:
            integrity.skip(problems, tag_dir, "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items())))


def _load_full(path: str, model: Optional[nn.Module], model_key: Optional[str], strict: bool, **not_for_full
               ) -> Optional[Dict[str, Any]]:
    """``load(path, model, sharded=False)``: one full state dict file, cut to this rank's shards."""
    for name, value in not_for_full.items():
        if value not in (None, False):
            raise ValueError(f"load(): {name}= applies to nxdtp's sharded checkpoint directories, not to a "
                             "sharded=False file (which holds one full model state dict)")
    if model_key is not None and not isinstance(model_key, str):
        raise TypeError(f"model_key={model_key!r} must be a string or None")
    error: Optional[BaseException] = None
    rest: Optional[Dict[str, Any]] = None
    comm.materialize(_live_tensors(model, None))
    try:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"load(sharded=False) needs the checkpoint file itself; {path} is not a file")
        checkpoint = _torch_load(path)
        if model_key is not None and (not isinstance(checkpoint, dict) or model_key not in checkpoint):
            keys = sorted(checkpoint) if isinstance(checkpoint, dict) else type(checkpoint).__name__
            raise KeyError(f"{path} has no model_key={model_key!r} entry (it has {keys}); pass model_key=None when "
                           "the file is the state dict itself")
        rest = checkpoint
        if model is not None:
            state = checkpoint.pop(model_key) if model_key is not None else checkpoint
            model.load_state_dict(get_sharded_model_dict(model, state), strict=strict)
            rest = checkpoint if model_key is not None else None
    except Exception as e:  # noqa: BLE001 - re-raised on every rank by _agree
        error = e
    _agree(error, f"loading {path}")
    return rest


def _torch_load(path: str) -> Any:
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (non-zip) format cannot be memory-mapped
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise pickle.UnpicklingError(f"{path} holds objects that torch.load(weights_only=True) refuses, and nxdtp "
                                     f"reads pickles only that way (whatever load(weights_only=) says): {e}") from None


def _live_tensors(model: Optional[nn.Module], optimizer: Optional[torch.optim.Optimizer]) -> List[torch.Tensor]:
    tensors = list(model.state_dict(keep_vars=True).values()) if model is not None else []
    if optimizer is not None:
        tensors += [value for state in optimizer.state.values() for value in state.values()
                    if isinstance(value, torch.Tensor)]
    return tensors


def list_tags(output_dir: str) -> List[str]:
    return tags.complete_tags(output_dir)
