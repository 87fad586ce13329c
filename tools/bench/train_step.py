"""Section 1: train steps of competitors (pools of single-threaded workers), alternating, each timed by the slowest
rank; ``run_gpu``: the --gpu section (docs/performance.md, section 1)."""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import BertForPreTraining, LlamaForCausalLM  # noqa: F401 - imported before the memory baselines

import nxdtp.grads
from nxdtp.grads import allreduce_sequence_parallel_gradients
from nxdtp.models import parallelize_model
from nxdtp.models.bert import parallelize_bert
from nxdtp.utils import move_model_to_device

from . import common
from .common import ADAMW, MAX_GRAD_NORM, SEED, Pool, alternate, barrier, log, median, section, summary, table, verdict

LABELS = {"dense": "(a) dense, 1 process x 1 thread", "nxdtp": "(b) nxdtp TP=2, 2 gloo ranks x 1 thread",
          "dtensor": "(c) DTensor TP=2, 2 gloo ranks x 1 thread"}
TP, WARMUP = 2, 2
PHASES = ("forward", "backward", "clip", "optimizer")
# Sharded sums move results by a few ulps per operation (at most 2.3e-6 relative over the 12 steps of the full run),
# far below the 4-22 % one step changes the loss here: a sharding error cannot hide inside this tolerance.
LOSS_RTOL = 1e-4
FULL = dict(model=dict(num_hidden_layers=4, hidden_size=768, num_attention_heads=12, intermediate_size=3072,
                       vocab_size=30522, max_position_embeddings=512, type_vocab_size=2), seq=128, batch=8, rounds=10)
QUICK = dict(model=dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=256,
                        vocab_size=512, max_position_embeddings=64, type_vocab_size=2), seq=32, batch=4, rounds=3)
# GQA: 8 query heads over 2 KV heads, so each TP rank holds 4 query heads and one KV head.
LLAMA_FULL = dict(model=dict(num_hidden_layers=4, hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                             intermediate_size=1408, vocab_size=8192, max_position_embeddings=256), seq=128, batch=4)
LLAMA_QUICK = dict(model=dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=176, vocab_size=512, max_position_embeddings=64), seq=32, batch=4)
STATE: Dict[str, Any] = {}  # a worker's model, optimizer and batch between calls


# ---- models and batches (also sections 3 and 4) --------------------------------------------------------------------

def build_dense(model_cfg: Dict[str, Any], seed: int, arch: str = "bert"):
    """The same model in every process: dropout off, an untied Llama head, every parameter moved by seeded noise."""
    dropout_off = (dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0) if arch == "bert"
                   else dict(attention_dropout=0.0, tie_word_embeddings=False))
    model = common.hf_model(model_cfg, arch, seed, **dropout_off)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():  # tied weights once, in a fixed order
            p.add_(torch.randn(p.shape, generator=generator), alpha=0.02)
    return model.train()


def make_batch(model_cfg: Dict[str, Any], seq: int, batch: int, seed: int, arch: str = "bert") -> Dict[str, Any]:
    generator = torch.Generator().manual_seed(seed + 2)
    ids = torch.randint(0, model_cfg["vocab_size"], (batch, seq), generator=generator)
    if arch != "bert":  # a packed causal-LM batch, as the Llama example reads it
        return {"input_ids": ids, "labels": ids.clone()}
    masked = torch.rand(batch, seq, generator=generator) < 0.15
    masked[:, 1] = True  # at least one MLM target per sequence
    return {"input_ids": ids, "token_type_ids": (torch.arange(seq) >= seq // 2).long().expand(batch, seq).contiguous(),
            "attention_mask": torch.ones(batch, seq, dtype=torch.long),
            "labels": torch.where(masked, ids, torch.full_like(ids, -100)),
            "next_sentence_label": torch.randint(0, 2, (batch,), generator=generator)}


def _dtensor_clip(parameters, max_norm: float):
    """``clip_grad_norm_`` refuses a mix of DTensor and Tensor gradients: the norm of each list, combined."""
    params = [p for p in parameters if p.grad is not None]
    groups = [g for g in ([p for p in params if isinstance(p.grad, DTensor) == s] for s in (True, False)) if g]
    norms = [torch.nn.utils.get_total_norm([p.grad for p in g]) for g in groups]
    total = torch.linalg.vector_norm(torch.stack([getattr(n, "full_tensor", lambda n=n: n)() for n in norms]))
    for group in groups:
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def shard(kind: str, model, arch: str = "bert", sequence_parallel: bool = False, vocab_multiple: int = 1):
    """Shard ``model`` as competitor ``kind`` does; return its gradient-clipping function."""
    if kind == "nxdtp":
        (parallelize_bert if arch == "bert" else parallelize_model)(
            model, sequence_parallel=sequence_parallel, make_vocab_size_divisible_by=vocab_multiple)
        return lambda params: nxdtp.grads.clip_grad_norm(params, MAX_GRAD_NORM)
    if kind == "dtensor":
        mesh = STATE.setdefault("mesh", init_device_mesh("cpu", (dist.get_world_size(),)))
        plan = {name: (RowwiseParallel if name.endswith("output.dense") else ColwiseParallel)() for name in (
            "attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
            "intermediate.dense", "output.dense")}
        for layer in model.bert.encoder.layer:
            parallelize_module(layer, mesh, plan)
            layer.attention.self.num_attention_heads //= mesh.size()  # the local head count
            layer.attention.self.all_head_size //= mesh.size()
        return lambda params: _dtensor_clip(params, MAX_GRAD_NORM)
    return lambda params: torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)


