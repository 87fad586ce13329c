"""Section 3: collectives per BERT layer per train step (forward + backward), counted two ways, next to Megatron's.

(i) XLA HLO of a simulated rank. In a separate process (PJRT_DEVICE=CPU) that executes nothing, rank 1 of a
    simulated world of 2 (tp=2) builds BertForPreTraining, shards it with ``parallelize_bert`` and traces one train
    step on the XLA device: the loss, ``backward()``, the sequence-parallel gradient sum (when on) and nxdtp's
    ``clip_grad_norm``. The XLA runtime is made to report the simulated world (``xr.world_size`` /
    ``xr.global_ordinal`` patched, as tests/test_xla.py does) so ``xm`` does not short-circuit collectives. The HLO
    text of growing sets of outputs ([loss]; + gradients; + the SP sum; + clipping) is read with
    ``_get_xla_tensors_hlo``, which compiles and executes nothing; the collective token is reset before each step,
    so each HLO holds every collective of the step exactly once and the differences give each phase's share. The
    batch goes in without its attention_mask (all ones: it changes no number), because transformers' SDPA mask code
    calls ``padding_mask.all()`` on it, which would execute a (collective-free) graph; the worker checks that the
    ExecuteComputation counter stays at 0.
(ii) A counting gloo run. The nxdtp workers of section 1 (2 real ranks) wrap the torch.distributed functions
    nxdtp.comm calls (all_reduce, all_gather_into_tensor, reduce_scatter_tensor, broadcast, ...) and count each call
    by phase over the second of two train steps (forward, backward, SP gradient sum, clip, AdamW).

Bytes are those of the full (unsharded) tensor a collective handles: the buffer of an all-reduce, the gathered output
of an all-gather, the input of a reduce-scatter (what Megatron's analysis calls the message size; a ring moves
2(n-1)/n of it per rank for an all-reduce, (n-1)/n for the others). HLO all-reduces carry the collective token as a
second scalar operand; it is not counted.

Per layer = (model with L+1 layers) - (model with L layers); the rest (embedding, loss, MLM head, norm) is the
L-layer count minus L x per layer. For context, the DTensor workers count their functional collectives the same way
(TP without sequence parallelism).

Megatron-LM's counts per layer, derived from its design (docs/performance.md, section 3). Without sequence
parallelism: 2 all-reduces forward (attention output, MLP output) and 2 backward (the input gradients of the fused QKV
and of the MLP's first column layer), each of batch x seq x hidden. With sequence parallelism: forward 2 all-gathers
(into QKV and into the MLP) + 2 reduce-scatters (out of the attention and MLP row layers); backward 2 reduce-scatters
(the column layers' input gradients), 2 all-gathers (the row layers' output gradients) and 2 all-gathers more: its
column layers save only their sequence shard and all-gather it again for the weight gradient. nxdtp does the same (its
Q, K and V share one re-gather), so the sequence-parallel backward has 4 all-gathers + 2 reduce-scatters.
"""

from __future__ import annotations

import os
import re
import tempfile
from typing import Any, Dict, List, Tuple

from .common import fmt_bytes, log, markdown_table, run_worker_script

OPS = ("all-reduce", "all-gather", "reduce-scatter", "broadcast")
HLO_WORLD, HLO_RANK, HLO_TP = 2, 1, 2
BASE_LAYERS = 1  # counts with L = 1 and L + 1 = 2 layers
PHASES = ("forward", "backward", "sequence-parallel gradient sum", "clip", "optimizer")

_HLO_LINE = re.compile(r"=\s*(?P<result>.*?)\s(?P<op>all-reduce|all-gather|reduce-scatter)\((?P<operands>[^)]*)\)")
_SHAPE = re.compile(r"(?P<dtype>pred|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64)\[(?P<dims>[0-9,]*)\]")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8}


def _shape_bytes(match) -> int:
    n = 1
    for d in filter(None, match.group("dims").split(",")):
        n *= int(d)
    return n * _DTYPE_BYTES[match.group("dtype")]


