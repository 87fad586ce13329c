"""What the silent-divergence safeguards cost on two gloo ranks at tp=2: the input check, sequence-parallel gradients
summed in backward, the replicated-tensor check of ``save`` (docs/performance.md, "Divergence checks")."""

from __future__ import annotations

import os
import tempfile
from typing import Any, Dict, List
from unittest import mock

import torch

from nxdtp import checkpointing, comm, mappings
from nxdtp.agreement import InputCheckNote, check_replicated_agree, set_input_check
from nxdtp.checkpointing.index import split_state_dict
from nxdtp.grads import allreduce_sequence_parallel_gradients
from nxdtp.models import parallelize_model
from nxdtp.parallel_state import tensor_parallel_group
from nxdtp.record import read_note

from .common import BERT_LARGE, Pool, alternate, emit, hf_model, log, median, summary, table, timed, tool_args

TINY_LLAMA = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=64)
BIGGER_LLAMA = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                    num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=1024)


def _ms(values: List[float]) -> Dict[str, Any]:
    return summary(1e3 * v for v in values)


def _paired(on: List[float], off: List[float]) -> str:
    """The median within-round difference (back to back, which cancels most of the machine's drift)."""
    difference = median(a - b for a, b in zip(on, off))
    return f"{difference * 1e3:+.3f} ms ({difference / median(off) * 100:+.2f} %)"


def _inputs(rounds: int) -> List[Any]:
    rows = []
    for size, cfg, seq in (("tiny", TINY_LLAMA, 8), ("bigger", BIGGER_LLAMA, 512)):
        model = parallelize_model(hf_model(cfg, "llama", seed=0)).train()
        ids = torch.randint(0, cfg["vocab_size"], (2, seq), generator=torch.Generator().manual_seed(1))
        batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids.clone())

        def one(every: int) -> float:  # 0: check off, 1: on, 2: the check alone
            set_input_check(model, every=min(every, 1))
            if every == 2:
                return timed(lambda: read_note(model, InputCheckNote).check(model, (), batch))
            return timed(lambda: model(**batch))

        times = alternate((0, 1, 2), rounds, one, warmup=2, swap=True)
        rows.append([f"{size} Llama, batch {tuple(batch['input_ids'].shape)}", _ms(times[1]), _ms(times[0]),
                     _paired(times[1], times[0]), _ms(times[2])])
    return ["### Input check per forward (tp=2, gloo, CPU, training mode, no backward)",
            table(["model", "forward, check on: median ms (min-max)|.3f", "check off|.3f",
                   "on - off, median of rounds", "the check alone|.3f"], rows)]


def _bert(layers: int):
    return hf_model(dict(BERT_LARGE, vocab_size=30528, num_hidden_layers=layers), seed=0, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0)


def _sp(rounds: int, layers: int) -> List[Any]:
    model = parallelize_model(_bert(layers), sequence_parallel=True).train()
    ids = torch.randint(0, 30522, (2, 128), generator=torch.Generator().manual_seed(2))
    batch = dict(input_ids=ids, labels=ids.clone(), next_sentence_label=torch.zeros(2, dtype=torch.long))
    owned = [[p for p in m.parameters(recurse=False) if getattr(p, "grad_allreduced_in_backward", False)]
             for m in model.modules()]
    per_module, sp_params = [sum(p.numel() for p in ps) for ps in owned if ps], [p for ps in owned for p in ps]
    for p in sp_params:  # unmarked, the call after backward sums them (the summing region reads its module's specs)
        p.grad_allreduced_in_backward = False
    group, identity = tensor_parallel_group(), lambda *tensors: tuple(t.view_as(t) for t in tensors)

    def backward(how: str) -> float:
        model.zero_grad()
        if how == "in backward":
            return timed(model(**batch).loss.backward)
        with mock.patch.object(mappings, "sum_gradients_over_tensor_parallel", identity):
            loss = model(**batch).loss
        return timed(lambda: (loss.backward(), allreduce_sequence_parallel_gradients(sp_params)))

    times = alternate(("bucket after", "in backward"), rounds, backward, warmup=1, swap=True)
    separate = [timed(lambda: [comm.all_reduce(torch.ones(n), group) for n in per_module]) for _ in range(rounds)]
    together = [timed(lambda: comm.all_reduce(torch.ones(sum(per_module)), group)) for _ in range(rounds)]
    on, off = times["in backward"], times["bucket after"]
    return ["### Sequence-parallel gradients summed in backward",
            f"BERT-large-shaped, {layers} layers, SP, tp=2: {len(per_module)} modules with sequence-parallel "
            f"parameters, {len(sp_params)} parameters, {sum(per_module)} elements",
            table(["backward", "median ms (min-max)|.3f"], [
                [f"gradients summed in backward ({len(per_module)} all-reduces)", _ms(on)],
                ["identity region, one bucketed all-reduce after backward", _ms(off)],
                ["difference, median of rounds", _paired(on, off)],
                [f"the {len(per_module)} all-reduces alone, one after the other", _ms(separate)],
                [f"one all-reduce of their {sum(per_module)} elements", _ms(together)]])]


def _save(rounds: int, workdir: str) -> List[Any]:
    model = parallelize_model(_bert(24))
    tensors, entries = split_state_dict(model.state_dict(keep_vars=True), 2)
    replicated = {k: t for k, t in tensors.items() if not entries[k].spec.is_sharded}
    alone = [timed(lambda: check_replicated_agree(replicated, tensor_parallel_group())) for _ in range(rounds)]
    saves: Dict[bool, List[float]] = {True: [], False: []}
    for i, check in enumerate((True, False, True, False)):
        saves[check].append(timed(lambda: checkpointing.save({"model": model, "global_step": 1}, os.path.join(
            workdir, f"save_{check}_{i}"), check_replicated=check)))
    return ["### Replicated-tensor check of save",
            f"BertForPreTraining, BERT-large (24 layers), tp=2: {len(replicated)} replicated tensors, "
            f"{sum(t.numel() for t in replicated.values()):,} elements",
            table(["operation", "median ms (min-max)|.3f"], [
                [f"check_replicated_agree alone ({rounds} rounds)", _ms(alone)],
                ["save, check on (2 saves)", _ms(saves[True])], ["save, check off (2 saves)", _ms(saves[False])]])]


def case_parts(parts: List[str], rounds: int, sp_layers: int, workdir: str) -> List[Any]:
    return ((_inputs(rounds) if "inputs" in parts else []) + (_sp(rounds, sp_layers) if "sp" in parts else [])
            + (_save(min(rounds, 10), workdir) if "save" in parts else []))


def main(argv=None) -> int:
    _, args = tool_args("divergence", __doc__, argv, {"--parts": dict(default="inputs,sp,save"), "--rounds": dict(
        type=int, default=20), "--sp-layers": dict(type=int, default=4), "--workdir": dict(default=None)})
    log(f"divergence: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir, Pool(2, tp=2) as pool:
        report = pool.call(case_parts, parts=args.parts.split(","), rounds=args.rounds, sp_layers=args.sp_layers,
                           workdir=workdir)[0]
    log(f"divergence: load average at the end {os.getloadavg()[0]:.1f}")
    return emit(report, report, args.json)
