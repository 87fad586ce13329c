"""NxD's parallel_layers.utils helpers in nxdtp.utils, against plain torch (single process; the XLA case on XLA:CPU)."""

from __future__ import annotations

import pytest
import torch

from nxdtp import parallel_state as ps
from nxdtp import utils


def test_division_and_padding():
    assert utils.divide(12, 4) == 3
    utils.ensure_divisibility(12, 3)
    with pytest.raises(ValueError, match="10 is not divisible by 4"):
        utils.ensure_divisibility(10, 4)
    assert [utils.get_padding_length(n, 4) for n in (8, 9, 10, 11, 0)] == [0, 3, 2, 1, 0]
    with pytest.raises(ValueError, match="denominator=0 must be > 0"):
        utils.get_padding_length(5, 0)


@pytest.mark.parametrize("contiguous", [False, True])
def test_splits_equal_chunk(contiguous):
    x = torch.arange(2 * 6 * 4.0).reshape(2, 6, 4)
    for dim, split in ((1, utils.split_tensor_along_second_dim), (2, utils.split_tensor_along_last_dim)):
        parts = split(x, 2, contiguous_split_chunks=contiguous)
        expected = x.chunk(2, dim=dim)
        assert len(parts) == 2 and all(torch.equal(a, b) for a, b in zip(parts, expected))
        assert all(p.is_contiguous() for p in parts) or not contiguous
    parts = utils.split_tensor_along_dim(x, 0, 2)
    assert all(torch.equal(a, b) for a, b in zip(parts, x.chunk(2, dim=0)))
    with pytest.raises(ValueError, match=r"dimension 1 of shape \(2, 6, 4\) is not divisible by num_partitions=4"):
        utils.split_tensor_along_second_dim(x, 4)


def test_indices_and_vocab_ranges():
    x = torch.zeros(3, 8)
    assert [utils.indices_split_along_dim(x, 1, r, 4).tolist() for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert utils.indices_split_along_dim(None, 1, 0, 4) is None
    assert utils.EmbeddingUtility.range_from_global_vocab_size(100, 3, 4) == (75, 100)
    assert utils.EmbeddingUtility.range_from_per_partition_vocab_size(25, 1, 4) == (25, 50)


def test_casts():
    state = {"w": torch.ones(2), "ids": torch.ones(2, dtype=torch.long), "nested": [torch.ones(1, dtype=torch.float16),
                                                                                   (torch.ones(1), "text")]}
    cast = utils.cast_all(state)
    assert cast["w"].dtype == torch.bfloat16 and cast["ids"].dtype == torch.long
    assert cast["nested"][0].dtype == torch.float16 and cast["nested"][1][0].dtype == torch.bfloat16
    assert cast["nested"][1][1] == "text" and isinstance(cast["nested"][1], tuple)
    assert utils.cast_tensor(torch.ones(1, dtype=torch.float16), torch.float16, torch.float32).dtype == torch.float32

    x, d, i = torch.ones(2), torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.long)
    assert utils.cast_if_autocast_enabled(x, d, i) == (x, d, i)   # autocast off: unchanged
    utils.verify_casted_dtype([x])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cx, cd, ci = utils.cast_if_autocast_enabled(x, d, i)
        assert (cx.dtype, cd.dtype, ci.dtype) == (torch.bfloat16, torch.float64, torch.long)
        utils.verify_casted_dtype({"a": cx})
        with pytest.raises(TypeError, match="a tensor is torch.float32, but autocast expects torch.bfloat16"):
            utils.verify_casted_dtype({"a": x})


def test_attribute_defaults_and_tp_duplicates():
    p = torch.nn.Parameter(torch.ones(2))
    p.partition_dim = 0
    utils.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
    assert (p.tensor_model_parallel, p.partition_dim, p.partition_stride, p.num_partitions) == (False, 0, 1, 1)
    sharded = torch.nn.Parameter(torch.ones(2))
    sharded.tensor_model_parallel = True
    for rank, expected in ((0, (True, True)), (1, (False, True))):
        with ps.simulated_topology(world_size=2, rank=rank, tensor_model_parallel_size=2):
            # NxD's one-argument form reads the TP rank; the explicit rank still works.
            assert (utils.param_is_not_tensor_parallel_duplicate(p),
                    utils.param_is_not_tensor_parallel_duplicate(sharded)) == expected
            assert utils.param_is_not_tensor_parallel_duplicate(p, 0)


def test_local_world_size(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert utils.get_local_world_size() == 4
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert utils.get_local_world_size() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='two' is not a positive integer"):
        utils.get_local_world_size()


def case_move_all_tensor_to_cpu():
    import torch_xla

    device = torch_xla.device()
    value = torch.arange(4.0, device=device) * 2    # a pending graph
    data = {"a": [value, torch.ones(1)], "b": (value + 1, "text"), "n": 3}
    moved = utils.move_all_tensor_to_cpu(data)
    kept = utils.move_all_tensor_to_cpu({"a": value}, convert=False)
    return dict(devices=[moved["a"][0].device.type, moved["a"][1].device.type, moved["b"][0].device.type],
                values=[moved["a"][0].tolist(), moved["b"][0].tolist()], rest=(moved["b"][1], moved["n"]),
                kept=kept["a"].device.type)


@pytest.mark.xla
def test_move_all_tensor_to_cpu_on_xla(worlds):
    result = worlds(1, "xla-exec").run(case_move_all_tensor_to_cpu, tensor_model_parallel_size=1)[0]
    assert result == dict(devices=["cpu", "cpu", "cpu"], values=[[0.0, 2.0, 4.0, 6.0], [1.0, 3.0, 5.0, 7.0]],
                          rest=("text", 3), kept="xla")


def test_clip_grads_with_norm_and_shared_filter():
    from nxdtp.grads import clip_grads_with_norm, param_is_not_shared

    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    reference = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    g = torch.Generator().manual_seed(0)
    for p, r in zip(params, reference):
        p.grad = torch.randn(p.shape, generator=g)
        r.grad = p.grad.clone()
    norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in params))
    assert clip_grads_with_norm(params, norm, 0.5) is norm
    torch.nn.utils.clip_grad_norm_(reference, 0.5)
    for p, r in zip(params, reference):
        torch.testing.assert_close(p.grad, r.grad, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="needs at least one parameter"):
        clip_grads_with_norm([], norm, 1.0)
    with pytest.raises(ValueError, match="max_norm=0 must be > 0"):
        clip_grads_with_norm(params, norm, 0)
    shared = torch.nn.Parameter(torch.ones(1))
    shared.shared = True
    assert param_is_not_shared(params[0]) and not param_is_not_shared(shared)
