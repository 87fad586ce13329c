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

import copy
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
    from nxdtp.checkpointing.cli import main

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
    # Every name once, the tied alias too, with the dense (unpadded) shape and the saved dtype.
    assert set(metadata) == set(dense) | {"head.weight"}
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
