"""How many distinct XLA graphs the ranks of a world would compile, found in one process before any compile is paid.

Each distinct graph is a separate compile on Trainium and TPU. ``trace_every_rank`` installs the topology of every rank
of a simulated world in turn (``topology.simulated_topology`` plus ``comm.simulated_xla_runtime``), calls a step
function that builds and traces that rank's work, and hashes the pending graphs it returns with torch_xla's
compile-cache key. Nothing is executed: the traced collectives name ranks that do not exist in this process, so run
it in a process that executes no other XLA graph.

    from nxdtp.xla_graphs import trace_every_rank

    def step():                                  # called once per rank, with that rank's topology installed
        model = build_and_shard_my_model().to(torch_xla.device())
        loss = model(**batch).loss
        loss.backward()
        norm = clip_grad_norm(model.parameters(), 1.0)
        optimizer.step()
        return {"forward": [loss], "step": [loss, norm, *model.parameters()]}

    graphs = trace_every_rank(step, world_size=8, tensor_model_parallel_size=4)
    assert graphs.distinct() == 1, graphs.summary()
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from . import comm, topology

StepResult = Union[Mapping[str, Sequence[torch.Tensor]], Sequence[torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class RankGraphs:
    """Per phase (a name the step function chose), the graph hash of every traced rank, in rank order."""

    world_size: int
    tensor_model_parallel_size: int
    ranks: Tuple[int, ...]
    hashes: Dict[str, Tuple[str, ...]]
    hlo: Optional[Dict[str, Tuple[str, ...]]] = None

    def distinct(self, phase: Optional[str] = None) -> int:
        """Distinct graphs of ``phase``, or the most of any phase when ``phase`` is None."""
        if phase is None:
            return max(len(set(h)) for h in self.hashes.values())
        if phase not in self.hashes:
            raise KeyError(f"phase {phase!r} was not traced; the step returned {sorted(self.hashes)}")
        return len(set(self.hashes[phase]))

    def rank_classes(self, phase: str) -> List[List[int]]:
        """The ranks grouped by the graph they trace for ``phase`` (one list when every rank shares it)."""
        classes: Dict[str, List[int]] = {}
        for rank, digest in zip(self.ranks, self.hashes[phase]):
            classes.setdefault(digest, []).append(rank)
        return list(classes.values())

    def first_difference(self, phase: str, context: int = 3) -> Optional[str]:
        """The first lines where a rank's HLO differs from the first traced rank's (needs ``keep_hlo=True``)."""
        if self.hlo is None:
            raise ValueError("first_difference needs the HLO text: trace with keep_hlo=True")
        texts = [_without_ids(text) for text in self.hlo[phase]]
        for rank, text in zip(self.ranks[1:], texts[1:]):
            if text != texts[0]:
                diff = difflib.unified_diff(texts[0], text, f"rank {self.ranks[0]}", f"rank {rank}", n=context,
                                            lineterm="")
                return "\n".join(list(diff)[:60])
        return None

    def summary(self) -> str:
        parts = [f"world {self.world_size}, tp={self.tensor_model_parallel_size}:"]
        for phase in self.hashes:
            classes = self.rank_classes(phase)
            parts.append(f"{phase}: {len(classes)} graph(s)"
                         + ("" if len(classes) == 1 else f" (ranks sharing one: {classes})"))
        return " ".join(parts)


def _without_ids(hlo: str) -> List[str]:
    # Instruction numbers shift with any extra node; without them the diff shows the operation that differs.
    return [re.sub(r"(%p|parameter\(|\.)\d+", r"\1", line) for line in hlo.splitlines()
            if not line.startswith(("HloModule", "ENTRY"))]


def _phases(result: StepResult, rank: int) -> Dict[str, List[torch.Tensor]]:
    phases = dict(result) if isinstance(result, Mapping) else {"step": list(result)}
    for phase, tensors in phases.items():
        tensors = list(tensors)
        if not tensors:
            raise ValueError(f"trace_every_rank: phase {phase!r} of rank {rank} returned no tensors")
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type != "xla":
                what = t.device if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"trace_every_rank: phase {phase!r} of rank {rank} returned a {what} value; every "
                                 "value must be a tensor on the XLA device (move the model and batch there)")
        phases[phase] = tensors
    return phases


def trace_every_rank(step: Callable[[], StepResult], world_size: int, tensor_model_parallel_size: int,
                     ranks: Optional[Sequence[int]] = None, keep_hlo: bool = False, *,
                     expert_model_parallel_size: int = 1) -> RankGraphs:
    """Call ``step()`` once for each rank of a simulated world (all ranks, or ``ranks``) and hash what it returns.

    ``step`` builds, shards and moves the model itself (sharding reads the installed topology) and returns the tensors
    whose pending graphs a real run would compile: a list, or a mapping from a phase name to a list. XLA's RNG seed is
    put back to its value at the call before each rank, as every process of a real run starts from the same seed.
    """
    import torch_xla
    import torch_xla.core.xla_model as xm

    if world_size < 1 or tensor_model_parallel_size < 1 or world_size % tensor_model_parallel_size:
        raise ValueError(f"world_size={world_size} and tensor_model_parallel_size={tensor_model_parallel_size}: the "
                         "TP size must be a positive divisor of the world size")
    ranks = tuple(range(world_size) if ranks is None else ranks)
    outside = [r for r in ranks if not 0 <= r < world_size]
    if outside or not ranks:
        raise ValueError(f"ranks={list(ranks)}: give at least one rank, each in 0..{world_size - 1}")
    seed = xm.get_rng_state()
    hashes: Dict[str, List[str]] = {}
    hlo: Dict[str, List[str]] = {}
    for rank in ranks:
        xm.set_rng_state(seed)
        with topology.simulated_topology(world_size, rank, tensor_model_parallel_size,
                                         expert_model_parallel_size), \
                comm.simulated_xla_runtime(world_size, rank):
            phases = _phases(step(), rank)
            if hashes and set(phases) != set(hashes):
                raise ValueError(f"trace_every_rank: rank {rank} returned phases {sorted(phases)}, rank {ranks[0]} "
                                 f"returned {sorted(hashes)}; the step must return the same phases on every rank")
            for phase, tensors in phases.items():
                hashes.setdefault(phase, []).append(torch_xla._XLAC._get_graph_hash(tensors).hex())
                if keep_hlo:
                    hlo.setdefault(phase, []).append(torch_xla._XLAC._get_xla_tensors_hlo(tensors))
    xm.set_rng_state(seed)
    return RankGraphs(world_size, tensor_model_parallel_size, ranks, {p: tuple(h) for p, h in hashes.items()},
                      {p: tuple(t) for p, t in hlo.items()} if keep_hlo else None)


__all__ = ["RankGraphs", "trace_every_rank"]
