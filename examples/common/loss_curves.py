"""The examples' loss-curve check: launch a training script once per layout, read each run's per-step losses, compare
them step by step and plot them to a PNG.

A layout changes how the model is computed (which rank holds which slice, who sums what), never what it computes:
from the same seed on the same global batches, with dropout off, every layout's curve must match the others'.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Dict, List, Sequence

from training_log import read_step_log

LINE_STYLES = ("-", "--", ":", "-.")


def run_layout(command: Sequence[str], run_dir: str, steps: int, label: str) -> List[Dict]:
    """Run one training launch (single-threaded ranks) and return the last ``steps`` records of its step log."""
    print(f"== {label}: {' '.join(command[3:])}", flush=True)
    subprocess.run(list(command), check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return read_step_log(run_dir)[-steps:]


def largest_gap(a: List[Dict], b: List[Dict]) -> float:
    if len(a) != len(b):
        raise ValueError(f"the curves have {len(a)} and {len(b)} steps")
    return max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b))


def plot(curves: Dict[str, List[Dict]], path: str, title: str, ylabel: str = "training loss") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (label, records) in enumerate(curves.items()):
        ax.plot([r["step"] for r in records], [r["loss"] for r in records], LINE_STYLES[i % len(LINE_STYLES)],
                marker="o", markersize=3, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def python_launch(nproc: int) -> List[str]:
    """The torchrun command (as ``python -m torch.distributed.run``) for ``nproc`` local processes."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
