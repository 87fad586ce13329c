"""What the silent-divergence safeguards (issue 23, item 5) cost: the input check per forward, the sequence-parallel
gradient sum inside backward, and the replicated-parameter check of ``checkpointing.save``. It prints markdown; it is a
benchmark, not a test (it asserts nothing). docs/performance.md ("Divergence checks") holds the figures.

Two gloo ranks (a worker pool, tp=2, one intra-op thread each, ``OMP_NUM_THREADS=1``), CPU tensors:

* ``inputs``: a forward of a parallelized ``LlamaForCausalLM`` in training mode (grad enabled, no backward) with the
  input check on (``set_input_check(model, every=1)``) and off (``every=0``), alternating, ``--rounds`` pairs; medians
  (of each, and of the difference within each round).
  Also the check alone (the model record's ``input_check(model, (), batch)``, same rounds). Two sizes: the tests' tiny
  Llama (hidden 32, 2 layers, batch 2 x 8 tokens) and a bigger one (hidden 1024, 16 heads, 8 KV heads, intermediate
  2816, 4 layers, vocabulary 32000, batch 2 x 512 tokens).
* ``sp``: BERT-large-shaped ``BertForPreTraining`` layers (hidden 1024, 16 heads, intermediate 4096, ``--sp-layers``
  layers, batch 2 x 128 tokens, sequence parallelism): backward with the gradients of the sequence-parallel parameters
  summed inside backward (nxdtp's way: one all-reduce per LayerNorm and per row-parallel bias) against backward with
  that region made an identity and one bucketed all-reduce of the same gradients after it (the end-of-backward bucket
  a ``queue_callback`` design would issue), alternating; medians. Also the all-reduces alone: the per-module sizes one
  after the other, and their total in one.
* ``save``: ``BertForPreTraining`` at BERT-large size (24 layers) at tp=2: ``check_replicated_agree`` on the model's
  replicated tensors alone (``--rounds``; median), and one ``save`` with ``check_replicated`` on and one off.

``python -m tools.bench divergence [--parts inputs,sp,save] [--rounds 20] [--sp-layers 4] [--workdir DIR]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from .common import Pool, log


def _timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def _median_ms(values) -> str:
    return f"{statistics.median(values) * 1e3:.3f} ({min(values) * 1e3:.3f}-{max(values) * 1e3:.3f})"


def _llama(size: str):
    import transformers

    if size == "tiny":
        config = transformers.LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64)
        batch, seq = 2, 8
    else:
        config = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                                          num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
                                          max_position_embeddings=1024)
        batch, seq = 2, 512
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
    return model, dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids.clone())


def _inputs(rounds: int) -> list:
    from nxdtp.agreement import set_input_check
    from nxdtp.models import parallelize_model
    from nxdtp.record import record_of

    lines = []
    for size in ("tiny", "bigger"):
        model, batch = _llama(size)
        model = parallelize_model(model).train()
        times = {0: [], 1: []}
        alone = []
        for r in range(rounds + 2):
            for every in (1, 0) if r % 2 else (0, 1):
                set_input_check(model, every=every)
                dist.barrier()
                elapsed = _timed(lambda model=model: model(**batch))
                if r >= 2:
                    times[every].append(elapsed)
            set_input_check(model, every=1)
            dist.barrier()
            elapsed = _timed(lambda model=model: record_of(model).input_check(model, (), batch))
            if r >= 2:
                alone.append(elapsed)
        off = statistics.median(times[0])
        # Paired by round (the two forwards of a round ran back to back), which cancels most of the load's drift.
        paired = statistics.median(a - b for a, b in zip(times[1], times[0]))
        lines.append(f"| {size} Llama, batch {tuple(batch['input_ids'].shape)} | {_median_ms(times[1])} | "
                     f"{_median_ms(times[0])} | {paired * 1e3:+.3f} ({paired / off * 100:+.2f} %) | "
                     f"{_median_ms(alone)} |")
        del model
    return lines


def _bert(layers: int):
    import transformers

    config = transformers.BertConfig(vocab_size=30528, hidden_size=1024, num_hidden_layers=layers,
                                     num_attention_heads=16, intermediate_size=4096, max_position_embeddings=512,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return transformers.BertForPreTraining(config)


def _sp(rounds: int, layers: int) -> list:
    from unittest import mock

    from nxdtp import comm, grads, mappings
    from nxdtp.models import parallelize_model
    from nxdtp.parallel_state import tensor_parallel_group

    model = parallelize_model(_bert(layers), sequence_parallel=True).train()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 30522, (2, 128), generator=g)
    batch = dict(input_ids=ids, labels=ids.clone(), next_sentence_label=torch.zeros(2, dtype=torch.long))
    sp_params = [p for p in model.parameters() if getattr(p, "grad_allreduced_in_backward", False)]
    identity = lambda *tensors: tuple(t.view_as(t) for t in tensors)  # noqa: E731
    modules = sum(1 for m in model.modules() if getattr(type(m), "_nxdtp_wrapper", None) ==
                  "nxdtp_sequence_parallel_grads_in_backward")
    times = {"in backward": [], "bucket after": []}
    for r in range(rounds + 1):
        for how in ("in backward", "bucket after") if r % 2 else ("bucket after", "in backward"):
            model.zero_grad()
            if how == "in backward":
                loss = model(**batch).loss
                dist.barrier()
                elapsed = _timed(loss.backward)
            else:
                with mock.patch.object(mappings, "sum_gradients_over_tensor_parallel", identity):
                    loss = model(**batch).loss
                dist.barrier()

                def backward_then_bucket():
                    loss.backward()
                    grads._bucketed_all_reduce([p.grad for p in sp_params], tensor_parallel_group(), 1, 512)

                elapsed = _timed(backward_then_bucket)
            if r >= 1:
                times[how].append(elapsed)
    # The collectives alone: the per-module all-reduces one after the other, and one of their total size.
    group = tensor_parallel_group()
    per_module = []
    for module in model.modules():
        if getattr(type(module), "_nxdtp_wrapper", None) == "nxdtp_sequence_parallel_grads_in_backward":
            per_module.append(sum(p.numel() for n, p in module.named_parameters(recurse=False)
                                  if getattr(p, "grad_allreduced_in_backward", False)))
    separate, together = [], []
    for _ in range(rounds):
        dist.barrier()
        separate.append(_timed(lambda: [comm.all_reduce(torch.ones(n), group) for n in per_module]))
        dist.barrier()
        together.append(_timed(lambda: comm.all_reduce(torch.ones(sum(per_module)), group)))
    after = statistics.median(times["bucket after"])
    # Paired by round (the two backwards of a round ran back to back), which cancels most of the load's drift.
    difference = statistics.median(a - b for a, b in zip(times["in backward"], times["bucket after"]))
    return [f"BERT-large-shaped, {layers} layers, SP, tp=2: {modules} modules with sequence-parallel parameters, "
            f"{len(sp_params)} parameters, {sum(per_module)} elements",
            "", "| backward | median ms (min-max) |", "|---|---|",
            f"| gradients summed in backward ({modules} all-reduces) | {_median_ms(times['in backward'])} |",
            f"| identity region, one bucketed all-reduce after backward | {_median_ms(times['bucket after'])} |",
            f"| difference, median of rounds | {difference * 1e3:+.3f} ms ({difference / after * 100:+.2f} %) |",
            f"| the {len(per_module)} all-reduces alone, one after the other | {_median_ms(separate)} |",
            f"| one all-reduce of their {sum(per_module)} elements | {_median_ms(together)} |"]


def _save(rounds: int, workdir: str) -> list:
    from nxdtp import checkpointing
    from nxdtp.agreement import check_replicated_agree
    from nxdtp.checkpointing.index import split_state_dict
    from nxdtp.models import parallelize_model
    from nxdtp.parallel_state import tensor_parallel_group

    model = parallelize_model(_bert(24))
    tensors, entries = split_state_dict(model.state_dict(keep_vars=True), 2)
    replicated = {k: t for k, t in tensors.items() if not entries[k].spec.is_sharded}
    elements = sum(t.numel() for t in replicated.values())
    alone = []
    for _ in range(rounds):
        dist.barrier()
        alone.append(_timed(lambda: check_replicated_agree(replicated, tensor_parallel_group())))
    saves = {}
    for check in (True, False, True, False):
        directory = os.path.join(workdir, f"save_{check}_{len(saves)}")
        dist.barrier()
        saves.setdefault(check, []).append(_timed(lambda: checkpointing.save({"model": model, "global_step": 1},
                                                                             directory, check_replicated=check)))
    return [f"BertForPreTraining, BERT-large (24 layers), tp=2: {len(replicated)} replicated tensors, {elements:,} "
            "elements", "", "| operation | median ms (min-max) |", "|---|---|",
            f"| check_replicated_agree alone ({rounds} rounds) | {_median_ms(alone)} |",
            f"| save, check on (2 saves) | {_median_ms(saves[True])} |",
            f"| save, check off (2 saves) | {_median_ms(saves[False])} |"]


def case_parts(parts: str, rounds: int, sp_layers: int, workdir: str) -> list:
    """The report's lines (rank 0's are printed)."""
    report = []
    if "inputs" in parts:
        report += ["### Input check per forward (tp=2, gloo, CPU, training mode, no backward)", "",
                   "| model | forward, check on: median ms (min-max) | check off | on - off, median of rounds | "
                   "the check alone |", "|---|---|---|---|---|"] + _inputs(rounds) + [""]
    if "sp" in parts:
        report += ["### Sequence-parallel gradients summed in backward", ""] + _sp(rounds, sp_layers) + [""]
    if "save" in parts:
        report += ["### Replicated-tensor check of save", ""] + _save(min(rounds, 10), workdir) + [""]
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench divergence", description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="inputs,sp,save")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--sp-layers", type=int, default=4)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir, Pool(2, tp=2) as pool:
        log(f"divergence: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
        report = pool.call(case_parts, parts=args.parts.split(","), rounds=args.rounds, sp_layers=args.sp_layers,
                           workdir=workdir)[0]
    print("\n".join(report))
    log(f"divergence: load average at the end {os.getloadavg()[0]:.1f}")
    return 0
