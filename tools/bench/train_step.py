"""Section 1: one BertForPreTraining train step on CPU, dense vs nxdtp TP=2 vs PyTorch DTensor TP=2; then one
train step of a Llama-shaped decoder (LlamaForCausalLM with grouped-query attention), dense vs nxdtp TP=2.

Every competitor is a group of long-lived worker processes (spawned, one intra-op thread each): ``dense`` is one
process, ``nxdtp`` and ``dtensor`` are two gloo ranks each. All of them import the same modules before their memory
baseline, build the same seeded dense model (every parameter randomised, biases and LayerNorms included) and the same
batch, then shard it their way:

* dense: nothing; ``torch.nn.utils.clip_grad_norm_``.
* nxdtp: ``initialize_model_parallel(2)`` and ``parallelize_bert(model)`` (attention, MLP, vocab-parallel embedding and
  MLM head, vocab-parallel loss); ``nxdtp.grads.clip_grad_norm``.
* dtensor: a 1-D CPU device mesh of the 2 gloo ranks and ``parallelize_module`` on every encoder layer: ColwiseParallel
  on Q/K/V and intermediate.dense, RowwiseParallel on attention.output.dense and output.dense; each BertSelfAttention's
  ``num_attention_heads`` / ``all_head_size`` set to the local values. Embeddings, MLM head and loss stay replicated.
  Clipping: ``torch.nn.utils.get_total_norm`` on the DTensor gradients (one all-reduce) and on the plain ones,
  combined, then ``clip_grads_with_norm_`` on each list (``clip_grad_norm_`` refuses a mix of DTensor and Tensor).

One step = ``zero_grad``, forward with MLM labels and NSP labels (the loss), backward, clip to norm 1.0, AdamW step.
The Llama rounds follow in the dense and nxdtp workers (their BERT released): the same step on a causal-LM batch, the
nxdtp model sharded by ``nxdtp.models.parallelize_model``'s Llama plan (``_run_llama``; DTensor has no Llama plan here).
The driver alternates the competitors step by step (dense, nxdtp, dtensor, dense, ...); only one competitor computes
at a time. Before each step the ranks of a competitor meet in a barrier; a step's time is the slowest rank's.

After the timed rounds: peak RSS per rank; a machine check (``gemm_probe``: can both ranks compute at full speed at
once?); with --profile, one profiled step of each competitor. The nxdtp workers also count the torch.distributed
collectives of one train step for section 3 (``count_comm``), and the DTensor workers count their functional
collectives (``count_comm``, through a dispatch mode). ``run_gpu`` is the --gpu section: dense vs nxdtp tp=1 on one
device.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import sys
import time
from typing import Any, Dict, List

from .common import SINGLE_THREAD_ENV, WorkerGroup, fmt, fmt_bytes, fmt_range, log, markdown_table, summary, verdict
from .rss import malloc_trim

COMPETITORS = ("dense", "nxdtp", "dtensor")
LABELS = {"dense": "(a) dense, 1 process x 1 thread",
          "nxdtp": "(b) nxdtp TP=2, 2 gloo ranks x 1 thread",
          "dtensor": "(c) DTensor TP=2, 2 gloo ranks x 1 thread"}
TP = 2
SEED = 1234
ADAMW = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
MAX_GRAD_NORM = 1.0
GLOO_TIMEOUT_S = 300

# Losses of the three competitors must agree within this relative tolerance. The sharded models compute the same
# fp32 sums in a different order (a row-parallel matmul adds two partial sums; the vocab-parallel loss combines two
# partial log-sum-exps), which moves results by a few ulps (~1e-7 relative) per operation. test_models_bert.py
# measures gradients of a TP=2 BERT within ~3e-6 of dense; AdamW's update is bounded by the learning rate, so after a
# dozen steps the loss differs by ~1e-6 relative (measured: 2.3e-6 at most over all 12 steps of the full run). 1e-4 is
# far above that and far below the change one training step makes to the loss here (4-22 % relative: the model learns
# the fixed batch), so an error in the sharding cannot hide inside it.
LOSS_RTOL = 1e-4

BERT_4L = dict(num_hidden_layers=4, hidden_size=768, num_attention_heads=12, intermediate_size=3072, vocab_size=30522,
               max_position_embeddings=512, type_vocab_size=2)
FULL = dict(model=BERT_4L, seq=128, batch=8, rounds=10, warmup=2)
QUICK = dict(model=dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=256,
                        vocab_size=512, max_position_embeddings=64, type_vocab_size=2),
             seq=32, batch=4, rounds=3, warmup=2)

# The Llama-shaped decoder (issue 25): dense (a) against nxdtp TP=2 (b) only, in the same worker processes after
# BERT's rounds. Grouped-query attention: 8 query heads over 2 KV heads, so each TP rank holds 4 query heads and one
# KV head. Sized to add about a tenth to the section's time (a dense step about a fifth of BERT's).
LLAMA_COMPETITORS = ("dense", "nxdtp")
LLAMA_FULL = dict(model=dict(num_hidden_layers=4, hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                             intermediate_size=1408, vocab_size=8192, max_position_embeddings=256),
                  seq=128, batch=4)
LLAMA_QUICK = dict(model=dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=176, vocab_size=512, max_position_embeddings=64),
                   seq=32, batch=4)

TARGETS = {"nxdtp/dense step time": 0.60, "nxdtp/dense step time limit": 0.50, "nxdtp/dtensor step time": 0.65,
           "nxdtp/dense peak RSS per rank": 0.60}


# ======================================================================================================================
# Worker side (runs in the spawned processes)
# ======================================================================================================================

def _import_everything() -> None:
    """The same modules in every competitor, before the memory baseline."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401
    import torch.profiler  # noqa: F401
    import transformers  # noqa: F401
    from transformers.models.bert import modeling_bert  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401

    import nxdtp  # noqa: F401
    import nxdtp.grads  # noqa: F401
    import nxdtp.models  # noqa: F401
    import nxdtp.models.bert  # noqa: F401

    from . import rss  # noqa: F401