def hlo_collectives(hlo: str) -> Dict[str, List[int]]:
    """{op: [count, bytes]} of the collectives in an HLO module's text (full-tensor bytes, token excluded)."""
    out: Dict[str, List[int]] = {}
    for m in _HLO_LINE.finditer(hlo):
        op = m.group("op")
        # all-reduce and reduce-scatter: the first operand is the full tensor (a torch_xla all-reduce's second operand
        # is the collective token); all-gather: the result is.
        shapes = list(_SHAPE.finditer(m.group("result") if op == "all-gather" else m.group("operands")))
        entry = out.setdefault(op, [0, 0])
        entry[0] += 1
        entry[1] += _shape_bytes(shapes[0]) if shapes else 0
    return out


def _subtract(a: Dict[str, List[int]], b: Dict[str, List[int]]) -> Dict[str, List[int]]:
    out = {}
    for op in set(a) | set(b):
        c = [a.get(op, [0, 0])[i] - b.get(op, [0, 0])[i] for i in range(2)]
        if c != [0, 0]:
            out[op] = c
    return out


def _scale(a: Dict[str, List[int]], k: int) -> Dict[str, List[int]]:
    return {op: [v[0] * k, v[1] * k] for op, v in a.items()}


# ---- (i) the HLO worker (its own process, PJRT_DEVICE=CPU; never executes a graph) -----------------------------------

def hlo_worker(args: Dict[str, Any]) -> Dict[str, Any]:
    from unittest import mock

    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    import torch_xla.runtime as xr

    from nxdtp import parallel_state
    from nxdtp.grads import allreduce_sequence_parallel_gradients, clip_grad_norm
    from nxdtp.models.bert import parallelize_bert
    from nxdtp.utils import move_model_to_device

    from .train_step import build_dense_bert, make_batch

    device = torch_xla.device()

    def reset_token():
        torch_xla._XLAC._set_all_reduce_token(xm._get_device_context().device, None)

    def hlo(tensors):
        return hlo_collectives(torch_xla._XLAC._get_xla_tensors_hlo(list(tensors)))

    results = {}
    for sequence_parallel in (False, True):
        for layers in (BASE_LAYERS, BASE_LAYERS + 1):
            cfg = dict(args["model_cfg"], num_hidden_layers=layers)
            with parallel_state.simulated_topology(HLO_WORLD, HLO_RANK, HLO_TP), \
                    mock.patch.object(xr, "world_size", lambda: HLO_WORLD), \
                    mock.patch.object(xr, "global_ordinal", lambda: HLO_RANK):
                model = parallelize_bert(build_dense_bert(cfg, args["seed"]), sequence_parallel=sequence_parallel,
                                         broadcast_replicated=False)
                model = move_model_to_device(model, device)
                # No attention_mask (the batch has no padding, so it is all ones and changes nothing): with one,
                # transformers' SDPA mask code calls padding_mask.all(), which executes a small graph.
                batch = {k: v.to(device) for k, v in make_batch(cfg, args["seq"], args["batch"], args["seed"]).items()
                         if k != "attention_mask"}
                params = list(model.parameters())
                reset_token()
                loss = model(**batch).loss
                forward = hlo([loss])
                loss.backward()
                grads = [p.grad for p in params if p.grad is not None]
                backward = hlo([loss] + grads)
                if sequence_parallel:
                    allreduce_sequence_parallel_gradients(params)
                sp_sum = hlo([loss] + [p.grad for p in params if p.grad is not None])
                clip_grad_norm(params, 1.0)
                step = hlo([loss] + [p.grad for p in params if p.grad is not None])
                reset_token()
            results[f"sp={sequence_parallel},layers={layers}"] = {
                "forward": forward, "backward": _subtract(backward, forward),
                "sequence-parallel gradient sum": _subtract(sp_sum, backward), "clip": _subtract(step, sp_sum),
                "optimizer": {}}
            del model, batch, params, loss
    executed = met.counter_value("ExecuteComputation") or 0
    if executed:
        raise AssertionError(f"the HLO worker executed {executed} graphs; it must only trace")
    return {"results": results, "world": HLO_WORLD, "rank": HLO_RANK, "tp": HLO_TP,
            "executed_graphs": executed, "torch": torch.__version__}


# ---- driver ----------------------------------------------------------------------------------------------------------

