"""Section 4: XLA graphs. (a) Graphs compiled and executed per train step on XLA:CPU (PJRT_DEVICE=CPU, tp=1, one
process). (b) Distinct graphs over all ranks of simulated worlds, and the compile time of one graph.

(a) A separate process joins a gloo world of 1, calls ``initialize_model_parallel(1)``, shards a small
BertForPreTraining with ``parallelize_bert`` (tp=1), moves it with ``move_model_to_device`` and runs 10 train steps:
``zero_grad``, forward (the loss), ``backward()``, nxdtp's ``clip_grad_norm``, AdamW ``step()``, ``torch_xla.sync()``,
then ``xm.wait_device_ops()`` (executions are counted when they finish). Per step it reads the deltas of the
``torch_xla.debug.metrics`` counters UncachedCompile, CachedCompile and ExecuteComputation (exact counters; the
ExecuteTime metric is asynchronous and not used). Target: from step 2 on (0-based), 1 executed graph and 0 new
compiles per step.

(b) Another process, which executes nothing, traces one train step (forward with dropout, backward, the SP and DP
gradient all-reduces, ``clip_grad_norm``, the optimizer step) for every rank of a simulated tp=8 x dp=4 world with
``nxdtp.xla_graphs.trace_every_rank`` and counts the distinct graph hashes (torch_xla's compile-cache key) of the
forward, the gradients and the whole step: BERT-large-shaped layers (``BertForPreTraining``, hidden 1024, 16 heads,
intermediate 4096, vocab 30522, 2 layers: every layer traces the same ops, so more layers add no new kind of
difference) with AdamW, and a Llama-shaped decoder (hidden 1024, 16 heads, 4 KV heads, so each KV head is copied on 2
TP ranks, intermediate 4096, vocab 32000, 2 layers) with nxdtp's LAMB; sequence parallelism off and on. Then it
compiles, without executing, the whole-step graph of the BERT model at tp=1 (``_xla_warm_up_cache``) and reads
torch_xla's CompileTime metric: the time one graph costs to compile on XLA:CPU. Target: 1 graph for every rank.
"""

from __future__ import annotations

import datetime
import re
from typing import Any, Dict

from .common import markdown_table

STEPS = 10
STEADY_FROM = 2
COUNTERS = ("UncachedCompile", "CachedCompile", "ExecuteComputation")
SMALL = dict(model=dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, intermediate_size=512,
                        vocab_size=4096, max_position_embeddings=128, type_vocab_size=2), seq=64, batch=4)
TINY = dict(model=dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                       vocab_size=128, max_position_embeddings=32, type_vocab_size=2), seq=16, batch=2)


# --quick only: XLA:CPU compiles ~3x faster without LLVM's expensive passes.
QUICK_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# A real batch has padding, so it needs a mask: the 2-D form makes transformers read a value back every forward (a
# second graph per step); nxdtp.models.bert.attention_bias gives the same mask in 4-D form, which it uses as given.
VARIANTS = ("without attention_mask", "with attention_mask", "with attention_bias(attention_mask)")


def worker(args: Dict[str, Any]) -> Dict[str, Any]:
    if args.get("mode") == "ranks":
        return ranks_worker(args)
    return steps_worker(args)


def steps_worker(args: Dict[str, Any]) -> Dict[str, Any]:
    import time

    import torch
    import torch.distributed as dist
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    from nxdtp import parallel_state
    from nxdtp.grads import clip_grad_norm
    from nxdtp.models.bert import attention_bias, parallelize_bert
    from nxdtp.utils import move_model_to_device

    from .train_step import ADAMW, MAX_GRAD_NORM, build_dense_bert, make_batch

    # A world of one needs no port: its store lives in this process.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    device = torch_xla.device()
    out = {}
    try:
        for variant in VARIANTS:
            model = parallelize_bert(build_dense_bert(args["model_cfg"], args["seed"]))
            model = move_model_to_device(model, device)
            optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
            batch = {k: v.to(device) for k, v in make_batch(args["model_cfg"], args["seq"], args["batch"],
                                                             args["seed"]).items()
                     if variant != "without attention_mask" or k != "attention_mask"}
            if variant.startswith("with attention_bias"):
                batch["attention_mask"] = attention_bias(batch["attention_mask"], torch.float32)
            torch_xla.sync()
            xm.wait_device_ops()
            met.clear_all()
            per_step, losses, seconds = [], [], []
            for _ in range(args["steps"]):
                before = {k: met.counter_value(k) or 0 for k in COUNTERS}
                start = time.perf_counter()
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
            # After counting: these tensors were materialised by the syncs; reading them executes nothing new.
            out[variant] = {"per_step": per_step, "losses": [float(x.cpu()) for x in losses], "seconds": seconds}
            del model, optimizer, batch, losses
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return out


