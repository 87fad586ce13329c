"""Section 1: one BertForPreTraining train step on CPU, dense vs nxdtp TP=2 vs PyTorch DTensor TP=2; then a
Llama-shaped decoder (LlamaForCausalLM, grouped-query attention), dense vs nxdtp TP=2. ``run_gpu`` is the --gpu
section: section 1's model on one device, dense vs nxdtp tp=1 (a 1-rank NCCL world).

Each competitor is a pool of long-lived worker processes (one intra-op thread each): ``dense`` is one process,
``nxdtp`` and ``dtensor`` two gloo ranks each. All import the same modules before their memory baseline, build the
same seeded dense model (every parameter randomised, biases and LayerNorms included) and batch, then shard it:

* dense: nothing; ``torch.nn.utils.clip_grad_norm_``.
* nxdtp: ``parallelize_bert`` (Llama: ``nxdtp.models.parallelize_model``); ``nxdtp.grads.clip_grad_norm``.
* dtensor: ``parallelize_module`` on every encoder layer over a 1-D CPU mesh (ColwiseParallel on Q/K/V and
  intermediate.dense, RowwiseParallel on the two output denses; local head counts); embeddings, MLM head and loss
  replicated. Clipping: ``get_total_norm`` of the DTensor and of the plain gradients, combined, then
  ``clip_grads_with_norm_`` on each list (``clip_grad_norm_`` refuses the mix).

A step: ``zero_grad``, forward (loss), backward, clip to 1.0, AdamW. The driver alternates the competitors step by step
(one computes at a time); a competitor's ranks meet in a barrier before each step, and a step's time is the slowest
rank's. After the rounds: peak RSS per rank, a machine check (can both ranks compute at full speed at once?) and, with
--profile, one profiled step of each. The nxdtp and DTensor workers also count the collectives of a step for section 3
(``case_count_comm``).
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Any, Dict, List

from .common import Pool, barrier, log, malloc_trim, median, proc_status_kib, summary, table, verdict

COMPETITORS = ("dense", "nxdtp", "dtensor")
LABELS = {"dense": "(a) dense, 1 process x 1 thread", "nxdtp": "(b) nxdtp TP=2, 2 gloo ranks x 1 thread",
          "dtensor": "(c) DTensor TP=2, 2 gloo ranks x 1 thread"}
TP, SEED, MAX_GRAD_NORM = 2, 1234, 1.0
ADAMW = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
PHASES = ("forward", "backward", "clip", "optimizer")
# The competitors' losses agree within this: sharded sums move results by a few ulps per operation (measured: 2.3e-6
# at most over the 12 steps of the full run), far below the 4-22 % one training step changes the loss here.
LOSS_RTOL = 1e-4
BERT_4L = dict(num_hidden_layers=4, hidden_size=768, num_attention_heads=12, intermediate_size=3072, vocab_size=30522,
               max_position_embeddings=512, type_vocab_size=2)
FULL = dict(model=BERT_4L, seq=128, batch=8, rounds=10, warmup=2)
QUICK = dict(model=dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=256,
                        vocab_size=512, max_position_embeddings=64, type_vocab_size=2), seq=32, batch=4, rounds=3,
             warmup=2)
# GQA: 8 query heads over 2 KV heads, so each TP rank holds 4 query heads and one KV head.
LLAMA_FULL = dict(model=dict(num_hidden_layers=4, hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                             intermediate_size=1408, vocab_size=8192, max_position_embeddings=256), seq=128, batch=4)
LLAMA_QUICK = dict(model=dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=176, vocab_size=512, max_position_embeddings=64), seq=32, batch=4)
TARGETS = {"nxdtp/dense step time": 0.60, "nxdtp/dtensor step time": 0.65, "nxdtp/dense peak RSS per rank": 0.60}
STATE: Dict[str, Any] = {}  # a worker's model, optimizer and batch between calls


# ---- models and batches (also used by sections 3 and 4) -------------------------------------------------------------

def _randomised(model, seed: int):
    """Every parameter (biases and norms too) moved off its initial value by seeded N(0, 0.02) noise."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():  # tied weights once, in a fixed order
            p.add_(torch.randn(p.shape, generator=generator), alpha=0.02)
    return model.train()


