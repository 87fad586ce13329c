"""Merging and resharding sharded checkpoints (nxdtp.checkpointing.merge, the nxdtp-merge CLI).

A BERT trained two AdamW steps at tp=2 is saved (live objects and NxD's state-dict form), merged to a dense HF
checkpoint that ``from_pretrained`` must load to the same outputs, and resharded 2 -> 4 -> 1 (vocab 53: padded to 54,
56, then none), where a fresh model loads the checkpoint and the optimizer state to give the same outputs before and
after a third step. Damaged inputs must fail with exit status 2, a message naming the file and no output.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.harness import WorkerGroup  # noqa: F401  (the worlds fixture lives in conftest)

VOCAB = 53  # odd: padded to 54 at tp=2 and 56 at tp=4
TOL = dict(rtol=1e-5, atol=1e-5)
LR = 1e-3
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config():
    from transformers import BertConfig

    return BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, architectures=["BertForPreTraining"])


def _dense_randomised(seed):
    import torch
    from transformers import BertForPreTraining

    torch.manual_seed(seed)
    model = BertForPreTraining(_config())
    with torch.no_grad():
        for p in model.parameters():  # HF starts biases at 0 and LayerNorms at 1: that would hide bugs
            p.add_(torch.randn_like(p) * 0.2)
    return model


def _batch():
    import torch

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (2, 8), generator=g)
    labels = torch.full_like(ids, -100)
    labels[:, 1::3] = torch.randint(0, VOCAB, labels[:, 1::3].shape, generator=g)
    return dict(input_ids=ids, token_type_ids=torch.randint(0, 2, ids.shape, generator=g),
                attention_mask=torch.ones_like(ids), labels=labels,
                next_sentence_label=torch.randint(0, 2, (2,), generator=g))


def _inputs(batch):
    return {k: batch[k] for k in ("input_ids", "token_type_ids", "attention_mask")}


def _outputs(model, batch, gather=True):
    import torch

    from nxdtp.models.bert import gather_vocab_logits

    with torch.no_grad():
        out = model(**_inputs(batch))
    mlm = gather_vocab_logits(out.prediction_logits, VOCAB) if gather else out.prediction_logits
    return mlm.clone(), out.seq_relationship_logits.clone()


def _step(model, optimizer, batch):
    model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


# ---- multi-rank cases ------------------------------------------------------------------------------------------------

def case_train_and_save(root: str):
    """Train 2 AdamW steps at this TP degree, save in both forms, then report outputs before and after a third step."""
    import torch

    from nxdtp import checkpointing
    from nxdtp.models.bert import parallelize_bert

    model = parallelize_bert(_dense_randomised(seed=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    batch = _batch()
    for _ in range(2):
        _step(model, optimizer, batch)
    checkpointing.save({"model": model, "optimizer": optimizer, "global_step": 2}, os.path.join(root, "live"))
    checkpointing.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "global_step": 2},
                       os.path.join(root, "nxd"))
    saved = _outputs(model, batch)
    _step(model, optimizer, batch)
    return {"saved": saved, "after_step": _outputs(model, batch)}


def case_load_resharded(checkpoint_dir: str):
    """A fresh model at this degree (other weights) loads the checkpoint; return outputs before and after a step."""
    import torch

    from nxdtp import checkpointing
    from nxdtp.models.bert import parallelize_bert

    model = parallelize_bert(_dense_randomised(seed=123))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR * 10, weight_decay=0.5)  # the checkpoint's groups win
    trainer_state = checkpointing.load(checkpoint_dir, model=model, optimizer=optimizer)
    assert trainer_state["global_step"] == 2, trainer_state
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    batch = _batch()
    loaded = _outputs(model, batch)
    _step(model, optimizer, batch)
    return {"saved": loaded, "after_step": _outputs(model, batch)}


# ---- fixtures and helpers --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(worlds, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("trained_tp2"))
    results = worlds(2).run(case_train_and_save, tensor_model_parallel_size=2, root=root)
    return root, results[0]


def _cli(argv, capsys=None):
    status, _, err = _cli_out(argv, capsys)
    return status, err


def _cli_out(argv, capsys=None):
    from nxdtp.cli import main

    status = main([str(a) for a in argv] + ["--no-progress"])
    captured = capsys.readouterr() if capsys is not None else None
    return status, captured.out if captured else "", captured.err if captured else ""


def _assert_close(actual, expected, what):
    import torch

    for name, a, e in zip(("MLM logits", "NSP logits"), actual, expected):
        torch.testing.assert_close(a, e, **TOL, msg=lambda m: f"{what}: {name}: {m}")


def _dense_state(directory):
    from safetensors.torch import load_file

    return load_file(os.path.join(directory, "model.safetensors"))


def _index(checkpoint_dir):
    with open(os.path.join(checkpoint_dir, "step_000002", "nxdtp_index.json")) as f:
        return json.load(f)


# ---- merge -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("form,fmt", [("live", "safetensors"), ("nxd", "safetensors"), ("live", "bin")])
def test_merge_gives_dense_model_with_same_outputs(trained, tmp_path, capsys, form, fmt):
    import torch
    from transformers import BertForPreTraining

    root, expected = trained
    out = tmp_path / "dense"
    name = "model.safetensors" if fmt == "safetensors" else "pytorch_model.bin"
    extra = []
    if form == "nxd":
        # model.state_dict() carries no config: the merge writes none unless --config supplies it.
        status, err = _cli([os.path.join(root, form), tmp_path / "no_config"], capsys)
        assert status == 0 and os.listdir(tmp_path / "no_config") == [name], err
        _config().save_pretrained(tmp_path / "config")
        extra = ["--config", tmp_path / "config" / "config.json"]
    status, err = _cli([os.path.join(root, form), out, "--format", fmt] + extra, capsys)
    assert status == 0, err
    # A live optimizer's state (keyed by name) goes beside the model; NxD's form (keyed by index) cannot.
    optimizer_files = ["optimizer.json", "optimizer.safetensors"] if form == "live" else []
    assert sorted(os.listdir(out)) == sorted(["config.json", name] + optimizer_files)
    state = _dense_state(out) if fmt == "safetensors" else torch.load(out / name, weights_only=True)
    # HF's dense key layout, tied tensors once under their primary key, vocabulary padding stripped.
    dense_keys = set(BertForPreTraining(_config()).state_dict())
    assert set(state) == dense_keys - {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
    assert state["bert.embeddings.word_embeddings.weight"].shape == (VOCAB, 16)
    assert state["cls.predictions.bias"].shape == (VOCAB,)

    model = BertForPreTraining.from_pretrained(out)
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    batch = _batch()
    with torch.no_grad():
        dense = model(**_inputs(batch))
    _assert_close((dense.prediction_logits, dense.seq_relationship_logits), expected["saved"], f"{form}/{fmt}")


def test_merge_is_atomic_on_failure(trained, tmp_path, monkeypatch):
    from nxdtp.checkpointing import merge as merge_module
    from nxdtp.checkpointing.pipeline import TagSource

    root, _ = trained
    calls = {"n": 0}
    real = TagSource.read_boxes

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("disk on fire")
        return real(*args, **kwargs)

    monkeypatch.setattr(TagSource, "read_boxes", failing)
    out = tmp_path / "dense"
    with pytest.raises(RuntimeError, match="disk on fire"):
        merge_module.merge(os.path.join(root, "live"), str(out), progress=False)
    assert not out.exists() and os.listdir(tmp_path) == []  # no output, no staging directory left behind

    # With force over an existing output, a failure keeps the old contents.
    out.mkdir()
    (out / "keep.txt").write_text("old")
    calls["n"] = 0
    with pytest.raises(RuntimeError, match="disk on fire"):
        merge_module.reshard(os.path.join(root, "live"), str(out), 4, force=True, progress=False)
    assert os.listdir(out) == ["keep.txt"] and sorted(os.listdir(tmp_path)) == ["dense"]


# ---- strided, padded, replicated and non-float tensors, without a model ----------------------------------------------

def _synthetic(directory, tp):
    """A hand-made checkpoint at ``tp``: fused (stride 3, dim 0), strided along dim 1, padded vocab with a tied alias,
    replicated bf16 and int64 tensors. Returns the dense tensors and their specs' keyword arguments."""
    import torch

    from nxdtp.checkpointing import tags
    from nxdtp.checkpointing.durable import write_bytes_durably
    from nxdtp.checkpointing.index import CheckpointIndex, TensorEntry, dtype_name, model_file
    from nxdtp.checkpointing.safetensors_stream import StreamingSafetensorsWriter
    from nxdtp.layers import shard_of
    from nxdtp.plan import padded_size
    from nxdtp.spec import ParamSpec

    g = torch.Generator().manual_seed(3)
    dense = {"fused.weight": torch.randn(12, 4, generator=g), "row.weight": torch.randn(4, 8, generator=g),
             "vocab.weight": torch.randn(7, 4, generator=g), "norm.weight": torch.randn(4, generator=g).bfloat16(),
             "position_ids": torch.arange(6).unsqueeze(0)}
    layout = {"fused.weight": (0, 3), "row.weight": (1, 2), "vocab.weight": (0, 1)}
    entries, full = {}, {}
    for key, value in dense.items():
        if key in layout:
            dim, stride = layout[key]
            shape = list(value.shape)
            if key == "vocab.weight":
                shape[0] = padded_size(shape[0], tp)
            padded = torch.zeros(shape, dtype=value.dtype)
            padded[tuple(slice(0, n) for n in value.shape)] = value
            padding = dict(pad_to_multiple_of=1, vocabulary=True) if key == "vocab.weight" else {}
            spec = ParamSpec(full_shape=tuple(shape), partition_dim=dim, stride=stride, num_partitions=tp,
                             real_shape=tuple(value.shape), **padding)
            full[key] = (padded, spec)
        else:
            full[key] = (value, ParamSpec(full_shape=tuple(value.shape), num_partitions=tp))
        entries[key] = TensorEntry(dtype=dtype_name(value.dtype), spec=full[key][1],
                                   aliases=["head.weight"] if key == "vocab.weight" else [])
    tag_dir = os.path.join(directory, "step_000001")
    files, contents = {}, {}
    for rank in range(tp):
        mine = [(k, shard_of(t, s.partition_dim, rank, tp, s.stride) if s.is_sharded else t)
                for k, (t, s) in full.items() if s.is_sharded or rank == 0]
        with StreamingSafetensorsWriter(os.path.join(tag_dir, model_file(rank)),
                                        [(k, t.dtype, tuple(t.shape)) for k, t in mine]) as writer:
            for k, t in mine:
                writer.write(k, t)
        files[model_file(rank)], contents[model_file(rank)] = writer.record(), writer.contents_record()
    files["trainer_state.json"] = write_bytes_durably(os.path.join(tag_dir, "trainer_state.json"),
                                                      json.dumps({"global_step": 1}).encode())
    index_record = CheckpointIndex(tensor_model_parallel_size=tp, data_parallel_size=1, tensors=entries,
                                   files=files, tensor_checksums=contents).write(tag_dir)
    tags.mark_done(tag_dir, index_record)
    tags.set_newest(directory, "step_000001")
    return dense


