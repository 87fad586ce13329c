"""The bridge to torch.distributed.checkpoint (DCP): ``nxdtp-merge CKPT OUT --to dcp`` (issue 27, first stage).

A tp=2 Llama (grouped-query attention with one KV head, so it is repeated on both ranks; an odd vocabulary padded by
``make_vocab_size_divisible_by``) and a tp=2 BERT (tied decoder weight and bias, padded vocabulary) are trained one
AdamW step with nxdtp, saved with ``nxdtp.checkpointing.save`` and exported to DCP. ``dcp.load`` must then fill a dense
HF model's state_dict and a dense AdamW's flattened state (``get_optimizer_state_dict(...,
flatten_optimizer_state_dict=True)`` under ``optimizer``) in one process: the same logits as the gathered TP logits,
the same moments as a dense reference step, and one more dense step equal to nxdtp's own next step. The export's keys
and global shapes must be exactly those torch's own ``dcp.save`` writes for the dense model and optimizer. A
hand-made checkpoint with fused (stride 3), dim-1 strided, padded and bf16/int64 tensors checks the chunk arithmetic
without a model; bad input exits with status 2, one line, nothing written.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.harness import WorkerGroup  # noqa: F401  (the worlds fixture lives in conftest)

transformers = pytest.importorskip("transformers")

TOL = dict(rtol=1e-5, atol=1e-5)
LR = 1e-3
LLAMA_VOCAB, BERT_VOCAB, SEQ, BATCH = 101, 53, 8, 2


# ---- the layout algebra's chunks -------------------------------------------------------------------------------------

def _specs():
    from nxdtp.spec import ParamSpec

    return {
        "vocab padded": ParamSpec(full_shape=(8, 3), partition_dim=0, num_partitions=2, real_shape=(7, 3)),
        "fused stride 3": ParamSpec(full_shape=(12, 2), partition_dim=0, stride=3, num_partitions=2),
        "dim 1 stride 2": ParamSpec(full_shape=(2, 8), partition_dim=1, stride=2, num_partitions=2),
        "kv heads x2": ParamSpec(full_shape=(8, 3), partition_dim=0, num_partitions=2, real_shape=(4, 3), replicas=2,
                                 replica_block=2),
        "kv heads x4 tp4": ParamSpec(full_shape=(8, 3), partition_dim=0, num_partitions=4, real_shape=(2, 3),
                                     replicas=4, replica_block=1),
        "zero heads per group": ParamSpec(full_shape=(12, 2), partition_dim=0, num_partitions=2, real_shape=(8, 2),
                                          pad_block=2, pad_groups=2),
        "zero heads at the end": ParamSpec(full_shape=(8, 2), partition_dim=0, num_partitions=4, real_shape=(6, 2),
                                           pad_block=2),
    }


@pytest.mark.parametrize("name", list(_specs()))
def test_dense_runs_cover_every_dense_row_once(name):
    """Each rank's runs, read from its piece, rebuild ``dense_from_full`` exactly, and every dense row once."""
    from nxdtp.layers import shard_of

    spec = _specs()[name]
    dense = torch.randn(spec.unpadded_shape)
    full = spec.full_from_dense(dense)
    assert torch.equal(spec.dense_from_full(full), dense), name
    rebuilt = torch.full_like(dense, float("nan"))
    seen = torch.zeros(dense.shape[spec.partition_dim], dtype=torch.long)
    for rank in range(spec.num_partitions):
        piece = shard_of(full, spec.partition_dim, rank, spec.num_partitions, spec.stride)
        for start, length, dense_start in spec.dense_runs_of_piece(rank):
            rebuilt.narrow(spec.partition_dim, dense_start, length).copy_(piece.narrow(spec.partition_dim, start,
                                                                                     length))
            seen[dense_start:dense_start + length] += 1
    assert torch.equal(seen, torch.ones_like(seen)), (name, seen)
    assert torch.equal(rebuilt, dense), name


# ---- a hand-made checkpoint: fused, strided, padded, tied, bf16 and int64 tensors ------------------------------------

def _cli(argv, capsys):
    from nxdtp.cli import main

    status = main([str(a) for a in argv] + ["--no-progress"])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _load_dcp(directory, state_dict):
    import torch.distributed.checkpoint as dcp

    dcp.load(state_dict, checkpoint_id=str(directory), no_dist=True)
    return state_dict


