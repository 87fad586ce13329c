"""BERT pretraining data in the NVIDIA wikicorpus HDF5 format, read per data-parallel rank.

A shard file ``<name>_training_<i>.hdf5`` holds six integer datasets with one row per sequence (``KEYS``):
``input_ids``, ``input_mask``, ``segment_ids`` [N, seq], ``masked_lm_positions``, ``masked_lm_ids`` [N, P] and
``next_sentence_labels`` [N] (or [N, 1]). ``build_pretraining_data.py`` in this directory writes such files.

``PretrainingBatches`` walks all shard files epoch after epoch. The order of files and of rows depends only on the seed
and the epoch, and each rank takes every dp-th row of the same permutation (``DistributedSampler``). So the k-th
batches of all ranks together are the k-th batch of a dp=1 run with a dp times larger batch, and a resumed run
(``skip_batches``) sees exactly the batches that the interrupted run would have seen next.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import glob
import os
import random
from typing import Callable, Iterator

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

from nxdtp.errors import DamagedInputError

KEYS = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids", "next_sentence_labels")
SHARD_PATTERN = "*_training_*.hdf5"
IGNORE_INDEX = -100  # label of unmasked positions; torch.nn.CrossEntropyLoss and HF BERT ignore it


class DataError(DamagedInputError):
    """Pretraining data that cannot be used: the message names the file, key or value and what would be valid."""


def list_training_shards(data_dir: str, data_parallel_size: int) -> list[str]:
    """Sorted paths of the shard files in ``data_dir``; at least one per data-parallel rank."""
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
    directory = os.path.expanduser(data_dir)
    if not os.path.exists(directory):
        raise DataError(f"data_dir {data_dir} does not exist; build one with build_pretraining_data.py")
    if not os.path.isdir(directory):
        raise DataError(f"data_dir {data_dir} is not a directory")
    pattern = os.path.join(directory, SHARD_PATTERN)
    files = sorted(glob.glob(pattern))
    if not files:
        raise DataError(f"data_dir {data_dir} has no training shards: nothing matches {pattern}; "
                        f"{_describe_contents(directory)}")
    if len(files) < data_parallel_size:
        # Every rank needs files of its own: NxD's layout gives each rank a slice of every file, but a file list
        # shorter than the rank count almost always means the wrong directory or an unfinished build.
        raise DataError(f"data_dir {data_dir} holds {len(files)} training shard(s) but there are "
                        f"{data_parallel_size} data-parallel ranks; build the data with --num_shards at least "
                        f"{data_parallel_size}")
    return files


def _describe_contents(directory: str, shown: int = 5) -> str:
    names = sorted(os.listdir(directory))
    if not names:
        return "the directory is empty"
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return "it holds " + ", ".join(names[:shown]) + more


def count_rows(path: str) -> int:
    """Number of sequences in a shard, from the dataset shape only (no data is read)."""
    with _opened(path) as f:
        if "input_ids" not in f:
            raise DataError(f"{path}: missing dataset 'input_ids'; found keys {sorted(f.keys())}; "
                            f"a shard needs {list(KEYS)}")
        shape = f["input_ids"].shape
    if len(shape) != 2:
        raise DataError(f"{path}: 'input_ids' has shape {shape}; expected 2-D [sequences, seq_len]")
    return int(shape[0])


class PretrainingShard(Dataset):
    """One shard file, fully in memory (in the file's compact dtypes) and validated on load.

    Items are NxD's five int64 tensors: input_ids, segment_ids, input_mask, masked_lm_labels (``IGNORE_INDEX`` except
    at masked positions) and next_sentence_labels (0-dim).
    """

    def __init__(self, path: str, max_pred_len: int, seq_len: int | None = None, vocab_size: int | None = None):
        self.path = path
        arrays = _read_arrays(path)
        _validate(path, arrays, max_pred_len, seq_len, vocab_size)
        self.input_ids = arrays["input_ids"]
        self.input_mask = arrays["input_mask"]
        self.segment_ids = arrays["segment_ids"]
        self.masked_lm_positions = arrays["masked_lm_positions"]
        self.masked_lm_ids = arrays["masked_lm_ids"]
        self.next_sentence_labels = arrays["next_sentence_labels"].reshape(-1)
        self._num_masked = _count_masked(self.masked_lm_positions)

    @property
    def sequence_length(self) -> int:
        return int(self.input_ids.shape[1])

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def __getitem__(self, index: int) -> list[torch.Tensor]:
        return [t[0] for t in self.batch([index])]

    def batch(self, indices) -> list[torch.Tensor]:
        """The items at ``indices`` stacked along a new first dimension, built with one gather per array."""
        rows = np.asarray(indices, dtype=np.int64)
        labels = np.full((len(rows), self.sequence_length), IGNORE_INDEX, dtype=np.int64)
        for out_row, row in enumerate(rows):
            n = self._num_masked[row]
            labels[out_row, self.masked_lm_positions[row, :n]] = self.masked_lm_ids[row, :n]
        return [_long(self.input_ids[rows]), _long(self.segment_ids[rows]), _long(self.input_mask[rows]),
                torch.from_numpy(labels), _long(self.next_sentence_labels[rows])]


def _long(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array.astype(np.int64))


def _count_masked(positions: np.ndarray) -> np.ndarray:
    """Per row, how many entries come before the first 0: a 0 pads the positions list (position 0 is [CLS])."""
    is_padding = positions == 0
    first_zero = np.argmax(is_padding, axis=1)
    return np.where(is_padding.any(axis=1), first_zero, positions.shape[1])


@contextlib.contextmanager
def _opened(path: str) -> Iterator[h5py.File]:
    """The shard opened for reading; whatever h5py raises on a truncated or damaged file (OSError, KeyError,
    ValueError, RuntimeError, ... depending on which structure the damage hit) becomes one DataError naming it."""
    try:
        with h5py.File(path, "r") as f:
            yield f
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - h5py's error type depends on where the file is damaged
        raise DataError(f"{path}: cannot read as HDF5, truncated or damaged? ({type(e).__name__}: {e})") from e


def _read_arrays(path: str) -> dict[str, np.ndarray]:
    with _opened(path) as f:
        missing = [k for k in KEYS if k not in f]
        if missing:
            raise DataError(f"{path}: missing dataset '{missing[0]}'"
                            + (f" (and {missing[1:]})" if len(missing) > 1 else "")
                            + f"; found keys {sorted(f.keys())}; a shard needs {list(KEYS)}")
        not_datasets = [k for k in KEYS if not isinstance(f[k], h5py.Dataset)]
        if not_datasets:
            raise DataError(f"{path}: '{not_datasets[0]}' is a {type(f[not_datasets[0]]).__name__}, not a dataset")
        return {k: np.asarray(f[k][()]) for k in KEYS}


def _validate(path: str, a: dict[str, np.ndarray], max_pred_len: int, seq_len: int | None,
              vocab_size: int | None) -> None:
    for key in KEYS:
        if not np.issubdtype(a[key].dtype, np.integer):
            raise DataError(f"{path}: '{key}' has dtype {a[key].dtype}; expected an integer dtype")

    rows = {k: (a[k].shape[0] if a[k].ndim else None) for k in KEYS}
    if len(set(rows.values())) != 1:
        raise DataError(f"{path}: the datasets disagree on the number of sequences: {rows}")

    ids = a["input_ids"]
    if ids.ndim != 2:
        raise DataError(f"{path}: 'input_ids' has shape {ids.shape}; expected 2-D [sequences, seq_len]")
    for key in ("input_mask", "segment_ids"):
        if a[key].shape != ids.shape:
            raise DataError(f"{path}: '{key}' has shape {a[key].shape}; expected {ids.shape} like 'input_ids'")
    positions, lm_ids = a["masked_lm_positions"], a["masked_lm_ids"]
    if positions.ndim != 2:
        raise DataError(f"{path}: 'masked_lm_positions' has shape {positions.shape}; expected 2-D "
                        f"[sequences, max_pred_len]")
    if lm_ids.shape != positions.shape:
        raise DataError(f"{path}: 'masked_lm_ids' has shape {lm_ids.shape}; expected {positions.shape} like "
                        f"'masked_lm_positions'")
    nsp = a["next_sentence_labels"]
    if not (nsp.ndim == 1 or (nsp.ndim == 2 and nsp.shape[1] == 1)):
        raise DataError(f"{path}: 'next_sentence_labels' has shape {nsp.shape}; expected [{ids.shape[0]}] "
                        f"or [{ids.shape[0]}, 1]")
    if ids.shape[0] == 0:
        raise DataError(f"{path}: the shard holds no sequences")

    file_seq_len, file_pred_len = ids.shape[1], positions.shape[1]
    if file_pred_len > max_pred_len:
        raise DataError(f"{path}: up to {file_pred_len} masked positions per sequence (masked_lm_positions has "
                        f"P={file_pred_len} columns) but --max_pred_len is {max_pred_len}; "
                        f"use --max_pred_len {file_pred_len} or larger")
    if seq_len is not None and seq_len != file_seq_len:
        raise DataError(f"--seq_len {seq_len} does not match the sequence length {file_seq_len} of {path}")

    _check_range(path, "masked_lm_positions", positions, 0, file_seq_len,
                 f"positions must lie in [0, {file_seq_len}), the sequence length")
    _check_range(path, "next_sentence_labels", nsp, 0, 2, "labels must be 0 (B follows A) or 1 (random B)")
    for key in ("input_ids", "masked_lm_ids"):
        _check_range(path, key, a[key], 0, None, "token ids cannot be negative")
        if vocab_size is not None and a[key].size and int(a[key].max()) >= vocab_size:
            raise DataError(f"{path}: '{key}' holds token id {int(a[key].max())} (max id) but the vocab size is "
                            f"{vocab_size}; ids must be below it (wrong vocab, or data built for another model?)")


def _check_range(path: str, key: str, values: np.ndarray, low: int, high: int | None, rule: str) -> None:
    """Raise unless ``low <= values < high`` (no upper bound when ``high`` is None)."""
    if values.size == 0:
        return
    smallest, largest = int(values.min()), int(values.max())
    if smallest < low:
        raise DataError(f"{path}: '{key}' holds {smallest}; {rule}")
    if high is not None and largest >= high:
        raise DataError(f"{path}: '{key}' holds {largest}; {rule}")


class PretrainingBatches:
    """Micro-batches for one data-parallel rank over all shard files, epoch after epoch (infinite iterator).

    Epoch e visits the files in ``random.Random(seed + e)`` order; within a file, rank r takes batches of
    ``batch_size`` consecutive indices of ``DistributedSampler(seed=seed, epoch=e)`` and drops the incomplete last
    batch. The next file loads in a background thread while the current one is iterated, so at most two files are
    in memory. Each ``iter()`` starts afresh after ``skip_batches`` batches.
    """

    def __init__(self, files: list[str], batch_size: int, max_pred_len: int, data_parallel_size: int,
                 data_parallel_rank: int, seed: int, seq_len: int | None = None, vocab_size: int | None = None,
                 skip_batches: int = 0, log: Callable[[str], None] | None = None):
        if not files:
            raise DataError("no shard files given")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} is not in [0, {data_parallel_size})")
        if skip_batches < 0:
            raise ValueError(f"skip_batches must be >= 0, got {skip_batches}")
        # Sorting makes the order a function of the seed alone, however the caller listed the files.
        self.files = sorted(files)
        self.batch_size = batch_size
        self.max_pred_len = max_pred_len
        self.dp_size = data_parallel_size
        self.dp_rank = data_parallel_rank
        self.seed = seed
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.skip_batches = skip_batches
        self.log = log
        self.rows = {path: count_rows(path) for path in self.files}
        self.batches_per_epoch = sum(self._batches_in(path) for path in self.files)
        if self.batches_per_epoch == 0:
            raise DataError(f"batch size {batch_size} is too big for the shard sizes: with {data_parallel_size} "
                            f"data-parallel rank(s), the largest shard ({max(self.rows.values())} sequences) gives "
                            f"no full batch; use a smaller batch size or bigger shards")

    def _batches_in(self, path: str) -> int:
        # DistributedSampler(drop_last=False) gives every rank ceil(rows / dp) indices (it repeats some to pad).
        per_rank = -(-self.rows[path] // self.dp_size)
        return per_rank // self.batch_size

    def epoch_at(self, consumed_batches: int) -> int:
        """The epoch of batch number ``consumed_batches`` (0-based, counted from the very start, skipped included)."""
        return consumed_batches // self.batches_per_epoch

    def position_at(self, consumed_batches: int) -> tuple[int, int]:
        """(epoch, index in that epoch's file order) of the file that batch number ``consumed_batches`` comes from.

        Every rank gets the same answer (its sampler gives each file ceil(rows / dp) indices), so the ranks agree on
        when a file is finished, e.g. to checkpoint together after each file.
        """
        epoch, left = divmod(consumed_batches, self.batches_per_epoch)
        for i, path in enumerate(self.file_order(epoch)):
            left -= self._batches_in(path)
            if left < 0:
                return epoch, i
        raise AssertionError("unreachable: batches_per_epoch is the sum of the files' batches")

    def file_order(self, epoch: int) -> list[str]:
        order = list(self.files)
        random.Random(self.seed + epoch).shuffle(order)
        return order

    def _schedule(self) -> Iterator[tuple[int, int, str, int, list[str]]]:
        """(epoch, index in the epoch's order, path, first batch, notes) of every file to read, from
        ``skip_batches`` on; notes are the log lines of files skipped just before this one for having no batch.

        Uses row counts only, so skipped files are never loaded.
        """
        epoch, to_skip = divmod(self.skip_batches, self.batches_per_epoch)
        notes: list[str] = []
        while True:
            for i, path in enumerate(self.file_order(epoch)):
                n = self._batches_in(path)
                if n == 0 and to_skip == 0:
                    notes.append(f"epoch {epoch} file {i + 1}/{len(self.files)} {os.path.basename(path)}: "
                                 f"skipped, its {self.rows[path]} sequences give no full batch of "
                                 f"{self.batch_size} for this rank")
                    continue
                if to_skip >= n:
                    to_skip -= n
                    continue
                yield epoch, i, path, to_skip, notes
                to_skip, notes = 0, []
            epoch += 1

    def _load(self, path: str) -> PretrainingShard:
        shard = PretrainingShard(path, self.max_pred_len, self.seq_len, self.vocab_size)
        if len(shard) != self.rows[path]:
            raise DataError(f"{path}: held {self.rows[path]} sequences when the run started, now {len(shard)}; "
                            f"was the data rebuilt while training?")
        return shard

    def _say(self, message: str) -> None:
        if self.log is not None:
            self.log(message)

    def __iter__(self) -> Iterator[list[torch.Tensor]]:
        schedule = self._schedule()
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pretraining-data")
        try:
            upcoming = next(schedule)
            pending = pool.submit(self._load, upcoming[2])
            while True:
                epoch, i, path, first_batch, notes = upcoming
                shard = pending.result()  # re-raises a DataError from the loader thread here, in next()
                upcoming = next(schedule)
                pending = pool.submit(self._load, upcoming[2])
                for note in notes:
                    self._say(note)
                yield from self._batches_of(shard, epoch, i, path, first_batch)
        finally:
            # A consumer that stops early must not wait for a prefetch it will never use.
            pool.shutdown(wait=False, cancel_futures=True)

    def _batches_of(self, shard: PretrainingShard, epoch: int, i: int, path: str,
                    first_batch: int) -> Iterator[list[torch.Tensor]]:
        sampler = DistributedSampler(shard, num_replicas=self.dp_size, rank=self.dp_rank, shuffle=True,
                                     seed=self.seed, drop_last=False)
        sampler.set_epoch(epoch)
        indices = list(sampler)
        count = len(indices) // self.batch_size
        resumed = f", resuming at batch {first_batch}" if first_batch else ""
        self._say(f"epoch {epoch} file {i + 1}/{len(self.files)} {os.path.basename(path)} ({len(shard)} sequences, "
                  f"{count} batches for this rank{resumed})")
        for k in range(first_batch, count):
            yield shard.batch(indices[k * self.batch_size:(k + 1) * self.batch_size])