# ---- (b) distinct graphs over every rank of a simulated world --------------------------------------------------------

BERT_LARGE_LAYERS = dict(num_hidden_layers=2, hidden_size=1024, num_attention_heads=16, intermediate_size=4096,
                         vocab_size=30522, max_position_embeddings=512, type_vocab_size=2)
LLAMA_LAYERS = dict(num_hidden_layers=2, hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
                    intermediate_size=4096, vocab_size=32000, max_position_embeddings=512)
RANKS_FULL = dict(world=32, tp=8, seq=64, batch=2, bert=BERT_LARGE_LAYERS, llama=LLAMA_LAYERS)
RANKS_QUICK = dict(world=4, tp=2, seq=16, batch=2, bert=TINY["model"],
                   llama=dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=64, vocab_size=130, max_position_embeddings=32))
FAMILIES = ("bert", "llama")
PHASES = ("forward", "gradients", "step")


def _dense_model(family: str, cfg: Dict[str, Any], seed: int):
    import torch
    import transformers

    torch.manual_seed(seed)
    if family == "bert":
        return transformers.BertForPreTraining(transformers.BertConfig(**cfg, hidden_dropout_prob=0.1,
                                                                       attention_probs_dropout_prob=0.1))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg, attention_dropout=0.1))


def _batch(family: str, cfg: Dict[str, Any], seq: int, batch: int, seed: int, device):
    import torch

    from nxdtp.models.bert import attention_bias

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq), generator=g)
    if family == "llama":
        return {"input_ids": ids.to(device), "labels": ids.to(device)}
    labels = torch.full((batch, seq), -100)
    labels[:, 1::7] = ids[:, 1::7]
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, seq - seq // 4:] = 0
    return {"input_ids": ids.to(device), "token_type_ids": (torch.arange(seq) >= seq // 2).long().expand(batch, seq)
            .to(device), "attention_mask": attention_bias(mask.to(device), torch.float32),
            "labels": labels.to(device), "next_sentence_label": (torch.arange(batch) % 2).to(device)}


def _traced_step(family: str, dense, batch: Dict[str, Any], sequence_parallel: bool, seed: int):
    """One rank's train step as the BERT example takes it; returns its phases' tensors (nothing is executed)."""
    import copy

    import torch
    import torch_xla

    from nxdtp import comm, grads, parallel_state
    from nxdtp.models import parallelize_model
    from nxdtp.optimizers import Lamb
    from nxdtp.random import model_parallel_xla_manual_seed
    from nxdtp.utils import move_model_to_device

    model = parallelize_model(copy.deepcopy(dense), sequence_parallel=sequence_parallel, broadcast_replicated=False)
    model_parallel_xla_manual_seed(seed)
    model = move_model_to_device(model, torch_xla.device()).train()
    optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-4) if family == "bert"
                 else Lamb(model.parameters(), lr=1e-4, trust_clip=True))
    kwargs = dict(batch)
    if family == "bert":  # the example's global counts of masked tokens and sentences over the DP group
        counts = comm.all_reduce(torch.stack([(kwargs["labels"] != -100).sum().float(),
                                              torch.tensor(float(kwargs["labels"].shape[0]),
                                                           device=kwargs["labels"].device)]),
                                 parallel_state.data_parallel_group())
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