def _metadata(directory):
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata


def test_export_of_strided_padded_tied_tensors_loads_dense(tmp_path, capsys):
    from tests.test_checkpoint_merge import _synthetic

    dense = _synthetic(str(tmp_path / "tp2"), tp=2)
    status, out, err = _cli([tmp_path / "tp2", tmp_path / "dcp", "--to", "dcp"], capsys)
    assert status == 0, err
    assert "wrote DCP checkpoint" in out and "no optimizer state" in out, out
    metadata = _metadata(tmp_path / "dcp")
    # Every name once, the tied alias too, with the dense (unpadded) shape and the saved dtype; and the step where
    # TorchTitan keeps it.
    assert set(metadata) == set(dense) | {"head.weight", "train_state.step", "train_state.ntokens_seen"}
    for key, value in list(dense.items()) + [("head.weight", dense["vocab.weight"])]:
        assert tuple(metadata[key].size) == tuple(value.shape) and metadata[key].properties.dtype == value.dtype, key
    # The fused (stride 3) weight is 6 chunks: no rank's piece is contiguous in the dense tensor.
    assert len(metadata["fused.weight"].chunks) == 6 and len(metadata["norm.weight"].chunks) == 1
    loaded = _load_dcp(tmp_path / "dcp", {key: torch.zeros_like(value) for key, value in dense.items()}
                       | {"head.weight": torch.zeros_like(dense["vocab.weight"])})
    for key, value in dense.items():
        assert torch.equal(loaded[key], value), key
    assert torch.equal(loaded["head.weight"], dense["vocab.weight"])


def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys):
    from tests.test_checkpoint_merge import _synthetic

    _synthetic(str(tmp_path / "tp2"), tp=2)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("old")
    status, out, err = _cli([tmp_path / "tp2", busy, "--to", "dcp"], capsys)
    assert status == 2 and out == "" and len(err.strip().splitlines()) == 1 and "not empty" in err, err
    assert os.listdir(busy) == ["keep.txt"]

    not_nxdtp = tmp_path / "not_nxdtp"
    not_nxdtp.mkdir()
    (not_nxdtp / "model.safetensors").write_bytes(b"\0" * 16)
    for source in (not_nxdtp, tmp_path / "missing"):
        status, out, err = _cli([source, tmp_path / "out", "--to", "dcp"], capsys)
        assert status == 2 and out == "" and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "out").exists()
    status, out, err = _cli([tmp_path / "tp2", tmp_path / "out", "--to", "dcp", "--reshard", "2"], capsys)
    assert status == 2 and len(err.strip().splitlines()) == 1 and "--reshard" in err, err
    assert sorted(os.listdir(tmp_path)) == ["busy", "not_nxdtp", "tp2"]


# ---- a trained tp=2 Llama and BERT, exported and loaded by a dense model and AdamW -----------------------------------

def _llama(seed):
    from tests.model_helpers import randomised

    config = transformers.LlamaConfig(
        vocab_size=LLAMA_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=64, rms_norm_eps=1e-6, attention_dropout=0.0,
        attention_bias=True, mlp_bias=True, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return randomised(transformers.LlamaForCausalLM(config), seed + 1)


def _llama_batch():
    g = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, LLAMA_VOCAB, (BATCH, SEQ), generator=g)
    input_ids[0, 3] = LLAMA_VOCAB - 1  # next to the vocabulary padding
    attention_mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    attention_mask[1, -2:] = 0
    return dict(input_ids=input_ids, attention_mask=attention_mask,
                labels=input_ids.masked_fill(attention_mask == 0, -100))


def _bert(seed):
    from tests.test_checkpoint_merge import _dense_randomised

    return _dense_randomised(seed)


def _bert_batch():
    from tests.test_checkpoint_merge import _batch

    return _batch()


FAMILIES = {
    # make_vocab_size_divisible_by=4: 101 rows padded to 104 at tp=2; one KV head, repeated on both ranks.
    "llama": (_llama, _llama_batch, 4),
    # 53 rows padded to 54; the MLM decoder weight and bias are tied to the word embeddings and cls.predictions.bias.
    "bert": (_bert, _bert_batch, 1),
}


