"""Where the example runs: the device, the process group, and the few calls that differ between XLA and eager devices.

nxdtp's own collectives pick their backend from the tensor's device; this module covers what a training loop needs
around them: starting the world, moving batches, ending a step, and running host-side code once a step's values exist.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

DEVICE_CHOICES = ("auto", "xla", "cuda", "cpu")
# PJRT device types that are real accelerators. XLA:CPU is one replica per process (see docs/troubleshooting.md), so
# "auto" never picks it; ask for it with --device xla.
XLA_ACCELERATORS = ("TPU", "NEURON", "CUDA", "GPU")
# How long a rank waits in a collective for its peers before it fails (and with it the job): torch's own default for
# gloo, and longer than the first steps' XLA compilation of BERT-large. NCCL's own default would be 10 minutes.
DEFAULT_COLLECTIVE_TIMEOUT_S = 1800.0
COLLECTIVE_TIMEOUT_ENV = "NXDTP_COLLECTIVE_TIMEOUT_S"
# ProcessGroupNCCL's values of this variable: only 1 (TearDown) and 3 (SkipCleanUp, torch 2.9's default) make its
# watchdog end the process when a collective outlives the timeout; with 0 or 2 a rank can wait on the GPU forever.
NCCL_ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NCCL_ERROR_HANDLING_LEGACY_ENV = "NCCL_ASYNC_ERROR_HANDLING"  # still read by torch when the first is unset
NCCL_TEARDOWN_MODES = ("1", "3")


def choose_device_kind(requested: str) -> str:
    if requested not in DEVICE_CHOICES:
        raise ValueError(f"--device {requested!r} is not one of {', '.join(DEVICE_CHOICES)}")
    if requested != "auto":
        return requested
    if os.environ.get("PJRT_DEVICE", "").upper() in XLA_ACCELERATORS and _importable("torch_xla"):
        return "xla"
    if _importable("torch_neuronx"):
        return "xla"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_main(argv, parse_args: Callable, run: Callable, xla_spawned_main: Callable, input_errors: tuple) -> None:
    """An example's ``main``: parse the flags; on an XLA accelerator started without torchrun, spawn one process per
    device (``xla_spawned_main(index, argv)``, a module-level function, as NxD's ``xmp.spawn``); else run, and turn the
    input errors the example knows (bad data, flags, checkpoints) into one line on stderr and exit status 1."""
    args = parse_args(argv)
    if (choose_device_kind(args.device) == "xla" and not launched_by_torchrun()
            and os.environ.get("PJRT_DEVICE", "").upper() in XLA_ACCELERATORS):
        import torch_xla

        torch_xla.launch(xla_spawned_main, args=(argv,))
        return
    try:
        run(args)
    except input_errors as error:
        print(f"error: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        sys.exit(1)


def launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


@dataclass
class Runtime:
    kind: str                 # "xla", "cuda" or "cpu"
    device: torch.device
    rank: int
    world_size: int
    owns_world: bool = True   # False when the caller had already initialised torch.distributed

    @property
    def is_xla(self) -> bool:
        return self.kind == "xla"

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def device_batches(self, batches: Iterable) -> Iterator:
        if self.is_xla:
            import torch_xla.distributed.parallel_loader as pl

            return iter(pl.MpDeviceLoader(batches, self.device))
        return (_to_device(batch, self.device) for batch in batches)

    def end_step(self) -> None:
        """Cut the XLA graph here: one graph per optimizer step. Eager devices have nothing to do."""
        if self.is_xla:
            import torch_xla

            torch_xla.sync()

    def after_step(self, function: Callable, *args) -> None:
        """Call ``function(*args)`` once the step's tensors hold values: at once on eager devices, after the graph
        has run on XLA (reading a value earlier would execute a partial graph)."""
        if self.is_xla:
            import torch_xla.core.xla_model as xm

            xm.add_step_closure(function, args)
        else:
            function(*args)

    def graph_counters(self) -> dict:
        """XLA only: cumulative compiled and executed graph counts, to check one graph per step."""
        if not self.is_xla:
            return {}
        import torch_xla.debug.metrics as met

        return {"xla_uncached_compiles": met.counter_value("UncachedCompile") or 0,
                "xla_cached_compiles": met.counter_value("CachedCompile") or 0,
                "xla_executions": met.counter_value("ExecuteComputation") or 0}

    def autocast(self, enabled: bool):
        return torch.autocast(device_type=self.kind, dtype=torch.bfloat16, enabled=enabled)


def _to_device(batch, device: torch.device):
    """A batch (a list of tensors, or a dict of them) on ``device``."""
    if device.type == "cpu":
        return batch
    if isinstance(batch, dict):
        return {k: t.to(device, non_blocking=True) for k, t in batch.items()}
    return [t.to(device, non_blocking=True) for t in batch]


def start(requested_device: str, timeout: datetime.timedelta, spawned_by_xla: bool = False) -> Runtime:
    """Initialise torch.distributed for the chosen device and return the Runtime.

    Under torchrun the world comes from its environment; under ``torch_xla.launch`` (``spawned_by_xla``) from the XLA
    runtime. A plain ``python script.py`` on CPU, CUDA or XLA:CPU runs a world of one.
    """
    kind = "xla" if spawned_by_xla else choose_device_kind(requested_device)
    if dist.is_initialized():
        # Called from inside an existing world (a notebook, a test harness): train in it, leave it running after.
        if kind == "xla":
            import torch_xla

            device = torch_xla.device()
        else:
            device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
        return Runtime(kind=kind, device=device, rank=dist.get_rank(), world_size=dist.get_world_size(),
                       owns_world=False)
    if not launched_by_torchrun() and not spawned_by_xla:
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(_free_port())})
    if kind == "xla":
        import torch_xla
        import torch_xla.runtime as xr

        if not spawned_by_xla and (xr.device_type() == "CPU" or int(os.environ["WORLD_SIZE"]) == 1):
            # XLA:CPU is one replica per process; host-side coordination goes over gloo, XLA collectives over xm.
            dist.init_process_group("gloo", timeout=timeout)
        else:
            import torch_xla.distributed.xla_backend  # noqa: F401 - registers the "xla" backend

            dist.init_process_group("xla", init_method="xla://", timeout=timeout)
        device = torch_xla.device()
    elif kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was requested but torch.cuda.is_available() is False")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        _enforce_nccl_timeouts()
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local_rank))
        device = torch.device("cuda", local_rank)
    else:
        dist.init_process_group("gloo", timeout=timeout)
        device = torch.device("cpu")
    return Runtime(kind=kind, device=device, rank=dist.get_rank(), world_size=dist.get_world_size())


def _enforce_nccl_timeouts() -> None:
    """Make the NCCL watchdog end a rank whose collective outlives the timeout (it then exits, and torchrun stops the
    others), whatever torch's default for the variable is; warn when the user turned that off."""
    name = next((n for n in (NCCL_ERROR_HANDLING_ENV, NCCL_ERROR_HANDLING_LEGACY_ENV) if n in os.environ), None)
    if name is None:
        os.environ[NCCL_ERROR_HANDLING_ENV] = "3"
        return
    mode = os.environ[name]
    if mode not in NCCL_TEARDOWN_MODES and os.environ.get("TORCH_NCCL_BLOCKING_WAIT", "0") != "1":
        print(f"warning: {name}={mode} turns off the NCCL watchdog's teardown: a rank that dies can leave the others "
              f"waiting forever; unset it (or set {' or '.join(NCCL_TEARDOWN_MODES)})", file=sys.stderr, flush=True)


def stop(rt: Runtime) -> None:
    if rt.owns_world and dist.is_initialized():
        dist.destroy_process_group()