def _per_layer(by_layers: Dict[int, Dict[str, Dict[str, List[int]]]]) -> Tuple[Dict, Dict]:
    """(per-layer counts, non-layer counts) by phase, from the L and L+1 layer counts."""
    low, high = by_layers[BASE_LAYERS], by_layers[BASE_LAYERS + 1]
    per_layer, rest = {}, {}
    for phase in PHASES:
        per_layer[phase] = _subtract(high.get(phase, {}), low.get(phase, {}))
        rest[phase] = _subtract(low.get(phase, {}), _scale(per_layer[phase], BASE_LAYERS))
    return per_layer, rest


def megatron_minimum(model_cfg, seq, batch, sequence_parallel: bool) -> Dict[str, Dict[str, List[int]]]:
    """Megatron-LM's collectives per transformer layer (module docstring), each of the full batch x seq x hidden."""
    full = batch * seq * model_cfg["hidden_size"] * 4
    if not sequence_parallel:
        return {"forward": {"all-reduce": [2, 2 * full]}, "backward": {"all-reduce": [2, 2 * full]}}
    # Backward: the two mirrors of forward's pair, plus one re-gather of the sequence shard per column layer (QKV, MLP).
    return {"forward": {"all-gather": [2, 2 * full], "reduce-scatter": [2, 2 * full]},
            "backward": {"all-gather": [4, 4 * full], "reduce-scatter": [2, 2 * full]}}


def trace_hlo(spec: Dict[str, Any], seed: int) -> Dict[str, Any]:
    """Part (i), in its own process."""
    log("communication: tracing the HLO of a simulated rank (separate process, nothing executed)")
    common = dict(model_cfg=spec["model"], seq=spec["seq"], batch=spec["batch"], seed=seed)
    with tempfile.TemporaryDirectory(prefix="bench_hlo_") as tmp:
        return run_worker_script("hlo", common, os.path.join(tmp, "hlo.json"), env={"PJRT_DEVICE": "CPU"})


def run(competitors, spec: Dict[str, Any], seed: int, hlo: Dict[str, Any] = None) -> Dict[str, Any]:
    """Both parts; ``hlo`` is trace_hlo's result when it already ran (in parallel, under --quick)."""
    common = dict(model_cfg=spec["model"], seq=spec["seq"], batch=spec["batch"], seed=seed)
    out: Dict[str, Any] = {"config": spec["model"], "seq": spec["seq"], "batch": spec["batch"], "tp": HLO_TP,
                           "layers_compared": [BASE_LAYERS, BASE_LAYERS + 1], "sources": {}}
    if hlo is None:
        hlo = trace_hlo(spec, seed)
    out["hlo_world"] = {"world": hlo["world"], "rank": hlo["rank"], "tp": hlo["tp"],
                        "executed_graphs": hlo["executed_graphs"]}
    for sp in (False, True):
        by_layers = {n: hlo["results"][f"sp={sp},layers={n}"] for n in (BASE_LAYERS, BASE_LAYERS + 1)}
        per_layer, rest = _per_layer(by_layers)
        out["sources"][f"hlo,sp={sp}"] = {"per_layer": per_layer, "non_layer": rest, "raw": by_layers}

    for kind, sps in (("nxdtp", (False, True)), ("dtensor", (False,))):
        group = competitors.get(kind)
        for sp in sps:
            by_layers = {}
            for layers in (BASE_LAYERS, BASE_LAYERS + 1):
                log(f"communication: counting {kind} collectives, {layers} layer(s), sequence_parallel={sp}")
                cfg = dict(spec["model"], num_hidden_layers=layers)
                answers = group.call("count_comm", **dict(common, model_cfg=cfg), sequence_parallel=sp)
                if any(a["counts"] != answers[0]["counts"] for a in answers):
                    raise AssertionError(f"{kind} ranks counted different collectives: {answers}")
                by_layers[layers] = answers[0]["counts"]
            per_layer, rest = _per_layer(by_layers)
            name = "gloo" if kind == "nxdtp" else "dtensor-gloo"
            out["sources"][f"{name},sp={sp}"] = {"per_layer": per_layer, "non_layer": rest, "raw": by_layers}
    out["megatron"] = {f"sp={sp}": megatron_minimum(spec["model"], spec["seq"], spec["batch"], sp)
                       for sp in (False, True)}
    out["agreement"] = {
        f"sp={sp}": {phase: out["sources"][f"hlo,sp={sp}"]["per_layer"][phase] ==
                     out["sources"][f"gloo,sp={sp}"]["per_layer"][phase] for phase in ("forward", "backward")}
        for sp in (False, True)}
    out["matches_megatron"] = {
        f"sp={sp}": {src: all(out["sources"][f"{src},sp={sp}"]["per_layer"][phase] ==
                              out["megatron"][f"sp={sp}"][phase] for phase in ("forward", "backward"))
                     for src in ("hlo", "gloo")} for sp in (False, True)}
    numbers = {}
    for key, source in out["sources"].items():
        for phase in ("forward", "backward"):
            for op in OPS:
                count, nbytes = source["per_layer"][phase].get(op, [0, 0])
                tag = key.replace(",", "_").replace("=", "")
                numbers[f"{tag}_{phase}_{op}_count"] = count
                numbers[f"{tag}_{phase}_{op}_bytes"] = nbytes
    out["numbers"] = numbers
    return out