def _logits(model, batch, tp_vocab=None):
    from nxdtp.models import gather_vocab_logits

    inputs = {k: v for k, v in batch.items() if k not in ("labels", "next_sentence_label")}
    with torch.no_grad():
        out = model(**inputs)
    if hasattr(out, "prediction_logits"):
        mlm = out.prediction_logits
        mlm = gather_vocab_logits(mlm, tp_vocab) if tp_vocab else mlm
        return [mlm.clone(), out.seq_relationship_logits.clone()]
    logits = gather_vocab_logits(out.logits, tp_vocab) if tp_vocab else out.logits
    return [logits.clone()]


def _step(model, optimizer, batch):
    model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _vocab(family):
    return LLAMA_VOCAB if family == "llama" else BERT_VOCAB


def case_train_save(family: str, root: str):
    """One AdamW step at tp=2, save; the gathered logits then, and after nxdtp's own next step."""
    import copy

    from nxdtp import checkpointing
    from nxdtp.models import parallelize_model

    make, batch_of, multiple = FAMILIES[family]
    model = parallelize_model(copy.deepcopy(make(seed=0)), make_vocab_size_divisible_by=multiple)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    batch = batch_of()
    _step(model, optimizer, batch)
    checkpointing.save({"model": model, "optimizer": optimizer, "global_step": 1}, root)
    saved = _logits(model, batch, _vocab(family))
    _step(model, optimizer, batch)
    return {"saved": saved, "after_step": _logits(model, batch, _vocab(family))}


@pytest.fixture(scope="module")
def trained(worlds, tmp_path_factory):
    results = {}
    for family in FAMILIES:
        root = str(tmp_path_factory.mktemp(f"{family}_tp2"))
        results[family] = (root, worlds(2).run(case_train_save, tensor_model_parallel_size=2, family=family,
                                               root=root)[0])
    return results


def _flat_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _native_state(model, optimizer):
    """What a native job hands to dcp.save / dcp.load: the model's keys at the top level, the flattened optimizer
    state under 'optimizer' (TorchTitan's layout)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return {**model.state_dict(), "optimizer": get_optimizer_state_dict(model, optimizer, options=_flat_options())}


def _index(root):
    import json

    with open(os.path.join(root, "step_000001", "nxdtp_index.json")) as f:
        return json.load(f)


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_loads_into_dense_model_and_adamw(trained, tmp_path, capsys, family):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    root, expected = trained[family]
    make, batch_of, _ = FAMILIES[family]
    batch = batch_of()
    # The traps are really there: padded vocabulary rows, and (Llama) the KV head repeated on both ranks.
    tensors = _index(root)["tensors"]
    embedding = "model.embed_tokens.weight" if family == "llama" else "bert.embeddings.word_embeddings.weight"
    assert tensors[embedding]["spec"]["full_shape"][0] > _vocab(family), tensors[embedding]
    if family == "llama":
        assert tensors["model.layers.0.self_attn.k_proj.weight"]["spec"]["replicas"] == 2
    out = tmp_path / "dcp"
    status, stdout, err = _cli([root, out, "--to", "dcp"], capsys)
    assert status == 0, err
    assert "optimizer entries under 'optimizer'" in stdout, stdout

    # The dense reference: the same weights, one dense AdamW step on the same batch.
    reference = make(seed=0)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01)
    _step(reference, reference_optimizer, batch)
    # The export holds exactly the keys, global shapes and dtypes torch's own dcp.save writes for the dense model and
    # its optimizer.
    dcp.save(_native_state(reference, reference_optimizer), checkpoint_id=str(tmp_path / "native"), no_dist=True)
    ours, native = _metadata(out), _metadata(tmp_path / "native")
    # ... plus the step where TorchTitan keeps it (no scheduler was saved here, so no 'lr_scheduler')
    assert sorted(ours) == sorted(list(native) + ["train_state.ntokens_seen", "train_state.step"])
    step = {"train_state.step": None}
    dcp.load(step, checkpoint_id=str(out), no_dist=True)
    assert step["train_state.step"] == 1
    for key, meta in native.items():
        assert type(ours[key]) is type(meta), key
        if isinstance(meta, TensorStorageMetadata):
            assert ours[key].size == meta.size and ours[key].properties.dtype == meta.properties.dtype, key

    # Another model and optimizer (other weights, other hyperparameters) load it: the checkpoint's values win.
    model = make(seed=99)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR * 10, weight_decay=0.5)
    state = _native_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(out), no_dist=True)
    model.load_state_dict({k: v for k, v in state.items() if k != "optimizer"})
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=_flat_options())
    for index, actual in enumerate(_logits(model, batch)):
        _close(actual, expected["saved"][index], f"{family} output {index} after dcp.load")
    reference_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        mine, theirs = optimizer.state[param], reference_optimizer.state[reference_params[name]]
        assert sorted(mine) == sorted(theirs), name
        for field in theirs:
            _close(mine[field], theirs[field], f"{family} {name} {field}")
    for group in optimizer.param_groups:
        assert group["lr"] == LR and group["weight_decay"] == 0.01 and group["betas"] == (0.9, 0.999), group

    # One more dense step equals nxdtp's own next step.
    _step(model, optimizer, batch)
    for index, actual in enumerate(_logits(model, batch)):
        _close(actual, expected["after_step"][index], f"{family} output {index} after a dense step")


# ---- DTensor tensor parallelism at another TP size -------------------------------------------------------------------

def case_dtensor_tp_load(checkpoint: str):
    """A dense Llama parallelized with DTensor TP over this gloo world (embedding row-wise, MLP column/row-wise, the LM
    head column-wise; attention stays replicated, as one KV head cannot be split) loads the export with dcp.load."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _llama(seed=99)
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for layer in range(len(model.model.layers)):
        plan.update({f"model.layers.{layer}.mlp.gate_proj": ColwiseParallel(),
                     f"model.layers.{layer}.mlp.up_proj": ColwiseParallel(),
                     f"model.layers.{layer}.mlp.down_proj": RowwiseParallel()})
    parallelize_module(model, mesh, plan)
    state = model.state_dict()
    sharded = sorted(k for k, v in state.items() if isinstance(v, DTensor))
    dcp.load(state, checkpoint_id=checkpoint)
    return {"sharded": sharded, "local_vocab_rows": model.lm_head.weight.to_local().shape[0],
            "logits": _logits(model, _llama_batch())}


