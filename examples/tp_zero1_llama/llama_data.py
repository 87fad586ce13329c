"""Tokenized, packed causal-LM data for the Llama example, read per data-parallel rank.

Two on-disk forms hold the same table, one row per packed block of ``seq_len`` token ids, with the columns
``input_ids`` (required), ``labels`` (optional; NxD's ``get_dataset.py`` writes a copy of ``input_ids``, and when it
is missing the input ids are used) and ``attention_mask`` (optional; all ones for packed blocks):

* **NxD's form**: a Hugging Face ``datasets`` directory written by ``Dataset.save_to_disk`` (``state.json``,
  ``dataset_info.json``, ``data-*.arrow``), which NxD's ``get_dataset.py`` produces. Reading it needs the
  ``datasets`` package (``pip install datasets``), which brings pyarrow and pandas (about 250 MB), so it is not one
  of the example's dependencies.
* **the light form**: one ``packed_blocks.safetensors`` file whose tensors are the columns ([rows, seq_len] integer
  tensors) and whose header metadata says ``"format": "nxdtp-packed-causal-lm"``. safetensors is already an nxdtp
  dependency; rows are read lazily (memory-mapped), so the file may be larger than memory.

``build_llama_data.py`` writes either form (synthetic blocks, or NxD's form converted to the light one).

The order is NxD's: ``DistributedSampler(shuffle=False, drop_last=True)`` over the rows, then micro-batches of
``batch_size`` rows in order, epoch after epoch. Rank ``r`` of ``dp`` takes rows ``r, r + dp, r + 2 dp, ...``, so the
k-th micro-batches of all ranks together are rows ``[k G, (k + 1) G)`` with ``G = batch_size * dp``: every layout with
the same global micro-batch trains on the same rows at the same step, and a resumed run skips to where it stopped.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Dict, Iterator, List, Optional

import torch

from nxdtp.errors import DamagedInputError

LIGHT_FILE = "packed_blocks.safetensors"
LIGHT_FORMAT = "nxdtp-packed-causal-lm"
COLUMNS = ("input_ids", "labels", "attention_mask")
IGNORE_INDEX = -100
SAFETENSORS_INTEGERS = ("I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64")


class DataError(DamagedInputError):
    """Data that cannot be used: the message names the directory, file, column or row and what would be valid."""


class PackedBlocks:
    """Random access to the rows of one dataset directory: ``rows(indices)`` gives a dict of [n, seq_len] int64
    tensors with ``input_ids``, ``labels`` and, when the data has it, ``attention_mask``."""

    def __init__(self, data_dir: str):
        self.data_dir = data_dir
        directory = os.path.expanduser(data_dir)
        if not os.path.exists(directory):
            raise DataError(f"--data_dir {data_dir} does not exist; build one with "
                            "examples/tp_zero1_llama/build_llama_data.py (or NxD's get_dataset.py)")
        if not os.path.isdir(directory):
            raise DataError(f"--data_dir {data_dir} is not a directory")
        self.directory = directory
        if os.path.isfile(os.path.join(directory, LIGHT_FILE)):
            self.form = "safetensors"
            self._open_light()
        elif glob.glob(os.path.join(directory, "*.arrow")) or os.path.isfile(os.path.join(directory, "state.json")):
            self.form = "datasets"
            self._open_hf()
        elif os.path.isfile(os.path.join(directory, "dataset_dict.json")):
            splits = sorted(d for d in os.listdir(directory) if os.path.isdir(os.path.join(directory, d)))
            raise DataError(f"--data_dir {data_dir} is a DatasetDict (splits {splits}); give the training split's "
                            f"directory, e.g. {os.path.join(data_dir, 'train')}")
        else:
            names = sorted(os.listdir(directory))[:5]
            raise DataError(f"--data_dir {data_dir} holds neither {LIGHT_FILE} nor a Hugging Face datasets "
                            f"save_to_disk directory (state.json, data-*.arrow); it has {names or 'nothing'}")
        if self.num_rows == 0:
            raise DataError(f"--data_dir {data_dir} has no rows")

    # ---- the two forms ---------------------------------------------------------------------------------------------

    def _open_light(self) -> None:
        from safetensors import SafetensorError, safe_open

        path = os.path.join(self.directory, LIGHT_FILE)
        try:
            self._file = safe_open(path, framework="pt")
            metadata = self._file.metadata() or {}
            keys = set(self._file.keys())
        except (SafetensorError, OSError, ValueError) as error:
            raise DataError(f"{path} is not a readable safetensors file: {error}") from None
        if metadata.get("format") != LIGHT_FORMAT:
            raise DataError(f"{path}: its metadata says format {metadata.get('format')!r}, not {LIGHT_FORMAT!r}")
        self.columns = [c for c in COLUMNS if c in keys]
        if "input_ids" not in keys:
            raise DataError(f"{path} has no input_ids tensor (it has {sorted(keys)})")
        shapes = {c: tuple(self._file.get_slice(c).get_shape()) for c in self.columns}
        dtypes = {c: self._file.get_slice(c).get_dtype() for c in self.columns}
        self._check_shapes(path, shapes, dtypes)
        self._path = path

    def _open_hf(self) -> None:
        try:
            import datasets
        except ImportError:
            raise DataError(f"--data_dir {self.data_dir} is a Hugging Face datasets directory (NxD's get_dataset.py "
                            "output); reading it needs the datasets package: pip install datasets (or convert it "
                            "once elsewhere with build_llama_data.py --from_hf_dataset)") from None
        try:
            table = datasets.load_from_disk(self.directory)
        except Exception as error:  # datasets raises many kinds (FileNotFoundError, ArrowInvalid, JSONDecodeError)
            raise DataError(f"--data_dir {self.data_dir}: datasets.load_from_disk failed: "
                            f"{type(error).__name__}: {error}") from None
        if isinstance(table, datasets.DatasetDict):
            raise DataError(f"--data_dir {self.data_dir} is a DatasetDict (splits {list(table)}); give the "
                            "training split's directory")
        if "input_ids" not in table.column_names:
            raise DataError(f"--data_dir {self.data_dir}: the dataset has no input_ids column "
                            f"(columns {table.column_names})")
        self.columns = [c for c in COLUMNS if c in table.column_names]
        self._table = table.with_format("torch", columns=self.columns)
        first = self._table[0]
        shapes = {c: (len(table),) + tuple(first[c].shape) for c in self.columns}
        dtypes = {c: str(first[c].dtype) for c in self.columns}
        self._check_shapes(self.data_dir, shapes, dtypes)

    def _check_shapes(self, where: str, shapes: Dict[str, tuple], dtypes: Dict[str, str]) -> None:
        for column, shape in shapes.items():
            if len(shape) != 2:
                raise DataError(f"{where}: column {column} has shape {list(shape)}; packed blocks are "
                                "[rows, seq_len] (every row the same length)")
            if "int" not in dtypes[column].lower() and dtypes[column].upper() not in SAFETENSORS_INTEGERS:
                raise DataError(f"{where}: column {column} holds {dtypes[column]}, not integers")
        if len(set(shapes.values())) != 1:
            raise DataError(f"{where}: the columns' shapes differ: {shapes}")
        self.num_rows, self.seq_len = shapes["input_ids"]
        if self.seq_len < 2:
            raise DataError(f"{where}: blocks of {self.seq_len} token(s) give no next-token target")

    def rows(self, indices: List[int]) -> Dict[str, torch.Tensor]:
        if self.form == "safetensors":
            # Contiguous runs are the common case (each DP rank reads every dp-th row): read row by row via slices.
            out = {c: torch.stack([self._file.get_slice(c)[i:i + 1][0] for i in indices]).long()
                   for c in self.columns}
        else:
            batch = self._table[list(indices)]
            out = {c: torch.as_tensor(batch[c]).long() for c in self.columns}
            if out["input_ids"].dim() != 2:
                raise DataError(f"--data_dir {self.data_dir}: rows {indices[:3]}... are not all {self.seq_len} "
                                "tokens long (packed blocks must be)")
        if "labels" not in out:
            out["labels"] = out["input_ids"].clone()
        return out


class MicroBatches:
    """The micro-batches of one data-parallel rank, in NxD's order (see the module docstring), from micro-batch
    ``skip`` on, epoch after epoch. ``vocab_size`` is checked on every batch read: a token id the model cannot embed
    is a DataError naming the row, not an index error deep inside the embedding."""

    def __init__(self, data: PackedBlocks, batch_size: int, dp_size: int, dp_rank: int, vocab_size: int,
                 skip: int = 0):
        self.data, self.batch_size, self.dp_size, self.dp_rank = data, batch_size, dp_size, dp_rank
        self.vocab_size = vocab_size
        self.per_epoch = data.num_rows // (batch_size * dp_size)
        if self.per_epoch == 0:
            raise DataError(f"--data_dir {data.data_dir} has {data.num_rows} rows, fewer than one global micro-batch "
                            f"(--batch_size {batch_size} x {dp_size} data-parallel ranks)")
        self.position = skip

    def epoch_of(self, micro_batch: int) -> int:
        return micro_batch // self.per_epoch

    def indices(self, micro_batch: int) -> List[int]:
        k = micro_batch % self.per_epoch
        per_rank = range(k * self.batch_size, (k + 1) * self.batch_size)
        return [j * self.dp_size + self.dp_rank for j in per_rank]

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> Dict[str, torch.Tensor]:
        indices = self.indices(self.position)
        batch = self.data.rows(indices)
        ids = batch["input_ids"]
        bad = (ids < 0) | (ids >= self.vocab_size)
        if bad.any():
            row, column = (int(v) for v in bad.nonzero()[0])
            raise DataError(f"--data_dir {self.data.data_dir}: row {indices[row]} holds token id "
                            f"{int(ids[row, column])} at position {column}, outside the model's vocabulary "
                            f"[0, {self.vocab_size}) (the tokenizer and the model config disagree)")
        labels = batch["labels"]
        if ((labels != IGNORE_INDEX) & ((labels < 0) | (labels >= self.vocab_size))).any():
            raise DataError(f"--data_dir {self.data.data_dir}: rows {indices[:3]}... hold labels outside "
                            f"[0, {self.vocab_size}) that are not {IGNORE_INDEX}")
        self.position += 1
        return batch


def describe(data: PackedBlocks) -> str:
    return (f"{data.num_rows} blocks of {data.seq_len} tokens ({data.form} form, columns "
            f"{', '.join(data.columns)}) in {data.data_dir}")


def write_light(directory: str, columns: Dict[str, torch.Tensor], info: Optional[dict] = None) -> str:
    """Write the light form: ``columns`` are [rows, seq_len] integer tensors (``input_ids`` required)."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LIGHT_FILE)
    metadata = {"format": LIGHT_FORMAT, "version": "1"}
    if info:
        metadata["info"] = json.dumps(info)
    save_file({k: v.contiguous() for k, v in columns.items()}, path + ".tmp", metadata=metadata)
    os.replace(path + ".tmp", path)
    return path