def test_merge_and_reshard_invert_strided_and_padded_sharding(tmp_path):
    import torch
    from safetensors.torch import load_file

    from nxdtp.checkpointing import CheckpointIndex
    from nxdtp.checkpointing.merge import merge, reshard
    from nxdtp.layers import shard_of

    dense = _synthetic(str(tmp_path / "tp2"), tp=2)
    merge(str(tmp_path / "tp2"), str(tmp_path / "dense"), progress=False)
    merged = load_file(tmp_path / "dense" / "model.safetensors")
    assert merged.keys() == dense.keys()  # the tied alias is written once, under its primary key
    for key, value in dense.items():
        assert merged[key].dtype == value.dtype and torch.equal(merged[key], value), key

    reshard(str(tmp_path / "tp2"), str(tmp_path / "tp4"), 4, progress=False)
    tag4 = tmp_path / "tp4" / "step_000001"
    index = CheckpointIndex.read(str(tag4))
    assert index.tensors["vocab.weight"].spec.full_shape == (8, 4)
    assert index.tensors["vocab.weight"].aliases == ["head.weight"]
    for rank in range(4):
        pieces = load_file(tag4 / "model" / f"tp_rank_{rank:02d}.safetensors")
        for key, (dim, stride) in {"fused.weight": (0, 3), "row.weight": (1, 2), "vocab.weight": (0, 1)}.items():
            full = torch.cat([dense[key], torch.zeros(1, 4)]) if key == "vocab.weight" else dense[key]
            assert torch.equal(pieces[key], shard_of(full, dim, rank, 4, stride)), (rank, key)
        assert ("norm.weight" in pieces) == (rank == 0)  # replicated tensors live in TP rank 0's file only

    reshard(str(tmp_path / "tp4"), str(tmp_path / "tp1"), 1, progress=False)
    merge(str(tmp_path / "tp1"), str(tmp_path / "dense1"), output_format="pytorch_bin", progress=False)
    merged = torch.load(tmp_path / "dense1" / "pytorch_model.bin", weights_only=True)
    for key, value in dense.items():
        assert merged[key].dtype == value.dtype and torch.equal(merged[key], value), key


