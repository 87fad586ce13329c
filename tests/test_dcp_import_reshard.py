"""``nxdtp-merge DCP_DIR OUT --from-dcp --reshard N`` (issue 27, item 2): a native job's DCP checkpoint into an nxdtp
sharded checkpoint at TP size N, optimizer included.

A DTensor TP=2 job (tests/test_dcp_bridge.py's: a randomised Llama with one KV head for four query heads, every
parameter randomised, norms included, an odd vocabulary) takes one AdamW step and ``dcp.save``s the model and the
flattened optimizer state in TorchTitan's layout. The import at TP 2 and 4 is loaded by ``nxdtp.checkpointing.load``
into an nxdtp model and AdamW built from other weights and hyperparameters at that TP size: the logits must equal the
dense model's after the same step, each rank's exp_avg / exp_avg_sq the dense optimizer's cut by the parameter's
layout, and the step and scheduler come across. Bad input exits with status 2, one line, nothing written.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.test_dcp_bridge import (
    LLAMA_VOCAB,
    LR,
    _cli,
    _close,
    _llama,
    _llama_batch,
    _logits,
    _step,
    case_dtensor_job_saves,
)

transformers = pytest.importorskip("transformers")


def case_load_resharded(checkpoint: str):
    """nxdtp at this world's TP size loads the resharded import into a model and AdamW of other weights and
    hyperparameters; returns the gathered logits, and checks the moments against a dense AdamW's after one step."""
    from nxdtp import checkpointing
    from nxdtp import parallel_state as ps
    from nxdtp.checkpointing.save_load import sharding_specs
    from nxdtp.models import parallelize_model

    tp, rank = ps.get_tensor_model_parallel_size(), ps.get_tensor_model_parallel_rank()
    model = parallelize_model(_llama(seed=99), make_vocab_size_divisible_by=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR * 10, weight_decay=0.5)
    state = checkpointing.load(checkpoint, model=model, optimizer=optimizer)
    assert state["global_step"] == 1 and state["scheduler"] == {"last_epoch": 1}, state
    assert all(g["lr"] == LR and g["weight_decay"] == 0.01 for g in optimizer.param_groups), optimizer.param_groups

    reference = _llama(seed=0)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01)
    _step(reference, reference_optimizer, _llama_batch())
    reference_params = dict(reference.named_parameters())
    specs = sharding_specs(model, tp)
    checked = 0
    for name, param in model.named_parameters():
        theirs = reference_optimizer.state[reference_params[name]]
        mine = optimizer.state[param]
        assert float(mine["step"]) == float(theirs["step"]) == 1.0, name
        for field in ("exp_avg", "exp_avg_sq"):
            spec = specs.get(id(param))
            expected = spec.shard(theirs[field], rank) if spec is not None else theirs[field]
            _close(mine[field], expected, f"tp={tp} rank {rank} {name} {field}")
            checked += 1
    return {"logits": _logits(model, _llama_batch(), LLAMA_VOCAB)[0], "checked": checked,
            "kv_rows": model.model.layers[0].self_attn.k_proj.weight.shape[0]}


@pytest.fixture(scope="module")
def native_checkpoint(worlds, tmp_path_factory):
    checkpoint = str(tmp_path_factory.mktemp("dcp_reshard") / "native")
    worlds(2).run(case_dtensor_job_saves, tensor_model_parallel_size=None, checkpoint=checkpoint)
    return checkpoint


def _dense_logits():
    reference = _llama(seed=0)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01)
    _step(reference, optimizer, _llama_batch())
    return _logits(reference, _llama_batch())[0]


@pytest.mark.parametrize("tp", [2, 4])
def test_dcp_import_resharded_loads_into_nxdtp_with_its_optimizer(worlds, native_checkpoint, tmp_path, capsys, tp):
    out = tmp_path / f"tp{tp}"
    status, stdout, err = _cli([native_checkpoint, out, "--from-dcp", "--reshard", tp], capsys)
    assert status == 0, err
    assert f"tensor_model_parallel_size={tp}" in stdout and "optimizer state in" in stdout, stdout
    assert sorted(os.listdir(tmp_path)) == [f"tp{tp}"]  # no temporaries left beside it
    assert (out / "newest").read_text().strip() == "step_000001"
    dense = _dense_logits()
    results = worlds(tp).run(case_load_resharded, tensor_model_parallel_size=tp, checkpoint=str(out))
    for rank, result in enumerate(results):
        assert result["checked"] == 2 * len(list(_llama(seed=0).parameters())), result["checked"]
        # one KV head (8 rows) repeated on every rank
        assert result["kv_rows"] == 8, result["kv_rows"]
        _close(result["logits"], dense, f"tp={tp} rank {rank} logits")


