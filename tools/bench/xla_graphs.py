"""Section 4: XLA graphs per train step on XLA:CPU, distinct graphs over every rank of a simulated world, the compile
time of one graph; each part in a process of its own."""

from __future__ import annotations

import copy
import os
import time
from typing import Any, Dict, List

import torch

from nxdtp import comm, grads, parallel_state
from nxdtp.grads import clip_grad_norm
from nxdtp.models import parallelize_model
from nxdtp.models.bert import attention_bias, parallelize_bert
from nxdtp.optimizer import Lamb
from nxdtp.random import model_parallel_xla_manual_seed
from nxdtp.utils import move_model_to_device

from .common import ADAMW, BERT_LARGE, MAX_GRAD_NORM, SEED, fresh, hf_model, log, model_text, section, snake, table
from .train_step import build_dense, make_batch

STEPS, STEADY_FROM = 10, 2
COUNTERS = ("UncachedCompile", "CachedCompile", "ExecuteComputation")
SMALL = dict(model=dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, intermediate_size=512,
                        vocab_size=4096, max_position_embeddings=128, type_vocab_size=2), seq=64, batch=4)
TINY = dict(model=dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                       vocab_size=128, max_position_embeddings=32, type_vocab_size=2), seq=16, batch=2)
# --quick only: XLA:CPU compiles ~3x faster without LLVM's expensive passes; graph counts do not depend on them.
QUICK_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
VARIANTS = ("without attention_mask", "with attention_mask", "with attention_bias(attention_mask)")
RANKS_FULL = dict(world=32, tp=8, seq=64, batch=2,
                  bert=dict(BERT_LARGE, num_hidden_layers=2),
                  llama=dict(num_hidden_layers=2, hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
                             intermediate_size=4096, vocab_size=32000, max_position_embeddings=512))
RANKS_QUICK = dict(world=4, tp=2, seq=16, batch=2, bert=TINY["model"],
                   llama=dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=64, vocab_size=130, max_position_embeddings=32))
FAMILIES, PHASES = ("bert", "llama"), ("forward", "gradients", "step")


def case_steps(spec: Dict[str, Any]) -> Dict[str, Any]:
    return {variant: _variant_steps(variant, spec) for variant in VARIANTS}


def _variant_steps(variant: str, spec: Dict[str, Any]) -> Dict[str, Any]:
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    device = torch_xla.device()
    model = move_model_to_device(parallelize_bert(build_dense(spec["model"], SEED)), device)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    batch = {k: v.to(device) for k, v in make_batch(spec["model"], spec["seq"], spec["batch"], SEED).items()
             if variant != VARIANTS[0] or k != "attention_mask"}
    if variant == VARIANTS[2]:
        batch["attention_mask"] = attention_bias(batch["attention_mask"], torch.float32)
    torch_xla.sync()
    xm.wait_device_ops()
    met.clear_all()
    per_step, losses, seconds = [], [], []
    for _ in range(STEPS):
        before, start = {k: met.counter_value(k) or 0 for k in COUNTERS}, time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        clip_grad_norm(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        torch_xla.sync()
        xm.wait_device_ops()  # executions are counted when they finish
        seconds.append(time.perf_counter() - start)
        per_step.append({k: (met.counter_value(k) or 0) - v for k, v in before.items()})
        losses.append(loss)
    # Read after counting: the syncs materialised these tensors, so reading them executes nothing new.
    return {"per_step": per_step, "losses": [float(x.cpu()) for x in losses], "seconds": seconds}


def _dense_model(family: str, cfg: Dict[str, Any]):
    dropout = dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1) if family == "bert" else dict(
        attention_dropout=0.1)
    return hf_model(cfg, family, SEED, **dropout)