@pytest.mark.parametrize("record", ["files", "tensor_checksums", "done"])
def test_a_tag_without_its_checksum_records_is_refused_naming_the_file(tmp_path, record):
    """Every tag records checksums; one without them (hand-made, or cut short) is an error naming what it lacks."""
    from nxdtp.checkpointing import CheckpointIntegrityError
    from nxdtp.checkpointing.merge import merge

    _synthetic(str(tmp_path / "tp2"), tp=2)
    tag_dir = tmp_path / "tp2" / "step_000001"
    if record == "done":
        (tag_dir / "done").write_text("complete\n")
        expected = f"{tag_dir / 'done'} is damaged: it must be JSON holding the record"
    else:
        index = json.loads((tag_dir / "nxdtp_index.json").read_text())
        del index[record]
        (tag_dir / "nxdtp_index.json").write_text(json.dumps(index))
        _rerecord(tag_dir, "nxdtp_index.json")  # so the missing records, not the changed bytes, meet the reader
        expected = f"{tag_dir / 'nxdtp_index.json'} records no '{record}'"
    with pytest.raises(CheckpointIntegrityError) as raised:
        merge(str(tag_dir), str(tmp_path / "dense"), progress=False)
    assert expected in str(raised.value), raised.value
    assert not (tmp_path / "dense").exists()