@pytest.mark.slow
@pytest.mark.newest_torch  # two gloo pools: the tp=2 training and the DTensor world of 4
def test_export_loads_into_dtensor_tp_at_another_size(worlds, trained, tmp_path, capsys):
    root, expected = trained["llama"]
    out = tmp_path / "dcp"
    status, _, err = _cli([root, out, "--to", "dcp"], capsys)
    assert status == 0, err
    results = worlds(4).run(case_dtensor_tp_load, tensor_model_parallel_size=None, checkpoint=str(out))
    assert "lm_head.weight" in results[0]["sharded"] and len(results[0]["sharded"]) >= 14, results[0]["sharded"]
    # 101 rows over 4 ranks, unpadded, cut as torch.chunk cuts them.
    assert [r["local_vocab_rows"] for r in results] == [26, 26, 26, 23]
    for rank, result in enumerate(results):
        _close(result["logits"][0], expected["saved"][0], f"DTensor TP=4 rank {rank} logits")


# ---- import: nxdtp-merge DCP_DIR OUT --from-dcp ----------------------------------------------------------------------

def test_export_then_import_gives_back_the_merged_model_and_optimizer(trained, tmp_path, capsys):
    """nxdtp -> DCP -> dense HF: the same tensors as a plain merge of the nxdtp checkpoint, and the same optimizer
    state (loaded into torch AdamW on the dense model: equal moments, equal next step)."""
    from safetensors.torch import load_file

    from nxdtp.checkpointing import load_dense_optimizer_state

    root, expected = trained["llama"]
    for argv in ([root, tmp_path / "dcp", "--to", "dcp"], [root, tmp_path / "merged"],
                 [tmp_path / "dcp", tmp_path / "imported", "--from-dcp"]):
        status, out, err = _cli(argv, capsys)
        assert status == 0, err
    assert "optimizer entries in optimizer.safetensors" in out, out
    imported, merged = load_file(tmp_path / "imported" / "model.safetensors"), load_file(
        tmp_path / "merged" / "model.safetensors")
    assert sorted(imported) == sorted(merged)
    for key in merged:
        assert torch.equal(imported[key], merged[key]), key
    assert load_file(tmp_path / "imported" / "optimizer.safetensors").keys() == load_file(
        tmp_path / "merged" / "optimizer.safetensors").keys()

    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "imported")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR * 10, weight_decay=0.5)
    state = load_dense_optimizer_state(str(tmp_path / "imported"), model, optimizer)
    assert state["global_step"] == 1  # the trainer state travels through the export record
    assert all(g["lr"] == LR and g["weight_decay"] == 0.01 for g in optimizer.param_groups)
    _step(model, optimizer, _llama_batch())
    _close(_logits(model, _llama_batch())[0], expected["after_step"][0], "logits after a dense step from the import")


