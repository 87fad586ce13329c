"""Section 3: collectives per BERT layer per train step, in the XLA HLO of a simulated rank and in a counting gloo run,
next to Megatron-LM's. Per layer = (L+1 layers) - (L layers)."""

from __future__ import annotations

import math
import re
from typing import Any, Dict, List
from unittest import mock

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from nxdtp import comm, parallel_state
from nxdtp.grads import allreduce_sequence_parallel_gradients, clip_grad_norm
from nxdtp.models.bert import parallelize_bert
from nxdtp.utils import move_model_to_device

from .common import fmt_bytes, fresh, log, table
from .train_step import ADAMW, FULL, QUICK, SEED, build_dense, make_batch, shard

OPS = ("all-reduce", "all-gather", "reduce-scatter")
HLO_WORLD, HLO_RANK, HLO_TP = 2, 1, 2
BASE_LAYERS = 1
PHASES = ("forward", "backward", "sequence-parallel gradient sum", "clip", "optimizer")
_HLO_LINE = re.compile(r"=\s*(?P<result>.*?)\s(?P<op>all-reduce|all-gather|reduce-scatter)\((?P<operands>[^)]*)\)")
_SHAPE = re.compile(r"(?P<dtype>pred|[su](?:8|16|32|64)|bf16|f16|f32|f64)\[(?P<dims>[0-9,]*)\]")


def hlo_collectives(hlo: str) -> Dict[str, List[int]]:
    """{op: [count, bytes]} of an HLO module's collectives: the first operand of an all-reduce or reduce-scatter (a
    torch_xla all-reduce's second operand is the token), the result of an all-gather."""
    out: Dict[str, List[int]] = {}
    for m in _HLO_LINE.finditer(hlo):
        shape = _SHAPE.search(m["result"] if m["op"] == "all-gather" else m["operands"])
        entry = out.setdefault(m["op"], [0, 0])
        entry[0] += 1
        if shape:  # elements times the element's bits (pred: 8)
            bits = 8 if shape["dtype"] == "pred" else int(re.sub(r"\D", "", shape["dtype"]))
            entry[1] += math.prod(int(d) for d in filter(None, shape["dims"].split(","))) * bits // 8
    return out


def _subtract(a: Dict[str, List[int]], b: Dict[str, List[int]], k: int = 1) -> Dict[str, List[int]]:
    out = {op: [a.get(op, [0, 0])[i] - k * b.get(op, [0, 0])[i] for i in range(2)] for op in set(a) | set(b)}
    return {op: v for op, v in out.items() if v != [0, 0]}


def _trace_step(cfg, args, sequence_parallel: bool, hlo) -> Dict[str, Any]:
    import torch_xla

    device = torch_xla.device()
    model = parallelize_bert(build_dense(cfg, SEED), sequence_parallel=sequence_parallel, broadcast_replicated=False)
    model = move_model_to_device(model, device)
    batch = {k: v.to(device) for k, v in make_batch(cfg, args["seq"], args["batch"], SEED).items()
             if k != "attention_mask"}
    params = list(model.parameters())
    grads = lambda: [p.grad for p in params if p.grad is not None]  # noqa: E731
    loss = model(**batch).loss
    forward = hlo([loss])
    loss.backward()
    backward = hlo([loss] + grads())
    if sequence_parallel:
        allreduce_sequence_parallel_gradients(params)
    sp_sum = hlo([loss] + grads())
    clip_grad_norm(params, 1.0)
    step = hlo([loss] + grads())
    return {"forward": forward, "backward": _subtract(backward, forward),
            "sequence-parallel gradient sum": _subtract(sp_sum, backward), "clip": _subtract(step, sp_sum),
            "optimizer": {}}


def case_hlo(**args) -> Dict[str, Any]:
    """The HLO count, in a process of its own (PJRT_DEVICE=CPU); never executes a graph. The all-ones attention_mask
    is left out: transformers' mask code would execute a graph on it."""
    import torch_xla
    import torch_xla.debug.metrics as met

    def hlo(tensors):
        return hlo_collectives(torch_xla._XLAC._get_xla_tensors_hlo(list(tensors)))

    results = {}
    for sp in (False, True):
        for layers in (BASE_LAYERS, BASE_LAYERS + 1):
            with parallel_state.simulated_topology(HLO_WORLD, HLO_RANK, HLO_TP), \
                    comm.simulated_xla_runtime(HLO_WORLD, HLO_RANK):
                results[f"sp={sp},layers={layers}"] = _trace_step(dict(args["model_cfg"], num_hidden_layers=layers),
                                                                  args, sp, hlo)
    executed = met.counter_value("ExecuteComputation") or 0
    if executed:
        raise AssertionError(f"the HLO worker executed {executed} graphs; it must only trace")
    return {"results": results, "executed_graphs": executed}