# ---- reshard ---------------------------------------------------------------------------------------------------------

def test_reshard_2_to_4_to_1_loads_with_same_outputs(worlds, trained, tmp_path, capsys):
    root, expected = trained
    source = os.path.join(root, "live")
    tp4, tp1 = tmp_path / "tp4", tmp_path / "tp1"

    status, err = _cli([source, tp4, "--reshard", 4], capsys)
    assert status == 0, err
    index = _index(tp4)
    assert index["tensor_model_parallel_size"] == 4 and index["optimizer"]["keyed_by"] == "name"
    embedding = index["tensors"]["bert.embeddings.word_embeddings.weight"]["spec"]
    assert embedding["full_shape"] == [56, 16] and embedding["real_shape"] == [VOCAB, 16]
    assert sorted(os.listdir(tp4 / "step_000002" / "model")) == [f"tp_rank_{r:02d}.safetensors" for r in range(4)]
    assert not (tp4 / "step_000002" / "rng").exists()  # RNG states belong to the old degree
    assert (tp4 / "newest").read_text().strip() == "step_000002"
    for name in ("done", "trainer_state.json", "config.json", "optim/state.json", "reshard.json"):
        assert (tp4 / "step_000002" / name).is_file(), name

    status, err = _cli([tp4, tp1, "--reshard", 1], capsys)
    assert status == 0, err
    embedding = _index(tp1)["tensors"]["bert.embeddings.word_embeddings.weight"]["spec"]
    assert embedding["full_shape"] == [VOCAB, 16]

    # Every degree merges to bit-identical dense tensors.
    import torch

    dense = {}
    for name, directory in (("tp2", source), ("tp4", tp4), ("tp1", tp1)):
        status, err = _cli([directory, tmp_path / f"dense_{name}"], capsys)
        assert status == 0, err
        dense[name] = _dense_state(tmp_path / f"dense_{name}")
    for name in ("tp4", "tp1"):
        assert dense[name].keys() == dense["tp2"].keys()
        for key, value in dense["tp2"].items():
            assert torch.equal(dense[name][key], value), f"{name}: {key}"

    # A fresh model at each degree loads model and optimizer: same outputs, and the same third AdamW step.
    for world, tp, directory in ((4, 4, tp4), (4, 1, tp1)):
        results = worlds(world).run(case_load_resharded, tensor_model_parallel_size=tp, checkpoint_dir=str(directory))
        for rank, result in enumerate(results):
            _assert_close(result["saved"], expected["saved"], f"tp={tp} rank {rank}, loaded")
            _assert_close(result["after_step"], expected["after_step"], f"tp={tp} rank {rank}, after a step")


