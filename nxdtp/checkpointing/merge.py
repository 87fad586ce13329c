"""Merge a sharded nxdtp checkpoint into one dense Hugging Face checkpoint, or reshard it to another TP degree, from the
checkpoint directory alone: (``TagSource``, ``DenseSink``) and (``TagSource``, ``RankFilesSink``) through the
checkpoint pipeline; everything is checked before anything is written (docs/checkpoints.md, "Merging and
resharding")."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import warnings
from functools import partial
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from ..spec import FlatShardLayout, ParamSpec
from ..version import __version__
from . import tags
from .dense import WEIGHTS_NAME, DenseWeightsWriter, dense_layout
from .dense_optimizer import DENSE_OPTIMIZER_FORMAT, DENSE_OPTIMIZER_TENSORS, DENSE_OPTIMIZER_VALUES, MASTER_PREFIX
from .durable import ChecksummedWriter, copy_durably, read_json, write_bytes_durably
from .hf_form import SavedForm
from .index import (
    CONFIG_FILE,
    INDEX_FILE,
    OPTIMIZER_STATE_FILE,
    TRAINER_STATE_FILE,
    CheckpointIndex,
    TensorEntry,
    dtype_from_name,
    is_zero1_optimizer_index,
    model_file,
    optimizer_rank_files,
    owners_by_name,
    zero1_group_size,
)
from .output_dir import write_atomically
from .pipeline import (
    DenseSink,
    RankFilesSink,
    TagSource,
    TensorSource,
    dense_slabs,
    rows_within,
    stream,
)
from .safetensors_stream import StreamingSafetensorsWriter
from .tag_source import (
    check_piece,
    choose_source,
    config_source,
    copy_if_present,
    model_file_names,
    progress_bar,
    rank_file_opener,
)

RESHARD_FILE = "reshard.json"
PYTORCH_BIN_NAME = "pytorch_model.bin"
OUTPUT_FORMATS = ("safetensors", "pytorch_bin")
HF_TRAINER_STATE_FILE = "trainer_state.json"   # transformers.trainer.TRAINER_STATE_NAME, beside the tag

__all__ = ["merge", "reshard", "OUTPUT_FORMATS"]


# ---- public entry points ---------------------------------------------------------------------------------------------

def merge(checkpoint_dir: str, output_dir: str, tag: Optional[str] = None, output_format: str = "safetensors",
          force: bool = False, progress: bool = True, config: Optional[str] = None, *, verify: bool = True,
          optimizer: bool = True) -> str:
    """Write the dense model of a sharded checkpoint to ``output_dir`` in Hugging Face's layout (``model.safetensors``,
    or ``pytorch_model.bin`` held whole with ``output_format="pytorch_bin"``) with the tag's config.json or
    ``config``; return the file path. ``checkpoint_dir`` is a checkpoint directory (``tag``, or the newest intact
    one) or a tag directory; ``verify`` checks every file read first. With ``optimizer``, state keyed by name is
    written beside the model; state keyed by index is left out with a warning."""
    return merge_and_name_source(checkpoint_dir, output_dir, tag, output_format, force, progress, config,
                                 verify=verify, optimizer=optimizer)[0]


def merge_and_name_source(checkpoint_dir: str, output_dir: str, tag: Optional[str] = None,
                          output_format: str = "safetensors", force: bool = False, progress: bool = True,
                          config: Optional[str] = None, *, verify: bool = True, optimizer: bool = True
                          ) -> Tuple[str, str]:
    """``merge``, returning ``(file written, tag directory merged)``: the tag is known only once damaged tags have been
    skipped."""
    if output_format not in OUTPUT_FORMATS:
        raise ValueError(f"output_format={output_format!r} must be one of {list(OUTPUT_FORMATS)}")
    # Validates every file before anything is written.
    tag_dir, index, model_files = choose_source(checkpoint_dir, tag, output_dir, force, verify,
                                                lambda tag_dir, index: files_read(index, config, optimizer))
    config_path = config_source(tag_dir, config)
    optim_files: Dict[str, Any] = {}
    try:
        optimizer_state = None
        if optimizer and index.optimizer is not None:
            optimizer_state, optim_files, why_not = dense_optimizer_state(tag_dir, index)
            if optimizer_state is None:
                warnings.warn(f"{tag_dir}: optimizer state not written beside the merged model: {why_not}",
                              stacklevel=2)

        def write(staging: str) -> str:
            name = WEIGHTS_NAME if output_format == "safetensors" else PYTORCH_BIN_NAME
            entries = list(index.tensors.items())
            with progress_bar(len(entries), f"merge {os.path.basename(tag_dir)}", progress) as bar:
                _write_merged_weights(os.path.join(staging, name), index, tag_model_source(index, model_files),
                                      config_path, bar)
            copy_if_present(config_path, os.path.join(staging, CONFIG_FILE))
            if optimizer_state is not None:  # with the trainer state: continuing dense training needs it
                kind = "zero1" if is_zero1_optimizer_index(index.optimizer) else "plain"
                write_dense_optimizer(staging, optimizer_state, kind, read_trainer_state(tag_dir), progress)
            return name

        name = write_atomically(output_dir, write)
    finally:
        model_files.clear()
        optim_files.clear()
    return os.path.join(output_dir, name), tag_dir


def _write_merged_weights(path: str, index: CheckpointIndex, source: TensorSource, config_path: Optional[str],
                          bar) -> None:
    """The dense weights file ``path``, tensors transformers saves in another form (fused experts) in that form, as the
    model's own save_pretrained writes them."""
    layout = dense_layout(index.tensors)
    form = SavedForm.of_config(config_path, layout)
    if path.endswith(".safetensors"):
        # The writer save_pretrained uses too, so both write the same directory for the same weights.
        with DenseWeightsWriter(os.path.dirname(path), form.layout() if form else layout,
                                metadata={"format": "pt"}) as writer:
            stream(source, DenseSink(writer, form), index.tensors, bar=bar)
        return
    state = {}
    for key, entry in index.tensors.items():
        shape = tuple(entry.spec.unpadded_shape)
        whole = source.read_boxes(key, [((0,) * len(shape), shape)])[0].clone()   # a copy: a view saves the padding
        parts = form.tensors(key, whole) if form else {key: whole}
        state.update({saved: part.clone() for saved, part in parts.items()})
        bar.update(1)
    with ChecksummedWriter(path) as f:
        torch.save(state, f)


