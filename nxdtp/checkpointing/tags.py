"""Checkpoint tags: one directory per save, complete only once ``done`` exists, and an atomic ``newest`` pointer.

A crash at any point of a save leaves ``newest`` naming the previous complete tag, and the half-written tag has no
``done`` file, so it is never loaded (it is named in the error if asked for explicitly).
"""

from __future__ import annotations

import os
import re
import shutil
from typing import List, Optional

from .index import DONE_FILE

NEWEST_FILE = "newest"
_TAG_PATTERN = re.compile(r"^[A-Za-z0-9_.-]+$")


def tag_for_step(global_step: int) -> str:
    return f"step_{int(global_step):06d}"


def step_of(tag: str) -> Optional[int]:
    """The global step a ``tag_for_step`` tag names; None for a tag named otherwise."""
    match = re.fullmatch(r"step_(\d+)", tag)
    return int(match.group(1)) if match else None


def check_tag_name(tag: str) -> None:
    if not _TAG_PATTERN.match(tag) or tag in (".", ".."):
        raise ValueError(f"checkpoint tag {tag!r} must be a plain directory name of letters, digits, '_', '.', '-'")


def first_free(output_dir: str, stem: str) -> str:
    """``stem``, or ``stem_1``, ``stem_2``, ...: the first name in ``output_dir`` without a complete tag (a crashed
    save's partial tag is written over)."""
    name, n = stem, 0
    while os.path.exists(os.path.join(output_dir, name)) and is_complete(os.path.join(output_dir, name)):
        n += 1
        name = f"{stem}_{n}"
    return name


def is_complete(tag_dir: str) -> bool:
    return os.path.isfile(os.path.join(tag_dir, DONE_FILE))


def write_atomically(path: str, text: str) -> None:
    temporary = f"{path}.tmp.{os.getpid()}"
    with open(temporary, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def mark_done(tag_dir: str) -> None:
    write_atomically(os.path.join(tag_dir, DONE_FILE), "complete\n")


def set_newest(output_dir: str, tag: str) -> None:
    write_atomically(os.path.join(output_dir, NEWEST_FILE), tag + "\n")


def newest_tag(output_dir: str) -> Optional[str]:
    path = os.path.join(output_dir, NEWEST_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def complete_tags(output_dir: str) -> List[str]:
    """Complete tags, oldest first (by modification time of their ``done`` file)."""
    if not os.path.isdir(output_dir):
        return []
    tags = [t for t in os.listdir(output_dir) if os.path.isdir(os.path.join(output_dir, t))
            and is_complete(os.path.join(output_dir, t))]
    return sorted(tags, key=lambda t: os.path.getmtime(os.path.join(output_dir, t, DONE_FILE)))


def resolve_tag(output_dir: str, tag: Optional[str]) -> str:
    """The directory of ``tag`` (default: the newest complete one), refusing incomplete or missing tags by name."""
    if not os.path.isdir(output_dir):
        raise FileNotFoundError(f"checkpoint directory {output_dir} does not exist")
    if tag is None:
        tag = newest_tag(output_dir)
        if tag is None:
            raise FileNotFoundError(f"{output_dir} has no '{NEWEST_FILE}' file: no complete checkpoint was saved there")
    check_tag_name(tag)
    tag_dir = os.path.join(output_dir, tag)
    if not os.path.isdir(tag_dir):
        raise FileNotFoundError(f"checkpoint tag {tag_dir} does not exist; complete tags: {complete_tags(output_dir)}")
    if not is_complete(tag_dir):
        raise ValueError(f"checkpoint tag {tag_dir} is incomplete (no '{DONE_FILE}' file: the save did not finish); "
                         f"complete tags: {complete_tags(output_dir)}")
    return tag_dir


def prune(output_dir: str, keep_last: int, protect: str) -> List[str]:
    """Delete complete tags beyond the newest ``keep_last`` (never ``protect``); return what was removed."""
    tags = [t for t in complete_tags(output_dir) if t != protect]
    doomed = tags[: max(0, len(tags) - (keep_last - 1))]
    for tag in doomed:
        shutil.rmtree(os.path.join(output_dir, tag))
    return doomed