def case_fsdp2_job_saves(checkpoint: str):
    """A native FSDP2 job over this world (every parameter cut along dim 0 across the ranks, so the saved chunks are
    row blocks): the dense Llama, one AdamW step on the same batch everywhere (FSDP2's average is that batch's
    gradient), then ``dcp.save`` of the model, the flattened optimizer state and TorchTitan's step and scheduler."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.test_dcp_bridge import _flat_options

    model = _llama(seed=0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, foreach=False)
    _step(model, optimizer, _llama_batch())
    dcp.save({**model.state_dict(), "optimizer": get_optimizer_state_dict(model, optimizer, options=_flat_options()),
              "lr_scheduler": {"last_epoch": 1}, "train_state": {"step": 1}}, checkpoint_id=checkpoint)
    if dist.get_rank() == 0:
        model.config.architectures = ["LlamaForCausalLM"]
        model.config.save_pretrained(checkpoint)


def _count_box_reads(monkeypatch):
    """The keys of every ``DcpReader.read_boxes`` call, in order."""
    from nxdtp.checkpointing import dcp_io

    boxes = []
    read_boxes = dcp_io.DcpReader.read_boxes
    monkeypatch.setattr(dcp_io.DcpReader, "read_boxes",
                        lambda self, key, wanted: boxes.append(key) or read_boxes(self, key, wanted))
    return boxes


def test_an_fsdp2_jobs_checkpoint_imports_resharded_in_bounded_slabs(worlds, tmp_path, capsys, monkeypatch):
    """An FSDP2 job's own save (row blocks of every tensor over 2 ranks: the embedding's 101 rows as 51 + 50) with
    ``--reshard 4`` and the import's read budget lowered to 8 KiB, under the embedding (12.6 KiB) and over its saved
    blocks, so each TP piece of it is read in its own box reads, some across the blocks' edge: nxdtp at TP 4 loads the
    dense model's logits after the step and the dense AdamW's moments cut by each layout."""
    from nxdtp.checkpointing import dcp_import

    checkpoint = str(tmp_path / "fsdp2")
    worlds(2).run(case_fsdp2_job_saves, tensor_model_parallel_size=None, checkpoint=checkpoint)
    monkeypatch.setattr(dcp_import, "BATCH_BYTES", 8192)
    boxes = _count_box_reads(monkeypatch)
    status, out, err = _cli([checkpoint, tmp_path / "out", "--from-dcp", "--reshard", 4], capsys)
    assert status == 0 and "optimizer state in 4 files" in out, err
    assert boxes.count("model.embed_tokens.weight") == 4 and "optimizer.state.lm_head.weight.exp_avg" in boxes
    dense = _dense_logits()
    for rank, result in enumerate(worlds(4).run(case_load_resharded, tensor_model_parallel_size=4,
                                                checkpoint=str(tmp_path / "out"))):
        _close(result["logits"], dense, f"rank {rank} logits")


def test_dcp_import_reshard_bad_arguments_exit_2_and_write_nothing(native_checkpoint, tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    status, out, err = _cli([native_checkpoint, tmp_path / "out", "--from-dcp", "--reshard", 0], capsys)
    assert status == 2 and out == "" and err.count("\n") == 1 and "--reshard 0" in err, err
    model = _llama(seed=0)
    partial = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    dcp.save(partial, checkpoint_id=str(tmp_path / "partial"), no_dist=True)
    model.config.architectures = ["LlamaForCausalLM"]
    model.config.save_pretrained(tmp_path / "partial")
    status, out, err = _cli([tmp_path / "partial", tmp_path / "out", "--from-dcp", "--reshard", 2], capsys)
    assert status == 2 and out == "" and err.count("\n") == 1, err
    assert "lacks tensors the model needs: ['lm_head.weight']" in err, err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("old")
    status, out, err = _cli([native_checkpoint, busy, "--from-dcp", "--reshard", 2], capsys)
    assert status == 2 and err.count("\n") == 1 and "not empty" in err, err
    assert os.listdir(busy) == ["keep.txt"]
    distilbert = transformers.DistilBertModel(transformers.DistilBertConfig(
        vocab_size=50, dim=16, hidden_dim=32, n_layers=1, n_heads=2, max_position_embeddings=16))
    dcp.save(dict(distilbert.state_dict()), checkpoint_id=str(tmp_path / "unplanned"), no_dist=True)
    distilbert.config.architectures = ["DistilBertModel"]
    distilbert.config.save_pretrained(tmp_path / "unplanned")
    status, out, err = _cli([tmp_path / "unplanned", tmp_path / "out", "--from-dcp", "--reshard", 2], capsys)
    assert status == 2 and out == "" and err.count("\n") == 1, err
    assert "cannot shard DistilBertModel" in err and "import without --reshard" in err, err
    status, out, err = _cli([native_checkpoint, tmp_path / "out", "--from-dcp", "--pad-to-multiple-of", 4], capsys)
    assert status == 2 and err.count("\n") == 1 and "--pad-to-multiple-of without --reshard" in err, err
    assert sorted(os.listdir(tmp_path)) == ["busy", "partial", "unplanned"]


def test_dcp_import_reshard_of_a_model_without_optimizer_state(tmp_path, capsys):
    """A DCP checkpoint of the model alone gives a checkpoint without optimizer state, padded as asked."""
    import json

    import torch.distributed.checkpoint as dcp

    model = _llama(seed=3)
    dcp.save(dict(model.state_dict()), checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    model.config.architectures = ["LlamaForCausalLM"]
    model.config.save_pretrained(tmp_path / "dcp")
    status, out, err = _cli([tmp_path / "dcp", tmp_path / "out", "--from-dcp", "--reshard", 2,
                             "--pad-to-multiple-of", 4], capsys)
    assert status == 0, err
    assert "no optimizer state" in out and "padded to a multiple of 4 * 2" in out, out
    tag = (tmp_path / "out" / "newest").read_text().strip()
    with open(tmp_path / "out" / tag / "nxdtp_index.json") as f:
        index = json.load(f)
    assert index["tensor_model_parallel_size"] == 2 and index.get("optimizer") is None
    assert index["tensors"]["model.embed_tokens.weight"]["spec"]["full_shape"][0] == 104  # 101 -> 8 * 13
    assert sorted(os.listdir(tmp_path)) == ["dcp", "out"]


def _dcp_with_optimizer(directory, optimizer_class, drop=(), **kwargs):
    """A single-process job's dcp.save of the Llama and its optimizer after one step, less the hyperparameters in
    ``drop`` (as an older torch wrote them)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    model = _llama(seed=4)
    optimizer = optimizer_class(model.parameters(), **kwargs)
    _step(model, optimizer, _llama_batch())
    flat = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    flat = {k: v for k, v in flat.items() if k.rsplit(".", 1)[1] not in drop}
    dcp.save({**model.state_dict(), "optimizer": flat}, checkpoint_id=str(directory), no_dist=True)
    model.config.architectures = ["LlamaForCausalLM"]
    model.config.save_pretrained(directory)