def build_dense(model_cfg: Dict[str, Any], seed: int, arch: str = "bert"):
    """BertForPreTraining or LlamaForCausalLM (untied head), dropout off, randomised; the same in every process."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    if arch == "bert":
        config = tf.BertConfig(**model_cfg, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return _randomised(tf.BertForPreTraining(config), seed)
    config = tf.LlamaConfig(**model_cfg, attention_dropout=0.0, tie_word_embeddings=False)
    return _randomised(tf.LlamaForCausalLM(config), seed)


def make_batch(model_cfg: Dict[str, Any], seq: int, batch: int, seed: int, arch: str = "bert") -> Dict[str, Any]:
    import torch

    generator = torch.Generator().manual_seed(seed + 2)
    input_ids = torch.randint(0, model_cfg["vocab_size"], (batch, seq), generator=generator)
    if arch != "bert":  # a packed causal-LM batch, as the Llama example reads it
        return {"input_ids": input_ids, "labels": input_ids.clone()}
    masked = torch.rand(batch, seq, generator=generator) < 0.15
    masked[:, 1] = True  # at least one MLM target per sequence
    return {"input_ids": input_ids,
            "token_type_ids": (torch.arange(seq) >= seq // 2).long().expand(batch, seq).contiguous(),
            "attention_mask": torch.ones(batch, seq, dtype=torch.long),
            "labels": torch.where(masked, input_ids, torch.full_like(input_ids, -100)),
            "next_sentence_label": torch.randint(0, 2, (batch,), generator=generator)}


def _dtensor_parallelize(model) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if "mesh" not in STATE:
        STATE["mesh"] = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = {**{f"attention.self.{n}": ColwiseParallel() for n in ("query", "key", "value")},
            "attention.output.dense": RowwiseParallel(), "intermediate.dense": ColwiseParallel(),
            "output.dense": RowwiseParallel()}
    for layer in model.bert.encoder.layer:
        parallelize_module(layer, STATE["mesh"], plan)
        layer.attention.self.num_attention_heads //= STATE["mesh"].size()  # consistent with the local shard
        layer.attention.self.all_head_size //= STATE["mesh"].size()


def _dtensor_clip(parameters, max_norm: float):
    import torch
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    groups = [[p for p in params if isinstance(p.grad, DTensor) == sharded] for sharded in (True, False)]
    norms = [torch.nn.utils.get_total_norm([p.grad for p in g]) for g in groups if g]
    total = torch.linalg.vector_norm(torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]))
    for group in groups:
        if group:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def shard(kind: str, model, arch: str = "bert", sequence_parallel: bool = False, vocab_multiple: int = 1):
    """Shard ``model`` as competitor ``kind`` does; return its gradient-clipping function."""
    import torch

    if kind == "nxdtp":
        from nxdtp.grads import clip_grad_norm
        from nxdtp.models import parallelize_model
        from nxdtp.models.bert import parallelize_bert

        (parallelize_bert if arch == "bert" else parallelize_model)(
            model, sequence_parallel=sequence_parallel, make_vocab_size_divisible_by=vocab_multiple)
        return lambda params: clip_grad_norm(params, MAX_GRAD_NORM)
    if kind == "dtensor":
        _dtensor_parallelize(model)
        return lambda params: _dtensor_clip(params, MAX_GRAD_NORM)
    return lambda params: torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)


# ---- worker side ----------------------------------------------------------------------------------------------------

def _import_everything() -> None:
    """The same modules in every competitor, before the memory baseline."""
    import torch.distributed.tensor.parallel  # noqa: F401
    import torch.profiler  # noqa: F401
    from transformers.models.bert import modeling_bert  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401

    import nxdtp.grads  # noqa: F401
    import nxdtp.models.bert  # noqa: F401


def case_build(kind: str, model_cfg, seq: int, batch: int, arch: str = "bert", vocab_multiple: int = 1,
               device: str = "cpu") -> Dict[str, Any]:
    """Build, shard and keep the model, AdamW and the batch."""
    import torch

    if "baseline" not in STATE:
        _import_everything()
        STATE["baseline"] = proc_status_kib()["VmRSS"] / 1024
    model = build_dense(model_cfg, SEED, arch)
    clip = shard(kind, model, arch, vocab_multiple=vocab_multiple)
    if device != "cpu":  # the --gpu section: tp=1, nothing was split
        from nxdtp.utils import move_model_to_device

        torch.cuda.set_device(device)
        model = move_model_to_device(model, device) if kind == "nxdtp" else model.to(device)
    STATE.update(model=model, clip=clip, optimizer=torch.optim.AdamW(model.parameters(), **ADAMW), device=device,
                 batch={k: v.to(device) for k, v in make_batch(model_cfg, seq, batch, SEED, arch).items()})
    gc.collect()
    STATE.update(peak_reset=reset_peak(), after_build=proc_status_kib()["VmRSS"] / 1024)
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    return {"parameter_bytes": sum(p.numel() * p.element_size() for p in local),
            "attn_implementation": model.config._attn_implementation,
            "local_vocab_rows": model.get_input_embeddings().weight.shape[0]}


def reset_peak() -> bool:
    from .common import reset_peak_rss

    if STATE.get("device", "cpu").startswith("cuda"):
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    return reset_peak_rss()


def _one_step(marks: bool = False) -> Dict[str, float]:
    """zero_grad and forward, backward, clip, AdamW step; the wall time of each phase (device work included)."""
    import torch
    from torch.profiler import record_function

    cuda = STATE["device"].startswith("cuda")
    times = [time.perf_counter()]
    model, optimizer = STATE["model"], STATE["optimizer"]
    actions = (lambda: (optimizer.zero_grad(set_to_none=True), model(**STATE["batch"]).loss)[1],
               lambda: STATE["loss"].backward(), lambda: STATE["clip"](list(model.parameters())), optimizer.step)
    out: Dict[str, Any] = {}
    for phase, action in zip(PHASES, actions):
        with record_function(f"phase::{phase}") if marks else contextlib.nullcontext():
            value = action()
        if phase == "forward":
            STATE["loss"] = value
        elif phase == "clip":
            out["grad_norm"] = float(value)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter())
        out[phase] = times[-1] - times[-2]
    out.update(seconds=times[-1] - times[0], loss=STATE.pop("loss").item())
    return out


def case_step() -> Dict[str, float]:
    barrier()
    return _one_step()


def case_memory() -> Dict[str, Any]:
    now = proc_status_kib()
    peak = now["VmHWM"] / 1024
    out = {"baseline_mib": STATE["baseline"], "peak_mib": peak, "increase_mib": peak - STATE["baseline"],
           "after_build_mib": STATE["after_build"], "increase_over_build_mib": peak - STATE["after_build"],
           "peak_reset": STATE["peak_reset"]}
    if STATE["device"].startswith("cuda"):
        import torch

        out["device_peak_mib"] = torch.cuda.max_memory_allocated() / (1 << 20)
    return out


def case_release() -> None:
    for key in ("model", "clip", "optimizer", "batch"):
        STATE.pop(key, None)
    gc.collect()
    malloc_trim()


def case_gemm_probe(model_cfg, seq: int, batch: int, seconds: float = 1.5) -> Dict[str, float]:
    """Can this machine run the TP ranks at full speed at once? Each rank times one MLP column-shard GEMM (forward and
    backward) alone, the other waiting in a barrier, then all at once: together / alone is 1.0 when each rank has a
    core to itself, 2.0 when two ranks share one core's worth of compute."""
    import torch
    import torch.nn.functional as F

    from .common import rank_and_world

    rank, world = rank_and_world()
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


