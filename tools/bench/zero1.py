"""Section 7: ZeRO-1 (``nxdtp.optimizer.NeuronZero1Optimizer``, issue 24): bytes per parameter per rank, peak RSS of a
real step, and step time against the plain DP all-reduce path.

1. **Bytes per parameter per rank, counted.** BERT-large (``BertForPreTraining``, the BERT plan) at tp = 1 and 8 and a
   Llama-3-8B-shaped ``LlamaForCausalLM`` (vocabulary 128256, hidden 4096, intermediate 14336, 32 layers, 32 heads,
   8 KV heads, untied embeddings) at tp = 8, at dp = 1, 2, 4, 8. Each model is built on the meta device in bf16 and
   sharded by ``parallelize_model`` under ``simulated_topology(world_size=tp*dp, rank=r)`` (r = the first and the last
   rank; the largest is reported); ``NeuronZero1Optimizer(..., torch.optim.AdamW, use_grad_acc_hook=True)`` makes its
   fp32 master shards through ``FlatShardLayout`` (padding included), every shard gets a meta gradient and the inner
   AdamW takes one real step, so its state exists; then ``state_bytes()`` counts master shards, AdamW state (exp_avg,
   exp_avg_sq and the per-tensor step counters) and the fp32 ``main_grad`` accumulators. Per parameter means per
   TP-local parameter of the rank (unpadded). Next to it, NxD's / Megatron's ``6 + 12/d``: bf16 parameters 2 + fp32
   gradient buffer 4, plus fp32 master 4 + Adam m, v 8 sharded over d.
2. **Peak RSS of a real step**, tp2 x dp2 on CPU (4 gloo processes, fp32 Llama-shaped model): plain AdamW with
   ``nxdtp.grads.allreduce_gradients`` + ``clip_grad_norm`` against ``NeuronZero1Optimizer`` (AdamW, clipping at 1.0),
   one after the other in the same processes. Per rank: RSS before the optimizer is made (after a warm-up forward and
   backward), the peak over the optimizer's construction and two steps (``VmHWM``, reset first) and the RSS held after
   them, next to the counted optimizer bytes (plain: ``optimizer_state_bytes``; ZeRO-1: ``state_bytes()``). The workers
   run with a fixed glibc mmap threshold, so freed tensors go back to the kernel and RSS follows live tensors.
3. **Step time**, tp1 x dp2 and tp2 x dp2 in one run: both paths (a copy of the same seeded model each, the same
   batches) in the same processes, one step of each in turn (the order swapped every round, to cancel drift), after a
   barrier; a step's time is its slowest rank's; ratio = the median over rounds of ZeRO-1 step / plain step of the same
   round (back to back, so drift cancels), with the ratio of the two medians as a check. The step after backward
   (gradient sync, norm and clip, AdamW, all-gather) is timed apart. After the rounds, both copies must hold the same
   weights (the two paths compute the same update). The DP collectives of both paths are also timed alone.
"""

from __future__ import annotations

import copy
import gc
import statistics
import time
from typing import Any, Dict, List, Optional

from .common import WorkerGroup, fmt, fmt_bytes, log, markdown_table, memory_measuring_workers, verdict

SEED = 1234
GLOO_TIMEOUT_S = 900
MAX_NORM = 1.0
ADAMW = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
PADDING_ALLOWANCE = 0.01   # the goal: <= 6 + 12/d plus 1 % padding
STEP_TIME_GOAL = 1.05      # ZeRO-1 step <= 1.05 x plain DP step