def test_reshard_same_degree_keeps_rng_and_nxd_form_drops_optimizer(trained, tmp_path):
    from nxdtp.checkpointing.merge import reshard

    root, _ = trained
    same = tmp_path / "same"
    reshard(os.path.join(root, "live"), str(same), 2, progress=False)
    assert sorted(os.listdir(same / "step_000002" / "rng")) == ["rank_00000.json", "rank_00001.json"]
    assert _index(same)["tensors"] == _index(os.path.join(root, "live"))["tensors"]

    with pytest.warns(UserWarning, match="optimizer state dropped: it is keyed by parameter index"):
        reshard(os.path.join(root, "nxd"), str(tmp_path / "nxd4"), 4, progress=False)
    assert _index(tmp_path / "nxd4")["optimizer"] is None
    assert not (tmp_path / "nxd4" / "step_000002" / "optim").exists()
    with open(tmp_path / "nxd4" / "step_000002" / "reshard.json") as f:
        notes = json.load(f)["notes"]
    assert any("optimizer state dropped" in n for n in notes) and any("RNG states" in n for n in notes)


def test_reshard_padding_multiple_is_inferred_recorded_and_overridable(trained, tmp_path):
    from nxdtp.checkpointing.merge import reshard

    root, _ = trained
    reshard(os.path.join(root, "live"), str(tmp_path / "m8"), 4, pad_to_multiple_of=8, progress=False)
    spec = _index(tmp_path / "m8")["tensors"]["cls.predictions.bias"]["spec"]
    assert spec["full_shape"] == [64] and spec["real_shape"] == [VOCAB]
    # The next reshard reads the recorded multiple: 53 at tp=2 with multiple 8 pads to 64, not 54.
    reshard(str(tmp_path / "m8"), str(tmp_path / "m8_tp2"), 2, progress=False)
    assert _index(tmp_path / "m8_tp2")["tensors"]["cls.predictions.bias"]["spec"]["full_shape"] == [64]
    # Without reshard.json, the tensor's own padding record (multiple 8) gives 64 at tp=4 again.
    _drop_recorded_file(tmp_path / "m8_tp2" / "step_000002", "reshard.json")
    reshard(str(tmp_path / "m8_tp2"), str(tmp_path / "back4"), 4, progress=False)
    assert _index(tmp_path / "back4")["tensors"]["cls.predictions.bias"]["spec"]["full_shape"] == [64]


def _drop_recorded_file(tag_dir, relative: str) -> None:
    """Delete one file of a tag and its record, as if the writer had never written it (the tag stays intact)."""
    from nxdtp.checkpointing import CheckpointIndex, tags

    os.remove(os.path.join(tag_dir, relative))
    index = CheckpointIndex.read(str(tag_dir))
    del index.files[relative]
    tags.mark_done(str(tag_dir), index.write(str(tag_dir)))


def _rerecord(tag_dir, relative: str) -> None:
    """Record a changed file's size and CRC-32 as the save would have (in the index, or for the index in 'done'), so
    the checks behind the checksums are what meets the damage."""
    from nxdtp.checkpointing import CheckpointIndex, tags
    from nxdtp.checkpointing.durable import checksum_file, file_record

    if relative != "nxdtp_index.json":
        index = CheckpointIndex.read(str(tag_dir))
        index.files[relative] = file_record(*checksum_file(os.path.join(tag_dir, relative)))
        index.write(str(tag_dir))
    tags.mark_done(str(tag_dir), file_record(*checksum_file(os.path.join(tag_dir, "nxdtp_index.json"))))


# ---- bad input -------------------------------------------------------------------------------------------------------

def _damaged_copy(trained, tmp_path):
    root, _ = trained
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(os.path.join(root, "live"), checkpoint)
    return checkpoint, checkpoint / "step_000002"


def _refused(argv, capsys, *fragments):
    status, err = _cli(argv, capsys)
    assert status == 2, err
    # One error line, after a warning line for each damaged tag skipped on the way (when no tag was named).
    lines = err.strip().splitlines()
    assert lines[-1].startswith("nxdtp-merge: error: ") and "Traceback" not in err, err
    assert all(line.startswith("nxdtp-merge: warning: checkpoint tag ") for line in lines[:-1]), err
    for fragment in fragments:
        assert str(fragment) in lines[-1], err
    return err


DAMAGES = ["missing_rank_file", "truncated", "wrong_piece_shape", "bad_json", "format_version", "index_field_missing",
           "incomplete_tag"]