def _cell(counts: Dict[str, List[int]], op: str) -> str:
    count, nbytes = counts.get(op, [0, 0])
    if count == 0:
        # A bucketed collective grows with the layers without adding calls (the SP gradient sum).
        return "0" if nbytes == 0 else f"0 (+{fmt_bytes(nbytes)} in an existing call)"
    return f"{count} ({fmt_bytes(nbytes)})"


def tables(result: Dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [f"Per train step of BertForPreTraining (hidden {cfg['hidden_size']}, seq {result['seq']}, batch "
             f"{result['batch']}, fp32), tp={result['tp']}: count (bytes of the full tensor). Per layer = "
             f"{result['layers_compared'][1]}-layer model - {result['layers_compared'][0]}-layer model. HLO: rank "
             f"{result['hlo_world']['rank']} of a simulated world of {result['hlo_world']['world']} "
             f"({result['hlo_world']['executed_graphs']} graphs executed); gloo: 2 real ranks, torch.distributed calls "
             "counted.", ""]
    rows = []
    sources = [("hlo", "nxdtp, XLA HLO"), ("gloo", "nxdtp, gloo run"), ("dtensor-gloo", "DTensor, gloo run")]
    for sp in (False, True):
        for phase in ("forward", "backward"):
            mega = result["megatron"][f"sp={sp}"][phase]
            for src, label in sources:
                key = f"{src},sp={sp}"
                if key not in result["sources"]:
                    continue
                counts = result["sources"][key]["per_layer"][phase]
                rows.append([f"per layer, {phase}", "on" if sp else "off", label]
                            + [_cell(counts, op) for op in OPS[:3]] + ["yes" if counts == mega else "no"])
            rows.append([f"per layer, {phase}", "on" if sp else "off", "Megatron-LM"]
                        + [_cell(mega, op) for op in OPS[:3]] + [""])
    for sp in (False, True):
        for src, label in sources:
            key = f"{src},sp={sp}"
            if key not in result["sources"]:
                continue
            for phase in PHASES[2:]:
                counts = result["sources"][key]["per_layer"][phase]
                if counts:
                    rows.append([f"per layer, {phase}", "on" if sp else "off", label]
                                + [_cell(counts, op) for op in OPS[:3]] + [""])
    for sp in (False, True):
        for src, label in sources:
            key = f"{src},sp={sp}"
            if key not in result["sources"]:
                continue
            rest = result["sources"][key]["non_layer"]
            for phase in PHASES:
                if rest.get(phase):
                    rows.append([f"not in layers, {phase}", "on" if sp else "off", label]
                                + [_cell(rest[phase], op) for op in OPS[:3]] + [""])
    lines.append(markdown_table(["what", "SP", "source", "all-reduce", "all-gather", "reduce-scatter",
                                 "= Megatron-LM"], rows))
    agree = result["agreement"]
    lines += ["", "HLO and gloo counts per layer agree: " + ", ".join(
        f"SP {'on' if sp == 'sp=True' else 'off'} {phase}: {'yes' if ok else 'NO'}"
        for sp, phases in agree.items() for phase, ok in phases.items()) + "."]
    return "\n".join(lines)
