"""No silent divergence across a tensor-parallel group (issue 23, item 5).

Each test is a way the ranks of a TP group could drift apart while the loss still looks right, and checks that nxdtp
either prevents it or refuses loudly:

1. Sequence-parallel gradients are summed over TP inside backward, with no user call: Llama and BERT at tp=2 equal the
   dense model in every gradient after ``loss.backward()`` alone; ``allreduce_sequence_parallel_gradients`` called
   as well changes nothing; two micro-batches accumulate to the dense sum, also under DDP's ``no_sync`` at tp2×dp2.
2. ``checkpointing.save`` refuses, before writing anything, a model whose replicated parameters differ across the TP
   group, naming the parameter and the TP rank that differs.
3. A parallelized model refuses a forward whose inputs differ across the TP group, naming the input and the TP rank
   (one small all-gather per forward, which ``set_input_check`` schedules or turns off); ``broadcast_data`` gives every
   TP rank TP rank 0's batch. On XLA the check traces into the forward graph without any host read and reports two
   steps later.
4. ``copy.deepcopy`` and ``torch.save``/``torch.load`` of a parallelized model keep what ``clip_grad_norm`` and
   checkpoints need: the copies' gradient norm and saved checkpoint equal the original's.

Every model is the dense HF model with every parameter randomised (tests/model_helpers.randomised), sharded from a
deep copy; tolerances are fp32 1e-5, as in the model tests.
"""

from __future__ import annotations

import copy
import io
import json
import os

import pytest
import torch

from nxdtp import parallel_state as ps
from nxdtp.grads import allreduce_sequence_parallel_gradients, clip_grad_norm, get_grad_norm
from nxdtp.models import parallelize_model, vocab_parallel_logits
from tests.test_models_bert import _check_grads, _close, _dense_grad_norm

transformers = pytest.importorskip("transformers")


# ---- models and batches ---------------------------------------------------------------------------------------------

def _llama(seed: int = 3):
    from tests.test_models_decoders import _config, _dense

    return _dense("llama", _config("llama", 2), seed=seed)   # attention and MLP biases: SP-marked row biases too


def _llama_batch(seed: int):
    from tests.test_models_decoders import _batch

    return _batch(seed=seed)


def _bert(seed: int = 5):
    from tests.test_models_bert import _config, _dense

    return _dense(transformers.BertForPreTraining, _config(vocab_size=101), seed=seed)


def _bert_batch(seed: int):
    from tests.test_models_bert import _batch, _config

    return _batch(_config(vocab_size=101), seed=seed)


FAMILIES = {"llama": (_llama, _llama_batch), "bert": (_bert, _bert_batch)}


def _pair(family: str, **kwargs):
    build, batch = FAMILIES[family]
    dense = build()
    return dense, parallelize_model(copy.deepcopy(dense), **kwargs), batch


# ---- 1. sequence-parallel gradients without a call -------------------------------------------------------------------

def case_sequence_parallel_gradients_need_no_call(family: str):
    tp = ps.get_tensor_model_parallel_size()
    what = f"{family} tp={tp} sp"
    dense, model, make_batch = _pair(family, sequence_parallel=True, make_vocab_size_divisible_by=8)
    marked = [n for n, p in model.named_parameters() if getattr(p, "sequence_parallel_enabled", False)]
    assert marked, f"{what}: no sequence-parallel parameter"
    batch = make_batch(7)
    dense(**batch).loss.backward()
    model(**batch).loss.backward()            # nothing else: no allreduce_sequence_parallel_gradients
    _check_grads(model, dense, what)
    _close(get_grad_norm(model.parameters()), torch.tensor(_dense_grad_norm(dense)), f"{what} grad norm")
    # The NxD call, which existing training scripts make after backward, must not sum a second time.
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    allreduce_sequence_parallel_gradients(optimizer)
    allreduce_sequence_parallel_gradients(model.parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, before[name]), f"{what}: allreduce_sequence_parallel_gradients changed {name}"
    return len(marked)


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_sequence_parallel_gradients_need_no_call(worlds, family):
    counts = worlds(2).run(case_sequence_parallel_gradients_need_no_call, tensor_model_parallel_size=2, family=family)
    assert counts[0] > 0 and len(set(counts)) == 1