def case_build(kind: str, model_cfg, seq: int, batch: int, arch: str = "bert", vocab_multiple: int = 1,
               device: str = "cpu", sequence_parallel: bool = False) -> Dict[str, Any]:
    """Build, shard and keep the model, AdamW and the batch; reset the peak-RSS watermark."""
    if "baseline" not in STATE:  # after the same imports in every competitor
        STATE["baseline"] = common.proc_status_kib()["VmRSS"] / 1024
    model = build_dense(model_cfg, SEED, arch)
    clip = shard(kind, model, arch, sequence_parallel, vocab_multiple)
    if device != "cpu":  # the --gpu section: tp=1, nothing was split
        torch.cuda.set_device(device)
        model = move_model_to_device(model, device) if kind == "nxdtp" else model.to(device)
        torch.cuda.reset_peak_memory_stats()
    STATE.update(model=model, clip=clip, optimizer=torch.optim.AdamW(model.parameters(), **ADAMW), device=device,
                 batch={k: v.to(device) for k, v in make_batch(model_cfg, seq, batch, SEED, arch).items()},
                 sequence_parallel=sequence_parallel)
    gc.collect()
    STATE.update(peak_reset=common.reset_peak_rss(), after_build=common.proc_status_kib()["VmRSS"] / 1024)
    local = [getattr(p, "to_local", lambda p=p: p)() for p in model.parameters()]
    return {"parameter_bytes": sum(p.numel() * p.element_size() for p in local),
            "attn_implementation": model.config._attn_implementation,
            "local_vocab_rows": model.get_input_embeddings().weight.shape[0]}


def case_step(marks: bool = False, counter=None) -> Dict[str, float]:
    """zero_grad and forward, backward, (with sequence parallelism, the gradient sum,) clip, AdamW step: the wall time
    of each phase (device work included). ``counter`` (section 3's) is told each phase before it runs."""
    barrier()
    model, optimizer, out = STATE["model"], STATE["optimizer"], {}
    actions = {"forward": lambda: (optimizer.zero_grad(set_to_none=True), model(**STATE["batch"]).loss)[1],
               "backward": lambda: out["loss"].backward(),
               "sequence-parallel gradient sum": lambda: allreduce_sequence_parallel_gradients(optimizer),
               "clip": lambda: STATE["clip"](list(model.parameters())), "optimizer": optimizer.step}
    if not STATE["sequence_parallel"]:
        del actions["sequence-parallel gradient sum"]
    start = last = time.perf_counter()
    for phase, action in actions.items():
        if counter is not None:
            counter.phase = phase
        with record_function(f"phase::{phase}") if marks else contextlib.nullcontext():
            out[{"forward": "loss", "clip": "grad_norm"}.get(phase, "_")] = action()
        if STATE["device"].startswith("cuda"):
            torch.cuda.synchronize()
        now = time.perf_counter()
        out[phase], last = now - last, now
    out.update(seconds=last - start, loss=out["loss"].item(), grad_norm=float(out["grad_norm"]))
    del out["_"]
    return out


def case_memory() -> Dict[str, Any]:
    peak = common.proc_status_kib()["VmHWM"] / 1024
    out = {"peak_mib": peak, "increase_mib": peak - STATE["baseline"], "after_build_mib": STATE["after_build"],
           "increase_over_build_mib": peak - STATE["after_build"], "peak_reset": STATE["peak_reset"]}
    if STATE["device"].startswith("cuda"):
        out["device_peak_mib"] = torch.cuda.max_memory_allocated() / (1 << 20)
    return out