def case_dtensor_job_saves(checkpoint: str):
    """A native job: a dense Llama parallelized with DTensor TP over this world (MLP column/row-wise, the LM head
    column-wise with a replicated output), one AdamW step, then ``dcp.save`` of the model and the flattened optimizer
    state, as TorchTitan lays them out. Returns the logits after the step."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _llama(seed=0)
    plan = {"lm_head": ColwiseParallel(output_layouts=Replicate())}
    for layer in range(len(model.model.layers)):
        plan.update({f"model.layers.{layer}.mlp.gate_proj": ColwiseParallel(),
                     f"model.layers.{layer}.mlp.up_proj": ColwiseParallel(),
                     f"model.layers.{layer}.mlp.down_proj": RowwiseParallel()})
    parallelize_module(model, init_device_mesh("cpu", (dist.get_world_size(),)), plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, foreach=False)
    _step(model, optimizer, _llama_batch())
    state = {**model.state_dict(),
             "optimizer": get_optimizer_state_dict(model, optimizer, options=_flat_options()),
             "lr_scheduler": {"last_epoch": 1}, "train_state": {"step": 1, "ntokens_seen": 32}}  # TorchTitan's
    dcp.save(state, checkpoint_id=checkpoint)
    if dist.get_rank() == 0:
        model.config.architectures = ["LlamaForCausalLM"]  # as the job's from_pretrained config names it
        model.config.save_pretrained(checkpoint)
    return _logits(model, _llama_batch())[0]


def case_nxdtp_continues_from_import(directory: str):
    """nxdtp at this world's TP size loads the imported directory and its optimizer state, and takes the next step."""
    from nxdtp.checkpointing import load_dense_optimizer_state
    from nxdtp.models import from_pretrained_sharded

    model = from_pretrained_sharded(directory, transformers.LlamaForCausalLM)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR * 10, weight_decay=0.5)
    state = load_dense_optimizer_state(directory, model, optimizer)
    assert state == {"global_step": 1, "scheduler": {"last_epoch": 1}}, state  # from TorchTitan's places
    reference = _llama(seed=0)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01)
    _step(reference, reference_optimizer, _llama_batch())
    logits = _logits(model, _llama_batch(), LLAMA_VOCAB)[0]
    check_next_adam_step(model, optimizer, reference, reference_optimizer, _llama_batch(),
                         "nxdtp's step after importing the DTensor job's checkpoint")
    return logits


def check_next_adam_step(model, optimizer, reference, reference_optimizer, batch, what: str) -> None:
    """The loaded AdamW moments, the next step's gradients (all-reduced over DP: every rank has the same batch) and
    the weights after it, against a dense model and AdamW one step ahead.

    Moments and gradients are held to 1e-5. Adam divides each gradient by the root of its second moment, which turns
    last-bit differences of a gradient near zero into differences of a few percent of the learning rate (they differ
    between CPU models), so the weights after the step are held to LR/10: a moment lost in loading would move them
    by about LR."""
    from nxdtp.grads import allreduce_gradients
    from tests.test_models_bert import _check_grads, _check_tensors, _check_weights

    moments = {**reference_optimizer.state, **optimizer.state}  # keyed by parameter: either model's
    for field in ("exp_avg", "exp_avg_sq"):
        _check_tensors(model, reference, lambda p: moments[p][field], TOL, f"{what}: the loaded {field}")
    model(**batch).loss.backward()
    allreduce_gradients(model)
    reference(**batch).loss.backward()
    _check_grads(model, reference, what)
    optimizer.step()
    reference_optimizer.step()
    _check_weights(model, reference, what, dict(rtol=1e-5, atol=LR / 10))