# ---- profiling (--profile) ------------------------------------------------------------------------------------------

CATEGORIES = (("collectives", ("gloo", "c10d", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                               "wait_tensor", "barrier")),
              ("attention", ("scaled_dot_product", "flash_attention", "efficient_attention")),
              ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear")),
              ("layer norm", ("layer_norm",)),
              ("copies", ("aten::copy_", "aten::clone", "aten::cat", "aten::stack", "aten::_to_copy",
                          "aten::contiguous", "aten::index_select", "aten::zeros", "aten::fill_", "aten::zero_")))


def _category(name: str, shapes, vocab_rows) -> str:
    """An op's category; ops with a vocabulary-sized dimension (decoder matmuls, loss, the embedding's update) are
    reported apart as the logits path."""
    base = next((c for c, needles in CATEGORIES if any(n in name for n in needles)), "other ops")
    vocab_sized = any(isinstance(s, (list, tuple)) and any(d in vocab_rows for d in s) for s in shapes or ())
    if base != "collectives" and (vocab_sized or any(n in name for n in ("softmax", "nll_loss", "cross_entropy"))):
        return "logits path: " + ("matmul" if base == "matmul" else "other ops")
    return base


def case_profile() -> Dict[str, Any]:
    """One train step under torch.profiler: self CPU ms by phase and op category."""
    from torch.profiler import ProfilerActivity, profile

    model = STATE["model"]
    vocab_rows = {model.get_input_embeddings().weight.shape[0], model.config.vocab_size}
    barrier()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step = _one_step(marks=True)
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
        bucket[category] = bucket.get(category, 0.0) + event.self_cpu_time_total / 1e3
    return {"step": step, "self_ms_by_phase_and_category": by_phase}