def reshard(checkpoint_dir: str, output_dir: str, new_tp: int, tag: Optional[str] = None, force: bool = False,
            progress: bool = True, pad_to_multiple_of: Optional[int] = None, config: Optional[str] = None, *,
            verify: bool = True) -> str:
    """Write a complete sharded checkpoint at tensor parallel degree ``new_tp``; return its tag directory. Each tensor
    is padded again by its own rule (``pad_to_multiple_of`` replaces the vocabulary's multiple); optimizer state
    keyed by name is resharded, keyed by index dropped with a warning; RNG states are kept only at the same degree;
    ``reshard.json`` records what was done. Other arguments as for ``merge``."""
    check_reshard_arguments(new_tp, pad_to_multiple_of)
    tag_dir, index, model_files = choose_source(checkpoint_dir, tag, output_dir, force, verify,
                                                 lambda tag_dir, index: sorted(index.files or {}))
    try:
        return reshard_source(tag_dir, index, tag_model_source(index, model_files), output_dir, new_tp,
                              progress=progress, pad_to_multiple_of=pad_to_multiple_of, config=config)
    finally:
        model_files.clear()


def reshard_source(tag_dir: str, index: CheckpointIndex, model_source: TensorSource, output_dir: str, new_tp: int, *,
                   progress: bool = True, pad_to_multiple_of: Optional[int] = None, config: Optional[str] = None,
                   open_file: Optional[Callable[[str], Any]] = None,
                   optimizer_source: Optional[TensorSource] = None, source: Optional[str] = None) -> str:
    """``reshard`` of a source already chosen and checked: ``tag_dir`` with its ``index`` and its model tensors as a
    ``TensorSource``. A converter gives a checkpoint that is not on disk as ``model_source``, ``open_file`` (an
    optimizer rank file's name -> a reader like ``SafetensorsFileReader``) and ``optimizer_source``, with only the
    JSON files in ``tag_dir``; ``source`` is what ``reshard.json`` names."""
    check_reshard_arguments(new_tp, pad_to_multiple_of)
    config_path = config_source(tag_dir, config)
    multiple, multiple_source = _pad_multiple(index, pad_to_multiple_of)
    new_entries = _resharded_entries(index, new_tp, pad_to_multiple_of)
    job = _ReshardJob(tag_dir=tag_dir, index=index, new_tp=new_tp, new_entries=new_entries, model_source=model_source,
                      config_path=config_path, multiple=multiple, multiple_source=multiple_source, progress=progress,
                      open_file=open_file or rank_file_opener(tag_dir), optimizer_source=optimizer_source,
                      source=source or os.path.abspath(tag_dir))
    try:
        job.plan_optimizer()
        job.plan_rng()
        write_atomically(output_dir, job.write)
    finally:
        job.optim_files.clear()
    return os.path.join(output_dir, job.tag_name)


