"""Is a tag intact, and are its bytes the ones that were saved? ``check_intact`` (cheap: ``done``, the index and every
file's size) picks the newest intact tag; ``verify_files`` checks whole files' checksums; ``TensorChecks`` verifies a
safetensors file's header and each tensor as it is read. A tag without these records is refused (docs/checkpoints.md,
"Integrity")."""

from __future__ import annotations

import os
import struct
import warnings
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import xxhash

from . import tags
from .durable import CHECKSUM, checksum_file, file_record, tensor_checksum
from .index import DONE_FILE, INDEX_FILE, CheckpointIndex
from .tags import CheckpointIntegrityError, read_done


def verify_file(path: str, record: dict) -> None:
    """Raise ``CheckpointIntegrityError`` (or ``FileNotFoundError``) unless the file at ``path`` has the recorded size
    and checksum."""
    _check_size(path, record)
    actual = file_record(*checksum_file(path))
    if actual != record:
        raise CheckpointIntegrityError(f"checkpoint file {path} fails its checksum: the index records size "
                                       f"{record['size']} {CHECKSUM} {record[CHECKSUM]}, the file has size "
                                       f"{actual['size']} {CHECKSUM} {actual[CHECKSUM]} (flipped bytes or an "
                                       f"overwritten file)")


def _check_size(path: str, record: dict) -> None:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file {path} is missing")
    size = os.path.getsize(path)
    if size != record["size"]:
        raise CheckpointIntegrityError(f"checkpoint file {path} has {size} bytes, the index records {record['size']}: "
                                       f"it is {'truncated' if size < record['size'] else 'longer than written'}")


def read_index(tag_dir: str, verify: bool = True) -> CheckpointIndex:
    """The tag's index, checked first against the record in ``done`` when ``verify``."""
    if verify:
        verify_file(os.path.join(tag_dir, INDEX_FILE), read_done(tag_dir))
    return CheckpointIndex.read(tag_dir)


def check_intact(tag_dir: str, verify_index: bool = True) -> CheckpointIndex:
    """Raise naming what is wrong unless ``tag_dir`` is complete and intact as far as a cheap check can tell (every
    byte of the index when ``verify_index``, the size of every other file); return its index."""
    if not tags.is_complete(tag_dir):
        raise ValueError(f"checkpoint tag {tag_dir} is incomplete (no '{DONE_FILE}' file: the save did not finish)")
    index = read_index(tag_dir, verify_index)
    for relative, record in index.files.items():
        _check_size(os.path.join(tag_dir, relative), record)
    return index


def verify_files(tag_dir: str, index: CheckpointIndex, relatives: Iterable[str], tensors_as_read: bool = False
                 ) -> None:
    """Verify the size and checksum of each listed file; one the index does not list is refused. With
    ``tensors_as_read``, a file with per-tensor records gets its size checked only (``TensorChecks`` does the rest)."""
    for relative in relatives:
        record = index.files.get(relative)
        path = os.path.join(tag_dir, relative)
        if record is None:
            raise CheckpointIntegrityError(f"checkpoint file {path} is not listed in {INDEX_FILE}'s file records, so "
                                           f"it was not written by the save that wrote the index")
        if tensors_as_read and relative in index.tensor_checksums:
            _check_size(path, record)
        else:
            verify_file(path, record)


class TensorChecks:
    """The recorded checksums of one safetensors file's header and tensors: ``check_header`` before a parser trusts the
    header, ``check`` on each tensor as read."""

    def __init__(self, path: str, record: Dict[str, dict]):
        self.path = path
        self._header = record["header"]
        self._tensors = record["tensors"]

    @classmethod
    def of(cls, tag_dir: str, index: CheckpointIndex, relative: str) -> Optional["TensorChecks"]:
        """The checks for file ``relative``, or None when the index records none for it (the whole file is then
        verified by ``verify_files``)."""
        record = index.tensor_checksums.get(relative)
        return None if record is None else cls(os.path.join(tag_dir, relative), record)

    def check_header(self) -> None:
        expected = self._header["size"]
        with open(self.path, "rb") as f:
            prefix = f.read(min(expected, 8))
            length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else None
            if length != expected - 8:
                raise CheckpointIntegrityError(
                    f"checkpoint file {self.path} has a damaged safetensors header: its length field says "
                    f"{length} bytes, the index records {expected - 8}")
            data = prefix + f.read(length)
        actual = file_record(len(data), xxhash.xxh3_64_hexdigest(data))
        if actual != self._header:
            raise CheckpointIntegrityError(
                f"checkpoint file {self.path} fails its checksum in its safetensors header (the first "
                f"{expected} bytes): the index records {CHECKSUM} {self._header[CHECKSUM]}, the file has "
                f"{actual[CHECKSUM]} (flipped bytes or an overwritten file)")

    def check(self, key: str, tensor: torch.Tensor) -> None:
        """Raise unless ``tensor``, read from the file as ``key``, has the checksum recorded for it."""
        expected = self._tensors.get(key)
        if expected is None:
            raise CheckpointIntegrityError(f"checkpoint file {self.path} holds '{key}', for which {INDEX_FILE} "
                                           f"records no checksum: it was not written by the save that wrote the index")
        actual = tensor_checksum(tensor)
        if actual != expected:
            raise CheckpointIntegrityError(
                f"checkpoint file {self.path} fails its checksum in tensor '{key}': the index records {CHECKSUM} "
                f"{expected}, the bytes read have {actual} (flipped bytes or an overwritten file)")


def intact_candidates(path: str, tag: Optional[str], problems: List[str], verify_index: bool = True
                      ) -> Iterator[Tuple[str, CheckpointIndex, bool]]:
    """``(tag_dir, index, named)`` for each tag to try, in order: a named tag alone (anything wrong raises), else
    ``tags.candidates``' order, each that fails ``check_intact`` skipped with a warning. When none is left, the error
    lists every skipped tag."""
    tag_dirs, named = tags.candidates(path, tag)
    if named:
        yield tag_dirs[0], check_intact(tag_dirs[0], verify_index), True
        return
    for tag_dir in tag_dirs:
        try:
            index = check_intact(tag_dir, verify_index)
        except (OSError, ValueError) as e:
            skip(problems, tag_dir, f"{type(e).__name__}: {e}")
            continue
        yield tag_dir, index, False
    raise ValueError(f"{path} has no intact checkpoint tag: " + ("; ".join(problems) or "no complete tag"))


def skip(problems: List[str], tag_dir: str, what: str) -> None:
    """Warn that the unnamed candidate ``tag_dir`` is skipped, and why; remember it for the final error."""
    message = f"checkpoint tag {tag_dir} is damaged, skipped: {what}"
    warnings.warn(message, stacklevel=3)
    problems.append(message)