def case_sequence_parallel_gradients_accumulate(ddp: bool):
    """Two micro-batches per optimizer step. With ``ddp`` the model is wrapped in DistributedDataParallel over the DP
    group and the first micro-batch runs under ``no_sync``: DDP reads each gradient when it is accumulated, so it must
    already be summed over TP then. Each DP rank has its own micro-batches; the dense reference sums all of them and
    divides by the DP size, as DDP averages."""
    from torch.nn.parallel import DistributedDataParallel

    dp_group = ps.data_parallel_group()
    what = f"llama tp={ps.get_tensor_model_parallel_size()} dp={dp_group.size} sp accumulation ddp={ddp}"
    dense, model, make_batch = _pair("llama", sequence_parallel=True, make_vocab_size_divisible_by=8)
    micro = [make_batch(20 + 2 * dp_group.rank + i) for i in range(2)]
    for d in range(dp_group.size):
        for i in range(2):
            (dense(**make_batch(20 + 2 * d + i)).loss / dp_group.size).backward()
    if ddp:
        wrapped = DistributedDataParallel(model, process_group=dp_group.process_group_for("cpu"))
        with wrapped.no_sync():
            wrapped(**micro[0]).loss.backward()
        wrapped(**micro[1]).loss.backward()
    else:
        for batch in micro:
            model(**batch).loss.backward()
    _check_grads(model, dense, what)
    _close(get_grad_norm(model.parameters()), torch.tensor(_dense_grad_norm(dense)), f"{what} grad norm")
    return True


@pytest.mark.parametrize("world,tp,ddp", [pytest.param(2, 2, False, id="tp2"),
                                          pytest.param(4, 2, True, id="tp2xdp2-ddp-no_sync")])
def test_sequence_parallel_gradients_accumulate_over_micro_batches(worlds, world, tp, ddp):
    assert worlds(world).run(case_sequence_parallel_gradients_accumulate, tensor_model_parallel_size=tp,
                             ddp=ddp) == [True] * world


# ---- 2. save refuses replicated parameters that differ ---------------------------------------------------------------

def case_save_refuses_diverged_replicas(root: str):
    from nxdtp import checkpointing
    from nxdtp.agreement import DivergenceError
    from nxdtp.plan import broadcast_replicated_state

    group = ps.tensor_parallel_group()
    model = parallelize_model(_llama())
    directory = os.path.join(root, "refused")
    with torch.no_grad():
        # The drift a missing SP all-reduce leaves: one replicated norm weight a little off on one TP rank.
        model.model.layers[1].post_attention_layernorm.weight[3] += 1e-4 * (group.rank == 1)
    with pytest.raises(DivergenceError) as refused:
        checkpointing.save({"model": model, "global_step": 1}, directory)
    message = str(refused.value)
    assert "'model.layers.1.post_attention_layernorm.weight'" in message, message
    assert "TP rank(s) [1]" in message, message
    assert "model.norm.weight" not in message, message   # only what differs is named
    assert not os.path.exists(directory), f"save wrote {os.listdir(directory)} before refusing"
    # Turned off on request, the save goes through (and keeps TP rank 0's copy).
    kept = checkpointing.save({"model": model, "global_step": 1}, os.path.join(root, "unchecked"),
                              check_replicated=False)
    # Repaired, it saves as usual.
    broadcast_replicated_state(model)
    saved = checkpointing.save({"model": model, "global_step": 2}, os.path.join(root, "repaired"))
    return message, os.path.isdir(kept), os.path.isdir(saved)


def test_save_refuses_replicated_parameters_that_differ(worlds, tmp_path):
    results = worlds(2).run(case_save_refuses_diverged_replicas, tensor_model_parallel_size=2, root=str(tmp_path))
    assert results[0] == results[1], results   # the same refusal on every rank
    assert results[0][1:] == (True, True)


# ---- 3. inputs must agree across the TP group ------------------------------------------------------------------------

def _counting(name: str):
    from unittest import mock

    from nxdtp import comm

    real = getattr(comm, name)
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].numel())
        return real(*args, **kwargs)

    return mock.patch.object(comm, name, counted), calls


def case_inputs_must_agree(family: str):
    from nxdtp.agreement import DivergenceError, set_input_check

    group = ps.tensor_parallel_group()
    _, model, make_batch = _pair(family)
    batch = make_batch(11)
    with torch.no_grad():
        model(**batch)   # the same inputs pass
        refused = {}
        for name in batch:
            other = dict(batch)
            changed = batch[name].clone()
            changed.view(-1)[-1] += group.rank   # rank 1's last element differs by one
            other[name] = changed
            with pytest.raises(DivergenceError) as error:
                model(**other)
            refused[name] = str(error.value)
            assert f"'{name}'" in refused[name] and "TP rank(s) [1]" in refused[name], refused[name]
        # An input passed on TP rank 0 only is named too (the check's size does not depend on the inputs, so no hang).
        lopsided = {k: v for k, v in batch.items() if k != "labels" or group.rank == 0}
        with pytest.raises(DivergenceError, match="'labels'"):
            model(**lopsided)
        # Positional inputs are named by the forward's parameter names.
        ids = batch["input_ids"] + group.rank
        with pytest.raises(DivergenceError, match="'input_ids'"):
            model(ids)
        # One small all-gather per forward, and none when turned off. Different but valid inputs from here on: the
        # forwards that are not checked run.
        other = dict(batch, input_ids=batch["input_ids"].roll(group.rank, dims=-1))
        patch, calls = _counting("all_gather")
        with patch:
            model(**batch)
            checked = list(calls)
            set_input_check(model, every=0)
            model(**other)   # different inputs, unchecked
            unchecked = len(calls) - len(checked)
        # The first forward and every second one after it.
        set_input_check(model, every=2)
        with pytest.raises(DivergenceError):
            model(**other)
        model(**other)
        with pytest.raises(DivergenceError):
            model(**other)
    return sorted(refused), len(checked) - unchecked, checked


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_inputs_that_differ_across_tp_ranks_are_refused(worlds, family):
    results = worlds(2).run(case_inputs_must_agree, tensor_model_parallel_size=2, family=family)
    names, extra_gathers, sizes = results[0]
    assert names == sorted(FAMILIES[family][1](0)), names
    assert extra_gathers == 1, results   # the check's one all-gather
    assert results[0] == results[1]


