"""A lock on one checkpoint tag (``<checkpoint_dir>/<tag>.lock``, created with ``O_EXCL``), so two jobs never write the
same tag at once; a lock left by a dead owner on this host is broken with a warning (docs/checkpoints.md, "Tag
locks")."""

from __future__ import annotations

import datetime
import json
import os
import secrets
import socket
import time
import warnings
from typing import Optional

from .durable import fsync_directory

LOCK_SUFFIX = ".lock"


class CheckpointLockedError(RuntimeError):
    """Another save holds the tag's lock."""


def lock_path(checkpoint_dir: str, tag: str) -> str:
    return os.path.join(checkpoint_dir, tag + LOCK_SUFFIX)


def _process_start_ticks(pid: int) -> Optional[int]:
    """When process ``pid`` started (clock ticks since boot, /proc/PID/stat field 22); None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _owner_is_dead(owner: dict) -> Optional[bool]:
    """True: the owner ran on this host and is gone; False: it runs; None: it ran on another host (unknown)."""
    if owner.get("host") != socket.gethostname():
        return None
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # it exists, under another user
        pass
    recorded, current = owner.get("process_start_ticks"), _process_start_ticks(pid)
    return recorded is not None and current is not None and recorded != current


def _describe(owner: dict) -> str:
    return (f"host {owner.get('host')!r}, pid {owner.get('pid')}, save started {owner.get('started')}")


class TagLock:
    """``acquire()`` takes the lock or raises; ``release()`` removes it if it is still this holder's."""

    def __init__(self, checkpoint_dir: str, tag: str):
        self.path = lock_path(checkpoint_dir, tag)
        self.tag = tag
        self._token: Optional[str] = None

    def acquire(self) -> None:
        owner = {"host": socket.gethostname(), "pid": os.getpid(),
                 "process_start_ticks": _process_start_ticks(os.getpid()),
                 "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                 "token": secrets.token_hex(8)}
        for _ in range(3):  # a stale lock broken, then retried; a lost race with another breaker raises below
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                self._break_if_stale()
                continue
            try:
                os.write(fd, json.dumps(owner).encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            fsync_directory(os.path.dirname(os.path.abspath(self.path)))
            self._token = owner["token"]
            return
        self._raise_held(self._read())

    def _read(self) -> Optional[dict]:
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        try:
            owner = json.loads(raw)
            return owner if isinstance(owner, dict) else {"unreadable": raw[:80]}
        except ValueError:
            return {"unreadable": raw[:80]}

    def _raise_held(self, owner: Optional[dict]) -> None:
        if owner is None:
            raise CheckpointLockedError(f"checkpoint tag {self.tag!r} is locked ({self.path}) by a save that keeps "
                                        "taking and releasing it; retry")
        if "unreadable" in owner:
            raise CheckpointLockedError(
                f"checkpoint tag {self.tag!r} is locked by {self.path}, whose content {owner['unreadable']!r} names "
                f"no owner (a save that died while taking it?); if no job is saving this tag, delete {self.path}")
        remedy = ("" if _owner_is_dead(owner) is False else
                  f"; that host's processes cannot be checked from {socket.gethostname()!r}: if that job is no longer "
                  f"running, delete {self.path}")
        raise CheckpointLockedError(f"checkpoint tag {self.tag!r} is being saved by another job: {_describe(owner)} "
                                    f"holds the lock {self.path}{remedy}")

    def _break_if_stale(self) -> None:
        owner = self._read()
        if owner is None:
            return  # released meanwhile: try again
        if "unreadable" in owner:
            # A lock file is written right after it is created: give a live taker a moment.
            time.sleep(0.2)
            if self._read() == owner:
                self._raise_held(owner)
            return
        if not _owner_is_dead(owner):
            self._raise_held(owner)
        # Move it aside first, then check it was the lock judged stale: a live job may have taken the lock between
        # the read and the rename; its lock is then put back.
        aside = f"{self.path}.stale.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        with open(aside, "rb") as f:
            taken = f.read()
        try:
            if json.loads(taken) != owner:
                try:
                    os.link(aside, self.path)
                finally:
                    os.unlink(aside)
                self._raise_held(self._read())
        except ValueError:
            pass
        if os.path.exists(aside):
            os.unlink(aside)
        warnings.warn(f"checkpoint tag {self.tag!r}: broke the stale lock {self.path} of a save that is no longer "
                      f"running ({_describe(owner)}: no such process on this host); its partial tag is written over",
                      stacklevel=4)

    def release(self) -> None:
        """Remove the lock if this holder still owns it (a lock broken and retaken by another job is left alone)."""
        if self._token is None:
            return
        owner = self._read()
        if owner is not None and owner.get("token") == self._token:
            os.unlink(self.path)
        self._token = None