def case_load_optimizer_kind(checkpoint: str, optimizer_class: str, kwargs: dict):
    """nxdtp at this world's TP size loads the import into a model and an optimizer of ``optimizer_class`` with other
    weights and a wrong learning rate: every group's hyperparameters and every state field must be the dense
    optimizer's after the step ``_dcp_with_optimizer`` took (fields shaped like their parameter cut by its layout);
    returns the gathered logits."""
    from nxdtp import checkpointing
    from nxdtp import parallel_state as ps
    from nxdtp.checkpointing.save_load import sharding_specs
    from nxdtp.models import parallelize_model

    tp, rank = ps.get_tensor_model_parallel_size(), ps.get_tensor_model_parallel_rank()
    model = parallelize_model(_llama(seed=99), make_vocab_size_divisible_by=1)
    optimizer = getattr(torch.optim, optimizer_class)(model.parameters(), **{**kwargs, "lr": LR * 10})
    checkpointing.load(checkpoint, model=model, optimizer=optimizer)
    reference = _llama(seed=4)
    reference_optimizer = getattr(torch.optim, optimizer_class)(reference.parameters(), **kwargs)
    _step(reference, reference_optimizer, _llama_batch())
    assert len(optimizer.param_groups) == 1
    mine = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    theirs = {k: v for k, v in reference_optimizer.param_groups[0].items() if k != "params"}
    assert mine == theirs, (mine, theirs)
    reference_params = dict(reference.named_parameters())
    specs = sharding_specs(model, tp)
    fields = set()
    for name, param in model.named_parameters():
        expected_state = reference_optimizer.state[reference_params[name]]
        assert set(optimizer.state[param]) == set(expected_state), name
        for field, expected in expected_state.items():
            spec = specs.get(id(param))
            if spec is not None and tuple(expected.shape) == tuple(reference_params[name].shape):
                expected = spec.shard(expected, rank)
            _close(optimizer.state[param][field], expected, f"tp={tp} rank {rank} {name} {field}")
            fields.add(field)
    return {"logits": _logits(model, _llama_batch(), LLAMA_VOCAB)[0], "fields": sorted(fields)}