def case_broadcast_data():
    from nxdtp.agreement import DivergenceError
    from nxdtp.data import broadcast_data

    tp_group, dp_group = ps.tensor_parallel_group(), ps.data_parallel_group()
    # Each DP replica draws its own batch; only TP rank 0's copy is passed (the others pass None or garbage).
    own = _llama_batch(seed=30 + dp_group.rank)
    garbage = {k: v + 1 for k, v in own.items()}
    data = own if tp_group.rank == 0 else (None if ps.get_data_parallel_rank() == 0 else garbage)
    got = broadcast_data(["input_ids", "labels", "attention_mask"], data, torch.int64)
    assert sorted(got) == ["attention_mask", "input_ids", "labels"]
    for key, value in got.items():
        assert value.dtype == torch.int64 and torch.equal(value, own[key]), key
    # Broadcast inputs pass the model's check; a dtype other than the one named is refused on every TP rank.
    model = parallelize_model(_llama())
    with torch.no_grad():
        model(**got)
    with pytest.raises(TypeError, match=r"broadcast_data: 'attention_mask' on tensor-parallel rank 0 is "
                                        r"torch.float32, but datatype=torch.int64"):
        broadcast_data(["input_ids", "attention_mask"],
                       {**own, "attention_mask": own["attention_mask"].float()} if tp_group.rank == 0 else None,
                       torch.int64)
    with pytest.raises(KeyError, match=r"broadcast_data: TP rank 0's data has no 'position_ids'"):
        broadcast_data(["position_ids"], own if tp_group.rank == 0 else None, torch.int64)
    assert issubclass(DivergenceError, ValueError)
    return {k: v.sum().item() for k, v in got.items()}


def test_broadcast_data_gives_every_tp_rank_rank_0s_batch(worlds):
    results = worlds(4).run(case_broadcast_data, tensor_model_parallel_size=2)
    assert results[0] == results[1] and results[2] == results[3] and results[0] != results[2], results


# ---- 3b. XLA: the check in the forward graph, read two steps later ---------------------------------------------------

def case_input_check_traces_without_host_reads():
    """A simulated tp=2 rank traces the Llama plan's forward: the check's all-gather over the TP replica group is in the
    graph, and the check executed and transferred nothing (a host read would: the forward of the model itself reads
    HF's mask checks, with or without the check)."""
    import torch_xla
    import torch_xla.debug.metrics as met

    from nxdtp import comm
    from nxdtp.agreement import pending_input_checks, set_input_check
    from nxdtp.utils import move_model_to_device

    def host_work():
        transfers = met.metric_data("TransferFromDeviceTime")
        return dict(executions=met.counter_value("ExecuteComputation") or 0, transfers=transfers[0] if transfers else 0)

    device = torch_xla.device()
    dense = _llama()
    batch = _llama_batch(seed=1)
    work = {}
    with ps.simulated_topology(4, 1, 2), comm.simulated_xla_runtime(4, 1):
        model = move_model_to_device(parallelize_model(copy.deepcopy(dense), broadcast_replicated=False), device)
        inputs = {k: v.to(device) for k, v in batch.items()}
        for every in (0, 1):
            set_input_check(model, every=every)
            before = host_work()
            with vocab_parallel_logits(model):   # the logits' own all-gather stays out of the count
                model(**inputs)
            work[every] = {k: v - before[k] for k, v in host_work().items()}
        pending = pending_input_checks(model)
        hlo = torch_xla._XLAC._get_xla_tensors_hlo(pending)
        comm.clear_xla_collective_token()
    return dict(unchecked=work[0], checked=work[1], pending=len(pending), all_gathers=hlo.count(" all-gather("),
                groups="replica_groups={{0,1},{2,3}}" in hlo)


