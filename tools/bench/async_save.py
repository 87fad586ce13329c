"""Section 8: the step loop's stall while ``save_checkpoint`` writes, sync against ``async_save=True``."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from nxdtp.trainer import finalize_checkpoint, save_checkpoint

from .common import Pool, alternate, log, median, model_text, slowest, table, timed
from .zero1 import SEED, TINY_LLAMA, llama_batch, make_optimizer, real_model

FULL = dict(model=dict(kind="llama", vocab_size=16000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False),
            batch=2, seq=64, warmup=2, pre=3, post=8, rounds=6, tp=2, dp=1)
QUICK = dict(model=TINY_LLAMA, batch=2, seq=16, warmup=1, pre=2, post=2, rounds=2, tp=2, dp=1)
STATE: Dict[str, Any] = {}


def _step() -> float:
    STATE["optimizer"].zero_grad(set_to_none=True)
    STATE["model"](**STATE["batch"]).loss.backward()
    STATE["optimizer"].step()
    STATE["scheduler"].step()


def case_setup(spec: Dict[str, Any]) -> int:
    model = real_model(spec["model"])
    optimizer = make_optimizer(model, "zero1")
    STATE.update(model=model, optimizer=optimizer, batch=llama_batch(spec), step=0,
                 scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + s)))
    for _ in range(spec["warmup"]):
        timed(_step)
    return sum(p.numel() for p in model.parameters())


def case_round(mode: str, directory: str, pre: int, post: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {"pre": [timed(_step) for _ in range(pre)]}
    STATE["step"] += 1
    tag = f"step_{STATE['step']}"
    state = (STATE["model"], STATE["optimizer"], STATE["scheduler"], {"global_step": STATE["step"], "seed": SEED})
    out["call_s"] = timed(lambda: save_checkpoint(directory, tag, *state, async_save=mode == "async"))
    out["post"] = [timed(_step) for _ in range(post)]
    out["finalize_s"] = timed(finalize_checkpoint)
    if dist.get_rank() == 0:
        out["bytes"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(directory, tag))
                           for f in fs)
    return out


def run(ctx) -> Dict[str, Any]:
    spec = QUICK if ctx.quick else FULL
    log(f"async_save: starting a gloo world of tp={spec['tp']} x dp={spec['dp']}")
    workdir = tempfile.mkdtemp(prefix="nxdtp_bench_async_save_")
    counter = iter(range(1 << 30))

    def one_round(mode: str) -> Dict[str, Any]:
        directory = os.path.join(workdir, f"{mode}_{next(counter)}")
        try:
            ranks = pool.call(case_round, mode=mode, directory=directory, pre=spec["pre"], post=spec["post"])
            return {**{k: [max(x) for x in zip(*(r[k] for r in ranks))] for k in ("pre", "post")},
                    **slowest(ranks, ("call_s", "finalize_s")), "bytes": ranks[0].get("bytes")}
        finally:
            shutil.rmtree(directory, ignore_errors=True)  # every save writes the same bytes

    try:
        with Pool(spec["tp"] * spec["dp"], tp=spec["tp"]) as pool:
            parameters = pool.call(case_setup, spec=spec)[0]
            rounds = alternate(("sync", "async"), spec["rounds"], one_round, swap=True, what="async_save")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return _result(spec, parameters, rounds)


def _result(spec, parameters: int, rounds: Dict[str, List[Dict[str, Any]]]) -> Dict[str, Any]:
    baseline = median(t for mine in rounds.values() for r in mine for t in r["pre"])
    numbers = {"baseline_step_s": baseline, "checkpoint_bytes": float(rounds["sync"][0]["bytes"] or 0),
               "parameters_per_rank": float(parameters)}
    for mode, mine in rounds.items():
        excess = [sum(t - baseline for t in r["post"]) for r in mine]
        numbers.update({f"{mode}_call_s": median(r["call_s"] for r in mine), f"{mode}_post_excess_s": median(excess),
                        f"{mode}_post_step_s": median(t for r in mine for t in r["post"]),
                        f"{mode}_finalize_s": median(r["finalize_s"] for r in mine),
                        f"{mode}_stall_s": median(r["call_s"] + e + r["finalize_s"] for r, e in zip(mine, excess))})
    numbers["async_over_sync_stall"] = numbers["async_stall_s"] / numbers["sync_stall_s"]
    numbers["async_call_over_sync_call"] = numbers["async_call_s"] / numbers["sync_call_s"]
    n, post = numbers, spec["post"]
    columns = {"call returns after s|.3f": "call_s", f"step s during the next {post}|.3f": "post_step_s",
               f"excess of those {post} steps over the baseline, s|.3f": "post_excess_s",
               "finalize_checkpoint waited s|.3f": "finalize_s", "stall s (call + excess + finalize)|.3f": "stall_s"}
    tables = [f"gloo world tp={spec['tp']} x dp={spec['dp']} (one thread per rank), fp32 Llama-shaped model "
              f"({model_text(spec['model'])}; {parameters:,} parameters per rank), ZeRO-1 AdamW, batch "
              f"{spec['batch']} x {spec['seq']}; a checkpoint tag of {n['checkpoint_bytes']:,.0f} bytes. "
              f"{spec['rounds']} rounds per mode, alternating; each round: {spec['pre']} steps, save_checkpoint, "
              f"{post} steps, finalize_checkpoint; slowest rank; medians over rounds. Baseline step "
              f"{baseline:.3f} s.",
              table(["save_checkpoint", *columns], ([m] + [n[f"{m}_{k}"] for k in columns.values()] for m in rounds)),
              f"Async stall / sync stall: {n['async_over_sync_stall']:.3f}; the async call takes "
              f"{n['async_call_over_sync_call']:.3f} of the sync save's time (the rest is written by the background "
              "thread while the steps run)."]
    return {"spec": spec, "rounds": rounds, "numbers": numbers, "tables": tables}