BERT_LARGE = dict(kind="bert", vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                  intermediate_size=4096, max_position_embeddings=512, type_vocab_size=2)
LLAMA_3_8B = dict(kind="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)
TINY_BERT = dict(kind="bert", vocab_size=101, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128, max_position_embeddings=64, type_vocab_size=2)
TINY_LLAMA = dict(kind="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)

FULL = dict(
    count=[("BERT-large", BERT_LARGE, 1), ("BERT-large", BERT_LARGE, 8), ("Llama-3-8B-shaped", LLAMA_3_8B, 8)],
    dps=(1, 2, 4, 8),
    # About 160 M parameters (640 MB fp32), 80 M per TP rank.
    rss=dict(model=dict(kind="llama", vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                        num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                        tie_word_embeddings=False), batch=2, seq=64, steps=2),
    # About 50 M parameters (200 MB fp32).
    time=dict(model=dict(kind="llama", vocab_size=16000, hidden_size=768, intermediate_size=2048,
                         num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=4,
                         tie_word_embeddings=False), batch=2, seq=64, warmup=2, rounds=16, collective_reps=5),
    worlds=((2, 2), (1, 2)),   # (tp, dp); the first also runs parts 1 and 2
)
QUICK = dict(count=[("BERT tiny", TINY_BERT, 1), ("BERT tiny", TINY_BERT, 2), ("Llama tiny", TINY_LLAMA, 2)],
             dps=(1, 2, 4, 8), rss=dict(model=TINY_LLAMA, batch=2, seq=16, steps=2),
             time=dict(model=TINY_LLAMA, batch=2, seq=16, warmup=1, rounds=2, collective_reps=2),
             worlds=((2, 2), (1, 2)))


def reference_bytes_per_parameter(dp: int) -> float:
    """NxD's / Megatron's bytes per parameter per rank: bf16 weights, fp32 gradients, sharded fp32 master + Adam."""
    return 6 + 12 / dp


# ======================================================================================================================
# Counting (part 1): meta models under a simulated topology
# ======================================================================================================================

def _build_model(cfg: Dict[str, Any]):
    import transformers

    cfg = dict(cfg)
    kind = cfg.pop("kind")
    if kind == "bert":
        return transformers.BertForPreTraining(transformers.BertConfig(**cfg))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))


def count_one(cfg: Dict[str, Any], tp: int, dp: int, rank: int) -> Dict[str, Any]:
    """The bytes one rank of a tp x dp world holds with bf16 parameters and ZeRO-1 AdamW (fp32 master shards)."""
    import torch

    from nxdtp import parallel_state as ps
    from nxdtp.models import parallelize_model
    from nxdtp.optimizer import NeuronZero1Optimizer
    from nxdtp.spec import FlatShardLayout

    with torch.device("meta"):
        model = _build_model(cfg).to(torch.bfloat16)
    with ps.simulated_topology(world_size=tp * dp, rank=rank, tensor_model_parallel_size=tp):
        parallelize_model(model)  # meta tensors: nothing is communicated
        params = list(model.parameters())
        if any(p.device.type != "meta" for p in params):
            raise AssertionError("parallelize_model materialised a meta model")
        zero = NeuronZero1Optimizer(params, torch.optim.AdamW, use_grad_acc_hook=True, **ADAMW)
        if zero.sharding_group.size != dp:
            raise AssertionError(f"sharding group of {zero.sharding_group.size}, expected dp={dp}")
        for group in zero.base_optimizer.param_groups:   # one real AdamW step on meta shards: its state exists
            for shard in group["params"]:
                shard.grad = torch.empty_like(shard)
        zero.base_optimizer.step()
        counted = zero.state_bytes()
    numel = sum(p.numel() for p in params)
    layout_padding = sum(FlatShardLayout(tuple(p.shape), dp).padding for p in params)
    master_elements = counted["master"] // 4
    padding = master_elements * dp - numel  # what the optimizer's own shards hold beyond the parameters
    if padding != layout_padding:
        raise AssertionError(f"master shards hold {padding} padding elements, FlatShardLayout says {layout_padding}")
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    return {"rank": rank, "tensors": len(params), "parameters": numel, "padding_elements": padding,
            "parameter_bytes": param_bytes,
            "grad_bytes": param_bytes,             # autograd's .grad, in the parameters' dtype (bf16)
            "main_grad_bytes": counted["main_grad"],  # fp32 accumulators of use_grad_acc_hook
            "master_bytes": counted["master"], "state_bytes": counted["state"]}