def check_reshard_arguments(new_tp: Any, pad_to_multiple_of: Any) -> None:
    """Refuse a TP size or vocabulary multiple that is not an integer >= 1 (a bool neither), naming it."""
    if isinstance(new_tp, bool) or not isinstance(new_tp, int) or new_tp < 1:
        raise ValueError(f"new tensor parallel size {new_tp!r} must be an integer >= 1")
    if pad_to_multiple_of is not None and (isinstance(pad_to_multiple_of, bool)
                                           or not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1):
        raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of!r} must be an integer >= 1")


def _resharded_entries(index: CheckpointIndex, new_tp: int, pad_to_multiple_of: Optional[int]
                       ) -> Dict[str, TensorEntry]:
    """The source's index entries with each spec moved to ``new_tp`` (and padded again by its rule)."""
    return {key: TensorEntry(dtype=e.dtype, spec=_new_spec(key, e.spec, new_tp, pad_to_multiple_of),
                             aliases=list(e.aliases))
            for key, e in index.tensors.items()}


@dataclasses.dataclass
class _ReshardJob:
    """One reshard: the source and what its tensors become, the optimizer and RNG plans, all decided before ``write``
    writes the new tag into ``write_atomically``'s staging directory."""

    tag_dir: str
    index: CheckpointIndex
    new_tp: int
    new_entries: Dict[str, TensorEntry]
    model_source: TensorSource
    config_path: Optional[str]
    multiple: int
    multiple_source: str
    progress: bool
    open_file: Callable[[str], Any]  # an optimizer rank file's name -> its reader
    optimizer_source: Optional[TensorSource]  # None: the optimizer's rank files
    source: str  # what reshard.json names as the source
    optimizer_plan: Any = None  # None: no optimizer state is written
    optim_files: Dict[str, Any] = dataclasses.field(default_factory=dict)
    copy_rng: bool = False
    notes: List[str] = dataclasses.field(default_factory=list)  # what was dropped and why, for reshard.json

    @property
    def tag_name(self) -> str:
        return os.path.basename(os.path.normpath(self.tag_dir))

    @property
    def old_tp(self) -> int:
        return self.index.tensor_model_parallel_size

    def plan_optimizer(self) -> None:
        """Plan the optimizer state's reshard, or drop it with a warning (and a note) saying why it cannot be."""
        if self.index.optimizer is None:
            return
        self.optimizer_plan, self.optim_files, why_not = plan_optimizer(self.tag_dir, self.index, self.open_file)
        if self.optimizer_plan is None:
            message = f"{self.tag_dir}: optimizer state dropped: {why_not}"
            warnings.warn(message, stacklevel=3)  # attributed to reshard's caller
            self.notes.append(message)

    def plan_rng(self) -> None:
        """Copy the RNG states at the same degree; otherwise drop them with a note (a TP rank's tracker state has no
        counterpart at another degree)."""
        rng_dir = os.path.join(self.tag_dir, "rng")
        self.copy_rng = self.new_tp == self.old_tp and os.path.isdir(rng_dir)
        if os.path.isdir(rng_dir) and not self.copy_rng:
            self.notes.append(f"RNG states (rng/) dropped: they belong to tensor_model_parallel_size={self.old_tp}; "
                              f"resume with restore_rng_states=False")

    def write(self, staging: str) -> str:
        """Write the new tag (and ``newest``) into ``staging``; return the tag's name."""
        new_tag_dir = os.path.join(staging, self.tag_name)
        os.makedirs(new_tag_dir)
        files, contents = self._write_rank_files(new_tag_dir)
        for relative in self._copied_files():
            if os.path.isfile(os.path.join(self.tag_dir, relative)):
                files[relative] = copy_durably(os.path.join(self.tag_dir, relative),
                                               os.path.join(new_tag_dir, relative))
        if self.config_path is not None:
            files[CONFIG_FILE] = copy_durably(self.config_path, os.path.join(new_tag_dir, CONFIG_FILE))
        files[RESHARD_FILE] = self._write_reshard_record(new_tag_dir)
        tags.mark_done(new_tag_dir, self._new_index(files, contents).write(new_tag_dir))
        tags.set_newest(staging, self.tag_name)
        # A Hugging Face Trainer checkpoint (checkpoint-N) keeps its state beside the tag: with it, Trainer resumes
        # from the resharded directory. Its per-process RNG files belong to the old layout and stay behind.
        trainer_state = os.path.join(os.path.dirname(os.path.normpath(self.tag_dir)), HF_TRAINER_STATE_FILE)
        if os.path.isfile(trainer_state):
            copy_durably(trainer_state, os.path.join(staging, HF_TRAINER_STATE_FILE))
        return self.tag_name

    def _write_rank_files(self, new_tag_dir: str) -> Tuple[Dict[str, dict], Dict[str, dict]]:
        """Write the model's and optimizer's rank files at the new degree; return their file records and header and
        tensor records."""
        total = len(self.new_entries) + sum(len(fields) for _, (_, fields) in self.optimizer_plan or [])
        with progress_bar(total, f"reshard {self.tag_name} tp {self.old_tp}->{self.new_tp}", self.progress) as bar:
            writers = _reshard_model(new_tag_dir, self.new_entries, self.model_source, self.new_tp, bar)
            if self.optimizer_plan is not None:
                writers += _reshard_optimizer(new_tag_dir, self.index, self.new_entries, self.optimizer_plan,
                                              self.optim_files, self.new_tp, bar, self.optimizer_source)
        files: Dict[str, dict] = {}
        contents: Dict[str, dict] = {}
        for writer in writers:
            relative = os.path.relpath(writer.path, new_tag_dir)
            files[relative], contents[relative] = writer.record(), writer.contents_record()
        return files, contents

    def _copied_files(self) -> List[str]:
        """The source's files that go to the new tag as they are (those that exist), relative to the tag."""
        copies = [TRAINER_STATE_FILE] + ([OPTIMIZER_STATE_FILE] if self.optimizer_plan is not None else [])
        if self.copy_rng:
            rng_dir = os.path.join(self.tag_dir, "rng")
            copies += sorted(os.path.relpath(os.path.join(rng_dir, name), self.tag_dir) for name in os.listdir(rng_dir))
        return copies

    def _write_reshard_record(self, new_tag_dir: str) -> dict:
        """``reshard.json``: where the tag came from, the padding multiple used and why, and what was dropped."""
        return write_bytes_durably(os.path.join(new_tag_dir, RESHARD_FILE), json.dumps(
            {"source": self.source, "source_tensor_model_parallel_size": self.old_tp,
             "tensor_model_parallel_size": self.new_tp, "pad_to_multiple_of": self.multiple,
             "pad_to_multiple_of_source": self.multiple_source, "notes": self.notes}, indent=1).encode())

    def _new_index(self, files: Dict[str, dict], contents: Dict[str, dict]) -> CheckpointIndex:
        optimizer = (_new_optimizer_index(self.index.optimizer, self.new_entries, self.optimizer_plan)
                     if self.optimizer_plan is not None else None)
        return CheckpointIndex(tensor_model_parallel_size=self.new_tp, data_parallel_size=self.index.data_parallel_size,
                               tensors=self.new_entries, optimizer=optimizer, nxdtp_version=__version__,
                               files=dict(sorted(files.items())), tensor_checksums=dict(sorted(contents.items())))


