"""Output directories of the tools that write a checkpoint or a merged model: refuse unsafe targets up front, and
write into a temporary sibling that replaces the target only once it is complete (nothing is left behind on error)."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Callable

from .durable import fsync_directory, fsync_tree, make_directories


def check_output_dir(checkpoint_dir: str, output_dir: str, force: bool) -> None:
    source, target = os.path.realpath(checkpoint_dir), os.path.realpath(output_dir)
    if target == source or target.startswith(source.rstrip(os.sep) + os.sep):
        raise ValueError(f"output directory {output_dir} is inside the input checkpoint directory {checkpoint_dir}; "
                         "choose a directory outside it")
    if source.startswith(target.rstrip(os.sep) + os.sep):
        raise ValueError(f"output directory {output_dir} contains the input checkpoint directory {checkpoint_dir}; "
                         "choose another directory")
    if os.path.lexists(output_dir):
        if not os.path.isdir(output_dir) or os.path.islink(output_dir):
            raise FileExistsError(f"output path {output_dir} exists and is not a directory")
        if os.listdir(output_dir) and not force:
            raise FileExistsError(f"output directory {output_dir} exists and is not empty; pass --force (force=True) "
                                  "to replace it")


def write_atomically(output_dir: str, write: Callable[[str], Any]) -> Any:
    """Run ``write(staging_dir)`` in a temporary sibling of ``output_dir``, then put the result in its place, durably: a
    power loss or an error leaves the old output or the complete new one."""
    target = os.path.abspath(output_dir)
    parent, base = os.path.dirname(target), os.path.basename(target)
    created = make_directories(parent)[::-1]  # deepest first, to be removed in that order on error
    staging = tempfile.mkdtemp(prefix=f".{base}.nxdtp-tmp-", dir=parent)
    try:
        result = write(staging)
        os.chmod(staging, 0o755 & ~_umask())  # mkdtemp makes it private; give it a normal directory's mode
        fsync_tree(staging, files=True)
        aside = None
        if os.path.lexists(target):
            aside = tempfile.mkdtemp(prefix=f".{base}.nxdtp-old-", dir=parent)
            os.rmdir(aside)
            os.rename(target, aside)
        try:
            os.rename(staging, target)
        except BaseException:
            if aside is not None:
                os.rename(aside, target)
            raise
        fsync_directory(parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for directory in created:
            try:
                os.rmdir(directory)
            except OSError:
                pass
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return result


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