def count_rows(spec: Dict[str, Any]) -> List[Dict[str, Any]]:
    rows = []
    for label, cfg, tp in spec["count"]:
        for dp in spec["dps"]:
            world = tp * dp
            per_rank = [count_one(cfg, tp, dp, r) for r in sorted({0, world - 1})]
            worst = max(per_rank, key=lambda r: r["parameter_bytes"] + r["master_bytes"] + r["state_bytes"])
            n = worst["parameters"]
            row = {"model": label, "tp": tp, "dp": dp, "ranks_counted": [r["rank"] for r in per_rank],
                   "ranks_equal": len({tuple(sorted((k, v) for k, v in r.items() if k != "rank"))
                                       for r in per_rank}) == 1, **{k: v for k, v in worst.items() if k != "rank"}}
            per = {k: worst[f"{k}_bytes"] / n for k in ("parameter", "grad", "main_grad", "master", "state")}
            row.update({
                "bpp_parameters": per["parameter"], "bpp_grads_bf16": per["grad"], "bpp_grads_fp32": per["main_grad"],
                "bpp_master": per["master"], "bpp_state": per["state"],
                "bpp_total_bf16_grads": per["parameter"] + per["grad"] + per["master"] + per["state"],
                "bpp_total_fp32_grads": per["parameter"] + per["main_grad"] + per["master"] + per["state"],
                "bpp_reference": reference_bytes_per_parameter(dp),
                "bpp_goal": 6 + 12 / dp * (1 + PADDING_ALLOWANCE),
                "padding_percent": 100 * worst["padding_elements"] / n,
                # the step counters: 4 bytes per tensor on every rank, not sharded
                "step_counter_bytes": worst["state_bytes"] - 8 * (n + worst["padding_elements"]) // dp,
            })
            row["goal_met"] = row["bpp_total_fp32_grads"] <= row["bpp_goal"]
            rows.append(row)
    return rows


# ======================================================================================================================
# Worker side (parts 2 and 3): a gloo world of tp x dp processes
# ======================================================================================================================

def _real_model(cfg: Dict[str, Any]):
    import torch

    from nxdtp.models import parallelize_model

    torch.manual_seed(SEED)  # the same dense model on every rank, then this rank's shards
    return parallelize_model(_build_model(cfg)).train()


def _batch(spec: Dict[str, Any]) -> Dict[str, Any]:
    import torch

    from nxdtp import parallel_state as ps

    generator = torch.Generator().manual_seed(SEED + 1 + ps.get_data_parallel_rank())  # each DP rank its own rows
    ids = torch.randint(0, spec["model"]["vocab_size"], (spec["batch"], spec["seq"]), generator=generator)
    return {"input_ids": ids, "labels": ids.clone()}


def _make_optimizer(model, variant: str):
    import torch

    from nxdtp.optimizer import NeuronZero1Optimizer

    if variant == "zero1":
        return NeuronZero1Optimizer(model.parameters(), torch.optim.AdamW, max_norm=MAX_NORM, **ADAMW)
    return torch.optim.AdamW(model.parameters(), **ADAMW)


def _forward_backward(model, optimizer, batch) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return float(loss.detach())


def _update(model, optimizer, variant: str) -> None:
    from nxdtp.grads import allreduce_gradients, clip_grad_norm

    if variant == "plain":   # the plain DP path: bucketed all-reduce, clip over TP x DP, AdamW on whole tensors
        allreduce_gradients(model)
        clip_grad_norm(model.parameters(), MAX_NORM)
    optimizer.step()       # ZeRO-1: reduce-scatter, norm and clip, AdamW on the shards, all-gather


def _optimizer_bytes(optimizer, variant: str) -> Dict[str, int]:
    from nxdtp.optimizer import optimizer_state_bytes

    if variant == "zero1":
        return optimizer.state_bytes()
    return {"state": optimizer_state_bytes(optimizer), "master": 0, "main_grad": 0}