# ---- the tag's tensors as a pipeline source -------------------------------------------------------------------------

def tag_model_source(index: CheckpointIndex, model_files: Dict[str, Any], slab_bytes: Optional[int] = None
                     ) -> TagSource:
    """The model tensors of a tag (its open rank files) as a ``TensorSource``."""
    tp = index.tensor_model_parallel_size
    return TagSource(model_files, {key: (entry.spec, dtype_from_name(entry.dtype), entry.files(tp))
                                   for key, entry in index.tensors.items()}, slab_bytes)


# ---- resharding ------------------------------------------------------------------------------------------------------

def _pad_multiple(index: CheckpointIndex, explicit: Optional[int]) -> Tuple[int, str]:
    """The vocabulary multiple of the reshard, and where it comes from (for ``reshard.json``)."""
    if explicit is not None:
        return explicit, "argument"
    recorded = sorted({e.spec.pad_to_multiple_of for e in index.tensors.values() if e.spec.vocabulary})
    if recorded:
        return recorded[0], "recorded in the source's index"
    return 1, "default (the source records no vocabulary padding)"


def _new_spec(key: str, spec: ParamSpec, new_tp: int, explicit_multiple: Optional[int]) -> ParamSpec:
    """The tensor's spec at ``new_tp`` by its own padding record; an explicit ``pad_to_multiple_of`` replaces a
    vocabulary's recorded multiple only."""
    if spec.vocabulary and spec.pad_to_multiple_of is not None and explicit_multiple is not None:
        spec = dataclasses.replace(spec, pad_to_multiple_of=explicit_multiple)
    try:
        return spec.at_degree(new_tp)
    except ValueError as e:
        raise ValueError(f"'{key}': {e}") from None