@pytest.mark.parametrize("optimizer_class, kwargs, drop, fields", [
    # AdamW as torch < 2.6 saved it: without the hyperparameters it added, which keep the loading AdamW's own values
    ("AdamW", {"lr": LR, "weight_decay": 0.1}, ("decoupled_weight_decay", "fused"), ["exp_avg", "exp_avg_sq", "step"]),
    ("SGD", {"lr": LR, "momentum": 0.9, "weight_decay": 0.01}, (), ["momentum_buffer"]),
    ("Adagrad", {"lr": LR, "lr_decay": 0.01}, (), ["step", "sum"]),
])
def test_dcp_import_reshard_any_torch_optimizer(worlds, tmp_path, capsys, optimizer_class, kwargs, drop, fields):
    """Whatever torch optimizer saved the state (nothing is rebuilt: its groups and every state field come across),
    loaded into the same class at TP 2 equals the dense optimizer's state after its step, and the model its logits."""
    _dcp_with_optimizer(tmp_path / "dcp", getattr(torch.optim, optimizer_class), drop=drop, **kwargs)
    status, out, err = _cli([tmp_path / "dcp", tmp_path / "out", "--from-dcp", "--reshard", 2], capsys)
    assert status == 0 and "optimizer state in 2 files" in out, err
    reference = _llama(seed=4)
    _step(reference, getattr(torch.optim, optimizer_class)(reference.parameters(), **kwargs), _llama_batch())
    dense = _logits(reference, _llama_batch())[0]
    results = worlds(2).run(case_load_optimizer_kind, tensor_model_parallel_size=2, checkpoint=str(tmp_path / "out"),
                            optimizer_class=optimizer_class, kwargs=kwargs)
    for rank, result in enumerate(results):
        assert result["fields"] == fields, result["fields"]
        _close(result["logits"], dense, f"{optimizer_class} rank {rank} logits")
    assert sorted(os.listdir(tmp_path)) == ["dcp", "out"]


def test_a_tensor_saved_in_chunks_over_the_budget_is_read_once(tmp_path, capsys, monkeypatch):
    """A one-process save holds each tensor in one chunk, which a DCP read loads whole whatever part of it is asked
    for: with the budget lowered under it, the resharding import reads such a tensor whole once instead of once per
    slab, and the result is that of the default budget, bitwise."""
    from safetensors.torch import load_file

    from nxdtp.checkpointing import dcp_import, dcp_io
    from nxdtp.checkpointing.index import model_file, optim_file

    _dcp_with_optimizer(tmp_path / "dcp", torch.optim.AdamW, lr=LR)
    status, out, err = _cli([tmp_path / "dcp", tmp_path / "default", "--from-dcp", "--reshard", 2], capsys)
    assert status == 0, err
    monkeypatch.setattr(dcp_import, "BATCH_BYTES", 512)
    boxes = _count_box_reads(monkeypatch)
    reads = []
    read = dcp_io.DcpReader.read
    monkeypatch.setattr(dcp_io.DcpReader, "read", lambda self, wanted: reads.extend(wanted) or read(self, wanted))
    status, out, err = _cli([tmp_path / "dcp", tmp_path / "small", "--from-dcp", "--reshard", 2], capsys)
    assert status == 0, err
    embedding_reads = reads.count("model.embed_tokens.weight")
    assert boxes == [] and embedding_reads == 1, (boxes, embedding_reads)
    tag = (tmp_path / "default" / "newest").read_text().strip()
    for relative in [model_file(r) for r in range(2)] + [optim_file(r) for r in range(2)]:
        want, got = load_file(tmp_path / "default" / tag / relative), load_file(tmp_path / "small" / tag / relative)
        assert sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want), relative


@pytest.mark.parametrize("optimizer_class, kwargs, message", [
    # Adafactor's row and column factors of a matrix have no layout to cut by
    ("Adafactor", {"lr": LR}, "cannot be cut by the parameter's tensor-parallel layout"),
    # the groups are written as JSON
    ("Adam", {"lr": torch.tensor(LR), "foreach": False}, "is a DenseOptimizerTensor, not a plain value"),
])
def test_dcp_import_reshard_refuses_state_it_cannot_carry(tmp_path, capsys, optimizer_class, kwargs, message):
    """Optimizer state it could only carry wrongly is refused: exit status 2, one line naming the entry, nothing
    written."""
    _dcp_with_optimizer(tmp_path / "dcp", getattr(torch.optim, optimizer_class), **kwargs)
    status, out, err = _cli([tmp_path / "dcp", tmp_path / "out", "--from-dcp", "--reshard", 2], capsys)
    assert status == 2 and out == "" and err.count("\n") == 1, err
    assert message in err and "optimizer." in err and "import without --reshard" in err, err
    assert sorted(os.listdir(tmp_path)) == ["dcp"]