def h_count(state, spec: Dict[str, Any]) -> Optional[List[Dict[str, Any]]]:
    return count_rows(spec) if state["rank"] == 0 else None


def h_rss(state, spec: Dict[str, Any], variant: str) -> Dict[str, Any]:
    """One variant's model, a warm-up forward and backward, then the optimizer and ``steps`` steps under the peak-RSS
    watermark."""
    from .rss import proc_status_kib, reset_peak_rss

    model = _real_model(spec["model"])
    batch = _batch(spec)
    loss = model(**batch).loss   # warm-up: lazily built state is not counted below
    loss.backward()
    for p in model.parameters():
        p.grad = None
    del loss
    gc.collect()
    before = proc_status_kib()
    peak_reset = reset_peak_rss()
    optimizer = _make_optimizer(model, variant)
    losses = []
    for _ in range(spec["steps"]):
        losses.append(_forward_backward(model, optimizer, batch))
        _update(model, optimizer, variant)
    gc.collect()
    after = proc_status_kib()
    params = list(model.parameters())
    result = {"rank": state["rank"], "variant": variant, "parameters": sum(p.numel() for p in params),
              "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
              "grad_bytes": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
              "optimizer_bytes": _optimizer_bytes(optimizer, variant), "losses": losses,
              "rss_before_kib": before["VmRSS"], "rss_after_kib": after["VmRSS"],
              "peak_rss_increase_kib": (after["VmHWM"] - before["VmRSS"]) if peak_reset else None,
              "rss_held_increase_kib": after["VmRSS"] - before["VmRSS"]}
    del optimizer, model, params
    gc.collect()
    return result


def h_time_setup(state, spec: Dict[str, Any]) -> None:
    model = _real_model(spec["model"])
    state["timing"] = {"batch": _batch(spec), "models": {}, "optimizers": {}}
    for variant in ("plain", "zero1"):
        copy_ = copy.deepcopy(model)
        state["timing"]["models"][variant] = copy_
        state["timing"]["optimizers"][variant] = _make_optimizer(copy_, variant)
    del model
    gc.collect()


def h_step(state, variant: str) -> Dict[str, float]:
    import torch.distributed as dist

    timing = state["timing"]
    model, optimizer = timing["models"][variant], timing["optimizers"][variant]
    dist.barrier()
    t0 = time.perf_counter()
    loss = _forward_backward(model, optimizer, timing["batch"])
    t1 = time.perf_counter()
    _update(model, optimizer, variant)
    t2 = time.perf_counter()
    return {"forward_backward_s": t1 - t0, "update_s": t2 - t1, "step_s": t2 - t0, "loss": loss}