def build_dense_bert(model_cfg: Dict[str, Any], seed: int):
    """BertForPreTraining, dropout off, every parameter (biases and LayerNorms too) moved off its HF initial value by
    seeded N(0, 0.02) noise. Same numbers in every process."""
    import torch
    from transformers import BertConfig, BertForPreTraining

    config = BertConfig(**model_cfg, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(seed)
    model = BertForPreTraining(config)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():  # tied weights once, in a fixed order
            p.add_(torch.randn(p.shape, generator=generator), alpha=0.02)
    return model.train()


def make_batch(model_cfg: Dict[str, Any], seq: int, batch: int, seed: int) -> Dict[str, Any]:
    import torch

    generator = torch.Generator().manual_seed(seed + 2)
    input_ids = torch.randint(0, model_cfg["vocab_size"], (batch, seq), generator=generator)
    masked = torch.rand(batch, seq, generator=generator) < 0.15
    masked[:, 1] = True  # at least one MLM target per sequence
    return {
        "input_ids": input_ids,
        "token_type_ids": (torch.arange(seq) >= seq // 2).long().expand(batch, seq).contiguous(),
        "attention_mask": torch.ones(batch, seq, dtype=torch.long),
        "labels": torch.where(masked, input_ids, torch.full_like(input_ids, -100)),
        "next_sentence_label": torch.randint(0, 2, (batch,), generator=generator),
    }


def build_dense_llama(model_cfg: Dict[str, Any], seed: int):
    """LlamaForCausalLM (untied LM head, dropout off), every parameter (norms too) moved off its HF initial value by
    seeded N(0, 0.02) noise. Same numbers in every process."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**model_cfg, attention_dropout=0.0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator), alpha=0.02)
    return model.train()


def make_llama_batch(model_cfg: Dict[str, Any], seq: int, batch: int, seed: int) -> Dict[str, Any]:
    """A packed causal-LM batch as the Llama example reads it: token ids, labels a copy of them, no padding."""
    import torch

    generator = torch.Generator().manual_seed(seed + 2)
    input_ids = torch.randint(0, model_cfg["vocab_size"], (batch, seq), generator=generator)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


DTENSOR_LAYER_PLAN = {"attention.self.query": "colwise", "attention.self.key": "colwise",
                      "attention.self.value": "colwise", "attention.output.dense": "rowwise",
                      "intermediate.dense": "colwise", "output.dense": "rowwise"}


def dtensor_parallelize(model, mesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers.models.bert import modeling_bert as hf

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {name: styles[style]() for name, style in DTENSOR_LAYER_PLAN.items()}
    for layer in model.bert.encoder.layer:
        parallelize_module(layer, mesh, plan)
    tp = mesh.size()
    for module in model.modules():
        if isinstance(module, hf.BertSelfAttention):
            # transformers 5 infers the head count from the tensor (view(..., -1, head_size)); keep the attributes
            # consistent with the local shard anyway.
            module.num_attention_heads //= tp
            module.all_head_size //= tp


def dtensor_clip_grad_norm(parameters, max_norm: float):
    import torch
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    sharded = [p for p in params if isinstance(p.grad, DTensor)]
    plain = [p for p in params if not isinstance(p.grad, DTensor)]
    norms = []
    if sharded:
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in sharded]).full_tensor())  # one all-reduce
    if plain:
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in plain]))
    total = torch.linalg.vector_norm(torch.stack(norms))
    for group in (sharded, plain):
        if group:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def _ensure_nxdtp_topology(state) -> None:
    from nxdtp import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=state["world"],
                                                 timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))


def _ensure_mesh(state):
    if "mesh" not in state:
        from torch.distributed.device_mesh import init_device_mesh

        state["mesh"] = init_device_mesh("cpu", (state["world"],))
    return state["mesh"]


def _shard(state, model, sequence_parallel: bool = False, vocab_multiple: int = 1, arch: str = "bert"):
    """Shard ``model`` as this competitor does; return the gradient-clipping function."""
    import torch

    kind = state["kind"]
    if kind == "nxdtp":
        from nxdtp.grads import clip_grad_norm
        from nxdtp.models import parallelize_model
        from nxdtp.models.bert import parallelize_bert

        _ensure_nxdtp_topology(state)
        shard = parallelize_bert if arch == "bert" else parallelize_model
        shard(model, sequence_parallel=sequence_parallel, make_vocab_size_divisible_by=vocab_multiple)
        return lambda params: clip_grad_norm(params, MAX_GRAD_NORM)
    if arch != "bert":
        assert kind == "dense", f"{kind}: the {arch} rounds have no such competitor"
    if kind == "dtensor":
        dtensor_parallelize(model, _ensure_mesh(state))
        return lambda params: dtensor_clip_grad_norm(params, MAX_GRAD_NORM)
    return lambda params: torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)


def _unique_parameter_bytes(model) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total


def h_build(state, model_cfg, seq, batch, seed, vocab_multiple: int = 1, arch: str = "bert"):
    """Build, shard and keep the model, AdamW and the batch. ``arch``: "bert" (BertForPreTraining) or "llama"
    (LlamaForCausalLM, sharded by ``nxdtp.models.parallelize_model``'s Llama plan)."""
    import torch

    from .rss import proc_status_kib, reset_peak_rss

    build, make = (build_dense_bert, make_batch) if arch == "bert" else (build_dense_llama, make_llama_batch)
    model = build(model_cfg, seed)
    clip = _shard(state, model, vocab_multiple=vocab_multiple, arch=arch)
    device = state["device"]
    if device != "cpu":  # the --gpu section: tp=1 only, so nothing was split
        from nxdtp.utils import move_model_to_device

        model = move_model_to_device(model, device) if state["kind"] == "nxdtp" else model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    inputs = {k: v.to(device) for k, v in make(model_cfg, seq, batch, seed).items()}
    state.update(model=model, clip=clip, optimizer=optimizer, batch=inputs, params=list(model.parameters()))
    gc.collect()
    state["peak_reset"] = reset_peak_rss()
    state["rss_after_build"] = proc_status_kib()["VmRSS"] / 1024
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        state["device_memory_after_build"] = torch.cuda.memory_allocated()
    return {"parameter_bytes": _unique_parameter_bytes(model),
            "attn_implementation": model.config._attn_implementation,
            "local_vocab_rows": model.get_input_embeddings().weight.shape[0],
            "rss_after_build_mib": state["rss_after_build"]}


def _one_step(state, phase_marks: bool = False) -> Dict[str, float]:
    """zero_grad, forward (loss), backward, clip, AdamW step; wall time of each phase."""
    from torch.profiler import record_function

    mark = record_function if phase_marks else (lambda name: contextlib.nullcontext())
    model, optimizer, clip = state["model"], state["optimizer"], state["clip"]
    if state["device"].startswith("cuda"):
        import torch

        def now() -> float:
            torch.cuda.synchronize()  # time the device's work, not the launches
            return time.perf_counter()
    else:
        now = time.perf_counter
    t0 = now()
    with mark("phase::forward"):
        optimizer.zero_grad(set_to_none=True)
        loss = model(**state["batch"]).loss
    t1 = now()
    with mark("phase::backward"):
        loss.backward()
    t2 = now()
    with mark("phase::clip"):
        norm = clip(state["params"])
    t3 = now()
    with mark("phase::optimizer"):
        optimizer.step()
    t4 = now()
    return {"seconds": t4 - t0, "forward": t1 - t0, "backward": t2 - t1, "clip": t3 - t2, "optimizer": t4 - t3,
            "loss": loss.item(), "grad_norm": float(norm)}


def _barrier(state) -> None:
    if state["world"] > 1:
        import torch.distributed as dist

        dist.barrier()


def h_steps(state, n: int = 1) -> List[Dict[str, float]]:
    out = []
    for _ in range(n):
        _barrier(state)
        out.append(_one_step(state))
    return out


def h_memory(state) -> Dict[str, Any]:
    from .rss import proc_status_kib

    now = proc_status_kib()
    baseline = state["baseline"]["VmRSS"] / 1024
    out = {"baseline_mib": baseline, "peak_mib": now["VmHWM"] / 1024, "increase_mib": now["VmHWM"] / 1024 - baseline,
           "after_build_mib": state["rss_after_build"],
           "increase_over_build_mib": now["VmHWM"] / 1024 - state["rss_after_build"],
           "peak_reset": state.get("peak_reset", False)}
    if state["device"].startswith("cuda"):
        import torch

        out["device_peak_mib"] = torch.cuda.max_memory_allocated() / (1 << 20)
        out["device_after_build_mib"] = state["device_memory_after_build"] / (1 << 20)
    return out


def h_release(state) -> None:
    for key in ("model", "clip", "optimizer", "batch", "params"):
        state.pop(key, None)
    gc.collect()
    malloc_trim()


# ---- profiling (--profile) -------------------------------------------------------------------------------------------

_CATEGORIES = (
    ("collectives (incl. waiting for the peer)", ("comm::", "gloo", "c10d", "allreduce", "all_reduce", "allgather",
                                                  "all_gather", "reduce_scatter", "wait_tensor", "barrier")),
    ("attention", ("scaled_dot_product", "flash_attention", "efficient_attention")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear")),
    ("layer norm", ("layer_norm",)),
    ("copies", ("aten::copy_", "aten::clone", "aten::cat", "aten::stack", "aten::_to_copy", "aten::contiguous",
                "aten::index_select", "aten::zeros", "aten::fill_", "aten::zero_")),
)
LOGITS = "logits path: "


def _category(name: str, shapes, vocab_rows) -> str:
    """An op's category; ops with a vocabulary-sized dimension (decoder matmuls, loss, logits copies, the word
    embedding's optimizer update) are reported apart as the logits path."""
    base = "other ops"
    for category, needles in _CATEGORIES:
        if any(needle in name for needle in needles):
            base = category
            break
    if base.startswith("collectives"):
        return base
    if any(isinstance(shape, (list, tuple)) and any(d in vocab_rows for d in shape) for shape in shapes or ()):
        return LOGITS + ("matmul" if base == "matmul" else "other ops")
    if "softmax" in name or "nll_loss" in name or "cross_entropy" in name:
        return LOGITS + "other ops"
    return base


@contextlib.contextmanager
def _timed_collectives():
    """Wrap the torch.distributed collectives nxdtp calls so the profiler sees each one, wait included."""
    import torch.distributed as dist
    from torch.profiler import record_function

    originals = {}

    def wrap(name, fn):
        def wrapper(*args, **kwargs):
            with record_function(f"comm::{name}"):
                return fn(*args, **kwargs)
        return wrapper

    for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "barrier"):
        originals[name] = getattr(dist, name)
        setattr(dist, name, wrap(name, originals[name]))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def h_profile(state, row_limit: int = 30) -> Dict[str, Any]:
    """One train step under torch.profiler: self CPU time by phase and op category, the top ops by input shape, and
    (TP ranks) the time of a bare all-reduce of one activation, back to back, for comparison."""
    import statistics

    import torch
    from torch.profiler import ProfilerActivity, profile

    model = state["model"]
    embedding_rows = model.get_input_embeddings().weight.shape[0]
    vocab_rows = {embedding_rows, model.config.vocab_size}
    _barrier(state)
    with _timed_collectives(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step = _one_step(state, phase_marks=True)
    by_phase: Dict[str, Dict[str, float]] = {}
    for event in prof.events():
        if event.name.startswith("phase::"):
            continue
        root = event
        while root.cpu_parent is not None:
            root = root.cpu_parent
        phase = root.name[len("phase::"):] if root.name.startswith("phase::") else "outside phases"
        bucket = by_phase.setdefault(phase, {})
        category = _category(event.name, event.input_shapes, vocab_rows)
        bucket[category] = bucket.get(category, 0.0) + event.self_cpu_time_total / 1e3  # ms
    table = prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=row_limit,
                                                               max_name_column_width=48, max_shapes_column_width=60)
    out = {"step": step, "self_ms_by_phase_and_category": by_phase, "table": table}
    if state["world"] > 1:
        import torch.distributed as dist

        batch = state["batch"]["input_ids"]
        activation = torch.randn(*batch.shape, model.config.hidden_size)
        times = []
        for _ in range(11):
            _barrier(state)
            t0 = time.perf_counter()
            dist.all_reduce(activation.clone())
            times.append(time.perf_counter() - t0)
        out["bare_all_reduce_ms"] = 1e3 * statistics.median(times[1:])
        out["bare_all_reduce_bytes"] = activation.numel() * activation.element_size()
    return out


# ---- collective counting (section 3) ---------------------------------------------------------------------------------

def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _Counter:
    def __init__(self):
        self.phase = "setup"
        self.counts: Dict[str, Dict[str, List[int]]] = {}

    def add(self, op: str, nbytes: int) -> None:
        entry = self.counts.setdefault(self.phase, {}).setdefault(op, [0, 0])
        entry[0] += 1
        entry[1] += int(nbytes)


@contextlib.contextmanager
def _counting_torch_distributed(counter: _Counter):
    """Count torch.distributed collectives by kind, with the bytes of the full (unsharded) tensor each one handles:
    all-reduce and broadcast: the buffer; all-gather: the gathered output; reduce-scatter: the input."""
    import torch.distributed as dist

    def arg(args, kwargs, index, *names):
        if len(args) > index:
            return args[index]
        for name in names:
            if name in kwargs:
                return kwargs[name]
        raise TypeError("unexpected call signature")

    measures = {
        "all_reduce": ("all-reduce", lambda a, k: _nbytes(arg(a, k, 0, "tensor"))),
        "broadcast": ("broadcast", lambda a, k: _nbytes(arg(a, k, 0, "tensor"))),
        "all_gather_into_tensor": ("all-gather", lambda a, k: _nbytes(arg(a, k, 0, "output_tensor"))),
        "all_gather": ("all-gather", lambda a, k: sum(_nbytes(t) for t in arg(a, k, 0, "tensor_list"))),
        "reduce_scatter_tensor": ("reduce-scatter", lambda a, k: _nbytes(arg(a, k, 1, "input"))),
        "reduce_scatter": ("reduce-scatter", lambda a, k: sum(_nbytes(t) for t in arg(a, k, 1, "input_list"))),
    }
    originals = {}

    def wrap(fn, op, measure):
        def wrapper(*args, **kwargs):
            counter.add(op, measure(args, kwargs))
            return fn(*args, **kwargs)
        return wrapper

    for name, (op, measure) in measures.items():
        originals[name] = getattr(dist, name)
        setattr(dist, name, wrap(originals[name], op, measure))
    try:
        yield counter
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _functional_collective_counter(counter: _Counter):
    """A dispatch mode counting DTensor's functional collectives (torch.ops._c10d_functional.*), same byte rules."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = str(func.overloadpacket)
            if name.startswith("_c10d_functional."):
                op = name.split(".", 1)[1]
                if op.startswith("all_reduce"):
                    counter.add("all-reduce", _nbytes(args[0]))
                elif op.startswith("all_gather_into_tensor"):
                    counter.add("all-gather", _nbytes(args[0]) * int(args[1]))
                elif op.startswith("reduce_scatter_tensor"):
                    counter.add("reduce-scatter", _nbytes(args[0]))
                elif op.startswith("broadcast"):
                    counter.add("broadcast", _nbytes(args[0]))
                elif not op.startswith("wait_tensor"):
                    counter.add(op, 0)
            return func(*args, **kwargs)

    return Mode()


def h_count_comm(state, model_cfg, seq, batch, seed, sequence_parallel: bool = False) -> Dict[str, Any]:
    """Collectives of the second of two train steps of a freshly sharded model, by phase and kind: {phase: {op:
    [count, bytes]}}."""
    import torch

    from nxdtp.grads import allreduce_sequence_parallel_gradients

    model = build_dense_bert(model_cfg, seed)
    clip = _shard(state, model, sequence_parallel=sequence_parallel)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    inputs = make_batch(model_cfg, seq, batch, seed)
    params = list(model.parameters())
    counter = _Counter()
    for _ in range(2):  # the first step creates AdamW's state; count the second
        counter.counts.clear()
        if state["kind"] == "dtensor":
            context = _functional_collective_counter(counter)
        else:
            context = _counting_torch_distributed(counter)
        with context:
            optimizer.zero_grad(set_to_none=True)
            counter.phase = "forward"
            loss = model(**inputs).loss
            counter.phase = "backward"
            loss.backward()
            if sequence_parallel:
                counter.phase = "sequence-parallel gradient sum"
                allreduce_sequence_parallel_gradients(optimizer)
            counter.phase = "clip"
            clip(params)
            counter.phase = "optimizer"
            optimizer.step()
    return {"counts": counter.counts, "loss": loss.item()}


def h_gemm_probe(state, model_cfg, seq, batch, seconds: float = 1.5) -> Dict[str, float]:
    """Can this machine run the TP ranks at full speed at the same time? Each rank times one MLP column-shard GEMM
    (forward + backward) alone (the other rank waits in a barrier), then both at once. together / alone = 1.0 when
    each rank has a core to itself; 2.0 when two ranks share one core's worth of compute (a busy or SMT machine)."""
    import statistics

    import torch
    import torch.nn.functional as F

    tokens, hidden = seq * batch, model_cfg["hidden_size"]
    out_features = model_cfg["intermediate_size"] // state["world"]
    x = torch.randn(tokens, hidden, requires_grad=True)
    w = torch.randn(out_features, hidden, requires_grad=True)
    upstream = torch.randn(tokens, out_features)

    def timed_loop() -> float:
        times, end = [], time.perf_counter() + seconds
        while time.perf_counter() < end or len(times) < 3:
            t0 = time.perf_counter()
            F.linear(x, w).backward(upstream)
            x.grad = w.grad = None
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    timed_loop()  # warm up
    alone = None
    for rank in range(state["world"]):
        _barrier(state)
        if rank == state["rank"]:
            alone = timed_loop()
        _barrier(state)
    _barrier(state)
    together = timed_loop()
    _barrier(state)
    return {"alone_ms": 1e3 * alone, "together_ms": 1e3 * together, "together_over_alone": together / alone,
            "shape": [tokens, hidden, out_features]}


def h_call(state, target: str, kwargs: Dict[str, Any] = None) -> Any:
    """Run ``module:function(**kwargs)`` in this worker (section 2 uses the dense worker, whose imports are done)."""
    import importlib

    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)(**(kwargs or {}))


HANDLERS = {"call": h_call, "gemm_probe": h_gemm_probe, "build": h_build, "steps": h_steps, "memory": h_memory,
            "release": h_release, "profile": h_profile, "count_comm": h_count_comm}


def worker_main(conn, name: str, rank: int, world: int, port: int, kind: str = None, device: str = "cpu",
                backend: str = "gloo") -> None:
    """``kind`` (default: ``name``) is dense, nxdtp or dtensor; ``device`` / ``backend`` are cpu / gloo except in the
    --gpu section (cuda / nccl)."""
    kind = kind or name
    os.dup2(2, 1)  # whatever a library prints (gloo's connection lines) goes to stderr, not into the report
    os.environ.update(SINGLE_THREAD_ENV)
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    _import_everything()
    from .common import serve
    from .rss import proc_status_kib

    state = {"kind": kind, "rank": rank, "world": world, "device": device, "baseline": proc_status_kib()}
    distributed = world > 1 or kind == "nxdtp"  # nxdtp needs a process group even at tp=1
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    if distributed:
        import torch.distributed as dist

        from .common import join_hosted_world

        join_hosted_world(backend, rank, world, port, GLOO_TIMEOUT_S)
    try:
        serve(conn, HANDLERS, state)
    finally:
        if distributed:
            import torch.distributed as dist

            from nxdtp import parallel_state

            parallel_state.destroy_model_parallel()
            if dist.is_initialized():
                dist.destroy_process_group()
    # Everything went back over the pipe; skip the interpreter's teardown of torch (seconds per process).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ======================================================================================================================
# Driver side
# ======================================================================================================================

class Competitors:
    """Lazily started worker groups, shared by sections 1 and 3."""

    def __init__(self):
        self.groups: Dict[str, WorkerGroup] = {}

    def get(self, name: str, kind: str = None, world: int = None, device: str = "cpu",
            backend: str = "gloo") -> WorkerGroup:
        if name not in self.groups:
            kind = kind or name
            world = world or (1 if kind == "dense" else TP)
            self.groups[name] = WorkerGroup(name, worker_main, world, extra_args=(kind, device, backend))
        return self.groups[name]

    def start(self, kinds) -> None:
        for kind in kinds:
            self.get(kind)

    def close(self) -> None:
        for group in self.groups.values():
            group.close()
        self.groups.clear()


def run(competitors: Competitors, quick: bool, rounds: int = None, warmup: int = None, profile: bool = False,
        nxdtp_vocab_multiple: int = 1) -> Dict[str, Any]:
    """``nxdtp_vocab_multiple``: parallelize_bert's make_vocab_size_divisible_by for competitor (b) (library default
    1; Megatron pads to 128)."""
    spec = dict(QUICK if quick else FULL)
    rounds = rounds or spec["rounds"]
    warmup = spec["warmup"] if warmup is None else warmup
    common = dict(model_cfg=spec["model"], seq=spec["seq"], batch=spec["batch"], seed=SEED)
    competitors.start(COMPETITORS)
    groups = {k: competitors.get(k) for k in COMPETITORS}
    log(f"train step: building {', '.join(COMPETITORS)} (config {spec['model']}, seq {spec['seq']}, "
        f"batch {spec['batch']})")
    for kind, group in groups.items():  # builds run concurrently; nothing is timed yet
        group.send("build", **common, **({"vocab_multiple": nxdtp_vocab_multiple} if kind == "nxdtp" else {}))
    builds = {k: g.receive() for k, g in groups.items()}

    steps = _alternate(groups, warmup, rounds)
    memory = {k: g.call("memory") for k, g in groups.items()}
    probe = groups["nxdtp"].call("gemm_probe", model_cfg=spec["model"], seq=spec["seq"], batch=spec["batch"])
    profiles = {}
    if profile:
        for kind in COMPETITORS:
            log(f"train step: profiling one step of {kind}")
            profiles[kind] = groups[kind].call("profile")
    for group in groups.values():
        group.call("release")
    result = _summarise(spec, rounds, warmup, builds, steps, memory, profiles, nxdtp_vocab_multiple)
    result["two_rank_gemm_probe"] = {"per_rank": probe,
                                     "together_over_alone": max(p["together_over_alone"] for p in probe)}
    result["numbers"]["two_rank_gemm_slowdown"] = result["two_rank_gemm_probe"]["together_over_alone"]
    result["llama"] = _run_llama(groups, quick, rounds, warmup, nxdtp_vocab_multiple)
    result["numbers"].update(result["llama"]["numbers"])
    return result


def _run_llama(groups: Dict[str, WorkerGroup], quick: bool, rounds: int, warmup: int,
               nxdtp_vocab_multiple: int) -> Dict[str, Any]:
    """The Llama-shaped decoder's rounds: dense (a) against nxdtp TP=2 (b), in the workers BERT's rounds used (their
    models released), alternating, medians; the same figures as BERT's for these two."""
    spec = dict(LLAMA_QUICK if quick else LLAMA_FULL)
    groups = {k: groups[k] for k in LLAMA_COMPETITORS}
    common = dict(model_cfg=spec["model"], seq=spec["seq"], batch=spec["batch"], seed=SEED, arch="llama")
    log(f"train step: building the Llama-shaped decoder, {', '.join(groups)} (config {spec['model']}, seq "
        f"{spec['seq']}, batch {spec['batch']})")
    for kind, group in groups.items():
        group.send("build", **common, **({"vocab_multiple": nxdtp_vocab_multiple} if kind == "nxdtp" else {}))
    builds = {k: g.receive() for k, g in groups.items()}
    steps = _alternate(groups, warmup, rounds)
    memory = {k: g.call("memory") for k, g in groups.items()}
    for group in groups.values():
        group.call("release")
    out: Dict[str, Any] = {"config": spec["model"], "seq": spec["seq"], "batch": spec["batch"], "tp": TP,
                           "nxdtp_make_vocab_size_divisible_by": nxdtp_vocab_multiple, "rounds": rounds,
                           "warmup_steps": warmup, "order": list(groups), "competitors": {}}
    for kind in groups:
        timed = steps[kind][warmup:]
        last = steps[kind][-1]
        out["competitors"][kind] = {
            "label": LABELS[kind], "ranks": len(last),
            "step_s": summary([max(r["seconds"] for r in step) for step in timed]),
            "step_s_per_round": [max(r["seconds"] for r in step) for step in timed],
            "phase_s_median": {p: summary([max(r[p] for r in step) for step in timed])["median"]
                               for p in ("forward", "backward", "clip", "optimizer")},
            "loss_per_step": [step[0]["loss"] for step in steps[kind]],
            "last_loss": last[0]["loss"], "last_loss_ranks_equal": len({r["loss"] for r in last}) == 1,
            "parameter_bytes_per_rank": [b["parameter_bytes"] for b in builds[kind]],
            "attn_implementation": builds[kind][0]["attn_implementation"],
            "local_vocab_rows": builds[kind][0]["local_vocab_rows"],
            "peak_rss_mib_per_rank": [m["peak_mib"] for m in memory[kind]],
            # The workers ran BERT's rounds first (released and trimmed, h_release): the figure compared is the peak
            # over the RSS right after the Llama was built, not over the imports.
            "peak_over_after_build_mib_per_rank": [m["increase_over_build_mib"] for m in memory[kind]],
            "peak_reset": all(m["peak_reset"] for m in memory[kind]),
        }
    c = out["competitors"]
    med = {k: c[k]["step_s"]["median"] for k in groups}
    per_round = [b / a for b, a in zip(c["nxdtp"]["step_s_per_round"], c["dense"]["step_s_per_round"])]
    during = {k: max(c[k]["peak_over_after_build_mib_per_rank"]) for k in groups}
    rel = abs(c["nxdtp"]["last_loss"] - c["dense"]["last_loss"]) / abs(c["dense"]["last_loss"])
    out["ratios"] = {"nxdtp/dense step time": med["nxdtp"] / med["dense"],
                     "nxdtp/dense step time, median of per-round ratios": summary(per_round)["median"],
                     "nxdtp/dense peak RSS over build per rank": during["nxdtp"] / during["dense"]}
    out["per_round_ratios"] = {"nxdtp/dense": per_round}
    out["loss_agreement"] = {"rtol": LOSS_RTOL, "losses": {k: c[k]["last_loss"] for k in groups},
                             "max_rel_diff_vs_dense": rel,
                             "agree": rel <= LOSS_RTOL and all(c[k]["last_loss_ranks_equal"] for k in groups)}
    out["numbers"] = {"llama_step_s_dense": med["dense"], "llama_step_s_nxdtp": med["nxdtp"],
                      "llama_ratio_nxdtp_dense": out["ratios"]["nxdtp/dense step time"],
                      **{f"llama_peak_over_build_mib_{k}": during[k] for k in groups},
                      **{f"llama_last_loss_{k}": c[k]["last_loss"] for k in groups},
                      "llama_loss_rel_diff": rel}
    return out


def llama_tables(result: Dict[str, Any]) -> str:
    c = result["competitors"]
    cfg = result["config"]
    lines = [f"LlamaForCausalLM (Llama-shaped decoder): {cfg['num_hidden_layers']} layers, hidden "
             f"{cfg['hidden_size']}, {cfg['num_attention_heads']} query heads over {cfg['num_key_value_heads']} KV "
             f"heads (GQA), intermediate {cfg['intermediate_size']}, vocab {cfg['vocab_size']}, untied LM head; seq "
             f"{result['seq']}, batch {result['batch']}, fp32, causal-LM loss, the same step (AdamW, clip to "
             f"{MAX_GRAD_NORM}), in the same workers after BERT's rounds. nxdtp: "
             f"`nxdtp.models.parallelize_model` (the Llama plan; make_vocab_size_divisible_by="
             f"{result['nxdtp_make_vocab_size_divisible_by']}, {c['nxdtp']['local_vocab_rows']} vocabulary rows per "
             f"rank). {result['warmup_steps']} warm-up steps, then {result['rounds']} alternating rounds (a, b); "
             f"medians; attention: {c['dense']['attn_implementation']}.", ""]
    rows = []
    for kind in result["order"]:
        k = c[kind]
        rows.append([k["label"], fmt_range(k["step_s"]), fmt(k["phase_s_median"]["forward"], 3),
                     fmt(k["phase_s_median"]["backward"], 3), fmt(k["phase_s_median"]["clip"], 4),
                     fmt(k["phase_s_median"]["optimizer"], 3),
                     f"{max(k['parameter_bytes_per_rank']) / (1 << 20):,.1f}",
                     " / ".join(fmt(v, 0) for v in k["peak_over_after_build_mib_per_rank"]),
                     f"{k['last_loss']:.7f}"])
    lines.append(markdown_table(
        ["competitor", "step s median (min-max)", "forward s", "backward s", "clip s", "AdamW s",
         "parameters MiB / rank", "peak RSS MiB per rank over RSS after build", "loss at last step"], rows))
    r = result["ratios"]
    la = result["loss_agreement"]
    lines += ["", markdown_table(["figure", "value", "target", "limit", "verdict"], [
        ["Llama step time b/a (nxdtp / dense)", fmt(r["nxdtp/dense step time"], 3), "<= 0.60",
         "0.50 (perfect 2-rank split)", verdict(r["nxdtp/dense step time"], TARGETS["nxdtp/dense step time"])],
        ["Llama b/a, median of per-round ratios", fmt(r["nxdtp/dense step time, median of per-round ratios"], 3), "",
         "", ""],
        ["Llama peak RSS per rank over RSS after build, b/a", fmt(r["nxdtp/dense peak RSS over build per rank"], 3),
         "", "", ""],
        ["Llama losses at the last step agree (a, b)", f"relative difference {la['max_rel_diff_vs_dense']:.2e}",
         f"<= {la['rtol']:.0e}", "", "met" if la["agree"] else "MISSED"],
    ])]
    return "\n".join(lines)


def _alternate(groups: Dict[str, WorkerGroup], warmup: int, rounds: int) -> Dict[str, List[List[Dict[str, float]]]]:
    """One step of each competitor in turn (a, b, c, a, b, c, ...); returns {competitor: [step][rank]}."""
    steps: Dict[str, List[List[Dict[str, float]]]] = {k: [] for k in groups}
    for index in range(warmup + rounds):
        for kind, group in groups.items():
            steps[kind].append([r[0] for r in group.call("steps", n=1)])
        if index >= warmup:
            log(f"train step round {index - warmup + 1}/{rounds}: " + ", ".join(
                f"{k} {max(r['seconds'] for r in steps[k][-1]):.3f} s" for k in groups))
    return steps


def run_gpu(competitors: Competitors, quick: bool, device: str = "cuda:0", rounds: int = None,
            warmup: int = None) -> Dict[str, Any]:
    """The --gpu section: section 1's model and step on one GPU, dense vs nxdtp at tp=1 (a 1-rank NCCL world:
    parallelize_bert, vocab-parallel loss, nxdtp's clip_grad_norm), alternating, medians; the ratio shows nxdtp's
    overhead where nothing is split. Peak device memory from torch.cuda.max_memory_allocated. ``device="cpu"``
    runs the same code on CPU (gloo), which is how it is checked on machines without a GPU."""
    spec = dict(QUICK if quick else FULL)
    rounds = rounds or spec["rounds"]
    warmup = spec["warmup"] if warmup is None else warmup
    backend = "nccl" if device.startswith("cuda") else "gloo"
    groups = {"dense": competitors.get("gpu-dense", kind="dense", world=1, device=device),
              "nxdtp": competitors.get("gpu-nxdtp", kind="nxdtp", world=1, device=device, backend=backend)}
    log(f"gpu: dense vs nxdtp tp=1 on {device} ({backend})")
    for group in groups.values():
        group.send("build", model_cfg=spec["model"], seq=spec["seq"], batch=spec["batch"], seed=SEED)
    builds = {k: g.receive() for k, g in groups.items()}
    steps = _alternate(groups, warmup, rounds)
    memory = {k: g.call("memory")[0] for k, g in groups.items()}
    for group in groups.values():
        group.call("release")
    out: Dict[str, Any] = {"config": spec["model"], "seq": spec["seq"], "batch": spec["batch"], "device": device,
                           "backend": backend, "rounds": rounds, "warmup_steps": warmup, "competitors": {}}
    for kind in groups:
        seconds = [step[0]["seconds"] for step in steps[kind][warmup:]]
        out["competitors"][kind] = {"step_s": summary(seconds), "step_s_per_round": seconds,
                                    "last_loss": steps[kind][-1][0]["loss"],
                                    "parameter_bytes": builds[kind][0]["parameter_bytes"], "memory": memory[kind]}
    c = out["competitors"]
    ratio = c["nxdtp"]["step_s"]["median"] / c["dense"]["step_s"]["median"]
    rel = abs(c["nxdtp"]["last_loss"] - c["dense"]["last_loss"]) / abs(c["dense"]["last_loss"])
    out["nxdtp_over_dense"] = ratio
    out["loss_agreement"] = {"rtol": LOSS_RTOL, "rel_diff": rel, "agree": rel <= LOSS_RTOL}
    out["numbers"] = {"step_s_dense": c["dense"]["step_s"]["median"],
                      "step_s_nxdtp_tp1": c["nxdtp"]["step_s"]["median"],
                      "nxdtp_tp1_over_dense": ratio, "loss_rel_diff": rel,
                      **{f"peak_{'device' if 'device_peak_mib' in m else 'rss'}_mib_{k}":
                         m.get("device_peak_mib", m["peak_mib"]) for k, m in memory.items()}}
    return out


def gpu_tables(result: Dict[str, Any]) -> str:
    c = result["competitors"]
    rows = []
    for kind, label in (("dense", "dense"), ("nxdtp", "nxdtp tp=1 (parallelize_bert, 1-rank world)")):
        m = c[kind]["memory"]
        peak = f"{m['device_peak_mib']:,.0f} (device)" if "device_peak_mib" in m else f"{m['peak_mib']:,.0f} (RSS)"
        rows.append([label, fmt_range(c[kind]["step_s"], 4), peak, f"{c[kind]['last_loss']:.7f}"])
    la = result["loss_agreement"]
    return "\n".join([
        f"Section 1's model and train step on {result['device']} ({result['backend']}), {result['warmup_steps']} "
        f"warm-up steps, {result['rounds']} alternating rounds, medians (each phase ends with a device "
        "synchronize).", "",
        markdown_table(["competitor", "step s median (min-max)", "peak memory MiB", "loss at last step"], rows), "",
        f"nxdtp tp=1 / dense step time: {result['nxdtp_over_dense']:.3f} (1.00 = no overhead); losses agree within "
        f"{la['rtol']:.0e}: {'yes' if la['agree'] else 'NO'} (relative difference {la['rel_diff']:.2e})."])


def _summarise(spec, rounds, warmup, builds, steps, memory, profiles, nxdtp_vocab_multiple) -> Dict[str, Any]:
    out: Dict[str, Any] = {"config": spec["model"], "seq": spec["seq"], "batch": spec["batch"], "tp": TP,
                           "nxdtp_make_vocab_size_divisible_by": nxdtp_vocab_multiple,
                           "rounds": rounds, "warmup_steps": warmup, "threads_per_rank": 1, "adamw": ADAMW,
                           "max_grad_norm": MAX_GRAD_NORM, "order": list(COMPETITORS), "competitors": {}}
    for kind in COMPETITORS:
        timed = steps[kind][warmup:]
        seconds = [max(r["seconds"] for r in step) for step in timed]
        phases = {p: summary([max(r[p] for r in step) for step in timed])["median"]
                  for p in ("forward", "backward", "clip", "optimizer")}
        last = steps[kind][-1]
        losses_by_rank = [r["loss"] for r in last]
        out["competitors"][kind] = {
            "label": LABELS[kind], "ranks": len(last), "step_s": summary(seconds), "step_s_per_round": seconds,
            "phase_s_median": phases,
            "loss_per_step": [step[0]["loss"] for step in steps[kind]],
            "grad_norm_per_step": [step[0]["grad_norm"] for step in steps[kind]],
            "last_loss": losses_by_rank[0], "last_loss_ranks_equal": len(set(losses_by_rank)) == 1,
            "parameter_bytes_per_rank": [b["parameter_bytes"] for b in builds[kind]],
            "attn_implementation": builds[kind][0]["attn_implementation"],
            "local_vocab_rows": builds[kind][0]["local_vocab_rows"],
            "peak_rss_mib_per_rank": [m["peak_mib"] for m in memory[kind]],
            "rss_increase_mib_per_rank": [m["increase_mib"] for m in memory[kind]],
            "baseline_rss_mib_per_rank": [m["baseline_mib"] for m in memory[kind]],
            "rss_after_build_mib_per_rank": [m["after_build_mib"] for m in memory[kind]],
            "peak_over_after_build_mib_per_rank": [m["increase_over_build_mib"] for m in memory[kind]],
            "peak_reset": all(m["peak_reset"] for m in memory[kind]),
        }
        if kind in profiles:
            out["competitors"][kind]["profile"] = profiles[kind][0]  # rank 0
    c = out["competitors"]
    med = {k: c[k]["step_s"]["median"] for k in COMPETITORS}
    per_round = {f"nxdtp/{other}": [b / o for b, o in zip(c["nxdtp"]["step_s_per_round"],
                                                          c[other]["step_s_per_round"])]
                 for other in ("dense", "dtensor")}
    losses = {k: c[k]["last_loss"] for k in COMPETITORS}
    reference = losses["dense"]
    max_rel = max(abs(v - reference) / abs(reference) for v in losses.values())
    grad_norms = {k: c[k]["grad_norm_per_step"][-1] for k in COMPETITORS}
    rss_increase = {k: max(c[k]["rss_increase_mib_per_rank"]) for k in COMPETITORS}
    rss_peak = {k: max(c[k]["peak_rss_mib_per_rank"]) for k in COMPETITORS}
    out["ratios"] = {
        "nxdtp/dense step time": med["nxdtp"] / med["dense"],
        "nxdtp/dtensor step time": med["nxdtp"] / med["dtensor"],
        "nxdtp/dense step time, median of per-round ratios": summary(per_round["nxdtp/dense"])["median"],
        "nxdtp/dtensor step time, median of per-round ratios": summary(per_round["nxdtp/dtensor"])["median"],
        "nxdtp/dense peak RSS increase per rank": rss_increase["nxdtp"] / rss_increase["dense"],
        "nxdtp/dense peak RSS per rank (absolute)": rss_peak["nxdtp"] / rss_peak["dense"],
        "dtensor/dense peak RSS increase per rank": rss_increase["dtensor"] / rss_increase["dense"],
    }
    out["per_round_ratios"] = per_round
    out["loss_agreement"] = {"rtol": LOSS_RTOL, "losses": losses, "max_rel_diff_vs_dense": max_rel,
                             "agree": max_rel <= LOSS_RTOL and all(c[k]["last_loss_ranks_equal"]
                                                                  for k in COMPETITORS),
                             "last_grad_norms": grad_norms}
    out["targets"] = TARGETS
    out["numbers"] = {
        **{f"step_s_{k}": med[k] for k in COMPETITORS},
        "ratio_nxdtp_dense": out["ratios"]["nxdtp/dense step time"],
        "ratio_nxdtp_dtensor": out["ratios"]["nxdtp/dtensor step time"],
        **{f"peak_rss_mib_{k}": rss_peak[k] for k in COMPETITORS},
        **{f"rss_increase_mib_{k}": rss_increase[k] for k in COMPETITORS},
        "rss_increase_ratio_nxdtp_dense": out["ratios"]["nxdtp/dense peak RSS increase per rank"],
        **{f"last_loss_{k}": losses[k] for k in COMPETITORS},
        "loss_max_rel_diff": max_rel,
    }
    return out


def tables(result: Dict[str, Any]) -> str:
    c = result["competitors"]
    cfg = result["config"]
    lines = [f"BertForPreTraining: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
             f"{cfg['num_attention_heads']} heads, intermediate {cfg['intermediate_size']}, vocab {cfg['vocab_size']}; "
             f"seq {result['seq']}, batch {result['batch']}, fp32, dropout 0, AdamW (lr {ADAMW['lr']}), clip to "
             f"{MAX_GRAD_NORM}. {result['warmup_steps']} warm-up steps, then {result['rounds']} alternating rounds "
             f"(a, b, c); medians; step time = slowest rank; attention: "
             f"{c['dense']['attn_implementation']}; nxdtp make_vocab_size_divisible_by="
             f"{result['nxdtp_make_vocab_size_divisible_by']} ({c['nxdtp']['local_vocab_rows']} vocabulary rows per "
             "rank).", ""]
    rows = []
    for kind in COMPETITORS:
        k = c[kind]
        rows.append([k["label"], fmt_range(k["step_s"]), fmt(k["phase_s_median"]["forward"], 3),
                     fmt(k["phase_s_median"]["backward"], 3), fmt(k["phase_s_median"]["clip"], 4),
                     fmt(k["phase_s_median"]["optimizer"], 3),
                     f"{max(k['parameter_bytes_per_rank']) / (1 << 20):,.1f}",
                     " / ".join(fmt(v, 0) for v in k["peak_rss_mib_per_rank"]),
                     " / ".join(fmt(v, 0) for v in k["rss_increase_mib_per_rank"]),
                     " / ".join(fmt(v, 0) for v in k["peak_over_after_build_mib_per_rank"]),
                     f"{k['last_loss']:.7f}"])
    lines.append(markdown_table(
        ["competitor", "step s median (min-max)", "forward s", "backward s", "clip s", "AdamW s",
         "parameters MiB / rank", "peak RSS MiB per rank", "peak RSS increase MiB per rank (over imports)",
         "of which during the steps (over RSS after build)", "loss at last step"], rows))
    r = result["ratios"]
    la = result["loss_agreement"]
    lines += ["", markdown_table(["figure", "value", "target", "limit", "verdict"], [
        ["step time b/a (nxdtp / dense)", fmt(r["nxdtp/dense step time"], 3), "<= 0.60", "0.50 (perfect 2-rank split)",
         verdict(r["nxdtp/dense step time"], TARGETS["nxdtp/dense step time"])],
        ["step time b/c (nxdtp / DTensor)", fmt(r["nxdtp/dtensor step time"], 3), "<= 0.65", "-",
         verdict(r["nxdtp/dtensor step time"], TARGETS["nxdtp/dtensor step time"])],
        ["b/a, median of per-round ratios", fmt(r["nxdtp/dense step time, median of per-round ratios"], 3), "", "", ""],
        ["b/c, median of per-round ratios", fmt(r["nxdtp/dtensor step time, median of per-round ratios"], 3), "", "",
         ""],
        ["peak RSS increase per rank, b/a", fmt(r["nxdtp/dense peak RSS increase per rank"], 3), "<= 0.60",
         "0.50", verdict(r["nxdtp/dense peak RSS increase per rank"], TARGETS["nxdtp/dense peak RSS per rank"])],
        ["peak RSS per rank (absolute, imports included), b/a", fmt(r["nxdtp/dense peak RSS per rank (absolute)"], 3),
         "", "", ""],
        ["peak RSS increase per rank, c/a", fmt(r["dtensor/dense peak RSS increase per rank"], 3), "", "", ""],
        ["machine check: a TP-shard GEMM, both ranks at once / one rank alone",
         fmt(result["two_rank_gemm_probe"]["together_over_alone"], 2), "1.00 (a core per rank)", "",
         "ok" if result["two_rank_gemm_probe"]["together_over_alone"] <= 1.15 else
         "the ranks do not get a core each: b/a cannot reach its target here"],
        ["losses at the last step agree (a, b, c)",
         f"max relative difference {la['max_rel_diff_vs_dense']:.2e}", f"<= {la['rtol']:.0e}", "",
         "met" if la["agree"] else "MISSED"],
    ])]
    lines.append("")
    lines.append("Peak RSS: VmHWM of each process over the train steps (the watermark is reset after the model is "
                 "built and sharded); increase = peak - RSS after the imports (same imports in every competitor); the "
                 "next column is the part above the RSS right after building and sharding (activations, gradients, "
                 "AdamW state, temporaries).")
    if "llama" in result:
        lines += ["", llama_tables(result["llama"])]
    for kind in COMPETITORS:
        prof = c[kind].get("profile")
        if prof:
            lines += ["", f"Profile of one step, {LABELS[kind]}, rank 0: self CPU ms by phase and op category", "",
                      _profile_table(prof)]
    return "\n".join(lines)


def _profile_table(prof: Dict[str, Any]) -> str:
    by_phase = prof["self_ms_by_phase_and_category"]
    categories = [c for c, _ in _CATEGORIES] + ["other ops", LOGITS + "matmul", LOGITS + "other ops"]
    phases = [p for p in ("forward", "backward", "clip", "optimizer", "outside phases") if p in by_phase]
    rows = []
    for category in categories:
        values = [by_phase[p].get(category, 0.0) for p in phases]
        if any(values):
            rows.append([category] + [fmt(v, 1) for v in values] + [fmt(sum(values), 1)])
    step = prof["step"]
    rows.append(["(wall time of the phase)"] + [fmt(1e3 * step[p], 1) if p in step else "-" for p in phases]
                + [fmt(1e3 * step["seconds"], 1)])
    text = markdown_table(["self CPU ms"] + phases + ["total"], rows)
    if "bare_all_reduce_ms" in prof:
        text += (f"\n\nA bare all-reduce of one activation ({fmt_bytes(prof['bare_all_reduce_bytes'])}) between the "
                 f"two ranks, after a barrier: {prof['bare_all_reduce_ms']:.2f} ms (median of 10).")
    return text
