"""Resharding pads every tensor by its own recorded rule (issue 26): one model holds a vocabulary padded to a multiple
of ``pad_to_multiple_of * tp`` (ParallelEmbedding) and a partition-padded convolution (padded to a multiple of tp).
No single checkpoint-wide multiple fits both, so inferring one fails and passing the vocabulary's mis-pads the conv.

Saved at tp=2, resharded to tp=4 with ``nxdtp-merge --reshard`` (with and without ``--pad-to-multiple-of``), the
checkpoint loads into the model built at tp=4 with every rank holding the dense tensors' pieces, and merges to the
dense tensors. The references are plain torch: the dense tensor zero-padded at the end of the split dim and chunked.
"""

from __future__ import annotations

import os

import pytest

from tests.harness import WorkerGroup  # noqa: F401  (the worlds fixture lives in conftest)

VOCAB, HIDDEN, MULTIPLE = 50, 4, 4  # 50 -> 56 rows at tp=2 (multiple 8), 64 at tp=4 (multiple 16)
CHANNELS_IN, CHANNELS_OUT = 3, 5  # 5 -> 6 output channels at tp=2, 8 at tp=4


def _dense():
    import torch

    g = torch.Generator().manual_seed(11)
    return {"embed.weight": torch.randn(VOCAB, HIDDEN, generator=g),
            "conv.weight": torch.randn(CHANNELS_OUT, CHANNELS_IN, 1, 1, generator=g),
            "conv.bias": torch.randn(CHANNELS_OUT, generator=g)}


def _reference_piece(dense, multiple: int, rank: int, tp: int):
    """Rank ``rank``'s piece of ``dense`` zero-padded along dim 0 to a multiple of ``multiple``, cut into tp pieces."""
    import torch

    rows = -(-dense.shape[0] // multiple) * multiple
    padded = torch.cat([dense, dense.new_zeros((rows - dense.shape[0],) + tuple(dense.shape[1:]))])
    return padded.chunk(tp)[rank]


def _multiples(tp: int):
    return {"embed.weight": MULTIPLE * tp, "conv.weight": tp, "conv.bias": tp}


def _model():
    from torch import nn

    from nxdtp.layers import OutputChannelParallelConv2d, ParallelEmbedding

    model = nn.Module()
    model.embed = ParallelEmbedding(VOCAB, HIDDEN, pad=True, pad_to_multiple_of=MULTIPLE)
    model.conv = OutputChannelParallelConv2d(CHANNELS_IN, CHANNELS_OUT, 1, gather_output=False, partition_pad=True)
    return model


def case_save(root: str):
    import torch

    from nxdtp import checkpointing, parallel_state

    tp, rank = parallel_state.get_tensor_model_parallel_size(), parallel_state.get_tensor_model_parallel_rank()
    model = _model()
    multiples = _multiples(tp)
    with torch.no_grad():
        for key, value in _dense().items():
            model.get_parameter(key).copy_(_reference_piece(value, multiples[key], rank, tp))
    checkpointing.save({"model": model, "global_step": 1}, root)


def case_load_pieces(checkpoint_dir: str):
    from nxdtp import checkpointing

    model = _model()
    checkpointing.load(checkpoint_dir, model=model)
    return {key: model.get_parameter(key).detach().clone() for key in _dense()}


@pytest.mark.parametrize("explicit_multiple", [False, True], ids=["recorded", "explicit"])
def test_padded_vocabulary_and_partition_padded_conv_reshard_each_by_its_own_rule(worlds, tmp_path, explicit_multiple):
    import torch
    from safetensors.torch import load_file

    from nxdtp.checkpointing import CheckpointIndex
    from nxdtp.cli import main

    source, tp4, merged = tmp_path / "tp2", tmp_path / "tp4", tmp_path / "dense"
    worlds(2).run(case_save, tensor_model_parallel_size=2, root=str(source))
    index = CheckpointIndex.read(str(source / "step_000001"))
    assert index.tensors["embed.weight"].spec.full_shape == (56, HIDDEN)
    assert index.tensors["conv.weight"].spec.full_shape == (6, CHANNELS_IN, 1, 1)

    flags = ["--pad-to-multiple-of", str(MULTIPLE)] if explicit_multiple else []
    assert main([str(source), str(tp4), "--reshard", "4", "--no-progress"] + flags) == 0
    index = CheckpointIndex.read(str(tp4 / "step_000001"))
    assert index.tensors["embed.weight"].spec.full_shape == (64, HIDDEN)
    assert index.tensors["conv.weight"].spec.full_shape == (8, CHANNELS_IN, 1, 1)
    assert index.tensors["conv.bias"].spec.full_shape == (8,)

    dense, multiples = _dense(), _multiples(4)
    for rank, pieces in enumerate(worlds(4).run(case_load_pieces, tensor_model_parallel_size=4,
                                                 checkpoint_dir=str(tp4))):
        for key, value in dense.items():
            assert torch.equal(pieces[key], _reference_piece(value, multiples[key], rank, 4)), (rank, key)

    assert main([str(tp4), str(merged), "--no-progress"]) == 0
    weights = load_file(os.path.join(merged, "model.safetensors"))
    assert weights.keys() == dense.keys()
    for key, value in dense.items():
        assert torch.equal(weights[key], value), key