def _batch(family: str, cfg: Dict[str, Any], seq: int, batch: int, device) -> Dict[str, Any]:
    """Section 1's batch; BERT's with an additive 4-D mask, one sequence padded."""
    out = make_batch(cfg, seq, batch, SEED, family)
    if family == "bert":
        out["attention_mask"][0, seq - seq // 4:] = 0
        out["attention_mask"] = attention_bias(out["attention_mask"], torch.float32)
    return {k: v.to(device) for k, v in out.items()}


def _traced_step(family: str, dense, batch: Dict[str, Any], sequence_parallel: bool) -> Dict[str, List[Any]]:
    """One rank's train step as the BERT example takes it; its phases' tensors (nothing is executed)."""
    import torch_xla

    model = parallelize_model(copy.deepcopy(dense), sequence_parallel=sequence_parallel, broadcast_replicated=False)
    model_parallel_xla_manual_seed(SEED)
    model = move_model_to_device(model, torch_xla.device()).train()
    optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-4) if family == "bert"
                 else Lamb(model.parameters(), lr=1e-4, trust_clip=True))
    kwargs = dict(batch)
    if family == "bert":  # the example's global counts of masked tokens and sentences over the DP group
        labels = kwargs["labels"]
        counts = comm.all_reduce(torch.stack([(labels != -100).sum().float(), torch.tensor(
            float(labels.shape[0]), device=labels.device)]), parallel_state.data_parallel_group())
        kwargs.update(mlm_denominator=counts[0], nsp_denominator=counts[1])
    loss = model(**kwargs).loss
    loss.backward()
    if sequence_parallel:
        grads.allreduce_sequence_parallel_gradients(model)
    grads.allreduce_gradients(model)
    gradients = [p.grad for p in model.parameters()]
    norm = grads.clip_grad_norm(model.parameters(), 1.0)
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values()
             if isinstance(t, torch.Tensor) and t.device.type == "xla"]
    return {"forward": [loss], "gradients": gradients, "step": [loss, norm] + list(model.parameters()) + state}