@pytest.mark.parametrize("damage,mode", [(d, m) for d in DAMAGES for m in ("merge", "reshard")]
                         + [("missing_optim_file", "reshard")])
def test_damaged_checkpoint_is_refused_and_nothing_written(trained, tmp_path, capsys, damage, mode):
    import torch
    from safetensors.torch import load_file, save_file

    checkpoint, tag = _damaged_copy(trained, tmp_path)
    rank1, index_file = tag / "model" / "tp_rank_01.safetensors", tag / "nxdtp_index.json"
    if damage == "missing_rank_file":
        os.remove(rank1)
        expected = [rank1, "missing"]
    elif damage == "truncated":
        data = rank1.read_bytes()
        rank1.write_bytes(data[: len(data) - 100])
        expected = [rank1, "truncated"]
    elif damage == "wrong_piece_shape":
        tensors = load_file(rank1)
        key = "bert.encoder.layer.0.intermediate.dense.weight"
        tensors[key] = torch.zeros(8, 16)
        save_file(tensors, rank1)
        _rerecord(tag, "model/tp_rank_01.safetensors")  # past the checksums: the shape check must catch it
        expected = [rank1, key, "[8, 16]", "[16, 16]"]
    elif damage == "bad_json":
        index_file.write_text(index_file.read_text()[:-20])
        expected = [index_file, "damaged"]
    elif damage == "format_version":
        index = json.loads(index_file.read_text())
        index["format_version"] = 99
        index_file.write_text(json.dumps(index))
        expected = [index_file, "format_version=99"]
    elif damage == "index_field_missing":
        index = json.loads(index_file.read_text())
        del index["tensors"]
        index_file.write_text(json.dumps(index))
        expected = [index_file, "damaged", "tensors"]
    elif damage == "incomplete_tag":
        os.remove(tag / "done")
        expected = [tag, "incomplete"]
    else:  # only resharding reads the optimizer state
        os.remove(tag / "optim" / "tp_rank_01.safetensors")
        expected = [tag / "optim" / "tp_rank_01.safetensors", "missing"]
    if damage in ("bad_json", "format_version", "index_field_missing"):
        _rerecord(tag, "nxdtp_index.json")  # past the index's checksum in 'done': the index parser must catch it
    out = tmp_path / "out"
    _refused([checkpoint, out] + (["--reshard", 4] if mode == "reshard" else []), capsys, *expected)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no output and no staging directory


def test_output_directory_rules(trained, tmp_path, capsys):
    root, _ = trained
    source = os.path.join(root, "live")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _refused([source, out], capsys, out, "not empty", "--force")
    assert os.listdir(out) == ["keep.txt"]
    _refused([source, out, "--reshard", 4], capsys, out, "not empty")
    assert os.listdir(out) == ["keep.txt"]
    status, err = _cli([source, out, "--force", "--no-optimizer"], capsys)
    assert status == 0, err
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]

    # Inside the input checkpoint (or the input itself, or a parent of it, with --force) is refused.
    checkpoint, tag = _damaged_copy(trained, tmp_path)
    before = sorted(os.listdir(checkpoint))
    _refused([checkpoint, checkpoint / "merged"], capsys, "inside the input checkpoint directory")
    _refused([checkpoint, tag / "merged", "--reshard", 1], capsys, "inside the input checkpoint directory")
    _refused([checkpoint, checkpoint, "--force"], capsys, "inside the input checkpoint directory")
    _refused([checkpoint, tmp_path, "--force"], capsys, "contains the input checkpoint directory")
    assert sorted(os.listdir(checkpoint)) == before

    # An empty existing output directory is fine without --force.
    empty = tmp_path / "empty"
    empty.mkdir()
    status, err = _cli([source, empty], capsys)
    assert status == 0, err


def test_bad_arguments_exit_2(trained, tmp_path, capsys):
    root, _ = trained
    source = os.path.join(root, "live")
    out = tmp_path / "out"
    _refused([tmp_path / "absent", out], capsys, tmp_path / "absent", "does not exist")
    _refused([source, out, "--tag", "step_000099"], capsys, "step_000099", "does not exist")
    _refused([source, out, "--reshard", 0], capsys, ">= 1")
    _refused([source, out, "--reshard", 3], capsys, "cannot be split into 3 partitions")
    _refused([source, out, "--format", "xml"], capsys, "invalid choice")
    _refused([source, out, "--reshard", 2, "--format", "bin"], capsys, "--format")
    _refused([source, out, "--from-nxd"], capsys, "--config")
    _refused([source, out, "--config", tmp_path / "absent.json"], capsys, tmp_path / "absent.json")
    _refused([source, out, "--from-nxd", "--config", tmp_path / "config.json"], capsys, tmp_path / "config.json",
             "does not exist")
    assert not out.exists()