def h_collectives(state, reps: int) -> Dict[str, Any]:
    """The DP collectives of both paths alone, on a buffer of this rank's fp32 gradient size: plain DP's all-reduce
    against ZeRO-1's reduce-scatter + all-gather (through ``nxdtp.comm``, with the optimizer's row shapes), in turn."""
    import torch
    import torch.distributed as dist

    from nxdtp import comm
    from nxdtp import parallel_state as ps

    group = ps.data_parallel_group()
    numel = sum(p.numel() for p in state["timing"]["models"]["plain"].parameters())
    shard = -(-numel // group.size)
    flat = torch.randn(numel, generator=torch.Generator().manual_seed(SEED))
    rows = torch.nn.functional.pad(flat, (0, shard * group.size - numel)).reshape(group.size, shard)
    times: Dict[str, List[float]] = {"all_reduce_s": [], "reduce_scatter_s": [], "all_gather_s": []}
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        comm.all_reduce(flat, group)
        t1 = time.perf_counter()
        dist.barrier()
        t2 = time.perf_counter()
        mine = comm.reduce_scatter(rows, group, dim=0)
        t3 = time.perf_counter()
        comm.all_gather(mine, group, dim=0)
        t4 = time.perf_counter()
        times["all_reduce_s"].append(t1 - t0)
        times["reduce_scatter_s"].append(t3 - t2)
        times["all_gather_s"].append(t4 - t3)
    return {"bytes": numel * 4, **times}


def h_time_finish(state) -> Dict[str, float]:
    timing = state.pop("timing")
    plain, zero = (dict(timing["models"][v].named_parameters()) for v in ("plain", "zero1"))
    worst = max(float((plain[n].detach() - zero[n].detach()).abs().max()) for n in plain)
    scale = max(float(p.detach().abs().max()) for p in plain.values())
    del timing
    gc.collect()
    return {"max_abs_weight_difference": worst, "max_abs_weight": scale}


def worker_main(conn, name: str, rank: int, world: int, port: int, tp: int) -> None:
    from .common import serve_in_gloo_world

    serve_in_gloo_world(conn, {"count": h_count, "rss": h_rss, "time_setup": h_time_setup, "step": h_step,
                               "collectives": h_collectives, "time_finish": h_time_finish},
                        rank, world, port, tp, GLOO_TIMEOUT_S)


# ======================================================================================================================
# Driver side
# ======================================================================================================================

def _start_world(tp: int, dp: int) -> WorkerGroup:
    return memory_measuring_workers(f"zero1 tp={tp} dp={dp}", worker_main, tp * dp, extra_args=(tp,))


def _rss_summary(per_rank: List[Dict[str, Any]]) -> Dict[str, Any]:
    def worst(key):
        values = [r[key] for r in per_rank]
        return None if None in values else max(values)

    optimizer = [sum(r["optimizer_bytes"].values()) for r in per_rank]
    return {"per_rank": per_rank, "parameters_per_rank": max(r["parameters"] for r in per_rank),
            "parameter_bytes": max(r["parameter_bytes"] for r in per_rank),
            "grad_bytes": max(r["grad_bytes"] for r in per_rank),
            "optimizer_bytes_counted": max(optimizer), "optimizer_bytes_by_kind": per_rank[0]["optimizer_bytes"],
            "peak_rss_increase_bytes": None if worst("peak_rss_increase_kib") is None
            else worst("peak_rss_increase_kib") * 1024,
            "rss_held_increase_bytes": worst("rss_held_increase_kib") * 1024,
            "rss_before_bytes": worst("rss_before_kib") * 1024, "last_loss": per_rank[0]["losses"][-1]}


def _timing(group: WorkerGroup, spec: Dict[str, Any], tp: int, dp: int) -> Dict[str, Any]:
    log(f"zero1: step time at tp={tp} x dp={dp}: setting up")
    group.call("time_setup", spec=spec)
    samples: Dict[str, List[Dict[str, float]]] = {"plain": [], "zero1": []}
    total = spec["warmup"] + spec["rounds"]
    for i in range(total):
        order = ("plain", "zero1") if i % 2 == 0 else ("zero1", "plain")
        for variant in order:
            ranks = group.call("step", variant=variant)
            if i >= spec["warmup"]:
                samples[variant].append({k: max(r[k] for r in ranks) for k in ("forward_backward_s", "update_s",
                                                                                "step_s")}
                                        | {"loss": ranks[0]["loss"]})
        log(f"zero1: tp={tp} x dp={dp} round {i + 1}/{total}")
    collectives = group.call("collectives", reps=spec["collective_reps"])
    finish = group.call("time_finish")
    cc = {k: statistics.median(max(r[k][i] for r in collectives) for i in range(spec["collective_reps"]))
          for k in ("all_reduce_s", "reduce_scatter_s", "all_gather_s")}
    cc["bytes"] = collectives[0]["bytes"]
    cc["ratio"] = (cc["reduce_scatter_s"] + cc["all_gather_s"]) / cc["all_reduce_s"]
    med = {v: {k: statistics.median(s[k] for s in samples[v]) for k in ("forward_backward_s", "update_s", "step_s")}
           for v in samples}
    per_round = [z["step_s"] / p["step_s"] for p, z in zip(samples["plain"], samples["zero1"])]
    per_round_update = [z["update_s"] / p["update_s"] for p, z in zip(samples["plain"], samples["zero1"])]
    return {"tp": tp, "dp": dp, "rounds": spec["rounds"], "warmup": spec["warmup"], "samples": samples,
            # The headline is the median of the per-round ratios: each pair ran back to back, so drift cancels.
            "median": med, "ratio": statistics.median(per_round),
            "ratio_of_medians": med["zero1"]["step_s"] / med["plain"]["step_s"],
            "update_ratio": statistics.median(per_round_update),
            "update_ratio_of_medians": med["zero1"]["update_s"] / med["plain"]["update_s"],
            "max_abs_weight_difference": max(f["max_abs_weight_difference"] for f in finish),
            "max_abs_weight": max(f["max_abs_weight"] for f in finish),
            "last_losses": {v: samples[v][-1]["loss"] for v in samples}, "collectives": cc}


def run(quick: bool) -> Dict[str, Any]:
    spec = QUICK if quick else FULL
    counted, rss, timings = None, {}, []
    for index, (tp, dp) in enumerate(spec["worlds"]):
        log(f"zero1: starting a gloo world of tp={tp} x dp={dp}")
        group = _start_world(tp, dp)
        try:
            if index == 0:
                log("zero1: counting bytes per parameter on meta models")
                counted = group.call("count", spec={k: spec[k] for k in ("count", "dps")})[0]
                for variant in ("plain", "zero1"):
                    log(f"zero1: peak RSS of a {variant} step at tp={tp} x dp={dp}")
                    rss[variant] = _rss_summary(group.call("rss", spec=spec["rss"], variant=variant))
                rss.update(tp=tp, dp=dp)
            timings.append(_timing(group, spec["time"], tp, dp))
        finally:
            group.close()
    return _result(spec, counted, rss, timings)


def _result(spec, counted, rss, timings) -> Dict[str, Any]:
    numbers: Dict[str, float] = {}
    for row in counted:
        key = f"{row['model'].split()[0].split('-')[0].lower()}_tp{row['tp']}_dp{row['dp']}"
        numbers[f"{key}_bytes_per_parameter_fp32_grads"] = row["bpp_total_fp32_grads"]
        numbers[f"{key}_bytes_per_parameter_bf16_grads"] = row["bpp_total_bf16_grads"]
        numbers[f"{key}_padding_percent"] = row["padding_percent"]
    plain, zero = rss["plain"], rss["zero1"]
    saving_counted = plain["optimizer_bytes_counted"] - zero["optimizer_bytes_counted"]
    saving_held = plain["rss_held_increase_bytes"] - zero["rss_held_increase_bytes"]
    rss_summary = {"counted_saving_bytes": saving_counted, "held_saving_bytes": saving_held,
                   "held_saving_over_counted": saving_held / saving_counted if saving_counted else None}
    if plain["peak_rss_increase_bytes"] is not None and zero["peak_rss_increase_bytes"] is not None:
        rss_summary["peak_saving_bytes"] = plain["peak_rss_increase_bytes"] - zero["peak_rss_increase_bytes"]
        rss_summary["peak_saving_over_counted"] = (rss_summary["peak_saving_bytes"] / saving_counted
                                                   if saving_counted else None)
    for k, v in rss_summary.items():
        if v is not None:
            numbers[f"rss_{k}"] = v
    for variant in ("plain", "zero1"):
        numbers[f"rss_{variant}_held_increase_bytes"] = rss[variant]["rss_held_increase_bytes"]
        numbers[f"rss_{variant}_optimizer_bytes_counted"] = rss[variant]["optimizer_bytes_counted"]
        if rss[variant]["peak_rss_increase_bytes"] is not None:
            numbers[f"rss_{variant}_peak_increase_bytes"] = rss[variant]["peak_rss_increase_bytes"]
    for t in timings:
        key = f"tp{t['tp']}_dp{t['dp']}"
        numbers[f"{key}_step_ratio"] = t["ratio"]
        numbers[f"{key}_step_ratio_of_medians"] = t["ratio_of_medians"]
        numbers[f"{key}_update_ratio"] = t["update_ratio"]
        numbers[f"{key}_plain_step_s"] = t["median"]["plain"]["step_s"]
        numbers[f"{key}_zero1_step_s"] = t["median"]["zero1"]["step_s"]
        numbers[f"{key}_max_abs_weight_difference"] = t["max_abs_weight_difference"]
        numbers[f"{key}_reduce_scatter_plus_all_gather_over_all_reduce"] = t["collectives"]["ratio"]
    return {"spec": {"count": [{"model": label, "config": cfg, "tp": tp} for label, cfg, tp in spec["count"]],
                     "dps": list(spec["dps"]), "rss": spec["rss"], "time": spec["time"],
                     "worlds": [list(w) for w in spec["worlds"]]},
            "adamw": ADAMW, "max_norm": MAX_NORM, "counted": counted, "rss": {**rss, **rss_summary},
            "timings": timings, "numbers": numbers}


# ---- report -------------------------------------------------------------------------------------------------------

def _model_text(cfg: Dict[str, Any]) -> str:
    return (f"hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, {cfg['num_attention_heads']} heads"
            + (f" ({cfg['num_key_value_heads']} KV)" if "num_key_value_heads" in cfg else "")
            + f", intermediate {cfg['intermediate_size']}, vocab {cfg['vocab_size']}")


def tables(result: Dict[str, Any]) -> str:
    spec = result["spec"]
    lines = ["**Bytes per parameter per rank**, bf16 parameters, ZeRO-1 AdamW with fp32 master shards; counted on "
             "meta models sharded under a simulated topology (FlatShardLayout padding included); per TP-local "
             "parameter. Models: " + "; ".join(f"{c['model']} tp={c['tp']} ({_model_text(c['config'])})"
                                               for c in spec["count"]) + ".", ""]
    rows = []
    for r in result["counted"]:
        rows.append([r["model"], r["tp"], r["dp"], f"{r['parameters']:,}",
                     f"{r['padding_elements']:,} ({r['padding_percent']:.1e} %)",
                     fmt(r["bpp_parameters"], 3), fmt(r["bpp_grads_bf16"], 3), fmt(r["bpp_grads_fp32"], 3),
                     fmt(r["bpp_master"], 4), fmt(r["bpp_state"], 4), fmt(r["bpp_total_bf16_grads"], 4),
                     fmt(r["bpp_total_fp32_grads"], 4), fmt(r["bpp_reference"], 4),
                     "met" if r["goal_met"] else "MISSED"])
    lines.append(markdown_table(
        ["model", "tp", "dp", "parameters / rank", "padding elements", "params (bf16)", "grads: bf16 .grad",
         "grads: fp32 main_grad", "fp32 master", "AdamW state", "total, bf16 grads", "total, fp32 main_grad",
         "NxD / Megatron 6 + 12/d", "goal <= 6 + 1.01 x 12/d"], rows))
    lines += ["", "Totals: params + grads + master + AdamW state. \"bf16 grads\" is nxdtp's default (autograd's .grad "
                  "in the parameter dtype); \"fp32 main_grad\" is `use_grad_acc_hook=True`, whose fp32 accumulators "
                  "are Megatron's gradient buffer, so that column is the like-for-like of 6 + 12/d. AdamW state "
                  "includes a 4-byte step counter per tensor on every rank (not sharded).", ""]

    rss = result["rss"]
    m = spec["rss"]
    lines += [f"**Peak RSS of a real step**, tp={rss['tp']} x dp={rss['dp']}, 4 gloo processes on CPU, fp32 "
              f"Llama-shaped model ({_model_text(m['model'])}), batch {m['batch']} x {m['seq']} per DP rank, "
              f"{m['steps']} steps after a warm-up forward and backward; per rank, the largest rank. Increases are "
              "over the RSS before the optimizer was made.", ""]
    body = []
    for variant, label in (("plain", "plain AdamW + DP all-reduce + clip"), ("zero1", "ZeRO-1 AdamW")):
        r = rss[variant]
        kinds = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in r["optimizer_bytes_by_kind"].items() if v)
        body.append([label, f"{r['parameters_per_rank']:,}", fmt_bytes(r["parameter_bytes"]),
                     fmt_bytes(r["grad_bytes"]), f"{fmt_bytes(r['optimizer_bytes_counted'])} ({kinds})",
                     fmt_bytes(r["rss_before_bytes"]), fmt_bytes(r["peak_rss_increase_bytes"]),
                     fmt_bytes(r["rss_held_increase_bytes"]), f"{r['last_loss']:.6f}"])
    body.append(["plain - ZeRO-1", "", "", "", fmt_bytes(rss["counted_saving_bytes"]), "",
                 fmt_bytes(rss.get("peak_saving_bytes")), fmt_bytes(rss["held_saving_bytes"]), ""])
    lines.append(markdown_table(["path", "parameters / rank", "parameter bytes", "gradient bytes",
                                 "optimizer bytes, counted", "RSS before the optimizer", "peak RSS increase",
                                 "RSS held after the steps, increase", "loss at the last step"], body))
    held = rss.get("held_saving_over_counted")
    peak = rss.get("peak_saving_over_counted")
    lines += ["", f"Measured saving / counted saving: held {fmt(held, 3)}, peak {fmt(peak, 3)}.", ""]

    t = spec["time"]
    lines += [f"**Step time**, ZeRO-1 against plain DP (bucketed all-reduce + clip + AdamW), fp32 Llama-shaped model "
              f"({_model_text(t['model'])}), batch {t['batch']} x {t['seq']} per DP rank; {t['warmup']} warm-up and "
              f"{t['rounds']} timed rounds, the two paths alternating (order swapped each round); slowest rank; "
              "step times are medians; the ratio is the median of each round's ZeRO-1 / plain.", ""]
    body = []
    for x in result["timings"]:
        p, z = x["median"]["plain"], x["median"]["zero1"]
        body.append([f"tp{x['tp']} x dp{x['dp']}", fmt(p["step_s"], 3), fmt(z["step_s"], 3),
                     fmt(x["ratio"], 3), fmt(x["ratio_of_medians"], 3),
                     f"{fmt(p['forward_backward_s'], 3)} / {fmt(z['forward_backward_s'], 3)}",
                     f"{fmt(p['update_s'], 3)} / {fmt(z['update_s'], 3)}", fmt(x["update_ratio"], 3),
                     f"<= {STEP_TIME_GOAL}: {verdict(x['ratio'], STEP_TIME_GOAL)}",
                     f"{x['max_abs_weight_difference']:.2e}"])
    lines.append(markdown_table(["world", "plain step s", "ZeRO-1 step s",
                                 "ratio ZeRO-1 / plain (median of per-round ratios)", "ratio of the medians",
                                 "forward+backward s, plain / ZeRO-1",
                                 "after backward s, plain / ZeRO-1", "after-backward ratio (per-round median)", "goal",
                                 "max abs weight difference, ZeRO-1 vs plain"], body))
    body = [[f"tp{x['tp']} x dp{x['dp']}", fmt_bytes(x["collectives"]["bytes"]),
             fmt(x["collectives"]["all_reduce_s"], 3), fmt(x["collectives"]["reduce_scatter_s"], 3),
             fmt(x["collectives"]["all_gather_s"], 3), fmt(x["collectives"]["ratio"], 2)] for x in result["timings"]]
    lines += ["", "The DP collectives alone (nxdtp.comm over the DP group, a buffer of the rank's fp32 gradient size, "
                  "the two paths in turn; slowest rank; medians):", "",
              markdown_table(["world", "buffer", "all-reduce s (plain)", "reduce-scatter s (ZeRO-1)",
                              "all-gather s (ZeRO-1)", "(reduce-scatter + all-gather) / all-reduce"], body)]
    return "\n".join(lines)