def _reshard_model(new_tag_dir: str, new_entries: Dict[str, TensorEntry], source: TensorSource, new_tp: int,
                   bar) -> List[StreamingSafetensorsWriter]:
    layouts: List[List[Tuple[str, torch.dtype, Tuple[int, ...]]]] = [[] for _ in range(new_tp)]
    for key, entry in new_entries.items():
        for rank in range(new_tp):
            if entry.spec.is_sharded or rank == 0:  # a replicated tensor lives in rank 0's file
                layouts[rank].append((key, dtype_from_name(entry.dtype), entry.spec.local_shape()))
    with _open_writers([os.path.join(new_tag_dir, model_file(r)) for r in range(new_tp)], layouts) as writers:
        stream(source, RankFilesSink(writers, {key: entry.spec for key, entry in new_entries.items()}), new_entries,
               bar=bar)
    return writers  # completed: their records are ready


@contextlib.contextmanager
def _open_writers(paths: List[str], layouts) -> Iterator[List[StreamingSafetensorsWriter]]:
    """One writer per path, completed on a normal exit; on an error closed without completing, so no file passes for a
    whole one."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(StreamingSafetensorsWriter(path, layout)) for path, layout in zip(paths, layouts)]


def _optimizer_params(tag_dir: str, index: CheckpointIndex):
    """The optimizer's per-parameter records, the model key of every parameter name, and why they cannot be resharded
    (None if they can)."""
    primary = owners_by_name(index.tensors)
    params = index.optimizer.get("params", {})
    unknown = [name for name in params if name not in primary]
    fused = [name for name in unknown if "fused_parts" in params[name]]
    if fused:
        # ZeRO-1 flat shards of a fused parameter mix its parts' rows, which the parts' specs do not lay out.
        parts = [part for part, _ in params[fused[0]]["fused_parts"]]
        raise ValueError(f"{tag_dir}: the ZeRO-1 optimizer state of the fused parameter '{fused[0]}' (parts {parts}) "
                         "is flat shards of its rows, which no model tensor of the checkpoint lays out: it cannot be "
                         "merged, resharded or exported. It resumes at tensor_model_parallel_size="
                         f"{index.tensor_model_parallel_size}; to move it, load the checkpoint into a plain "
                         "(non-ZeRO) optimizer with nxdtp.checkpointing.load and save again (a plain optimizer's "
                         "state is saved as the parts'), or merge the model alone (--no-optimizer)")
    if unknown:
        return primary, params, f"its parameters {unknown[:3]} are not tensors of the model index"
    state_path = os.path.join(tag_dir, OPTIMIZER_STATE_FILE)
    if not os.path.isfile(state_path):
        raise FileNotFoundError(f"checkpoint file {state_path} is missing")
    return primary, params, None


def plan_optimizer(tag_dir: str, index: CheckpointIndex, open_file: Optional[Callable[[str], Any]] = None):
    """How the tag's optimizer state keyed by name is laid out: ``[(param name, (model key, [(field, kind, shape,
    dtype)]))]``, the open rank files, or ``(None, {}, why not)``. kind is "shard" (split like its sharded
    parameter), "replicate" (whole like its replicated parameter), "flat" (ZeRO-1 flat shards, masters included) or
    "copy" (e.g. 'step': rank 0's value). A damaged index or rank file raises."""
    try:
        return _plan_optimizer(tag_dir, index, open_file or rank_file_opener(tag_dir))
    except (KeyError, TypeError, AttributeError) as e:  # the index's optimizer part is not what save writes
        raise ValueError(f"{os.path.join(tag_dir, INDEX_FILE)} is damaged: malformed optimizer entry {e}") from None


def _plan_optimizer(tag_dir: str, index: CheckpointIndex, open_file: Callable[[str], Any]):
    info, zero1 = index.optimizer, is_zero1_optimizer_index(index.optimizer)
    if not isinstance(info, dict) or info.get("keyed_by") != "name":
        return None, {}, (f"it is {'ZeRO-1 state ' if zero1 else ''}keyed by parameter index (saved from "
                          "optimizer.state_dict() rather than a live optimizer and model), so it cannot be matched to "
                          "the parameters it belongs to")
    primary, params, why_not = _optimizer_params(tag_dir, index)
    if why_not:
        return None, {}, why_not
    files = optimizer_rank_files(info, index.tensor_model_parallel_size)
    handles = {relative: open_file(relative) for relative in files.values()}
    first = handles[files[(0, 0)]]
    plan = []
    for name, fields in params.items():
        spec = index.tensors[primary[name]].spec
        flat = _zero1_layout(tag_dir, name, fields, spec, info) if zero1 else None
        per_field = []
        for field in list(fields["tensors"]) + ([fields["master"]] if zero1 else []):
            key = f"{name}/{field}"
            if key not in first.keys():
                raise ValueError(f"checkpoint file {os.path.join(tag_dir, files[(0, 0)])} lacks '{key}', which the "
                                 "index lists")
            shape = tuple(first.get_slice(key).get_shape())
            if zero1:
                kind = "flat" if field == fields["master"] or field in fields["flat"] else "copy"
            elif spec.is_sharded:
                kind = "shard" if shape == spec.local_shape() else "copy"
            else:
                kind = "replicate" if shape == tuple(spec.full_shape) else "copy"
            if kind in ("shard", "flat"):  # every rank file holds a piece of its own
                for relative in files.values():
                    check_piece(handles[relative], os.path.join(tag_dir, relative), key,
                                (flat.shard_numel,) if flat else spec.local_shape())
            per_field.append((field, kind, shape, first.dtype(key)))
        plan.append((name, (primary[name], per_field)))
    return plan, handles, None


def _zero1_layout(tag_dir: str, name: str, fields: Dict[str, Any], spec: ParamSpec, info: Dict[str, Any]
                  ) -> FlatShardLayout:
    """The flat layout of a parameter's ZeRO-1 state, checked against its model tensor's local shape and the sharding
    group size."""
    layout, dp = FlatShardLayout.from_dict(fields["layout"]), zero1_group_size(info)
    if tuple(layout.shape) != tuple(spec.local_shape()) or layout.group_size != dp:
        raise ValueError(f"{os.path.join(tag_dir, INDEX_FILE)}: the ZeRO-1 state of '{name}' is cut as "
                         f"{fields['layout']}, but its model tensor's local shape is {list(spec.local_shape())} and "
                         f"the sharding group size {dp}")
    return layout


def _reshard_optimizer(new_tag_dir: str, index: CheckpointIndex, new_entries: Dict[str, TensorEntry], plan,
                       handles: Dict[str, Any], new_tp: int, bar, source: Optional[TensorSource] = None
                       ) -> List[StreamingSafetensorsWriter]:
    """Write the optimizer's rank files at ``new_tp``: state shaped like its parameter streamed into a ``RankFilesSink``
    (plain) or ``Zero1Sink`` (ZeRO-1, same DP size); other state is rank 0's value."""
    zero1 = is_zero1_optimizer_index(index.optimizer)
    dp = zero1_group_size(index.optimizer)
    new_files = optimizer_rank_files(index.optimizer, new_tp)
    first = handles[new_files[(0, 0)]]
    fields = {f"{name}/{field}": (new_entries[key].spec, kind, shape, dtype)
              for name, (key, fields) in plan for field, kind, shape, dtype in fields}
    stored = {"copy": lambda spec, shape: shape, "replicate": lambda spec, shape: shape,
              "shard": lambda spec, shape: spec.local_shape(),
              "flat": lambda spec, shape: (FlatShardLayout(spec.local_shape(), dp).shard_numel,)}
    layout = [(key, dtype, stored[kind](spec, shape)) for key, (spec, kind, shape, dtype) in fields.items()]
    paths = [os.path.join(new_tag_dir, relative) for relative in new_files.values()]
    with _open_writers(paths, [layout] * len(paths)) as writers:
        specs = {key: spec for key, (spec, _, _, _) in fields.items()}
        sink = Zero1Sink(dict(zip(new_files, writers)), specs, dp) if zero1 else RankFilesSink(writers, specs, True)
        source = source or tag_optimizer_source(index, plan, handles)
        for key, (_, kind, _, _) in fields.items():
            if kind == "copy":
                value = first.get_tensor(key)
                for writer in writers:
                    writer.write(key, value)
            else:
                stream(source, sink, [key])
            bar.update(1)
    return writers  # completed: their records are ready


class Zero1Sink:
    """ZeRO-1 rank files (``writers[(tp rank, dp rank)]``): each new TP piece cut into flat shards over ``dp`` ranks."""

    def __init__(self, writers: Dict[Tuple[int, int], Any], specs: Dict[str, ParamSpec], dp: int):
        self.writers, self.specs, self.dp = writers, specs, dp

    def write(self, key: str, shape: Tuple[int, ...], dtype: torch.dtype, read_boxes, slab_bytes: int) -> None:
        spec = self.specs[key]
        full = spec.full_from_dense(read_boxes([((0,) * len(shape), shape)])[0].to(dtype))
        flat = FlatShardLayout(spec.local_shape(), self.dp)
        for rank in sorted({tp_rank for tp_rank, _ in self.writers}):
            piece = spec.piece_of_full(full, rank, own=False)
            for k in range(self.dp):
                self.writers[(rank, k)].write(key, flat.shard_of(piece, k))


def tag_optimizer_source(index: CheckpointIndex, plan, handles: Dict[str, Any], slab_bytes: Optional[int] = None
                         ) -> TagSource:
    """The optimizer's tensors (``name/field``) as a ``TagSource`` of its rank files; a ZeRO-1 TP piece is built whole
    from its DP shards."""
    tp = index.tensor_model_parallel_size
    files = optimizer_rank_files(index.optimizer, tp)
    layout, flat = {}, {}
    for name, (key, fields) in plan:
        for field, kind, shape, dtype in fields:
            spec = ParamSpec(full_shape=shape) if kind == "copy" else index.tensors[key].spec
            layout[f"{name}/{field}"] = (spec, dtype, [files[(rank, 0)] for rank in range(tp)])
            if kind == "flat":
                flat[f"{name}/{field}"] = FlatShardLayout.from_dict(index.optimizer["params"][name]["layout"])
    if not is_zero1_optimizer_index(index.optimizer):
        return TagSource(handles, layout, slab_bytes)

    def joined_shards(key: str, rank: int) -> torch.Tensor:
        if key not in flat:  # 'step': the same in every file
            return handles[files[(rank, 0)]].get_tensor(key)
        return flat[key].full_from_shards([handles[files[(rank, k)]].get_tensor(key)
                                           for k in range(flat[key].group_size)])

    return TagSource(handles, layout, slab_bytes, build_piece=joined_shards)


def _new_optimizer_index(optimizer: Dict[str, Any], new_entries: Dict[str, TensorEntry], plan) -> Dict[str, Any]:
    """A resharded tag's optimizer index: ZeRO-1 entries get their new shape, layout and spec; plain state's is
    unchanged."""
    if not is_zero1_optimizer_index(optimizer):
        return optimizer
    keys = dict((name, key) for name, (key, _) in plan)
    dp = zero1_group_size(optimizer)
    params = {}
    for name, info in optimizer["params"].items():
        spec = new_entries[keys[name]].spec
        layout = FlatShardLayout(spec.local_shape(), dp)
        params[name] = {**info, "shape": list(layout.shape), "layout": layout.to_dict(), "spec": spec.to_dict()}
    return {**optimizer, "params": params}


# ---- the dense model's optimizer state (a plain merge writes it beside the model) --------------------------------

@dataclasses.dataclass
class DenseOptimizerTensor:
    """One tensor of the dense model's optimizer state: ``read()`` gives it whole; state shaped like its parameter also
    has ``spec`` and ``read_piece(tp_rank)``; ``read_parts()``, where given, yields it in row ranges to stream."""
    shape: Tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[], torch.Tensor]
    spec: Optional[ParamSpec] = None
    read_piece: Optional[Callable[[int], torch.Tensor]] = None
    read_parts: Optional[Callable[[], Iterable[torch.Tensor]]] = None

    @classmethod
    def of_source(cls, source: TensorSource, key: str, pieces: bool = False, parts: bool = True
                  ) -> "DenseOptimizerTensor":
        """Tensor ``key`` of a pipeline source; with ``pieces`` its spec and TP pieces (a ``TagSource``'s), with
        ``parts`` its slabs of rows."""
        spec, dtype, read_boxes = source.spec(key), source.dtype(key), partial(source.read_boxes, key)
        shape = tuple(spec.unpadded_shape)
        return cls(shape=shape, dtype=dtype, read=lambda: read_boxes([((0,) * len(shape), shape)])[0].contiguous(),
                   spec=spec if pieces else None, read_piece=partial(source.piece, key) if pieces else None,
                   read_parts=partial(dense_slabs, read_boxes, shape, rows_within(source.slab_bytes, shape, dtype))
                   if parts and shape else None)


