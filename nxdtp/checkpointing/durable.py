"""Durable writes, so that a power loss leaves either the old state or the new one on disk: files and their directories
``fsync``ed, small files replaced atomically, checksums (XXH3-64, fast enough that verification costs less than
reading) computed while writing."""

from __future__ import annotations

import json
import mmap
import os
import re
from typing import Any, List, Tuple

import torch
import xxhash

READ_CHUNK_BYTES = 16 << 20
# The name of the checksum in every record (the index's ``files``, ``done``): a record under another name is refused.
CHECKSUM = "xxh3_64"
_DIGEST = re.compile("[0-9a-f]{16}")


def _fsync(path: str, flags: int = 0) -> None:
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_directory(path: str) -> None:
    """Make the entries of directory ``path`` (names created, removed or renamed in it) durable."""
    _fsync(path, getattr(os, "O_DIRECTORY", 0))


def make_directories(path: str) -> List[str]:
    """Create ``path`` and its missing parents, each made durable in its parent; return those created, outermost
    first."""
    missing = []
    probe = os.path.abspath(path)
    while not os.path.isdir(probe):
        missing.append(probe)
        probe = os.path.dirname(probe)
    created = []
    for directory in reversed(missing):
        try:
            os.mkdir(directory)
        except FileExistsError:  # another rank made it first; its entry still needs the fsync below
            if not os.path.isdir(directory):
                raise
        else:
            created.append(directory)
        fsync_directory(os.path.dirname(directory))
    return created


class ClosesOnExit:
    """A writer used as a context manager: ``close()`` (completing it) on a normal exit, ``abandon()`` on an error, so
    no file passes for a whole one."""

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.close()
        else:
            self.abandon()


class ChecksummedWriter(ClosesOnExit):
    """A binary file opened for writing that keeps the checksum and size of what was written; ``close`` flushes and
    ``fsync``s it. Usable wherever a writable binary file object is (``torch.save``, ``json.dump`` via ``text``)."""

    def __init__(self, path: str):
        self.path = path
        self._hash = xxhash.xxh3_64()
        self.size = 0
        self._file = open(path, "wb")

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._hash.update(view)
        self.size += view.nbytes
        return self._file.write(view)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        """Complete the file: flushed and on disk."""
        if self._file.closed:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def abandon(self) -> None:
        """Close without claiming the file is complete (an error happened while writing it)."""
        self._file.close()

    def record(self) -> dict:
        return file_record(self.size, self._hash.hexdigest())


def file_record(size: int, digest: str) -> dict:
    """How the index records one file: its size and its checksum (16 hex digits)."""
    return {"size": int(size), CHECKSUM: digest}


def checked_record(record) -> dict:
    """``record`` as read from JSON, if it is a well-formed file record; ``ValueError`` naming what is wrong if not."""
    if not isinstance(record, dict) or set(record) != {"size", CHECKSUM}:
        raise ValueError(f"a file record is {{'size': bytes, '{CHECKSUM}': 16 hex digits}}, got {record!r}")
    size, digest = record["size"], record[CHECKSUM]
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError(f"a file record's size must be a non-negative integer, got {size!r}")
    return file_record(size, checked_digest(digest))


def checked_digest(digest) -> str:
    """``digest`` as read from JSON, if it is a well-formed checksum; ``ValueError`` if not."""
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise ValueError(f"a {CHECKSUM} checksum must be 16 lower-case hex digits, got {digest!r}")
    return digest


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, as safetensors stores them (little-endian), without a copy; a byte
    view works for bfloat16, which numpy lacks."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def tensor_checksum(tensor: torch.Tensor) -> str:
    """The checksum of a CPU tensor's bytes as safetensors stores them, hashed in place (no copy)."""
    tensor = tensor.contiguous()
    try:
        array = tensor.numpy()  # cheaper than the byte view below, which matters at hundreds of tensors per load
    except TypeError:  # bfloat16 and other dtypes numpy lacks
        array = tensor.reshape(-1).view(torch.uint8).numpy()
    return xxhash.xxh3_64_hexdigest(array)


def write_bytes_durably(path: str, data: bytes) -> dict:
    """Write ``data`` to ``path`` (replacing it), ``fsync`` it; return its record. The directory entry is left to the
    caller's directory ``fsync``."""
    with ChecksummedWriter(path) as f:
        f.write(data)
    return f.record()


def read_json(path: str) -> Any:
    """A JSON file's contents (nxdtp's JSON files are written with ``write_bytes_durably``)."""
    with open(path) as f:
        return json.load(f)


def checksum_file(path: str) -> Tuple[int, str]:
    """``(size, checksum)`` of the file at ``path``. The file is memory-mapped, so the hash reads the page cache
    directly (no copy); the GIL is released while it runs."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:  # mmap refuses an empty file
            return 0, xxhash.xxh3_64().hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return size, xxhash.xxh3_64_hexdigest(mapped)


def replace_atomically(path: str, data: bytes) -> None:
    """Give ``path`` the content ``data`` all at once, durably: a temporary file in the same directory is written and
    ``fsync``ed, renamed over ``path``, and the directory ``fsync``ed. A reader (or a power loss) sees the old file or
    the new one, never a mix."""
    directory = os.path.dirname(os.path.abspath(path))
    temporary = f"{path}.tmp.{os.getpid()}"
    write_bytes_durably(temporary, data)
    os.replace(temporary, path)
    fsync_directory(directory)


def fsync_tree(root: str, files: bool = False) -> List[str]:
    """``fsync`` every directory under ``root`` (deepest first) and ``root`` itself, and with ``files`` every file in
    them first (cheap for files already ``fsync``ed); return the directories in that order."""
    walked = list(os.walk(root))
    if files:
        for dirpath, _, names in walked:
            for name in names:
                _fsync(os.path.join(dirpath, name))
    directories = [dirpath for dirpath, _, _ in reversed(walked)]
    for directory in directories:
        fsync_directory(directory)
    return directories


def copy_durably(source: str, destination: str) -> dict:
    """Copy a file, ``fsync`` the copy, and return the copy's record (size, checksum)."""
    buffer = bytearray(READ_CHUNK_BYTES)
    view = memoryview(buffer)
    make_directories(os.path.dirname(os.path.abspath(destination)))
    with open(source, "rb", buffering=0) as f, ChecksummedWriter(destination) as out:
        while True:
            n = f.readinto(view)
            if not n:
                break
            out.write(view[:n])
    return out.record()