# ---- (ii) the counting gloo run, in section 1's nxdtp and DTensor workers -------------------------------------------

class _Counter:
    """{phase: {op: [count, bytes of the full tensor]}}, with the op's measured argument (an all-reduce's buffer, an
    all-gather's output, a reduce-scatter's input) by torch.distributed function, or by functional collective."""

    DIST = {"all_reduce": ("all-reduce", 0, "tensor"), "broadcast": ("broadcast", 0, "tensor"),  # what nxdtp.comm calls
            "all_gather_into_tensor": ("all-gather", 0, "output_tensor"),
            "reduce_scatter_tensor": ("reduce-scatter", 1, "input")}
    FUNCTIONAL = {"all_reduce": "all-reduce", "all_gather_into_tensor": "all-gather",
                  "reduce_scatter_tensor": "reduce-scatter", "broadcast": "broadcast"}

    def __init__(self):
        self.phase, self.counts = "setup", {}

    def add(self, op: str, nbytes: int) -> None:
        entry = self.counts.setdefault(self.phase, {}).setdefault(op, [0, 0])
        entry[0] += 1
        entry[1] += int(nbytes)

    def torch_distributed(self):
        """Every torch.distributed collective of ``DIST``, counted on its way through."""
        def wrap(name, fn):
            op, index, keyword = self.DIST[name]

            def wrapper(*args, **kwargs):
                self.add(op, (args[index] if len(args) > index else kwargs[keyword]).nbytes)
                return fn(*args, **kwargs)
            return wrapper

        return mock.patch.multiple(dist, **{name: wrap(name, getattr(dist, name)) for name in self.DIST})

    def functional(self):
        """A dispatch mode counting DTensor's functional collectives (torch.ops._c10d_functional.*)."""
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func.overloadpacket)
                op = name.split(".", 1)[1] if name.startswith("_c10d_functional.") else "wait_tensor"
                if not op.startswith("wait_tensor"):
                    kind = next((k for k in counter.FUNCTIONAL if op.startswith(k)), None)  # unknown: 0 bytes
                    scale = int(args[1]) if kind == "all_gather_into_tensor" else 1
                    counter.add(counter.FUNCTIONAL.get(kind, op), args[0].nbytes * scale if kind else 0)
                return func(*args, **(kwargs or {}))

        return Mode()


def case_count_comm(kind: str, model_cfg, seq: int, batch: int, sequence_parallel: bool = False) -> Dict[str, Any]:
    """Collectives of the second of two train steps of a freshly sharded BERT, by phase and kind."""
    model = build_dense(model_cfg, SEED)
    clip = shard(kind, model, sequence_parallel=sequence_parallel)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    inputs, counter = make_batch(model_cfg, seq, batch, SEED), _Counter()
    for _ in range(2):  # the first step creates AdamW's state; count the second
        counter.counts.clear()
        with counter.functional() if kind == "dtensor" else counter.torch_distributed():
            optimizer.zero_grad(set_to_none=True)
            counter.phase = "forward"
            loss = model(**inputs).loss
            counter.phase = "backward"
            loss.backward()
            if sequence_parallel:
                counter.phase = "sequence-parallel gradient sum"
                allreduce_sequence_parallel_gradients(optimizer)
            counter.phase = "clip"
            clip(list(model.parameters()))
            counter.phase = "optimizer"
            optimizer.step()
    return {"counts": counter.counts, "loss": loss.item()}


def trace_hlo(spec: Dict[str, Any]) -> Dict[str, Any]:
    log("communication: tracing the HLO of a simulated rank (a process of its own, nothing executed)")
    return fresh(case_hlo, env={"PJRT_DEVICE": "CPU"}, model_cfg=spec["model"], seq=spec["seq"], batch=spec["batch"])[0]


def _per_layer(by_layers: Dict[int, Dict[str, Any]]) -> Dict[str, Any]:
    low, high = by_layers[BASE_LAYERS], by_layers[BASE_LAYERS + 1]
    per_layer = {p: _subtract(high.get(p, {}), low.get(p, {})) for p in PHASES}
    return {"per_layer": per_layer,
            "non_layer": {p: _subtract(low.get(p, {}), per_layer[p], BASE_LAYERS) for p in PHASES}}


def megatron_minimum(model_cfg, seq: int, batch: int, sequence_parallel: bool) -> Dict[str, Dict[str, List[int]]]:
    full = batch * seq * model_cfg["hidden_size"] * 4
    if not sequence_parallel:
        return {"forward": {"all-reduce": [2, 2 * full]}, "backward": {"all-reduce": [2, 2 * full]}}
    return {"forward": {"all-gather": [2, 2 * full], "reduce-scatter": [2, 2 * full]},
            "backward": {"all-gather": [4, 4 * full], "reduce-scatter": [2, 2 * full]}}