def files_read(index: CheckpointIndex, config: Optional[str], optimizer: bool = True) -> List[str]:
    """The files of a tag that a merge or an export reads: the model's, its own config.json unless ``config``
    replaces it, and the optimizer's."""
    own_config = [CONFIG_FILE] if config is None and CONFIG_FILE in (index.files or {}) else []
    return model_file_names(index) + own_config + (optimizer_file_names(index) if optimizer else [])


def optimizer_file_names(index: CheckpointIndex) -> List[str]:
    """The tag's optimizer files: the rank files and the JSON part."""
    if index.optimizer is None:
        return []
    names = list(optimizer_rank_files(index.optimizer, index.tensor_model_parallel_size).values())
    return [name for name in names + [OPTIMIZER_STATE_FILE] if index.files is None or name in index.files]


def optimizer_values(tag_dir: str) -> Dict[str, Any]:
    """The non-tensor optimizer state under torch's flattened keys (``state.<param>.<field>``,
    ``param_groups.<param>.<hyperparameter>``)."""
    saved = read_json(os.path.join(tag_dir, OPTIMIZER_STATE_FILE))
    values: Dict[str, Any] = {}
    for name, fields in saved.get("scalars", {}).items():
        for field, value in fields.items():
            values[f"state.{name}.{field}"] = value
    for group in saved["param_groups"]:
        for name in group["params"]:
            for field, value in group.items():
                if field != "params":
                    values[f"param_groups.{name}.{field}"] = value
    return values


