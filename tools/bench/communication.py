"""Section 3: collectives per BERT layer per train step, in the XLA HLO of a simulated rank and in a counting gloo run,
next to Megatron-LM's. Per layer = (L+1 layers) - (L layers)."""

from __future__ import annotations

import math
import re
from typing import Any, Dict, List

from torch.utils._python_dispatch import TorchDispatchMode

from nxdtp import comm, parallel_state
from nxdtp.grads import allreduce_sequence_parallel_gradients, clip_grad_norm
from nxdtp.models.bert import parallelize_bert
from nxdtp.utils import move_model_to_device

from .common import SEED, fmt_bytes, fresh, log, table
from .train_step import FULL, QUICK, build_dense, case_build, case_release, case_step, make_batch

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
    params, loss = list(model.parameters()), model(**batch).loss
    seen = [hlo([loss])]  # the collectives in the graph after forward, backward, the SP sum, clip: each less the last
    sp_sum = (lambda: allreduce_sequence_parallel_gradients(params)) if sequence_parallel else (lambda: None)
    for action in (loss.backward, sp_sum, lambda: clip_grad_norm(params, 1.0)):
        action()
        seen.append(hlo([loss] + [p.grad for p in params if p.grad is not None]))
    return {"forward": seen[0], **{p: _subtract(b, a) for p, a, b in zip(PHASES[1:4], seen, seen[1:])}, "optimizer": {}}


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

class _Counter(TorchDispatchMode):
    """{phase: {op: [count, bytes of the full tensor]}} of the collectives dispatched within: torch.distributed's (what
    nxdtp.comm calls), or with ``functional`` DTensor's (torch.ops._c10d_functional.*), each by its measured argument
    (an all-reduce's buffer, an all-gather's output, a reduce-scatter's input)."""

    C10D = {"allreduce_": ("all-reduce", 0), "broadcast_": ("broadcast", 0), "_allgather_base_": ("all-gather", 0),
            "_reduce_scatter_base_": ("reduce-scatter", 1)}  # op: (its name here, the index of its measured argument)
    FUNCTIONAL = {"all_reduce": "all-reduce", "all_gather_into_tensor": "all-gather",
                  "reduce_scatter_tensor": "reduce-scatter", "broadcast": "broadcast"}

    def __init__(self, functional: bool):
        super().__init__()
        self.phase, self.counts, self.functional = "setup", {}, functional

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        library, _, op = str(func.overloadpacket).partition(".")
        if self.functional and library == "_c10d_functional" and not op.startswith("wait_tensor"):
            kind = next((k for k in self.FUNCTIONAL if op.startswith(k)), None)  # unknown: 0 bytes
            scale = int(args[1]) if kind == "all_gather_into_tensor" else 1
            self.add(self.FUNCTIONAL.get(kind, op), args[0].nbytes * scale if kind else 0)
        elif not self.functional and library == "c10d" and op in self.C10D:
            name, index = self.C10D[op]
            self.add(name, (args[index][0] if isinstance(args[index], list) else args[index]).nbytes)
        return func(*args, **(kwargs or {}))

    def add(self, op: str, nbytes: int) -> None:
        entry = self.counts.setdefault(self.phase, {}).setdefault(op, [0, 0])
        entry[0] += 1
        entry[1] += int(nbytes)


def case_count_comm(kind: str, model_cfg, seq: int, batch: int, sequence_parallel: bool = False) -> Dict[str, list]:
    """Collectives of the second of two of section 1's train steps of a freshly sharded BERT, by phase and kind."""
    case_build(kind, model_cfg, seq, batch, sequence_parallel=sequence_parallel)
    for _ in range(2):  # the first step creates AdamW's state; count the second
        with _Counter(functional=kind == "dtensor") as counter:
            case_step(counter=counter)
    case_release()
    return counter.counts


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
            if any(a != answers[0] for a in answers):
                raise AssertionError(f"{kind} ranks counted different collectives: {answers}")
            by_layers[layers] = answers[0]
        sources[f"{name},sp={sp}"] = _per_layer(by_layers)
    megatron = {f"sp={sp}": megatron_minimum(spec["model"], spec["seq"], spec["batch"], sp) for sp in (False, True)}
    out = {"config": spec["model"], "seq": spec["seq"], "batch": spec["batch"], "tp": HLO_TP, "sources": sources,
           "megatron": megatron, "hlo_executed_graphs": hlo["executed_graphs"],
           "agreement": {f"sp={sp}": {p: sources[f"hlo,sp={sp}"]["per_layer"][p] == sources[f"gloo,sp={sp}"]
                                      ["per_layer"][p] for p in PHASES[:2]} for sp in (False, True)}}
    out["numbers"] = {f"{key.replace(',', '_').replace('=', '')}_{phase}_{op}_{what}": source["per_layer"][phase]
                      .get(op, [0, 0])[i] for key, source in sources.items() for phase in PHASES[:2]
                      for op in OPS + ("broadcast",) for i, what in enumerate(("count", "bytes"))}
    return dict(out, tables=_tables(out))


def _cells(counts: Dict[str, List[int]]) -> List[str]:
    # A bucketed collective grows with the layers without adding calls (the SP gradient sum).
    return [f"{c} ({fmt_bytes(b)})" if c else ("0" if not b else f"0 (+{fmt_bytes(b)} in an existing call)")
            for c, b in (counts.get(op, [0, 0]) for op in OPS)]


def _tables(out: Dict[str, Any]) -> List[Any]:
    labels = {"hlo": "nxdtp, XLA HLO", "gloo": "nxdtp, gloo run", "dtensor-gloo": "DTensor, gloo run"}
    rows = []
    for (what, part), sp, phase in ((w, sp, p) for w in (("per layer", "per_layer"), ("not in layers", "non_layer"))
                                    for sp in (False, True) for p in PHASES):
        mega = out["megatron"][f"sp={sp}"].get(phase) if part == "per_layer" else None
        for src, label in labels.items():
            counts = (source := out["sources"].get(f"{src},sp={sp}")) and source[part][phase]
            if counts or (source and mega is not None):
                rows.append([f"{what}, {phase}", sp, label, *_cells(counts), "" if mega is None else counts == mega])
        rows += [[f"{what}, {phase}", sp, "Megatron-LM", *_cells(mega), ""]] if mega is not None else []
    cfg = out["config"]
    return [f"Per train step of BertForPreTraining (hidden {cfg['hidden_size']}, seq {out['seq']}, batch "
            f"{out['batch']}, fp32), tp={out['tp']}: count (bytes of the full tensor), 2-layer model - 1-layer model. "
            f"HLO: rank {HLO_RANK} of a simulated world of {HLO_WORLD} ({out['hlo_executed_graphs']} graphs "
            "executed); gloo: 2 real ranks.",
            table(["what", "SP", "source", *OPS, "= Megatron-LM"], rows),
            "HLO and gloo counts per layer agree: " + ", ".join(
                f"SP {sp[3:]} {phase}: {ok}" for sp, by_phase in out["agreement"].items()
                for phase, ok in by_phase.items())]
