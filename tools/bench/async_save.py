"""Section 8: the training loop's stall while a checkpoint is written, ``save_checkpoint`` synchronous against
``async_save=True`` (``nxdtp.trainer.checkpoint``, issue 25).

A gloo world of tp=2 x dp=1 (2 processes, one thread each) trains an fp32 Llama-shaped model with ZeRO-1 AdamW (the
optimizer of NxD's Llama example). A round is: ``pre`` timed steps, ``save_checkpoint(dir, tag, model, optimizer,
scheduler, user_content, async_save=...)`` timed, ``post`` timed steps, ``finalize_checkpoint()`` timed; every step and
call starts after a barrier and its time is the slowest rank's. Rounds alternate sync and async (the order swapped
each time); the checkpoint directory is removed after each round, so every save writes the same bytes.

* baseline step: the median of every round's ``pre`` steps;
* sync stall: the ``save_checkpoint`` call (the whole save) plus the ``post`` steps' excess over the baseline;
* async stall: the call (prepare: state dicts, replicated check, lock; and the host copy), plus the ``post`` steps'
  excess over the baseline (the writer thread shares the core), plus what ``finalize_checkpoint`` waited;
* the async call's share of the sync save, and async stall / sync stall; medians over rounds.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Dict, List

from .common import WorkerGroup, fmt, fmt_bytes, log, markdown_table
from .zero1 import SEED, TINY_LLAMA, _batch, _make_optimizer, _model_text, _real_model

GLOO_TIMEOUT_S = 900

FULL = dict(model=dict(kind="llama", vocab_size=16000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False),
            batch=2, seq=64, warmup=2, pre=3, post=8, rounds=6, tp=2, dp=1)
QUICK = dict(model=TINY_LLAMA, batch=2, seq=16, warmup=1, pre=2, post=2, rounds=2, tp=2, dp=1)


# ---- worker side -----------------------------------------------------------------------------------------------------

def _step(state) -> float:
    import torch.distributed as dist

    model, optimizer, scheduler = state["model"], state["optimizer"], state["scheduler"]
    dist.barrier()
    t0 = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    model(**state["batch"]).loss.backward()
    optimizer.step()
    scheduler.step()
    return time.perf_counter() - t0


def h_setup(state, spec: Dict[str, Any]) -> Dict[str, Any]:
    import torch

    model = _real_model(spec["model"])
    optimizer = _make_optimizer(model, "zero1")
    state.update(model=model, optimizer=optimizer, batch=_batch(spec), step=0,
                 scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + s)))
    for _ in range(spec["warmup"]):
        _step(state)
    return {"parameters": sum(p.numel() for p in model.parameters())}


def h_round(state, mode: str, directory: str, pre: int, post: int) -> Dict[str, Any]:
    import torch.distributed as dist

    from nxdtp.trainer import finalize_checkpoint, save_checkpoint

    out: Dict[str, Any] = {"pre": [_step(state) for _ in range(pre)]}
    state["step"] += 1
    dist.barrier()
    t0 = time.perf_counter()
    save_checkpoint(directory, f"step_{state['step']}", state["model"], state["optimizer"], state["scheduler"],
                    {"global_step": state["step"], "seed": SEED}, async_save=mode == "async")
    out["call_s"] = time.perf_counter() - t0
    out["post"] = [_step(state) for _ in range(post)]
    dist.barrier()
    t0 = time.perf_counter()
    finalize_checkpoint()
    out["finalize_s"] = time.perf_counter() - t0
    if dist.get_rank() == 0:
        tag = os.path.join(directory, f"step_{state['step']}")
        out["bytes"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tag) for f in fs)
    return out


def worker_main(conn, name: str, rank: int, world: int, port: int, tp: int) -> None:
    from .common import serve_in_gloo_world

    serve_in_gloo_world(conn, {"setup": h_setup, "round": h_round}, rank, world, port, tp, GLOO_TIMEOUT_S)


# ---- driver side -----------------------------------------------------------------------------------------------------

def _slowest(ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
    return {"pre": [max(r["pre"][i] for r in ranks) for i in range(len(ranks[0]["pre"]))],
            "post": [max(r["post"][i] for r in ranks) for i in range(len(ranks[0]["post"]))],
            "call_s": max(r["call_s"] for r in ranks), "finalize_s": max(r["finalize_s"] for r in ranks),
            "bytes": ranks[0].get("bytes")}


def run(quick: bool) -> Dict[str, Any]:
    spec = QUICK if quick else FULL
    log(f"async_save: starting a gloo world of tp={spec['tp']} x dp={spec['dp']}")
    group = WorkerGroup("async_save", worker_main, spec["tp"] * spec["dp"], extra_args=(spec["tp"],))
    workdir = tempfile.mkdtemp(prefix="nxdtp_bench_async_save_")
    rounds: List[Dict[str, Any]] = []
    try:
        parameters = group.call("setup", spec=spec)[0]["parameters"]
        for i in range(spec["rounds"]):
            for mode in (("sync", "async") if i % 2 == 0 else ("async", "sync")):
                directory = os.path.join(workdir, f"round{i}_{mode}")
                result = _slowest(group.call("round", mode=mode, directory=directory, pre=spec["pre"],
                                             post=spec["post"]))
                shutil.rmtree(directory, ignore_errors=True)
                rounds.append({"round": i, "mode": mode, **result})
            log(f"async_save: round {i + 1}/{spec['rounds']}")
    finally:
        group.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return _result(spec, parameters, rounds)


def _result(spec, parameters: int, rounds: List[Dict[str, Any]]) -> Dict[str, Any]:
    baseline = statistics.median(t for r in rounds for t in r["pre"])
    per_mode: Dict[str, Dict[str, float]] = {}
    for mode in ("sync", "async"):
        mine = [r for r in rounds if r["mode"] == mode]
        excess = [sum(t - baseline for t in r["post"]) for r in mine]
        stall = [r["call_s"] + e + r["finalize_s"] for r, e in zip(mine, excess)]
        per_mode[mode] = {"call_s": statistics.median(r["call_s"] for r in mine),
                          "post_excess_s": statistics.median(excess),
                          "post_step_s": statistics.median(t for r in mine for t in r["post"]),
                          "finalize_s": statistics.median(r["finalize_s"] for r in mine),
                          "stall_s": statistics.median(stall)}
    sync, async_ = per_mode["sync"], per_mode["async"]
    numbers = {"baseline_step_s": baseline, "checkpoint_bytes": float(rounds[0]["bytes"] or 0),
               "parameters_per_rank": float(parameters)}
    for mode, values in per_mode.items():
        numbers.update({f"{mode}_{k}": v for k, v in values.items()})
    numbers["async_over_sync_stall"] = async_["stall_s"] / sync["stall_s"]
    numbers["async_call_over_sync_call"] = async_["call_s"] / sync["call_s"]
    return {"spec": spec, "rounds": rounds, "numbers": numbers}


def tables(result: Dict[str, Any]) -> str:
    spec, n = result["spec"], result["numbers"]
    lines = [f"gloo world tp={spec['tp']} x dp={spec['dp']} (one thread per rank), fp32 Llama-shaped model "
             f"({_model_text(spec['model'])}; {int(n['parameters_per_rank']):,} parameters per rank), ZeRO-1 AdamW, "
             f"batch {spec['batch']} x {spec['seq']}; a checkpoint tag of {fmt_bytes(n['checkpoint_bytes'])}. "
             f"{spec['rounds']} rounds per mode, alternating; each round: {spec['pre']} steps, save_checkpoint, "
             f"{spec['post']} steps, finalize_checkpoint; slowest rank; medians over rounds. Baseline step "
             f"{fmt(n['baseline_step_s'], 3)} s.", ""]
    rows = []
    for mode in ("sync", "async"):
        rows.append([mode, fmt(n[f"{mode}_call_s"], 3), fmt(n[f"{mode}_post_step_s"], 3),
                     fmt(n[f"{mode}_post_excess_s"], 3), fmt(n[f"{mode}_finalize_s"], 3), fmt(n[f"{mode}_stall_s"], 3)])
    lines.append(markdown_table(["save_checkpoint", "call returns after s", f"step s during the next {spec['post']}",
                                 f"excess of those {spec['post']} steps over the baseline, s",
                                 "finalize_checkpoint waited s", "stall s (call + excess + finalize)"], rows))
    lines += ["", f"Async stall / sync stall: {fmt(n['async_over_sync_stall'], 3)}; the async call takes "
                  f"{fmt(n['async_call_over_sync_call'], 3)} of the sync save's time (the rest is written by the "
                  "background thread while the steps run)."]
    return "\n".join(lines)