def ranks_worker(args: Dict[str, Any]) -> Dict[str, Any]:
    """Never executes a graph: traces every rank of a simulated world, then compiles (only) one tp=1 graph."""
    import time

    import torch_xla
    import torch_xla.debug.metrics as met

    from nxdtp import parallel_state
    from nxdtp.xla_graphs import trace_every_rank

    spec, seed = args["spec"], args["seed"]
    out: Dict[str, Any] = {"census": {}}
    device = torch_xla.device()
    for family in FAMILIES:
        cfg = spec[family]
        dense = _dense_model(family, cfg, seed)
        batch = _batch(family, cfg, spec["seq"], spec["batch"], seed, device)
        for sequence_parallel in (False, True):
            start = time.perf_counter()
            graphs = trace_every_rank(lambda: _traced_step(family, dense, batch, sequence_parallel, seed),
                                      spec["world"], spec["tp"])
            out["census"][f"{family} sp={'on' if sequence_parallel else 'off'}"] = {
                "distinct": {p: graphs.distinct(p) for p in PHASES},
                "ranks_per_graph": graphs.rank_classes("step"), "trace_s": time.perf_counter() - start}
        del dense, batch
    # Compile, without executing, the whole-step graph of the BERT model at tp=1 (a world of one: no collectives).
    dense = _dense_model("bert", spec["bert"], seed)
    batch = _batch("bert", spec["bert"], spec["seq"], spec["batch"], seed, device)
    with parallel_state.simulated_topology(1, 0, 1):
        tensors = _traced_step("bert", dense, batch, False, seed)["step"]
        met.clear_all()
        start = time.perf_counter()
        torch_xla._XLAC._xla_warm_up_cache(tensors, [str(device)])
        wall = time.perf_counter() - start
    compile_metric = met.metric_data("CompileTime")
    out["compile"] = {"wall_s": wall, "compile_time_s": compile_metric[1] / 1e9 if compile_metric else None,
                      "compiles": met.counter_value("UncachedCompile") or 0,
                      "executed": met.counter_value("ExecuteComputation") or 0}
    return out


def _steady(variant: Dict[str, Any]) -> Dict[str, Any]:
    steady = variant["per_step"][STEADY_FROM:]
    executed = [s["ExecuteComputation"] for s in steady]
    compiles = sum(s["UncachedCompile"] for s in steady)
    return {"max_executed_per_step_after": max(executed), "min_executed_per_step_after": min(executed),
            "new_compiles_after": compiles, "compiles_step0": variant["per_step"][0]["UncachedCompile"],
            "target_met": max(executed) == 1 and min(executed) == 1 and compiles == 0}