@pytest.mark.xla
def test_input_check_on_xla_traces_into_the_forward_without_host_reads(worlds):
    result, = worlds(1, "xla-hlo").run(case_input_check_traces_without_host_reads, tensor_model_parallel_size=None)
    assert result["checked"] == result["unchecked"], result
    assert result["pending"] == 1 and result["all_gathers"] == 1 and result["groups"], result


def case_input_check_on_xla_reports_two_steps_later():
    """Two processes, each an XLA:CPU device of its own (XLA collectives cannot span them here): the check's gather
    is routed over gloo, and the rest is XLA's own: the check's result is read only once it was materialised by a
    sync and one more sync passed, so a mismatch at step 0 raises at the forward of step 2, on every rank."""
    from unittest import mock

    import torch_xla

    from nxdtp import agreement, comm
    from nxdtp.agreement import DivergenceError, set_input_check

    device = torch_xla.device()
    group = ps.tensor_parallel_group()

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(()))

        def forward(self, input_ids, labels=None):
            return input_ids.float().sum() * self.scale

    model = Tiny().to(device)   # the check runs where the model is
    set_input_check(model, every=1)
    real_gather = comm.all_gather

    def gather_over_gloo(tensor, group_, dim=-1):
        return real_gather(tensor.cpu(), group_, dim).to(tensor.device)

    ids = torch.arange(6).reshape(2, 3)
    seen = []
    with mock.patch.object(agreement.comm, "all_gather", gather_over_gloo):
        for step in range(4):
            labels = ids + (group.rank if step == 0 else 0)   # only step 0's labels differ
            try:
                model(ids.to(device), labels=labels.to(device))
                seen.append(None)
            except DivergenceError as e:
                seen.append(str(e))
            torch_xla.sync()
    return seen


@pytest.mark.xla
def test_input_check_on_xla_reports_two_steps_later(worlds):
    results = worlds(2, "xla-input-check").run(case_input_check_on_xla_reports_two_steps_later,
                                               tensor_model_parallel_size=2)
    assert results[0] == results[1], results
    assert results[0][:2] == [None, None] and results[0][3] is None, results
    assert "'labels'" in results[0][2] and "step" in results[0][2], results


# ---- 4. copies keep what clip_grad_norm and checkpoints need --------------------------------------------------------

def _saved_contents(tag_dir: str) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for name in sorted(os.listdir(os.path.join(tag_dir, "model"))):
        tensors.update({f"{name}:{k}": v for k, v in load_file(os.path.join(tag_dir, "model", name)).items()})
    with open(os.path.join(tag_dir, "nxdtp_index.json")) as f:
        index = json.load(f)
    return dict(tensors=tensors, specs=index["tensors"])


def case_copies_keep_tp_attributes(root: str):
    from nxdtp import checkpointing

    group = ps.tensor_parallel_group()
    dense = _llama()
    model = parallelize_model(copy.deepcopy(dense), sequence_parallel=True, make_vocab_size_divisible_by=8)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = {"original": model, "deepcopy": copy.deepcopy(model), "torch.load": torch.load(buffer, weights_only=False)}
    attributes = ("tensor_model_parallel", "partition_dim", "partition_stride", "num_partitions",
                  "sequence_parallel_enabled", "num_replicas")
    batch = _llama_batch(seed=12)
    dense(**batch).loss.backward()
    norms, saved = {}, {}
    for how, other in copies.items():
        for (name, p), q in zip(model.named_parameters(), other.parameters()):
            assert {a: getattr(q, a, None) for a in attributes} == {a: getattr(p, a, None) for a in attributes}, \
                f"{how}: {name} lost its TP attributes"
        other(**batch).loss.backward()
        norms[how] = clip_grad_norm(other.parameters(), max_norm=1e9).item()
        tag = checkpointing.save({"model": other, "global_step": 1}, os.path.join(root, how.replace(".", "_")))
        saved[how] = _saved_contents(tag)
    dense_norm = _dense_grad_norm(dense)
    for how in copies:
        assert abs(norms[how] - dense_norm) <= 1e-5 * dense_norm, (how, norms, dense_norm)
        assert saved[how]["specs"] == saved["original"]["specs"], how
        assert saved[how]["tensors"].keys() == saved["original"]["tensors"].keys(), how
        for key, value in saved["original"]["tensors"].items():
            assert torch.equal(saved[how]["tensors"][key], value), (how, key)
    return group.rank, norms


def test_deepcopy_and_pickle_keep_grad_norm_and_checkpoint(worlds, tmp_path):
    results = worlds(2).run(case_copies_keep_tp_attributes, tensor_model_parallel_size=2, root=str(tmp_path))
    assert results[0][1] == results[1][1], results