def test_a_dtensor_jobs_checkpoint_imports_into_nxdtp_at_another_tp_size(worlds, tmp_path, capsys):
    """DTensor TP=2 job -> dcp.save -> --from-dcp -> nxdtp at TP=4 (from_pretrained_sharded,
    load_dense_optimizer_state): the logits of the job after its step, and nxdtp's next step equal to two dense
    steps (so the moments came across: Adam's second step depends on them)."""
    checkpoint = str(tmp_path / "native")
    job_logits = worlds(2).run(case_dtensor_job_saves, tensor_model_parallel_size=None, checkpoint=checkpoint)[0]
    status, out, err = _cli([checkpoint, tmp_path / "imported", "--from-dcp"], capsys)
    assert status == 0, err
    for rank, logits in enumerate(worlds(4).run(case_nxdtp_continues_from_import, tensor_model_parallel_size=4,
                                                directory=str(tmp_path / "imported"))):
        _close(logits, job_logits, f"nxdtp TP=4 rank {rank} logits after the import")


def test_import_refuses_what_is_not_a_dcp_checkpoint_of_the_model(trained, tmp_path, capsys):
    """Exit status 2, one line naming the problem, nothing written."""
    import torch.distributed.checkpoint as dcp

    root, _ = trained["llama"]
    status, out, err = _cli([root, tmp_path / "out", "--from-dcp"], capsys)  # an nxdtp checkpoint, not DCP
    assert status == 2 and "is not a torch.distributed.checkpoint directory" in err and err.count("\n") == 1, err
    model = _llama(seed=0)
    partial = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    dcp.save(partial, checkpoint_id=str(tmp_path / "partial"), no_dist=True)
    status, _, err = _cli([tmp_path / "partial", tmp_path / "out", "--from-dcp"], capsys)
    assert status == 2 and "config.json is missing" in err, err
    model.config.save_pretrained(tmp_path / "partial")
    status, _, err = _cli([tmp_path / "partial", tmp_path / "out", "--from-dcp"], capsys)
    assert status == 2 and "names no model class" in err and "architectures" in err, err
    model.config.architectures = ["LlamaForCausalLM"]
    model.config.save_pretrained(tmp_path / "partial")
    status, _, err = _cli([tmp_path / "partial", tmp_path / "out", "--from-dcp"], capsys)
    assert status == 2 and "lacks tensors the model needs: ['lm_head.weight']" in err, err
    renamed = {("tok_embeddings.weight" if k == "model.embed_tokens.weight" else k): v
               for k, v in model.state_dict().items()}
    dcp.save(renamed, checkpoint_id=str(tmp_path / "titan"), no_dist=True)
    model.config.save_pretrained(tmp_path / "titan")
    status, _, err = _cli([tmp_path / "titan", tmp_path / "out", "--from-dcp"], capsys)
    assert status == 2 and "holds tensors the model does not have: ['tok_embeddings.weight']" in err, err
    status, _, err = _cli([tmp_path / "titan", tmp_path / "out", "--from-dcp", "--reshard", "2"], capsys)
    assert status == 2 and "holds tensors the model does not have" in err and err.count("\n") == 1, err
    status, _, err = _cli([tmp_path / "titan", tmp_path / "out", "--from-dcp", "--format", "bin"], capsys)
    assert status == 2 and "--from-dcp takes no --format" in err, err
    assert not (tmp_path / "out").exists()
    assert sorted(os.listdir(tmp_path)) == ["partial", "titan"]  # no temporaries of --reshard left either


# ---- FSDP2, 2-D TP x FSDP2 and transformers' own TP load the export --------------------------------------------------

def _native_load(model, optimizer, checkpoint: str) -> None:
    """What a native job does to resume: dcp.load into its own state dict (sharded DTensors, filled in place), then
    the optimizer's flattened state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    state = _native_state(model, optimizer)
    dcp.load(state, checkpoint_id=checkpoint)
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=_flat_options())


def case_fsdp2_load(checkpoint: str, tp: int):
    """The dense Llama sharded by FSDP2 over this world (tp=1), or by DTensor TP over pairs of ranks and FSDP2 over the
    other mesh dimension (tp=2, a 2-D mesh), loads the export and takes one step natively."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _llama(seed=99)  # other weights: only the checkpoint can give the expected logits
    dp = dist.get_world_size() // tp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        plan = {"lm_head": ColwiseParallel(output_layouts=Replicate())}
        for layer in range(len(model.model.layers)):
            plan.update({f"model.layers.{layer}.mlp.gate_proj": ColwiseParallel(),
                         f"model.layers.{layer}.mlp.up_proj": ColwiseParallel(),
                         f"model.layers.{layer}.mlp.down_proj": RowwiseParallel()})
        parallelize_module(model, mesh["tp"], plan)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR * 10, weight_decay=0.5, foreach=False)
    _native_load(model, optimizer, checkpoint)
    saved = _logits(model, _llama_batch())[0]
    _step(model, optimizer, _llama_batch())  # every rank the same batch: FSDP2's gradient average is the batch's
    return {"saved": saved, "after_step": _logits(model, _llama_batch())[0],
            "lr": [g["lr"] for g in optimizer.param_groups]}


