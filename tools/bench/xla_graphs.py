"""Section 4: XLA graphs compiled and executed per train step on XLA:CPU (PJRT_DEVICE=CPU, tp=1, one process).

A separate process joins a gloo world of 1, calls ``initialize_model_parallel(1)``, shards a small BertForPreTraining
with ``parallelize_bert`` (tp=1), moves it with ``move_model_to_device`` and runs 10 train steps: ``zero_grad``,
forward (the loss), ``backward()``, nxdtp's ``clip_grad_norm``, AdamW ``step()``, ``torch_xla.sync()``, then
``xm.wait_device_ops()`` (executions are counted when they finish). Per step it reads the deltas of the
``torch_xla.debug.metrics`` counters UncachedCompile, CachedCompile and ExecuteComputation (exact counters; the
ExecuteTime metric is asynchronous and not used). Target: from step 2 on (0-based), 1 executed graph and 0 new
compiles per step.
"""

from __future__ import annotations

import datetime
import re
from typing import Any, Dict

from .common import free_port, markdown_table

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
    import time

    import torch
    import torch.distributed as dist
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    from bench.train_step import ADAMW, MAX_GRAD_NORM, build_dense_bert, make_batch
    from nxdtp import parallel_state
    from nxdtp.grads import clip_grad_norm
    from nxdtp.models.bert import attention_bias, parallelize_bert
    from nxdtp.utils import move_model_to_device

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args['port']}", rank=0, world_size=1,
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
    args = dict(model_cfg=spec["model"], seq=spec["seq"], batch=spec["batch"], seed=seed, steps=STEPS,
                port=free_port())
    log(f"xla graphs: {STEPS} steps on XLA:CPU, {len(VARIANTS)} variants (separate process)")
    with tempfile.TemporaryDirectory(prefix="bench_xla_") as tmp:
        env = {"PJRT_DEVICE": "CPU"}
        if quick:  # compiling is most of this section's time; the graph counts do not depend on optimisation
            env["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + QUICK_XLA_FLAGS).strip()
        variants = run_worker_script("xla-graphs", args, os.path.join(tmp, "xla.json"), env=env)
    for variant in variants.values():
        variant.update(_steady(variant))
    primary = variants[VARIANTS[0]]
    out = {"config": spec["model"], "seq": spec["seq"], "batch": spec["batch"], "steps": STEPS,
           "steady_from_step": STEADY_FROM, "variants": variants, "target_met": primary["target_met"]}
    out["numbers"] = {}
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
    return "\n".join(lines)