def case_release() -> None:
    STATE.update(model=None, clip=None, optimizer=None, batch=None)
    gc.collect()
    common.malloc_trim()


def case_gemm_probe(model_cfg, seq: int, batch: int, seconds: float = 1.5) -> Dict[str, float]:
    """Each rank times an MLP column-shard GEMM alone, then all at once: 1.0 with a core per rank, 2.0 sharing one."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(seq * batch, model_cfg["hidden_size"], requires_grad=True)
    w = torch.randn(model_cfg["intermediate_size"] // world, model_cfg["hidden_size"], requires_grad=True)
    upstream = torch.randn(x.shape[0], w.shape[0])

    def timed_loop() -> float:
        times, end = [], time.perf_counter() + seconds
        while time.perf_counter() < end or len(times) < 3:
            t0 = time.perf_counter()
            F.linear(x, w).backward(upstream)
            x.grad = w.grad = None
            times.append(time.perf_counter() - t0)
        return median(times[1:])

    timed_loop()  # warm up
    alone = None
    for turn in range(world):
        barrier()
        alone = timed_loop() if turn == rank else alone
        barrier()
    together = timed_loop()
    barrier()
    return {"alone_ms": 1e3 * alone, "together_ms": 1e3 * together, "together_over_alone": together / alone}


def case_profile(row_limit: int = 25) -> Dict[str, Any]:
    """One train step under torch.profiler: the phases' wall times and the ops by self CPU time."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step = case_step(marks=True)
    ops = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)[:row_limit]
    return {"step": step, "ops": [[e.key, str(e.input_shapes)[:60], e.count, e.self_cpu_time_total / 1e3]
                                  for e in ops if not e.key.startswith("phase::")]}


class Competitors(dict):
    """Worker pools by name, started when first asked for, shared by sections 1 and 3 (and the --gpu section's)."""

    SHAPES = {"dense": (1, None), "nxdtp": (TP, TP), "dtensor": (TP, None), "gpu-dense": (1, None), "gpu-nxdtp": (1, 1)}

    def pool(self, name: str, backend: str = "gloo") -> Pool:
        if name not in self:
            self[name] = Pool(*self.SHAPES[name], backend=backend)
        return self[name]

    def close(self) -> None:
        while self:
            self.popitem()[1].close()


def _competitor(kind: str, build: List[dict], steps: List[List[dict]], memory: List[dict], warmup: int) -> dict:
    timed, last = steps[warmup:], [r["loss"] for r in steps[-1]]
    seconds = [max(r["seconds"] for r in step) for step in timed]
    return {"label": LABELS[kind], "ranks": len(build), "step_s": summary(seconds), "step_s_per_round": seconds,
            "phase_s_median": {p: median(max(r[p] for r in step) for step in timed) for p in PHASES},
            "loss_per_step": [step[0]["loss"] for step in steps],
            "last_loss": last[0], "last_loss_ranks_equal": len(set(last)) == 1,
            "parameter_bytes_per_rank": [b["parameter_bytes"] for b in build],
            "attn_implementation": build[0]["attn_implementation"], "local_vocab_rows": build[0]["local_vocab_rows"],
            "memory": memory[0],
            **{f"{k}_per_rank": [m[v] for m in memory] for k, v in (("peak_rss_mib", "peak_mib"), (
                "rss_increase_mib", "increase_mib"), ("peak_over_after_build_mib", "increase_over_build_mib"))}}


def _rounds(pools: Dict[str, Pool], spec, arch: str, ctx, device: str = "cpu", profiled: bool = False) -> dict:
    """Build on every competitor, alternate their steps, read their memory (then profile a step), release the model;
    the figures of each and their ratios."""
    rounds = ctx.rounds or (QUICK if ctx.quick else FULL)["rounds"]
    warmup = WARMUP if ctx.warmup is None else ctx.warmup
    log(f"train step ({arch}): building {', '.join(pools)} (config {spec['model']}, seq {spec['seq']})")
    builds = {k: p.call(case_build, kind=k, model_cfg=spec["model"], seq=spec["seq"], batch=spec["batch"], arch=arch,
                        device=device, vocab_multiple=ctx.vocab_multiple if k == "nxdtp" else 1)
              for k, p in pools.items()}
    steps = alternate(list(pools), warmup + rounds, lambda k: pools[k].call(case_step), what=f"train step ({arch})")
    c = {k: _competitor(k, builds[k], steps[k], p.call(case_memory), warmup) for k, p in pools.items()}
    for k, pool in pools.items():
        if profiled:
            c[k]["profile"] = pool.call(case_profile)[0]
        pool.call(case_release)
    losses = {k: v["last_loss"] for k, v in c.items()}
    worst = max(abs(v - losses["dense"]) / abs(losses["dense"]) for v in losses.values())
    per_round = {f"nxdtp/{o}": [b / a for b, a in zip(c["nxdtp"]["step_s_per_round"], c[o]["step_s_per_round"])]
                 for o in c if o != "nxdtp"}
    return {"config": spec["model"], "seq": spec["seq"], "batch": spec["batch"], "tp": TP, "rounds": rounds,
            "warmup_steps": warmup, "nxdtp_make_vocab_size_divisible_by": ctx.vocab_multiple, "order": list(c),
            "competitors": c, "per_round_ratios": per_round,
            "loss_agreement": {"rtol": LOSS_RTOL, "losses": losses, "max_rel_diff_vs_dense": worst,
                               "agree": worst <= LOSS_RTOL and all(v["last_loss_ranks_equal"] for v in c.values())},
            "ratios": {**{f"{o} step time": c["nxdtp"]["step_s"]["median"] / c[o[6:]]["step_s"]["median"]
                          for o in per_round},
                       **{f"{o} step time, median of per-round ratios": median(v) for o, v in per_round.items()}}}