def case_ranks(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Never executes a graph: traces every rank of a simulated world, then compiles (only) BERT's whole-step graph at
    tp=1 (a world of one: no collectives)."""
    import torch_xla
    import torch_xla.debug.metrics as met

    from nxdtp.xla_graphs import trace_every_rank

    census = {}
    for family in FAMILIES:
        dense = _dense_model(family, spec[family])
        batch = _batch(family, spec[family], spec["seq"], spec["batch"], torch_xla.device())
        for sp in (False, True):
            start = time.perf_counter()
            graphs = trace_every_rank(lambda: _traced_step(family, dense, batch, sp), spec["world"], spec["tp"])
            census[f"{family} sp={'on' if sp else 'off'}"] = {
                "distinct": {p: graphs.distinct(p) for p in PHASES}, "ranks_per_graph": graphs.rank_classes("step"),
                "trace_s": time.perf_counter() - start}
    device = torch_xla.device()
    batch = _batch("bert", spec["bert"], spec["seq"], spec["batch"], device)
    with parallel_state.simulated_topology(1, 0, 1):
        tensors = _traced_step("bert", _dense_model("bert", spec["bert"]), batch, False)["step"]
        met.clear_all()
        start = time.perf_counter()
        torch_xla._XLAC._xla_warm_up_cache(tensors, [str(device)])
        wall = time.perf_counter() - start
    metric = met.metric_data("CompileTime")
    return {"census": census, "compile": {"wall_s": wall, "compile_time_s": metric[1] / 1e9 if metric else None,
                                          "compiles": met.counter_value("UncachedCompile") or 0,
                                          "executed": met.counter_value("ExecuteComputation") or 0}}


def run(ctx) -> Dict[str, Any]:
    spec, ranks_spec = (TINY, RANKS_QUICK) if ctx.quick else (SMALL, RANKS_FULL)
    env = {"PJRT_DEVICE": "CPU"}
    if ctx.quick:
        env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {QUICK_XLA_FLAGS}".strip()
    log(f"xla graphs: {STEPS} steps on XLA:CPU, {len(VARIANTS)} variants (a process of its own)")
    variants = fresh(case_steps, tp=1, env=env, spec=spec)[0]
    log(f"xla graphs: every rank of a simulated tp={ranks_spec['tp']} x dp={ranks_spec['world'] // ranks_spec['tp']} "
        "world, BERT and Llama, SP off and on (a process of its own, nothing executed)")
    ranks = fresh(case_ranks, env=env, spec=ranks_spec)[0]
    for v in variants.values():
        steady = v["per_step"][STEADY_FROM:]
        executed = [s["ExecuteComputation"] for s in steady]
        v.update(max_executed_per_step_after=max(executed), min_executed_per_step_after=min(executed),
                 new_compiles_after=sum(s["UncachedCompile"] for s in steady), last_loss=v["losses"][-1])
        v["target_met"] = max(executed) == 1 == min(executed) and v["new_compiles_after"] == 0
    out = {"config": spec["model"], "seq": spec["seq"], "batch": spec["batch"], "steps": STEPS,
           "variants": variants, "ranks": dict(ranks, **{k: ranks_spec[k] for k in ("world", "tp", "seq", "batch")},
                                               models={f: ranks_spec[f] for f in FAMILIES})}
    return dict(out, **section(_tables(out), compile_time_s_tp1_bert_step=ranks["compile"]["compile_time_s"],
                               compile_executed_graphs=ranks["compile"]["executed"], **{
                                   snake(name, k): v[k] for name, v in variants.items() for k in (
                                       "min_executed_per_step_after", "max_executed_per_step_after",
                                       "new_compiles_after", "last_loss")}))


def _tables(out: Dict[str, Any]) -> List[Any]:
    cfg, variants, ranks = out["config"], out["variants"], out["ranks"]
    header = ["step"] + [f"{n}: {c}" for n in variants for c in COUNTERS + ("wall s",)]
    rows = [[i] + [x for v in variants.values() for x in [v["per_step"][i][k] for k in COUNTERS] + [v["seconds"][i]]]
            for i in range(out["steps"])]
    c = ranks["compile"]
    return [f"XLA:CPU, tp=1, BertForPreTraining ({model_text(cfg)}), seq {out['seq']}, batch {out['batch']}: counter "
            "deltas per train step.", table(header, rows, {h: ".3f" for h in header if h.endswith("wall s")}),
            "\n".join(f"{n}: from step {STEADY_FROM} on, executed graphs per step {v['min_executed_per_step_after']}-"
                      f"{v['max_executed_per_step_after']} (target 1), new compiles {v['new_compiles_after']} (target "
                      f"0): {'met' if v['target_met'] else 'MISSED'}; losses {v['losses'][0]:.5f} -> "
                      f"{v['losses'][-1]:.5f}." for n, v in variants.items()),
            f"Distinct graph hashes over all {ranks['world']} ranks of a simulated tp={ranks['tp']} x "
            f"dp={ranks['world'] // ranks['tp']} world (seq {ranks['seq']}, batch {ranks['batch']}); BERT "
            f"({model_text(ranks['models']['bert'])}) with AdamW, Llama ({model_text(ranks['models']['llama'])}) with "
            "nxdtp LAMB. Target: 1.",
            table(["model", *(f"distinct {p} graphs" for p in PHASES), "ranks per step graph",
                   "trace s (all ranks)|.1f"],
                  ([name, *(x["distinct"][p] for p in PHASES), " ".join(str(len(g)) for g in x["ranks_per_graph"]),
                    x["trace_s"]] for name, x in ranks["census"].items())),
            f"Compile time of BERT's whole-step graph at tp=1 on XLA:CPU, compiled, not executed: CompileTime "
            f"{c['compile_time_s']:.2f} s (wall {c['wall_s']:.2f} s, {c['compiles']} compile(s), {c['executed']} "
            "executions)."]
