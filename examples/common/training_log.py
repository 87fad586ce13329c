"""What the example reports: NxD's LOG line, NxD's JSON metrics file, a per-step JSON-lines log, TensorBoard.

Users of NxD's example parse its ``LOG`` lines and its metrics file, so both keep NxD's format. The JSON-lines file
keeps full-precision numbers for scripts (the loss-curve plot, the tests).
"""

from __future__ import annotations

import collections
import json
import math
import os
import time
from datetime import datetime, timezone
from typing import Any, Dict, List, Optional

STEP_LOG_FILE = "train_log.jsonl"


def log_line(epoch: int, step: int, step_loss: float, learning_rate: float, throughput: float,
             grad_norm: Optional[float] = None) -> str:
    line = (f"LOG {time.asctime()} - ({epoch}, {step}) step_loss : {step_loss:.4f} "
            f"learning_rate : {learning_rate:.2e} throughput : {throughput:.2f} seq/s ")
    if grad_norm is not None:
        line += f"grad-norm : {grad_norm}"
    return line


class Throughput:
    """Sequences per second over a moving window of optimizer steps."""

    def __init__(self, sequences_per_step: int, window: int = 10):
        self.sequences_per_step = sequences_per_step
        self.step_times: collections.deque = collections.deque(maxlen=window)
        self.last = time.perf_counter()

    def tick(self) -> float:
        now = time.perf_counter()
        self.step_times.append(now - self.last)
        self.last = now
        return len(self.step_times) * self.sequences_per_step / max(sum(self.step_times), 1e-9)


class MetricsFile:
    """NxD's results file: ``{"results": {"parameters": {...}, "metrics": [{MetricName, MeasuredValue, Units,
    Timestamp, AdditionalData}, ...]}}``, rewritten whole (via a temporary file) on each update."""

    def __init__(self, path: str):
        self.path = path

    def _read(self) -> Dict[str, Any]:
        if not os.path.exists(self.path):
            return {"results": {}}
        with open(self.path) as f:
            content = json.load(f) or {}
        content.setdefault("results", {})
        return content

    def _write(self, content: Dict[str, Any]) -> None:
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(content, f, indent=1)
        os.replace(tmp, self.path)

    def store_parameters(self, parameters: Dict[str, Any]) -> None:
        content = self._read()
        content["results"].setdefault("parameters", {}).update(parameters)
        self._write(content)

    def store_metrics(self, metrics: List[Dict[str, Any]]) -> None:
        content = self._read()
        stamp = datetime.now(timezone.utc).isoformat()
        content["results"].setdefault("metrics", []).extend(
            {"MetricName": m["name"], "MeasuredValue": m["value"], "Units": m.get("units", ""), "Timestamp": stamp,
             "AdditionalData": m.get("additional_data", {})} for m in metrics)
        self._write(content)


class TrainingLog:
    """Rank 0's reporting: prints the LOG line, appends the JSON-lines record, feeds TensorBoard when installed."""

    def __init__(self, output_dir: str, print_grad_norm: bool, tensorboard_name: str):
        self.print_grad_norm = print_grad_norm
        self.records: List[Dict[str, Any]] = []
        os.makedirs(output_dir, exist_ok=True)
        self.jsonl = open(os.path.join(output_dir, STEP_LOG_FILE), "a")
        self.tensorboard = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is optional
            SummaryWriter = None
        if SummaryWriter is not None:
            self.tensorboard = SummaryWriter(os.path.join(output_dir, tensorboard_name))

    def step(self, epoch: int, step: int, loss: float, learning_rate: float, throughput: float,
             grad_norm: float, extra: Optional[Dict[str, Any]] = None) -> None:
        # A non-finite grad norm is always printed: it is why the run stops.
        show_norm = self.print_grad_norm or not math.isfinite(grad_norm)
        print(log_line(epoch, step, loss, learning_rate, throughput, grad_norm if show_norm else None), flush=True)
        record = {"epoch": epoch, "step": step, "loss": loss, "learning_rate": learning_rate,
                  "throughput": throughput, "grad_norm": grad_norm, "time": time.time(), **(extra or {})}
        self.records.append(record)
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tensorboard is not None:
            for key in ("loss", "learning_rate", "throughput", "grad_norm"):
                self.tensorboard.add_scalar(key.replace("_", " "), record[key], step)

    def close(self) -> None:
        self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def read_step_log(output_dir: str) -> List[Dict[str, Any]]:
    """The per-step records of every run that wrote to ``output_dir``, in order (a resumed run appends)."""
    with open(os.path.join(output_dir, STEP_LOG_FILE)) as f:
        return [json.loads(line) for line in f if line.strip()]