def run(quick: bool, seed: int) -> Dict[str, Any]:
    import os
    import tempfile

    from .common import log, run_worker_script

    spec = TINY if quick else SMALL
    args = dict(model_cfg=spec["model"], seq=spec["seq"], batch=spec["batch"], seed=seed, steps=STEPS)
    log(f"xla graphs: {STEPS} steps on XLA:CPU, {len(VARIANTS)} variants (separate process)")
    with tempfile.TemporaryDirectory(prefix="bench_xla_") as tmp:
        env = {"PJRT_DEVICE": "CPU"}
        if quick:  # compiling is most of this section's time; the graph counts do not depend on optimisation
            env["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + QUICK_XLA_FLAGS).strip()
        variants = run_worker_script("xla-graphs", dict(args, mode="steps"), os.path.join(tmp, "xla.json"), env=env)
        ranks_spec = RANKS_QUICK if quick else RANKS_FULL
        log(f"xla graphs: every rank of a simulated tp={ranks_spec['tp']} x "
            f"dp={ranks_spec['world'] // ranks_spec['tp']} world, BERT and Llama, SP off and on (separate process, "
            "nothing executed)")
        ranks = run_worker_script("xla-graphs", dict(mode="ranks", spec=ranks_spec, seed=seed),
                                  os.path.join(tmp, "ranks.json"), env=env, timeout=1800)
    for variant in variants.values():
        variant.update(_steady(variant))
    primary = variants[VARIANTS[0]]
    out = {"config": spec["model"], "seq": spec["seq"], "batch": spec["batch"], "steps": STEPS,
           "steady_from_step": STEADY_FROM, "variants": variants, "target_met": primary["target_met"]}
    out["ranks"] = dict(ranks, world=ranks_spec["world"], tp=ranks_spec["tp"], seq=ranks_spec["seq"],
                        batch=ranks_spec["batch"], models={f: ranks_spec[f] for f in FAMILIES})
    out["numbers"] = {}
    for name, census in ranks["census"].items():
        tag = re.sub(r"\W+", "_", name).strip("_")
        out["numbers"].update({f"{tag}_distinct_{phase}_graphs": census["distinct"][phase] for phase in PHASES})
    out["ranks_target_met"] = all(n == 1 for c in ranks["census"].values() for n in c["distinct"].values())
    out["numbers"]["compile_time_s_tp1_bert_step"] = ranks["compile"]["compile_time_s"]
    out["numbers"]["compile_executed_graphs"] = ranks["compile"]["executed"]
    for name, variant in variants.items():
        tag = re.sub(r"\W+", "_", name).strip("_")
        out["numbers"].update({f"{tag}_max_executed_per_step_after_2": variant["max_executed_per_step_after"],
                               f"{tag}_new_compiles_after_2": variant["new_compiles_after"],
                               f"{tag}_compiles_step0": variant["compiles_step0"],
                               f"{tag}_last_loss": variant["losses"][-1]})
    return out


def tables(result: Dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [f"XLA:CPU, tp=1, BertForPreTraining ({cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
             f"vocab {cfg['vocab_size']}, seq {result['seq']}, batch {result['batch']}): counter deltas per step "
             "(forward, backward, clip_grad_norm, AdamW step, torch_xla.sync()). The batch has no padding; the second "
             "variant passes its all-ones attention_mask explicitly, the third the same mask as "
             "nxdtp.models.bert.attention_bias(mask) (what the pretraining example does).", ""]
    variants = result["variants"]
    header = ["step"]
    for name in variants:
        header += [f"{name}: {c}" for c in ("UncachedCompile", "CachedCompile", "ExecuteComputation")] + \
                  [f"{name}: wall s"]
    rows = []
    for i in range(result["steps"]):
        row = [i]
        for variant in variants.values():
            s = variant["per_step"][i]
            row += [s[k] for k in COUNTERS] + [f"{variant['seconds'][i]:.3f}"]
        rows.append(row)
    lines.append(markdown_table(header, rows))
    lines.append("")
    for name, v in variants.items():
        lines.append(f"{name}: from step {result['steady_from_step']} on, executed graphs per step "
                     f"{v['min_executed_per_step_after']}-{v['max_executed_per_step_after']} (target 1), new compiles "
                     f"{v['new_compiles_after']} (target 0): {'met' if v['target_met'] else 'MISSED'}; losses "
                     f"{v['losses'][0]:.5f} -> {v['losses'][-1]:.5f}.")
    lines += ["", _ranks_table(result["ranks"])]
    return "\n".join(lines)


def _ranks_table(ranks: Dict[str, Any]) -> str:
    bert, llama = ranks["models"]["bert"], ranks["models"]["llama"]
    lines = [f"Distinct graph hashes over all {ranks['world']} ranks of a simulated tp={ranks['tp']} x "
             f"dp={ranks['world'] // ranks['tp']} world (one train step: forward with dropout, backward, SP/DP "
             f"gradient all-reduces, clip_grad_norm, optimizer step; seq {ranks['seq']}, batch {ranks['batch']}). "
             f"BERT: BertForPreTraining, {bert['num_hidden_layers']} layers, hidden {bert['hidden_size']}, "
             f"{bert['num_attention_heads']} heads, intermediate {bert['intermediate_size']}, vocab "
             f"{bert['vocab_size']}, AdamW. Llama: {llama['num_hidden_layers']} layers, hidden {llama['hidden_size']}, "
             f"{llama['num_attention_heads']} heads / {llama['num_key_value_heads']} KV heads, intermediate "
             f"{llama['intermediate_size']}, vocab {llama['vocab_size']}, nxdtp LAMB. Target: 1.", ""]
    rows = [[name, *(c["distinct"][p] for p in PHASES),
             " ".join(str(len(group)) for group in c["ranks_per_graph"]), f"{c['trace_s']:.1f}"]
            for name, c in ranks["census"].items()]
    lines.append(markdown_table(["model", *(f"distinct {p} graphs" for p in PHASES), "ranks per step graph",
                                 "trace s (all ranks)"], rows))
    c = ranks["compile"]
    lines += ["", f"Compile time of one graph on XLA:CPU (BERT's whole-step graph at tp=1, compiled by "
              f"_xla_warm_up_cache, not executed): CompileTime {c['compile_time_s']:.2f} s (wall {c['wall_s']:.2f} s, "
              f"{c['compiles']} compile(s), {c['executed']} executions)."]
    return "\n".join(lines)
