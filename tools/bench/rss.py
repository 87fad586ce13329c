"""Memory probes for the benchmarks in this folder (Linux): RSS from /proc, the peak watermark, and a sampler.

Used by the merge, pretrained-loading, train-step and memory benchmarks.
"""

from __future__ import annotations

import threading
import time


def proc_status_kib() -> dict:
    """VmRSS, VmHWM, RssAnon, RssFile, RssShmem of this process, in KiB."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                fields[key] = int(value.split()[0])
    return fields


def malloc_trim() -> None:
    """Give the heap's free pages back to the kernel (glibc), so that RSS measured next counts what is alive, not what
    the allocator kept of freed memory (a model built next in a worker then starts from an RSS without the last one's
    freed memory in it)."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the figure then also counts what the heap kept
        pass


def maxrss_kib() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def reset_peak_rss() -> bool:
    """Reset this process's peak-RSS watermark to its current RSS; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class RssSampler:
    """Highest RssAnon / RssFile / VmRSS seen by a background thread while running."""

    def __init__(self, interval_s: float = 0.001):
        self.interval_s = interval_s
        self.peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        status = proc_status_kib()
        for key in self.peak:
            self.peak[key] = max(self.peak[key], status.get(key, 0))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval_s)

    def __enter__(self):
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()