def test_tools_script_exit_status(trained, tmp_path):
    root, _ = trained
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = os.path.join(REPO_ROOT, "tools", "merge_checkpoints.py")
    bad = subprocess.run([sys.executable, script, str(tmp_path / "absent"), str(tmp_path / "out")],
                         capture_output=True, text=True, env=env, cwd=str(tmp_path))
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "Traceback" not in bad.stderr, bad.stderr
    assert "does not exist" in bad.stderr


# ---- the tag directory as input, and what the CLI prints -------------------------------------------------------------

def test_tag_directory_is_accepted_and_runs_report_what_they_wrote(trained, tmp_path, capsys):
    root, _ = trained
    checkpoint = os.path.join(root, "live")
    tag = os.path.join(checkpoint, "step_000002")  # what the training log prints

    status, out, err = _cli_out([tag, tmp_path / "from_tag"], capsys)
    assert status == 0 and err == "", err
    written = tmp_path / "from_tag" / "model.safetensors"
    tensors = len(_dense_state(tmp_path / "from_tag"))
    assert out == f"nxdtp-merge: wrote dense checkpoint {written} ({tensors} tensors, with config.json and the " \
                  f"optimizer state in optimizer.safetensors) from tag step_000002 ({tag})\n", out
    status, out, err = _cli_out([checkpoint, tmp_path / "from_parent"], capsys)
    assert status == 0 and f"from tag step_000002 ({tag})" in out, (out, err)
    assert (tmp_path / "from_tag" / "model.safetensors").read_bytes() == \
        (tmp_path / "from_parent" / "model.safetensors").read_bytes()

    status, out, err = _cli_out([tag, tmp_path / "tp4", "--reshard", 4], capsys)
    assert status == 0 and err == "", err
    lines = out.splitlines()
    files = sum(len(names) for _, _, names in os.walk(tmp_path / "tp4" / "step_000002"))
    assert lines[0] == (f"nxdtp-merge: wrote checkpoint {tmp_path / 'tp4'}: tag step_000002 at "
                        f"tensor_model_parallel_size=4 (from 2, {tag}), {len(_index(tmp_path / 'tp4')['tensors'])} "
                        "model tensors in 4 model files, optimizer state in 4 files, vocabulary padded to a multiple "
                        f"of 1 * 4; {files} files"), out
    assert lines[1:] == ["  note: RNG states (rng/) dropped: they belong to tensor_model_parallel_size=2; resume with "
                         "restore_rng_states=False"], out
    assert _index(tmp_path / "tp4")["tensor_model_parallel_size"] == 4
    assert (tmp_path / "tp4" / "newest").read_text().strip() == "step_000002"


def test_tag_directory_refusals(trained, tmp_path, capsys):
    checkpoint, tag = _damaged_copy(trained, tmp_path)
    out = tmp_path / "out"
    for extra in ([], ["--reshard", 4]):
        # --tag applies to a checkpoint directory only.
        _refused([tag, out, "--tag", "step_000002"] + extra, capsys, tag, "is a tag directory", "--tag step_000002",
                 f"its checkpoint directory {checkpoint}")
        # The output must lie outside the checkpoint directory that holds the tag, too.
        _refused([tag, checkpoint / "merged"] + extra, capsys, "inside the input checkpoint directory", checkpoint)
    os.remove(tag / "done")
    for extra in ([], ["--reshard", 4]):
        _refused([tag, out] + extra, capsys, tag, "incomplete", "no 'done' file")
    os.remove(tag / "nxdtp_index.json")
    _refused([tag, out], capsys, tag, "incomplete", "no 'nxdtp_index.json' and no 'done' files")
    # A directory that is neither says so, and lists the complete tags it holds.
    (checkpoint / "newest").unlink()
    shutil.copytree(trained[0] + "/live/step_000002", checkpoint / "step_000003")
    _refused([checkpoint, out], capsys, checkpoint, "no 'newest' file", "not a tag directory", "['step_000003']")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert sorted(os.listdir(checkpoint)) == ["step_000002", "step_000003"]