@pytest.mark.slow
@pytest.mark.newest_torch  # two gloo pools (2 and 4 ranks) beside the trained fixture's
@pytest.mark.parametrize("world,tp", [(2, 1), (4, 2)], ids=["fsdp2", "tp2xfsdp2"])
def test_export_loads_into_fsdp2_and_a_2d_mesh_and_continues_as_nxdtp(worlds, trained, tmp_path, capsys, world, tp):
    root, expected = trained["llama"]
    out = tmp_path / "dcp"
    status, _, err = _cli([root, out, "--to", "dcp"], capsys)
    assert status == 0, err
    for rank, result in enumerate(worlds(world).run(case_fsdp2_load, tensor_model_parallel_size=None,
                                                    checkpoint=str(out), tp=tp)):
        assert result["lr"] == [LR], result["lr"]
        _close(result["saved"], expected["saved"][0], f"rank {rank} logits after dcp.load")
        _close(result["after_step"], expected["after_step"][0], f"rank {rank} logits after a native step")


def _llama_mha(seed):
    """The Llama of this module with as many KV heads as query heads: transformers' own TP splits KV heads and needs
    TP to divide their count."""
    from tests.model_helpers import randomised

    config = _llama(seed).config
    config.num_key_value_heads = config.num_attention_heads
    torch.manual_seed(seed)
    return randomised(transformers.LlamaForCausalLM(config), seed + 1)


def case_train_save_mha(root: str):
    import copy

    from nxdtp import checkpointing
    from nxdtp.models import parallelize_model

    model = parallelize_model(copy.deepcopy(_llama_mha(seed=0)), make_vocab_size_divisible_by=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    _step(model, optimizer, _llama_batch())
    checkpointing.save({"model": model, "optimizer": optimizer, "global_step": 1}, root)
    return _logits(model, _llama_batch(), LLAMA_VOCAB)[0]


def case_transformers_tp_load(checkpoint: str, model_dir: str):
    """transformers' own tensor parallelism (``from_pretrained(..., tp_plan="auto")``, DTensor parameters) loads the
    export into the model it built from other weights."""
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, tp_plan="auto")
    sharded = sorted(k for k, v in model.state_dict().items() if type(v).__name__ == "DTensor")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR * 10, weight_decay=0.5, foreach=False)
    _native_load(model, optimizer, checkpoint)
    return {"sharded": sharded, "logits": _logits(model, _llama_batch())[0]}


@pytest.mark.slow
@pytest.mark.newest_torch  # a tp=2 nxdtp run and a transformers TP world
def test_export_loads_into_transformers_own_tensor_parallelism(worlds, tmp_path, capsys):
    import warnings

    root = str(tmp_path / "nxdtp")
    saved = worlds(2).run(case_train_save_mha, tensor_model_parallel_size=2, root=root)[0]
    status, _, err = _cli([root, tmp_path / "dcp", "--to", "dcp"], capsys)
    assert status == 0, err
    other = _llama_mha(seed=99)
    other.config.architectures = ["LlamaForCausalLM"]
    other.save_pretrained(tmp_path / "other")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # tp_plan= moves to distributed_config in later releases
        results = worlds(2).run(case_transformers_tp_load, tensor_model_parallel_size=None,
                                checkpoint=str(tmp_path / "dcp"), model_dir=str(tmp_path / "other"))
    assert "model.layers.0.self_attn.q_proj.weight" in results[0]["sharded"], results[0]["sharded"]
    for rank, result in enumerate(results):
        _close(result["logits"], saved, f"transformers TP rank {rank} logits after dcp.load")