def _peak_ratio(competitors: Dict[str, Any], kind: str, key: str) -> float:
    return max(competitors[kind][key]) / max(competitors["dense"][key])


def run(ctx) -> Dict[str, Any]:
    pools, spec = {k: ctx.competitors.pool(k) for k in LABELS}, QUICK if ctx.quick else FULL
    out = _rounds(pools, spec, "bert", ctx, profiled=ctx.profile)
    probe = pools["nxdtp"].call(case_gemm_probe, model_cfg=spec["model"], seq=spec["seq"], batch=spec["batch"])
    out["two_rank_gemm_probe"] = {"per_rank": probe, "together_over_alone": max(p["together_over_alone"]
                                                                               for p in probe)}
    out["ratios"].update({f"{k}/dense peak RSS {what}": _peak_ratio(out["competitors"], k, key) for k, what, key in (
        ("nxdtp", "increase per rank", "rss_increase_mib_per_rank"),
        ("nxdtp", "per rank (absolute)", "peak_rss_mib_per_rank"),
        ("dtensor", "increase per rank", "rss_increase_mib_per_rank"))})
    llama_pools = {k: pools[k] for k in ("dense", "nxdtp")}  # the same workers, their BERT released
    llama = out["llama"] = _rounds(llama_pools, LLAMA_QUICK if ctx.quick else LLAMA_FULL, "llama", ctx)
    # The workers ran BERT's rounds first: the peak is compared over the RSS right after the Llama was built.
    llama["ratios"]["nxdtp/dense peak RSS over build per rank"] = _peak_ratio(
        llama["competitors"], "nxdtp", "peak_over_after_build_mib_per_rank")
    return dict(out, **section(_tables(out)))


def run_gpu(ctx) -> Dict[str, Any]:
    """The --gpu section: section 1's step, dense vs nxdtp tp=1 (NCCL; gloo when ``ctx.gpu_device`` is cpu)."""
    device = ctx.gpu_device
    backend = "nccl" if device.startswith("cuda") else "gloo"
    pools = {"dense": ctx.competitors.pool("gpu-dense"), "nxdtp": ctx.competitors.pool("gpu-nxdtp", backend)}
    out = dict(_rounds(pools, QUICK if ctx.quick else FULL, "bert", ctx, device, profiled=ctx.profile),
               device=device, backend=backend)
    ratio, agree = out["ratios"]["nxdtp/dense step time"], out["loss_agreement"]
    return dict(out, **section([
        f"Section 1's model and step on {device} ({backend}), {out['warmup_steps']} warm-up steps, {out['rounds']} "
        "alternating rounds, medians (each phase ends with a device synchronize).",
        table({"competitor": "kind", "step s median (min-max)|.4f": "step_s", "peak memory MiB": lambda v: v[
            "memory"].get("device_peak_mib", v["memory"]["peak_mib"]), "loss at last step|.7f": "last_loss"},
              [dict(v, kind=k) for k, v in out["competitors"].items()]),
        f"nxdtp tp=1 / dense step time: {ratio:.3f} (1.00 = no overhead); losses agree within {LOSS_RTOL:.0e}: "
        f"{agree['agree']}."], nxdtp_tp1_over_dense=ratio, loss_rel_diff=agree["max_rel_diff_vs_dense"]))