def run(ctx, hlo: Dict[str, Any] = None) -> Dict[str, Any]:
    """Both parts; ``hlo``: trace_hlo's result when it already ran (beside section 1, under --quick)."""
    spec = QUICK if ctx.quick else FULL
    hlo = hlo or trace_hlo(spec)
    sources = {f"hlo,sp={sp}": _per_layer({n: hlo["results"][f"sp={sp},layers={n}"]
                                           for n in (BASE_LAYERS, BASE_LAYERS + 1)}) for sp in (False, True)}
    for kind, name, sp in (("nxdtp", "gloo", False), ("nxdtp", "gloo", True), ("dtensor", "dtensor-gloo", False)):
        by_layers = {}
        for layers in (BASE_LAYERS, BASE_LAYERS + 1):
            log(f"communication: counting {kind} collectives, {layers} layer(s), sequence_parallel={sp}")
            answers = ctx.competitors.pool(kind).call(case_count_comm, kind=kind, seq=spec["seq"], batch=spec["batch"],
                                                      model_cfg=dict(spec["model"], num_hidden_layers=layers),
                                                      sequence_parallel=sp)
            if any(a["counts"] != answers[0]["counts"] for a in answers):
                raise AssertionError(f"{kind} ranks counted different collectives: {answers}")
            by_layers[layers] = answers[0]["counts"]
        sources[f"{name},sp={sp}"] = _per_layer(by_layers)
    megatron = {f"sp={sp}": megatron_minimum(spec["model"], spec["seq"], spec["batch"], sp) for sp in (False, True)}
    out = {"config": spec["model"], "seq": spec["seq"], "batch": spec["batch"], "tp": HLO_TP, "sources": sources,
           "megatron": megatron, "hlo_executed_graphs": hlo["executed_graphs"],
           "agreement": {f"sp={sp}": {p: sources[f"hlo,sp={sp}"]["per_layer"][p] == sources[f"gloo,sp={sp}"]
                                      ["per_layer"][p] for p in PHASES[:2]} for sp in (False, True)}}
    out["numbers"] = {f"{key.replace(',', '_').replace('=', '')}_{phase}_{op}_{what}": source["per_layer"][phase]
                      .get(op, [0, 0])[i] for key, source in sources.items() for phase in PHASES[:2]
                      for op in OPS + ("broadcast",) for i, what in enumerate(("count", "bytes"))}
    out["tables"] = _tables(out)
    return out


def _cells(counts: Dict[str, List[int]]) -> List[str]:
    # A bucketed collective grows with the layers without adding calls (the SP gradient sum).
    return [f"{c} ({fmt_bytes(b)})" if c else ("0" if not b else f"0 (+{fmt_bytes(b)} in an existing call)")
            for c, b in (counts.get(op, [0, 0]) for op in OPS)]


def _tables(out: Dict[str, Any]) -> List[Any]:
    labels = {"hlo": "nxdtp, XLA HLO", "gloo": "nxdtp, gloo run", "dtensor-gloo": "DTensor, gloo run"}
    rows = []
    for what in ("per layer", "not in layers"):
        for sp in (False, True):
            for phase in PHASES:
                mega = out["megatron"][f"sp={sp}"].get(phase) if what == "per layer" else None
                for src, label in labels.items():
                    source = out["sources"].get(f"{src},sp={sp}")
                    counts = source and source["per_layer" if what == "per layer" else "non_layer"][phase]
                    if counts or (source and mega is not None):
                        rows.append([f"{what}, {phase}", sp, label, *_cells(counts), "" if mega is None
                                     else counts == mega])
                if mega is not None:
                    rows.append([f"{what}, {phase}", sp, "Megatron-LM", *_cells(mega), ""])
    cfg = out["config"]
    return [f"Per train step of BertForPreTraining (hidden {cfg['hidden_size']}, seq {out['seq']}, batch "
            f"{out['batch']}, fp32), tp={out['tp']}: count (bytes of the full tensor), 2-layer model - 1-layer model. "
            f"HLO: rank {HLO_RANK} of a simulated world of {HLO_WORLD} ({out['hlo_executed_graphs']} graphs "
            "executed); gloo: 2 real ranks.",
            table(["what", "SP", "source", *OPS, "= Megatron-LM"], rows),
            "HLO and gloo counts per layer agree: " + ", ".join(
                f"SP {sp[3:]} {phase}: {ok}" for sp, by_phase in out["agreement"].items()
                for phase, ok in by_phase.items())]