def _profile_table(kind: str, prof: Dict[str, Any]) -> List[Any]:
    by_phase = prof["self_ms_by_phase_and_category"]
    phases = [p for p in PHASES + ("outside phases",) if p in by_phase]
    categories = sorted({c for p in by_phase.values() for c in p})
    rows = [[c] + [by_phase[p].get(c, 0.0) for p in phases] for c in categories]
    rows.append(["(wall time of the phase)"] + [1e3 * prof["step"].get(p, float("nan")) for p in phases])
    return [f"Profile of one step, {LABELS[kind]}, rank 0: self CPU ms by phase and op category",
            table(["self CPU ms"] + phases, rows, dict.fromkeys(phases, ".1f"))]


# ---- collective counting (section 3) --------------------------------------------------------------------------------

def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _Counter:
    """{phase: {op: [count, bytes of the full tensor]}}: an all-reduce's buffer, an all-gather's output, a
    reduce-scatter's input."""

    def __init__(self):
        self.phase, self.counts = "setup", {}

    def add(self, op: str, nbytes: int) -> None:
        entry = self.counts.setdefault(self.phase, {}).setdefault(op, [0, 0])
        entry[0] += 1
        entry[1] += int(nbytes)


# torch.distributed function -> (op, index of the measured argument, its keyword, whether it is a list)
_DIST_CALLS = {"all_reduce": ("all-reduce", 0, "tensor", False), "broadcast": ("broadcast", 0, "tensor", False),
               "all_gather_into_tensor": ("all-gather", 0, "output_tensor", False),
               "all_gather": ("all-gather", 0, "tensor_list", True),
               "reduce_scatter_tensor": ("reduce-scatter", 1, "input", False),
               "reduce_scatter": ("reduce-scatter", 1, "input_list", True)}


@contextlib.contextmanager
def _counting_torch_distributed(counter: _Counter):
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in _DIST_CALLS}

    def wrap(name, fn):
        op, index, keyword, is_list = _DIST_CALLS[name]

        def wrapper(*args, **kwargs):
            value = args[index] if len(args) > index else kwargs[keyword]
            counter.add(op, sum(map(_nbytes, value)) if is_list else _nbytes(value))
            return fn(*args, **kwargs)
        return wrapper

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


_FUNCTIONAL = {"all_reduce": "all-reduce", "all_gather_into_tensor": "all-gather",
               "reduce_scatter_tensor": "reduce-scatter", "broadcast": "broadcast"}