def _describe(result: Dict[str, Any], arch: str) -> List[Any]:
    """The caption and the competitors' table of one model's rounds."""
    cfg, c, bert = result["config"], result["competitors"], arch == "bert"
    columns = {"competitor": "label", "step s median (min-max)|.3f": "step_s", **{
        f"{p if p != 'optimizer' else 'AdamW'} s|{'.4f' if p == 'clip' else '.3f'}": lambda k, p=p: k[
            "phase_s_median"][p] for p in PHASES},
        "parameters MiB / rank|,.1f": lambda k: max(k["parameter_bytes_per_rank"]) / (1 << 20),
        "peak RSS MiB per rank|.0f": "peak_rss_mib_per_rank",
        **({"peak RSS increase MiB per rank (over imports)|.0f": "rss_increase_mib_per_rank"} if bert else {}),
        "peak RSS MiB per rank over RSS after build|.0f": "peak_over_after_build_mib_per_rank",
        "loss at last step|.7f": "last_loss"}
    name = "BertForPreTraining" if bert else "LlamaForCausalLM (Llama-shaped decoder)"
    return [f"{name}: {common.model_text(cfg)}; seq {result['seq']}, batch {result['batch']}, fp32, AdamW (lr "
            f"{ADAMW['lr']}), clip to {MAX_GRAD_NORM}; {result['warmup_steps']} warm-up steps, {result['rounds']} "
            f"rounds; attention {c['dense']['attn_implementation']}; nxdtp make_vocab_size_divisible_by="
            f"{result['nxdtp_make_vocab_size_divisible_by']} ({c['nxdtp']['local_vocab_rows']} vocabulary rows per "
            "rank).", table(columns, c.values(), name="" if bert else "llama")]


HALF = "<= 0.60 (limit 0.50)"
# (label, ratio[, target text, target]) of section 1's figures; the Llama's after them.
FIGURES = [("step time b/a (nxdtp / dense)", "nxdtp/dense step time", HALF, 0.60),
           ("step time b/c (nxdtp / DTensor)", "nxdtp/dtensor step time", "<= 0.65", 0.65),
           ("b/a, median of per-round ratios", "nxdtp/dense step time, median of per-round ratios"),
           ("b/c, median of per-round ratios", "nxdtp/dtensor step time, median of per-round ratios"),
           ("peak RSS increase per rank, b/a", "nxdtp/dense peak RSS increase per rank", HALF, 0.60),
           ("peak RSS per rank (absolute, imports included), b/a", "nxdtp/dense peak RSS per rank (absolute)"),
           ("peak RSS increase per rank, c/a", "dtensor/dense peak RSS increase per rank")]
LLAMA_FIGURES = [("Llama step time b/a (nxdtp / dense)", "nxdtp/dense step time", HALF, 0.60),
                 ("Llama b/a, median of per-round ratios", "nxdtp/dense step time, median of per-round ratios"),
                 ("Llama peak RSS per rank over RSS after build, b/a", "nxdtp/dense peak RSS over build per rank")]


def _figures(result: Dict[str, Any], figures, who: str, *extra: list) -> Dict[str, Any]:
    """The table of ``figures`` (their targets and verdicts), ``extra`` rows, then the losses' agreement."""
    agree, ratios = result["loss_agreement"], result["ratios"]
    return table(["figure", "value", "target", "verdict"], [
        [label, ratios[key], *((t[0], verdict(ratios[key], t[1])) if t else ("", ""))] for label, key, *t in figures]
        + list(extra) + [[f"{who}losses at the last step agree", agree["max_rel_diff_vs_dense"],
                          f"<= {LOSS_RTOL:.0e}", "met" if agree["agree"] else "MISSED"]])


def _tables(out: Dict[str, Any]) -> List[Any]:
    probe = out["two_rank_gemm_probe"]["together_over_alone"]
    blocks = _describe(out, "bert") + [_figures(out, FIGURES, "", [
        "machine check: a TP-shard GEMM, both ranks at once / one rank alone", probe, "1.00 (a core per rank)",
        "ok" if probe <= 1.15 else "the ranks do not get a core each: b/a cannot reach its target here"]),
        "Peak RSS: VmHWM over the train steps; increase = over the RSS after the imports; the next column, over the "
        "RSS after build."]
    blocks += _describe(out["llama"], "llama") + [_figures(out["llama"], LLAMA_FIGURES, "Llama ")]
    for kind, c in out["competitors"].items():
        if "profile" in c:
            blocks += [f"Profile of one step, {LABELS[kind]}, rank 0 (phases {c['profile']['step']}):",
                       table(["op", "input shapes", "calls", "self CPU ms|.2f"], c["profile"]["ops"], keys=0)]
    return blocks