def dense_optimizer_state(tag_dir: str, index: CheckpointIndex):
    """The dense model's optimizer state, ``{flattened key: DenseOptimizerTensor or value}``, and the open files; or
    ``(None, {}, why not)``."""
    zero1 = is_zero1_optimizer_index(index.optimizer)
    plan, handles, why_not = plan_optimizer(tag_dir, index)
    if plan is None:
        return None, {}, why_not
    source = tag_optimizer_source(index, plan, handles)
    state: Dict[str, Any] = {}
    for name, (_, fields) in plan:
        master = index.optimizer["params"][name].get("master") if zero1 else None
        for field, kind, _, _ in fields:
            key = f"{name}/{field}"
            flat_key = f"{MASTER_PREFIX}{name}" if field == master else f"state.{name}.{field}"
            # 'step' and other state not shaped like the parameter is TP rank 0's value; plain state is stored as
            # its parameter, so it is read in slabs of piece rows (a ZeRO-1 piece is built whole).
            state[flat_key] = DenseOptimizerTensor.of_source(source, key, pieces=kind != "copy", parts=not zero1)
    state.update(optimizer_values(tag_dir))
    return state, handles, None


def read_trainer_state(tag_dir: str) -> Optional[dict]:
    """The tag's trainer state (the step, the scheduler's state), or None when it has none."""
    if not os.path.isfile(os.path.join(tag_dir, TRAINER_STATE_FILE)):
        return None
    return read_json(os.path.join(tag_dir, TRAINER_STATE_FILE))


