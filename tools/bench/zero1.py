"""Section 7: ZeRO-1's bytes per parameter per rank counted, the peak RSS of a real step, step time against plain DP;
section 8 (``run_async_save``): the step loop's stall while ``save_checkpoint`` writes, sync against async_save."""

from __future__ import annotations

import copy
import gc
import os
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from nxdtp import comm
from nxdtp import parallel_state as ps
from nxdtp.grads import allreduce_gradients, clip_grad_norm
from nxdtp.models import parallelize_model
from nxdtp.optimizer import NeuronZero1Optimizer, optimizer_state_bytes
from nxdtp.spec import FlatShardLayout
from nxdtp.trainer import finalize_checkpoint, save_checkpoint

from . import common
from .common import ADAMW, MAX_GRAD_NORM, SEED, Pool, alternate, log, median, model_text, section, slowest, table, timed

PADDING_ALLOWANCE = 0.01   # the goal: <= 6 + 12/d plus 1 % padding
STEP_TIME_GOAL = 1.05      # ZeRO-1 step <= 1.05 x plain DP step

BERT_LARGE = dict(common.BERT_LARGE, kind="bert")
LLAMA_3_8B = dict(kind="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)
TINY_BERT = dict(kind="bert", vocab_size=101, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128, max_position_embeddings=64, type_vocab_size=2)
TINY_LLAMA = dict(kind="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)

LLAMA_160M = dict(kind="llama", vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=False)  # 80 M per TP rank
LLAMA_50M = dict(kind="llama", vocab_size=16000, hidden_size=768, intermediate_size=2048, num_hidden_layers=4,
                 num_attention_heads=12, num_key_value_heads=4, tie_word_embeddings=False)  # 200 MB fp32
FULL = dict(count=[("BERT-large", BERT_LARGE, 1), ("BERT-large", BERT_LARGE, 8), ("Llama-3-8B-shaped", LLAMA_3_8B, 8)],
            dps=(1, 2, 4, 8), rss=dict(model=LLAMA_160M, batch=2, seq=64, steps=2),
            time=dict(model=LLAMA_50M, batch=2, seq=64, warmup=2, rounds=16, collective_reps=5),
            worlds=((2, 2), (1, 2)))  # (tp, dp); the first also runs parts 1 and 2
QUICK = dict(FULL, count=[("BERT tiny", TINY_BERT, 1), ("BERT tiny", TINY_BERT, 2), ("Llama tiny", TINY_LLAMA, 2)],
             rss=dict(model=TINY_LLAMA, batch=2, seq=16, steps=2),
             time=dict(model=TINY_LLAMA, batch=2, seq=16, warmup=1, rounds=2, collective_reps=2))
ASYNC_FULL = dict(model=dict(LLAMA_50M, hidden_size=512, intermediate_size=1408, num_attention_heads=8), batch=2,
                  seq=64, warmup=2, pre=3, post=8, rounds=6, tp=2, dp=1)
ASYNC_QUICK = dict(model=TINY_LLAMA, batch=2, seq=16, warmup=1, pre=2, post=2, rounds=2, tp=2, dp=1)


# ---- counting (part 1): meta models under a simulated topology --------------------------------------------------

def _build_model(cfg: Dict[str, Any], **kwargs):
    return common.hf_model({k: v for k, v in cfg.items() if k != "kind"}, cfg["kind"], **kwargs)


def count_one(cfg: Dict[str, Any], tp: int, dp: int, rank: int) -> Dict[str, Any]:
    """The bytes one rank of a tp x dp world holds with bf16 parameters and ZeRO-1 AdamW (fp32 master shards)."""
    model = _build_model(cfg, device="meta").to(torch.bfloat16)
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
    padding = counted["master"] // 4 * dp - numel  # what the optimizer's own shards hold beyond the parameters
    if padding != layout_padding:
        raise AssertionError(f"master shards hold {padding} padding elements, FlatShardLayout says {layout_padding}")
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    # grad: autograd's .grad in the parameters' dtype (bf16); main_grad: the fp32 accumulators of use_grad_acc_hook
    return {"rank": rank, "tensors": len(params), "parameters": numel, "padding_elements": padding,
            "parameter_bytes": param_bytes, "grad_bytes": param_bytes, "main_grad_bytes": counted["main_grad"],
            "master_bytes": counted["master"], "state_bytes": counted["state"]}


def case_count(spec: Dict[str, Any]) -> Optional[List[Dict[str, Any]]]:
    """Rank 0: the counted rows of every model, tp and dp."""
    if dist.get_rank() != 0:
        return None
    rows = []
    for label, cfg, tp in spec["count"]:
        for dp in spec["dps"]:
            per_rank = [count_one(cfg, tp, dp, r) for r in sorted({0, tp * dp - 1})]
            worst = max(per_rank, key=lambda r: r["parameter_bytes"] + r["master_bytes"] + r["state_bytes"])
            n, pad = worst["parameters"], worst["padding_elements"]
            per = {k: worst[f"{k}_bytes"] / n for k in ("parameter", "grad", "main_grad", "master", "state")}
            common = per["parameter"] + per["master"] + per["state"]
            # bpp_reference: NxD's / Megatron's bf16 weights, fp32 gradients, sharded fp32 master + Adam m, v
            rows.append({"model": label, "tp": tp, "dp": dp, **{k: v for k, v in worst.items() if k != "rank"},
                         "ranks_equal": len({tuple(sorted((k, v) for k, v in r.items() if k != "rank"))
                                             for r in per_rank}) == 1,
                         **{f"bpp_{k}": v for k, v in per.items()}, "bpp_total_bf16_grads": common + per["grad"],
                         "bpp_total_fp32_grads": common + per["main_grad"], "bpp_reference": 6 + 12 / dp,
                         "padding_percent": 100 * pad / n, "step_counter_bytes": worst["state_bytes"] - 8 * (n + pad)
                         // dp, "goal_met": common + per["main_grad"] <= 6 + 12 / dp * (1 + PADDING_ALLOWANCE)})
    return rows


STATE: Dict[str, Any] = {}  # part 3's two models, optimizers and batch between calls


def real_model(cfg: Dict[str, Any]):
    return parallelize_model(_build_model(cfg, seed=SEED)).train()  # the same dense model on every rank, then shards


def llama_batch(spec: Dict[str, Any]) -> Dict[str, Any]:
    generator = torch.Generator().manual_seed(SEED + 1 + ps.get_data_parallel_rank())  # each DP rank its own rows
    ids = torch.randint(0, spec["model"]["vocab_size"], (spec["batch"], spec["seq"]), generator=generator)
    return {"input_ids": ids, "labels": ids.clone()}


def make_optimizer(model, variant: str):
    if variant == "zero1":
        return NeuronZero1Optimizer(model.parameters(), torch.optim.AdamW, max_norm=MAX_GRAD_NORM, **ADAMW)
    return torch.optim.AdamW(model.parameters(), **ADAMW)


def timed_step(model, optimizer, batch, variant: str) -> Dict[str, float]:
    """A forward and backward, then the update; the loss and the times of both and of the whole."""
    t0 = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    loss, t1 = float(loss.detach()), time.perf_counter()
    if variant == "plain":   # bucketed all-reduce, clip over TP x DP, AdamW on whole tensors
        allreduce_gradients(model)
        clip_grad_norm(model.parameters(), MAX_GRAD_NORM)
    optimizer.step()       # ZeRO-1: reduce-scatter, norm and clip, AdamW on the shards, all-gather
    t2 = time.perf_counter()
    return {"forward_backward_s": t1 - t0, "update_s": t2 - t1, "step_s": t2 - t0, "loss": loss}


def case_rss(spec: Dict[str, Any], variant: str) -> Dict[str, Any]:
    """A warm-up forward and backward, then the optimizer and ``steps`` steps under the peak-RSS watermark."""
    model, batch = real_model(spec["model"]), llama_batch(spec)
    model(**batch).loss.backward()   # warm-up: lazily built state is not counted below
    for p in model.parameters():
        p.grad = None
    mark = common.rss_mark()
    optimizer = make_optimizer(model, variant)
    losses = [timed_step(model, optimizer, batch, variant)["loss"] for _ in range(spec["steps"])]
    gc.collect()
    rss, params = mark(), list(model.parameters())
    counted = optimizer.state_bytes() if variant == "zero1" else {"state": optimizer_state_bytes(optimizer)}
    return {"parameters": sum(p.numel() for p in params),
            "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
            "grad_bytes": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
            "optimizer_bytes": counted, "losses": losses, "rss_before_kib": rss["before"],
            "peak_rss_increase_kib": rss["peak"], "rss_held_increase_kib": rss["held"]}


def case_time_setup(spec: Dict[str, Any]) -> None:
    model = real_model(spec["model"])
    STATE.update(batch=llama_batch(spec), models={v: copy.deepcopy(model) for v in ("plain", "zero1")})
    STATE["optimizers"] = {v: make_optimizer(m, v) for v, m in STATE["models"].items()}
    del model
    gc.collect()


def case_step(variant: str) -> Dict[str, float]:
    common.barrier()
    return timed_step(STATE["models"][variant], STATE["optimizers"][variant], STATE["batch"], variant)


def case_collectives(reps: int) -> Dict[str, Any]:
    """The DP collectives of both paths alone, on a buffer of this rank's fp32 gradient size: plain DP's all-reduce
    against ZeRO-1's reduce-scatter + all-gather (``nxdtp.comm``, the optimizer's row shapes), in turn."""
    group = ps.data_parallel_group()
    numel = sum(p.numel() for p in STATE["models"]["plain"].parameters())
    shard = -(-numel // group.size)
    flat = torch.randn(numel, generator=torch.Generator().manual_seed(SEED))
    rows = torch.nn.functional.pad(flat, (0, shard * group.size - numel)).reshape(group.size, shard)
    times: Dict[str, List[float]] = {"all_reduce_s": [], "reduce_scatter_s": [], "all_gather_s": []}
    for _ in range(reps):
        times["all_reduce_s"].append(timed(lambda: comm.all_reduce(flat, group)))
        mine = []
        times["reduce_scatter_s"].append(timed(lambda: mine.append(comm.reduce_scatter(rows, group, dim=0))))
        t1 = time.perf_counter()  # no barrier: the all-gather follows the reduce-scatter as in the optimizer's step
        comm.all_gather(mine[0], group, dim=0)
        times["all_gather_s"].append(time.perf_counter() - t1)
    return {"bytes": numel * 4, **times}


def case_time_finish() -> Dict[str, float]:
    plain, zero = (dict(STATE["models"][v].named_parameters()) for v in ("plain", "zero1"))
    worst = max(float((plain[n].detach() - zero[n].detach()).abs().max()) for n in plain)
    scale = max(float(p.detach().abs().max()) for p in plain.values())
    STATE.clear()
    gc.collect()
    return {"max_abs_weight_difference": worst, "max_abs_weight": scale}


def _rss_summary(per_rank: List[Dict[str, Any]]) -> Dict[str, Any]:
    most = slowest(per_rank, ("parameters", "parameter_bytes", "grad_bytes"))
    kib = slowest(per_rank, ("peak_rss_increase_kib", "rss_held_increase_kib", "rss_before_kib"))
    return {"per_rank": per_rank, "parameters_per_rank": most.pop("parameters"), **most,
            "optimizer_bytes_counted": max(sum(r["optimizer_bytes"].values()) for r in per_rank),
            "optimizer_bytes_by_kind": per_rank[0]["optimizer_bytes"], "last_loss": per_rank[0]["losses"][-1],
            **{f"{k[:-4]}_bytes": None if v is None else v * 1024 for k, v in kib.items()}}


def _timing(pool: Pool, spec: Dict[str, Any], tp: int, dp: int) -> Dict[str, Any]:
    log(f"zero1: step time at tp={tp} x dp={dp}")
    pool.call(case_time_setup, spec=spec)
    keys, reps = ("forward_backward_s", "update_s", "step_s"), spec["collective_reps"]
    samples = alternate(("plain", "zero1"), spec["rounds"], lambda v: pool.call(case_step, variant=v),
                        warmup=spec["warmup"], swap=True, what=f"zero1 tp={tp} x dp={dp}")
    samples = {v: [{**slowest(ranks, keys), "loss": ranks[0]["loss"]} for ranks in s] for v, s in samples.items()}
    collectives = pool.call(case_collectives, reps=reps)
    finish = slowest(pool.call(case_time_finish), ("max_abs_weight_difference", "max_abs_weight"))
    cc = {k: median(max(r[k][i] for r in collectives) for i in range(reps))
          for k in ("all_reduce_s", "reduce_scatter_s", "all_gather_s")}
    cc.update(bytes=collectives[0]["bytes"], ratio=(cc["reduce_scatter_s"] + cc["all_gather_s"]) / cc["all_reduce_s"])
    med = {v: {k: median(x[k] for x in s) for k in keys} for v, s in samples.items()}
    per_round = {k: [z[k] / p[k] for p, z in zip(samples["plain"], samples["zero1"])] for k in ("step_s", "update_s")}
    # The headline is the median of the per-round ratios: each pair ran back to back, so drift cancels.
    return {"tp": tp, "dp": dp, "rounds": spec["rounds"], "warmup": spec["warmup"], "samples": samples, "median": med,
            "ratio": median(per_round["step_s"]), "ratio_of_medians": med["zero1"]["step_s"] / med["plain"]["step_s"],
            "update_ratio": median(per_round["update_s"]), **finish, "collectives": cc}


def run(ctx) -> Dict[str, Any]:
    spec = QUICK if ctx.quick else FULL
    counted, rss, timings = None, {}, []
    for index, (tp, dp) in enumerate(spec["worlds"]):
        log(f"zero1: starting a gloo world of tp={tp} x dp={dp}")
        with Pool(tp * dp, tp=tp, malloc=True) as pool:
            if index == 0:
                counted = pool.call(case_count, spec={k: spec[k] for k in ("count", "dps")})[0]
                for variant in ("plain", "zero1"):
                    log(f"zero1: peak RSS of a {variant} step at tp={tp} x dp={dp}")
                    rss[variant] = _rss_summary(pool.call(case_rss, spec=spec["rss"], variant=variant))
                rss.update(tp=tp, dp=dp)
            timings.append(_timing(pool, spec["time"], tp, dp))
    for what, key in (("counted", "optimizer_bytes_counted"), ("held", "rss_held_increase_bytes"),
                      ("peak", "peak_rss_increase_bytes")):
        if None not in (rss["plain"][key], rss["zero1"][key]):
            rss[f"{what}_saving_bytes"] = rss["plain"][key] - rss["zero1"][key]
    saving = rss["counted_saving_bytes"]
    rss.update({f"{k}_saving_over_counted": rss[f"{k}_saving_bytes"] / saving for k in ("held", "peak")
                if saving and f"{k}_saving_bytes" in rss})
    out = {"spec": {**spec, "count": [{"model": label, "config": cfg, "tp": tp} for label, cfg, tp in spec["count"]]},
           "counted": counted, "rss": rss, "timings": timings}
    return dict(out, **section(_tables(out), **{f"rss_{k}": v for k, v in rss.items() if "over" in k}))


COUNT_COLUMNS = {"model": "model", "tp": "tp", "dp": "dp", "parameters / rank": "parameters",
                 "padding elements": "padding_elements", "padding %|.1e": "padding_percent",
                 "params (bf16)|.4f": "bpp_parameter", "grads: bf16 .grad|.4f": "bpp_grad",
                 "grads: fp32 main_grad|.4f": "bpp_main_grad", "fp32 master|.4f": "bpp_master",
                 "AdamW state|.4f": "bpp_state", "total, bf16 grads|.4f": "bpp_total_bf16_grads",
                 "total, fp32 main_grad|.4f": "bpp_total_fp32_grads", "NxD / Megatron 6 + 12/d|.4f": "bpp_reference",
                 "goal <= 6 + 1.01 x 12/d met": "goal_met"}
RSS_COLUMNS = {"path": "path", "parameters / rank": "parameters_per_rank",
               "parameter bytes|bytes": "parameter_bytes", "gradient bytes|bytes": "grad_bytes",
               "optimizer bytes, counted|bytes": "optimizer_bytes_counted", "RSS before the optimizer|bytes":
               "rss_before_bytes", "peak RSS increase|bytes": "peak_rss_increase_bytes",
               "RSS held after the steps, increase|bytes": "rss_held_increase_bytes"}
TIME_COLUMNS = {"world": lambda x: f"tp{x['tp']} x dp{x['dp']}",
                "plain step s": lambda x: x["median"]["plain"]["step_s"],
                "ZeRO-1 step s": lambda x: x["median"]["zero1"]["step_s"],
                "ratio ZeRO-1 / plain (median of per-round ratios)": "ratio",
                "ratio of the medians": "ratio_of_medians",
                "after backward s, plain / ZeRO-1": lambda x: [x["median"][v]["update_s"] for v in ("plain", "zero1")],
                "after-backward ratio": "update_ratio",
                "goal": lambda x: f"<= {STEP_TIME_GOAL}: {common.verdict(x['ratio'], STEP_TIME_GOAL)}",
                "max abs weight difference|.2e": "max_abs_weight_difference",
                "DP buffer|bytes": lambda x: x["collectives"]["bytes"],
                **{c: lambda x, k=k: x["collectives"][k] for c, k in (
                    ("all-reduce s (plain)", "all_reduce_s"), ("reduce-scatter s (ZeRO-1)", "reduce_scatter_s"),
                    ("all-gather s (ZeRO-1)", "all_gather_s"),
                    ("(reduce-scatter + all-gather) / all-reduce", "ratio"))}}


def _tables(out: Dict[str, Any]) -> List[Any]:
    spec, rss, m, t = out["spec"], out["rss"], out["spec"]["rss"], out["spec"]["time"]
    paths = [dict(rss["plain"], path="plain AdamW + DP all-reduce + clip"), dict(rss["zero1"], path="ZeRO-1 AdamW"),
             {"path": "plain - ZeRO-1", "optimizer_bytes_counted": rss["counted_saving_bytes"],
              "peak_rss_increase_bytes": rss.get("peak_saving_bytes"),
              "rss_held_increase_bytes": rss["held_saving_bytes"]}]
    return [
        "**Bytes per parameter per rank**: bf16 parameters, ZeRO-1 AdamW with fp32 master shards, counted on meta "
        "models sharded under a simulated topology (FlatShardLayout padding included), per TP-local parameter. Models: "
        + "; ".join(f"{c['model']} tp={c['tp']} ({model_text(c['config'])})" for c in spec["count"]),
        table(COUNT_COLUMNS, out["counted"], keys=3),
        "Totals: params + grads + master + AdamW state. \"bf16 grads\": nxdtp's default .grad; \"fp32 main_grad\": "
        "`use_grad_acc_hook=True`, Megatron's gradient buffer, the like-for-like of 6 + 12/d. AdamW state includes "
        "a 4-byte step counter per tensor on every rank (not sharded).",
        f"**Peak RSS of a real step**, tp={rss['tp']} x dp={rss['dp']} gloo ranks, fp32 Llama "
        f"({model_text(m['model'])}), batch {m['batch']} x {m['seq']} per DP rank, {m['steps']} steps after a warm-up "
        "forward and backward; largest rank; increases over the RSS before the optimizer. Measured / counted saving: "
        f"held {common.cell(rss.get('held_saving_over_counted'), '.3f')}, peak "
        f"{common.cell(rss.get('peak_saving_over_counted'), '.3f')}.",
        table(RSS_COLUMNS, paths),
        f"**Step time**, ZeRO-1 against plain DP (bucketed all-reduce + clip + AdamW), fp32 Llama "
        f"({model_text(t['model'])}), batch {t['batch']} x {t['seq']} per DP rank; {t['warmup']} warm-up and "
        f"{t['rounds']} rounds alternating the paths (order swapped each round); slowest rank; medians. DP collectives "
        "alone: nxdtp.comm on the DP group, a buffer of the rank's fp32 gradient size.",
        table(TIME_COLUMNS, out["timings"])]


# ---- section 8: the stall of save_checkpoint, sync against async_save -------------------------------------------

def _async_step() -> None:
    timed_step(STATE["model"], STATE["optimizer"], STATE["batch"], "zero1")
    STATE["scheduler"].step()


def case_async_setup(spec: Dict[str, Any]) -> int:
    model = real_model(spec["model"])
    optimizer = make_optimizer(model, "zero1")
    STATE.update(model=model, optimizer=optimizer, batch=llama_batch(spec), step=0,
                 scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + s)))
    for _ in range(spec["warmup"]):
        timed(_async_step)
    return sum(p.numel() for p in model.parameters())


def case_async_round(mode: str, directory: str, pre: int, post: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {"pre": [timed(_async_step) for _ in range(pre)]}
    STATE["step"] += 1
    tag = f"step_{STATE['step']}"
    state = (STATE["model"], STATE["optimizer"], STATE["scheduler"], {"global_step": STATE["step"], "seed": SEED})
    out["call_s"] = timed(lambda: save_checkpoint(directory, tag, *state, async_save=mode == "async"))
    out["post"] = [timed(_async_step) for _ in range(post)]
    out["finalize_s"] = timed(finalize_checkpoint)
    if dist.get_rank() == 0:
        out["bytes"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(directory, tag))
                           for f in fs)
    return out


def run_async_save(ctx) -> Dict[str, Any]:
    spec = ASYNC_QUICK if ctx.quick else ASYNC_FULL
    log(f"async_save: starting a gloo world of tp={spec['tp']} x dp={spec['dp']}")

    def one_round(mode: str) -> Dict[str, Any]:
        with tempfile.TemporaryDirectory(dir=workdir) as directory:  # every save writes the same bytes
            ranks = pool.call(case_async_round, mode=mode, directory=directory, pre=spec["pre"], post=spec["post"])
        return {**{k: [max(x) for x in zip(*(r[k] for r in ranks))] for k in ("pre", "post")},
                **slowest(ranks, ("call_s", "finalize_s")), "bytes": ranks[0].get("bytes")}

    with tempfile.TemporaryDirectory(prefix="nxdtp_bench_async_save_") as workdir, \
            Pool(spec["tp"] * spec["dp"], tp=spec["tp"]) as pool:
        parameters = pool.call(case_async_setup, spec=spec)[0]
        rounds = alternate(("sync", "async"), spec["rounds"], one_round, swap=True, what="async_save")
    return _async_result(spec, parameters, rounds)


def _async_result(spec, parameters: int, rounds: Dict[str, List[Dict[str, Any]]]) -> Dict[str, Any]:
    baseline, post, rows = median(t for mine in rounds.values() for r in mine for t in r["pre"]), spec["post"], []
    for mode, mine in rounds.items():
        excess = [sum(t - baseline for t in r["post"]) for r in mine]
        rows.append({"mode": mode, "call_s": median(r["call_s"] for r in mine), "post_excess_s": median(excess),
                     "post_step_s": median(t for r in mine for t in r["post"]),
                     "finalize_s": median(r["finalize_s"] for r in mine),
                     "stall_s": median(r["call_s"] + e + r["finalize_s"] for r, e in zip(mine, excess))})
    stall, call = (rows[1][k] / rows[0][k] for k in ("stall_s", "call_s"))  # async / sync
    size = float(rounds["sync"][0]["bytes"] or 0)
    return {"spec": spec, "rounds": rounds, **section([
        f"tp={spec['tp']} x dp={spec['dp']} gloo ranks, fp32 Llama ({model_text(spec['model'])}; {parameters:,} "
        f"parameters / rank), ZeRO-1 AdamW, batch {spec['batch']} x {spec['seq']}; checkpoint tag {size:,.0f} B; "
        f"baseline step {baseline:.3f} s. {spec['rounds']} alternating rounds per mode: {spec['pre']} steps, "
        f"save_checkpoint, {post} steps, finalize_checkpoint; slowest rank; medians.",
        table({"save_checkpoint": "mode", "call returns after s|.3f": "call_s",
               f"step s during the next {post}|.3f": "post_step_s",
               f"excess of those {post} steps over the baseline, s|.3f": "post_excess_s",
               "finalize_checkpoint waited s|.3f": "finalize_s", "stall s (call + excess + finalize)|.3f": "stall_s"},
              rows),
        f"Async stall / sync stall: {stall:.3f}; async call / sync call: {call:.3f} (the background thread writes the "
        "rest while the steps run)."], baseline_step_s=baseline, checkpoint_bytes=size,
        parameters_per_rank=float(parameters), async_over_sync_stall=stall, async_call_over_sync_call=call)}