def _functional_collective_counter(counter: _Counter):
    """A dispatch mode counting DTensor's functional collectives (torch.ops._c10d_functional.*), same byte rules."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            op = name.split(".", 1)[1] if name.startswith("_c10d_functional.") else "wait_tensor"
            if not op.startswith("wait_tensor"):
                kind = next((k for k in _FUNCTIONAL if op.startswith(k)), None)  # unknown: counted, 0 bytes
                scale = int(args[1]) if kind == "all_gather_into_tensor" else 1
                counter.add(_FUNCTIONAL.get(kind, op), _nbytes(args[0]) * scale if kind else 0)
            return func(*args, **(kwargs or {}))

    return Mode()


def case_count_comm(kind: str, model_cfg, seq: int, batch: int, sequence_parallel: bool = False) -> Dict[str, Any]:
    """Collectives of the second of two train steps of a freshly sharded BERT, by phase and kind."""
    import torch

    from nxdtp.grads import allreduce_sequence_parallel_gradients

    model = build_dense(model_cfg, SEED)
    clip = shard(kind, model, sequence_parallel=sequence_parallel)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    inputs, params, counter = make_batch(model_cfg, seq, batch, SEED), list(model.parameters()), _Counter()
    for _ in range(2):  # the first step creates AdamW's state; count the second
        counter.counts.clear()
        with (_functional_collective_counter(counter) if kind == "dtensor" else _counting_torch_distributed(counter)):
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


# ---- driver side ----------------------------------------------------------------------------------------------------

class Competitors:
    """Lazily started worker pools, shared by sections 1 and 3 (and the --gpu section's own two)."""

    SHAPES = {"dense": (1, None, "gloo"), "nxdtp": (TP, TP, "gloo"), "dtensor": (TP, None, "gloo"),
              "gpu-dense": (1, None, "gloo"), "gpu-nxdtp": (1, 1, "nccl")}

    def __init__(self):
        self.pools: Dict[str, Pool] = {}

    def get(self, name: str, backend: str = None) -> Pool:
        if name not in self.pools:
            world, tp, default = self.SHAPES[name]
            self.pools[name] = Pool(world, tp, backend=backend or default)
        return self.pools[name]

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()


def _competitor(kind: str, build: List[dict], steps: List[List[dict]], memory: List[dict], warmup: int) -> dict:
    timed = steps[warmup:]
    seconds = [max(r["seconds"] for r in step) for step in timed]
    last = [r["loss"] for r in steps[-1]]
    return {"label": LABELS[kind], "ranks": len(build), "step_s": summary(seconds), "step_s_per_round": seconds,
            "phase_s_median": {p: median(max(r[p] for r in step) for step in timed) for p in PHASES},
            "loss_per_step": [step[0]["loss"] for step in steps],
            "grad_norm_per_step": [step[0]["grad_norm"] for step in steps],
            "last_loss": last[0], "last_loss_ranks_equal": len(set(last)) == 1,
            "parameter_bytes_per_rank": [b["parameter_bytes"] for b in build],
            "attn_implementation": build[0]["attn_implementation"], "local_vocab_rows": build[0]["local_vocab_rows"],
            "memory": memory[0], "peak_rss_mib_per_rank": [m["peak_mib"] for m in memory],
            "rss_increase_mib_per_rank": [m["increase_mib"] for m in memory],
            "peak_over_after_build_mib_per_rank": [m["increase_over_build_mib"] for m in memory],
            "peak_reset": all(m["peak_reset"] for m in memory)}


def _rounds(pools: Dict[str, Pool], spec, arch: str, rounds: int, warmup: int, vocab_multiple: int = 1,
            device: str = "cpu") -> Dict[str, Any]:
    """Build on every competitor, alternate their steps, read their memory; the figures of each and their ratios."""
    log(f"train step ({arch}): building {', '.join(pools)} (config {spec['model']}, seq {spec['seq']})")
    builds = {k: p.call(case_build, kind=k.replace("gpu-", ""), model_cfg=spec["model"], seq=spec["seq"],
                        batch=spec["batch"], arch=arch, vocab_multiple=vocab_multiple if "nxdtp" in k else 1,
                        device=device) for k, p in pools.items()}
    steps = alternate_steps(pools, warmup + rounds, arch)
    c = {k.replace("gpu-", ""): _competitor(k.replace("gpu-", ""), builds[k], steps[k], p.call(case_memory), warmup)
         for k, p in pools.items()}
    losses = {k: v["last_loss"] for k, v in c.items()}
    worst = max(abs(v - losses["dense"]) / abs(losses["dense"]) for v in losses.values())
    return {"config": spec["model"], "seq": spec["seq"], "batch": spec["batch"], "tp": TP, "rounds": rounds,
            "warmup_steps": warmup, "nxdtp_make_vocab_size_divisible_by": vocab_multiple, "order": list(c),
            "competitors": c, "loss_agreement": {
                "rtol": LOSS_RTOL, "losses": losses, "max_rel_diff_vs_dense": worst,
                "agree": worst <= LOSS_RTOL and all(v["last_loss_ranks_equal"] for v in c.values())},
            "ratios": {f"nxdtp/{o} step time": c["nxdtp"]["step_s"]["median"] / c[o]["step_s"]["median"]
                       for o in c if o != "nxdtp"},
            "per_round_ratios": {f"nxdtp/{o}": [b / a for b, a in zip(c["nxdtp"]["step_s_per_round"],
                                                                      c[o]["step_s_per_round"])]
                                 for o in c if o != "nxdtp"}}


def alternate_steps(pools: Dict[str, Pool], total: int, what: str) -> Dict[str, List[List[dict]]]:
    """One step of each competitor in turn (a, b, c, a, b, c, ...): {competitor: [step][rank]}."""
    steps: Dict[str, List[List[dict]]] = {k: [] for k in pools}
    for index in range(total):
        for kind, pool in pools.items():
            steps[kind].append(pool.call(case_step))
        log(f"train step ({what}) round {index + 1}/{total}: " + ", ".join(
            f"{k} {max(r['seconds'] for r in s[-1]):.3f} s" for k, s in steps.items()))
    return steps


def _release(pools: Dict[str, Pool]) -> None:
    for pool in pools.values():
        pool.call(case_release)


def run(ctx) -> Dict[str, Any]:
    """Section 1. ``ctx.vocab_multiple``: parallelize_bert's make_vocab_size_divisible_by for (b) (Megatron pads to
    128; the library default is 1)."""
    spec = QUICK if ctx.quick else FULL
    rounds, warmup = ctx.rounds or spec["rounds"], spec["warmup"] if ctx.warmup is None else ctx.warmup
    pools = {k: ctx.competitors.get(k) for k in COMPETITORS}
    out = _rounds(pools, spec, "bert", rounds, warmup, ctx.vocab_multiple)
    c = out["competitors"]
    probe = pools["nxdtp"].call(case_gemm_probe, model_cfg=spec["model"], seq=spec["seq"], batch=spec["batch"])
    out["two_rank_gemm_probe"] = {"per_rank": probe, "together_over_alone": max(p["together_over_alone"]
                                                                               for p in probe)}
    if ctx.profile:
        for kind, pool in pools.items():
            c[kind]["profile"] = pool.call(case_profile)[0]
    _release(pools)
    increase = {k: max(v["rss_increase_mib_per_rank"]) for k, v in c.items()}
    peak = {k: max(v["peak_rss_mib_per_rank"]) for k, v in c.items()}
    out["ratios"].update({
        **{f"{o} step time, median of per-round ratios": median(v) for o, v in out["per_round_ratios"].items()},
        "nxdtp/dense peak RSS increase per rank": increase["nxdtp"] / increase["dense"],
        "nxdtp/dense peak RSS per rank (absolute)": peak["nxdtp"] / peak["dense"],
        "dtensor/dense peak RSS increase per rank": increase["dtensor"] / increase["dense"]})
    out.update(adamw=ADAMW, max_grad_norm=MAX_GRAD_NORM, targets=TARGETS, numbers={
        **{f"step_s_{k}": v["step_s"]["median"] for k, v in c.items()},
        "ratio_nxdtp_dense": out["ratios"]["nxdtp/dense step time"],
        "ratio_nxdtp_dtensor": out["ratios"]["nxdtp/dtensor step time"],
        **{f"peak_rss_mib_{k}": v for k, v in peak.items()},
        **{f"rss_increase_mib_{k}": v for k, v in increase.items()},
        "rss_increase_ratio_nxdtp_dense": out["ratios"]["nxdtp/dense peak RSS increase per rank"],
        **{f"last_loss_{k}": v for k, v in out["loss_agreement"]["losses"].items()},
        "loss_max_rel_diff": out["loss_agreement"]["max_rel_diff_vs_dense"],
        "two_rank_gemm_slowdown": out["two_rank_gemm_probe"]["together_over_alone"]})
    llama = {k: pools[k] for k in ("dense", "nxdtp")}  # the same workers, their BERT released
    out["llama"] = _rounds(llama, LLAMA_QUICK if ctx.quick else LLAMA_FULL, "llama", rounds, warmup,
                           ctx.vocab_multiple)
    _release(llama)
    _llama_figures(out["llama"])
    out["numbers"].update(out["llama"]["numbers"])
    out["tables"] = _tables(out)
    return out


def _llama_figures(out: Dict[str, Any]) -> None:
    c = out["competitors"]
    # The workers ran BERT's rounds first: the peak is compared over the RSS right after the Llama was built.
    during = {k: max(v["peak_over_after_build_mib_per_rank"]) for k, v in c.items()}
    out["ratios"].update({"nxdtp/dense step time, median of per-round ratios": median(
        out["per_round_ratios"]["nxdtp/dense"]), "nxdtp/dense peak RSS over build per rank": during["nxdtp"]
                          / during["dense"]})
    out["numbers"] = {"llama_step_s_dense": c["dense"]["step_s"]["median"],
                      "llama_step_s_nxdtp": c["nxdtp"]["step_s"]["median"],
                      "llama_ratio_nxdtp_dense": out["ratios"]["nxdtp/dense step time"],
                      **{f"llama_peak_over_build_mib_{k}": v for k, v in during.items()},
                      **{f"llama_last_loss_{k}": v["last_loss"] for k, v in c.items()},
                      "llama_loss_rel_diff": out["loss_agreement"]["max_rel_diff_vs_dense"]}


def run_gpu(ctx) -> Dict[str, Any]:
    """The --gpu section: section 1's model and step on one device, dense vs nxdtp at tp=1 (parallelize_bert,
    vocab-parallel loss, nxdtp's clip_grad_norm), alternating, medians; the ratio is nxdtp's overhead where nothing
    is split. ``ctx.gpu_device == "cpu"`` runs the same code over gloo (how it is checked without a GPU)."""
    spec = QUICK if ctx.quick else FULL
    device = ctx.gpu_device
    backend = "nccl" if device.startswith("cuda") else "gloo"
    pools = {"gpu-dense": ctx.competitors.get("gpu-dense"), "gpu-nxdtp": ctx.competitors.get("gpu-nxdtp", backend)}
    out = _rounds(pools, spec, "bert", ctx.rounds or spec["rounds"], spec["warmup"] if ctx.warmup is None
                  else ctx.warmup, device=device)
    _release(pools)
    c = out["competitors"]
    memory = {k: v["memory"].get("device_peak_mib", v["memory"]["peak_mib"]) for k, v in c.items()}
    out.update(device=device, backend=backend, numbers={
        "step_s_dense": c["dense"]["step_s"]["median"], "step_s_nxdtp_tp1": c["nxdtp"]["step_s"]["median"],
        "nxdtp_tp1_over_dense": out["ratios"]["nxdtp/dense step time"],
        "loss_rel_diff": out["loss_agreement"]["max_rel_diff_vs_dense"],
        **{f"peak_{'device' if device.startswith('cuda') else 'rss'}_mib_{k}": v for k, v in memory.items()}})
    out["tables"] = [f"Section 1's model and train step on {device} ({backend}), {out['warmup_steps']} warm-up "
                     f"steps, {out['rounds']} alternating rounds, medians (each phase ends with a device synchronize).",
                     table(["competitor", "step s median (min-max)", "peak memory MiB", "loss at last step"],
                           [[k, v["step_s"], memory[k], v["last_loss"]] for k, v in c.items()],
                           {"step s median (min-max)": ".4f", "loss at last step": ".7f"}),
                     f"nxdtp tp=1 / dense step time: {out['ratios']['nxdtp/dense step time']:.3f} (1.00 = no "
                     f"overhead); losses agree within {LOSS_RTOL:.0e}: {out['loss_agreement']['agree']}."]
    return out


def _competitor_table(result: Dict[str, Any], over_imports: bool) -> Dict[str, Any]:
    columns = ["competitor", "step s median (min-max)", "forward s", "backward s", "clip s", "AdamW s",
               "parameters MiB / rank", "peak RSS MiB per rank"]
    columns += ["peak RSS increase MiB per rank (over imports)"] if over_imports else []
    columns += ["peak RSS MiB per rank over RSS after build", "loss at last step"]
    rows = []
    for k in result["competitors"].values():
        rows.append([k["label"], k["step_s"], *(k["phase_s_median"][p] for p in PHASES),
                     max(k["parameter_bytes_per_rank"]) / (1 << 20), k["peak_rss_mib_per_rank"]]
                    + ([k["rss_increase_mib_per_rank"]] if over_imports else [])
                    + [k["peak_over_after_build_mib_per_rank"], k["last_loss"]])
    formats = {c: ".0f" for c in columns if "RSS" in c}
    return table(columns, rows, {**formats, "step s median (min-max)": ".3f", "parameters MiB / rank": ",.1f",
                                 "forward s": ".3f", "backward s": ".3f", "clip s": ".4f", "AdamW s": ".3f",
                                 "loss at last step": ".7f"})


def _describe(result: Dict[str, Any], arch: str) -> str:
    cfg, c = result["config"], result["competitors"]
    heads = f"{cfg['num_attention_heads']} heads" + (f" over {cfg['num_key_value_heads']} KV heads (GQA)"
                                                     if "num_key_value_heads" in cfg else "")
    name = "BertForPreTraining" if arch == "bert" else "LlamaForCausalLM (Llama-shaped decoder)"
    return (f"{name}: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, {heads}, intermediate "
            f"{cfg['intermediate_size']}, vocab {cfg['vocab_size']}; seq {result['seq']}, batch {result['batch']}, "
            f"fp32, dropout 0, AdamW (lr {ADAMW['lr']}), clip to {MAX_GRAD_NORM}. {result['warmup_steps']} warm-up "
            f"steps, then {result['rounds']} alternating rounds; medians; step time = slowest rank; attention "
            f"{c['dense']['attn_implementation']}; nxdtp make_vocab_size_divisible_by="
            f"{result['nxdtp_make_vocab_size_divisible_by']} ({c['nxdtp']['local_vocab_rows']} vocabulary rows per "
            "rank).")


def _tables(out: Dict[str, Any]) -> List[Any]:
    r, la, llama = out["ratios"], out["loss_agreement"], out["llama"]
    probe = out["two_rank_gemm_probe"]["together_over_alone"]
    figures = [
        ["step time b/a (nxdtp / dense)", r["nxdtp/dense step time"], "<= 0.60 (limit 0.50)",
         verdict(r["nxdtp/dense step time"], TARGETS["nxdtp/dense step time"])],
        ["step time b/c (nxdtp / DTensor)", r["nxdtp/dtensor step time"], "<= 0.65",
         verdict(r["nxdtp/dtensor step time"], TARGETS["nxdtp/dtensor step time"])],
        ["b/a, median of per-round ratios", r["nxdtp/dense step time, median of per-round ratios"], "", ""],
        ["b/c, median of per-round ratios", r["nxdtp/dtensor step time, median of per-round ratios"], "", ""],
        ["peak RSS increase per rank, b/a", r["nxdtp/dense peak RSS increase per rank"], "<= 0.60 (limit 0.50)",
         verdict(r["nxdtp/dense peak RSS increase per rank"], TARGETS["nxdtp/dense peak RSS per rank"])],
        ["peak RSS per rank (absolute, imports included), b/a", r["nxdtp/dense peak RSS per rank (absolute)"], "", ""],
        ["peak RSS increase per rank, c/a", r["dtensor/dense peak RSS increase per rank"], "", ""],
        ["machine check: a TP-shard GEMM, both ranks at once / one rank alone", probe, "1.00 (a core per rank)",
         "ok" if probe <= 1.15 else "the ranks do not get a core each: b/a cannot reach its target here"],
        ["losses at the last step agree (a, b, c)", la["max_rel_diff_vs_dense"], f"<= {la['rtol']:.0e}",
         "met" if la["agree"] else "MISSED"]]
    lr = llama["ratios"]
    llama_figures = [
        ["Llama step time b/a (nxdtp / dense)", lr["nxdtp/dense step time"], "<= 0.60 (limit 0.50)",
         verdict(lr["nxdtp/dense step time"], TARGETS["nxdtp/dense step time"])],
        ["Llama b/a, median of per-round ratios", lr["nxdtp/dense step time, median of per-round ratios"], "", ""],
        ["Llama peak RSS per rank over RSS after build, b/a", lr["nxdtp/dense peak RSS over build per rank"], "", ""],
        ["Llama losses at the last step agree (a, b)", llama["loss_agreement"]["max_rel_diff_vs_dense"],
         f"<= {LOSS_RTOL:.0e}", "met" if llama["loss_agreement"]["agree"] else "MISSED"]]
    columns = ["figure", "value", "target", "verdict"]
    blocks = [_describe(out, "bert"), _competitor_table(out, True), table(columns, figures),
              "Peak RSS: VmHWM of each process over the train steps (reset after the model is built and sharded); "
              "increase = peak - RSS after the imports (the same in every competitor); the next column is the part "
              "above the RSS right after building and sharding (activations, gradients, AdamW state, temporaries).",
              _describe(llama, "llama"), _competitor_table(llama, False), table(columns, llama_figures)]
    for kind, c in out["competitors"].items():
        blocks += _profile_table(kind, c["profile"]) if "profile" in c else []
    return blocks