def write_dense_optimizer(directory: str, state: Dict[str, Any], source_kind: str, trainer_state: Optional[dict],
                          progress: bool) -> None:
    """Write ``optimizer.safetensors`` (tensors, one at a time) and ``optimizer.json`` (the other values, the source
    kind and the trainer state) into ``directory``."""
    tensors = {key: value for key, value in state.items() if isinstance(value, DenseOptimizerTensor)}
    with progress_bar(len(tensors), "optimizer", progress) as bar:
        layout = [(key, t.dtype, t.shape) for key, t in tensors.items()]
        with StreamingSafetensorsWriter(os.path.join(directory, DENSE_OPTIMIZER_TENSORS), layout,
                                        metadata={"format": "pt"}) as writer:
            for key, t in tensors.items():
                if t.read_parts is not None:
                    writer.write_parts(key, t.read_parts())
                else:
                    writer.write(key, t.read())
                bar.update(1)
    record = {"format": DENSE_OPTIMIZER_FORMAT, "nxdtp_version": __version__, "source_kind": source_kind,
              "values": {key: value for key, value in state.items() if key not in tensors},
              "trainer_state": trainer_state}
    write_bytes_durably(os.path.join(directory, DENSE_OPTIMIZER_VALUES), json.dumps(record, indent=1).encode())
