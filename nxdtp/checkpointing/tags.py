"""Checkpoint tags: one directory per save, complete only once ``done`` (which records the index) exists, and an atomic
``newest`` pointer, so a crash leaves the previous complete tag in use (docs/checkpoints.md, "Crash consistency")."""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import List, Optional, Tuple

from .durable import checked_record, replace_atomically
from .index import DONE_FILE, INDEX_FILE, CheckpointIntegrityError

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


def mark_done(tag_dir: str, index_record: dict) -> None:
    """Mark ``tag_dir`` complete (durably, all at once); ``done`` records the index's size and checksum."""
    payload = json.dumps({"complete": True, INDEX_FILE: index_record}) + "\n"
    replace_atomically(os.path.join(tag_dir, DONE_FILE), payload.encode())


def read_done(tag_dir: str) -> dict:
    """The index record that ``tag_dir``'s ``done`` holds; ``CheckpointIntegrityError`` naming the file if it holds
    none."""
    path = os.path.join(tag_dir, DONE_FILE)
    with open(path, "rb") as f:
        raw = f.read()
    try:
        record = json.loads(raw.decode())[INDEX_FILE]
        return checked_record(record)
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise CheckpointIntegrityError(f"{path} is damaged: it must be JSON holding the record (size and "
                                       f"checksum) of {INDEX_FILE} ({type(e).__name__}: {e})") from None


def set_newest(output_dir: str, tag: str) -> None:
    replace_atomically(os.path.join(output_dir, NEWEST_FILE), (tag + "\n").encode())


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


def candidates(path: str, tag: Optional[str]) -> Tuple[List[str], bool]:
    """``(tag directories to try, named)``: a named tag alone, or the tag ``newest`` names (listed even when it names no
    directory, so the caller can say so) then every other complete tag, newest first."""
    if tag is not None or is_tag_dir(path):
        return [_resolve_named(path, tag)], True
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    newest = newest_tag(path)
    if newest is None:
        raise FileNotFoundError(f"{path} has no '{NEWEST_FILE}' file (no complete checkpoint was saved there) and is "
                                f"not a tag directory (no '{INDEX_FILE}' or '{DONE_FILE}'); pass a checkpoint "
                                f"directory or one of its tags; complete tags in it: {complete_tags(path)}")
    first = os.path.join(path, newest) if _TAG_PATTERN.match(newest) and newest not in (".", "..") \
        else os.path.join(path, f"<'{NEWEST_FILE}' holds {newest[:40]!r}, not a tag name>")
    return [first] + [os.path.join(path, t) for t in reversed(complete_tags(path)) if t != newest], False


def is_tag_dir(path: str) -> bool:
    """Whether ``path`` looks like one tag (complete or not) rather than a checkpoint directory: it has no ``newest``
    file, and it has the index, ``done`` or a ``model/`` directory."""
    return (os.path.isdir(path) and not os.path.isfile(os.path.join(path, NEWEST_FILE))
            and any(os.path.exists(os.path.join(path, name)) for name in (INDEX_FILE, DONE_FILE, "model")))


def _resolve_named(path: str, tag: Optional[str]) -> str:
    """The one tag directory a caller named: ``tag`` of the checkpoint directory ``path``, or ``path`` itself, a tag
    directory (``tag`` must then be None). A tag directory that is not complete is refused with what it lacks."""
    if not is_tag_dir(path):
        return resolve_tag(path, tag)
    if tag is not None:
        raise ValueError(f"{path} is a tag directory, so --tag {tag} (tag={tag!r}) cannot apply; pass the tag "
                         f"directory alone, or its checkpoint directory {os.path.dirname(os.path.abspath(path))} "
                         f"with --tag")
    missing = [name for name in (INDEX_FILE, DONE_FILE) if not os.path.isfile(os.path.join(path, name))]
    if missing:
        raise ValueError(f"checkpoint tag {path} is incomplete: it has no {' and no '.join(repr(m) for m in missing)} "
                         f"file{'s' if len(missing) > 1 else ''} (the save did not finish); pass a complete tag, or "
                         f"the checkpoint directory to take its newest complete tag")
    return path


def prune(output_dir: str, keep_last: int, protect: str) -> List[str]:
    """Delete complete tags beyond the newest ``keep_last`` (never ``protect``); return what was removed."""
    tags = [t for t in complete_tags(output_dir) if t != protect]
    doomed = tags[: max(0, len(tags) - (keep_last - 1))]
    for tag in doomed:
        shutil.rmtree(os.path.join(output_dir, tag))
    return doomed
