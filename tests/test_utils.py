"""NxD's parallel_layers.utils helpers in nxdtp.utils, against plain torch (single process; the XLA case on XLA:CPU)."""

from __future__ import annotations

import os
import warnings

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
    # A 1-element norm (NxD-style code may build one) clips as the 0-dim one does.
    again = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    for a, r in zip(again, reference):
        a.grad = r.grad / min(1.0, 0.5 / (norm.item() + 1e-6))   # the gradients before clipping
    clip_grads_with_norm(again, norm.reshape(1), 0.5)
    for a, r in zip(again, reference):
        torch.testing.assert_close(a.grad, r.grad, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match=r"total_norm of shape \(2,\) must hold one number"):
        clip_grads_with_norm(params, torch.ones(2), 1.0)
    with pytest.raises(ValueError, match="needs at least one parameter"):
        clip_grads_with_norm([], norm, 1.0)
    with pytest.raises(ValueError, match="max_norm=0 must be > 0"):
        clip_grads_with_norm(params, norm, 0)
    shared = torch.nn.Parameter(torch.ones(1))
    shared.shared = True
    assert param_is_not_shared(params[0]) and not param_is_not_shared(shared)


# ---- the running stack, and NxD's single-process fallback ------------------------------------------------------------

@pytest.mark.parametrize("version,greater_than_2,override", [
    ("2.9.0+cu128", True, False), ("2.0.1", True, True), ("2.0.0a0+git1234", True, True), ("2.10.1", True, False),
    ("1.13.1", False, False), ("3.1.0", True, False), ("20.0", True, False),
])
def test_torch_version_helpers(monkeypatch, version, greater_than_2, override):
    monkeypatch.setattr(torch, "__version__", version)
    assert utils.is_torch_version_greater_than_2() is greater_than_2
    assert utils.requires_init_pg_override() is override


def test_torch_version_helpers_on_this_torch():
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    assert utils.is_torch_version_greater_than_2() is (major >= 2)
    assert utils.requires_init_pg_override() is ((major, minor) == (2, 0))


def test_is_pjrt_device(monkeypatch):
    for value, expected in (("NEURON", True), ("CPU", True), ("CUDA", True), ("TPU", True), ("", False),
                            (None, False)):
        if value is None:
            monkeypatch.delenv("PJRT_DEVICE", raising=False)
        else:
            monkeypatch.setenv("PJRT_DEVICE", value)
        assert utils.is_pjrt_device() is expected, value


def test_fallback_backend_for_each_device(monkeypatch):
    import torch.distributed as dist

    # Imports add entries to torch's global map (transformers registers "hpu", torch_xla "xla"): fix it for the test.
    monkeypatch.setattr(dist.Backend, "default_device_backend_map",
                        {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl", "mps": "gloo"})
    expected = {None: "gloo", "cpu": "gloo", "meta": "gloo", "xla": "xla", "cuda": "cpu:gloo,cuda:nccl",
                "xpu": "cpu:gloo,xpu:xccl", "mps": "gloo"}
    for device, backend in expected.items():
        assert ps.single_process_backend(torch.device(device) if device else None) == backend, device
    with pytest.raises(ValueError, match=r"no torch.distributed backend is known for device 'hpu'; valid device "
                                         r"types are \['cpu', 'cuda', 'meta', 'mps', 'xla', 'xpu'\], or None \(CPU\)"):
        ps.single_process_backend(torch.device("hpu"))


def _fallback_script(device_kind: str) -> dict:
    """Runs in a fresh process (no torch.distributed world yet): the fallback, then a TP layer pair and the
    vocab-parallel loss against torch.nn, every parameter random."""
    import random

    import numpy as np
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    from nxdtp import layers
    from nxdtp.loss_functions import parallel_cross_entropy

    if device_kind == "xla":
        import torch_xla

        device = torch_xla.device()
    else:
        device = None
    assert not dist.is_initialized()
    torch.manual_seed(123)
    utils.initialize_fallback_parallel_state(device)
    out = dict(backend=str(dist.get_backend()), world=dist.get_world_size(), tp=ps.get_tensor_model_parallel_size(),
               dp=ps.get_data_parallel_size(), torch_seed=torch.initial_seed(),
               python_random=random.random(), numpy_random=float(np.random.rand()))
    random.seed(0)
    np.random.seed(0)
    out["seeded_like_zero"] = (out["python_random"] == random.random(), out["numpy_random"] == float(np.random.rand()))
    from nxdtp.random import get_xla_rng_tracker
    out["tracker"] = sorted(get_xla_rng_tracker().get_states())

    g = torch.Generator().manual_seed(7)
    torch.manual_seed(11)
    column = layers.ColumnParallelLinear(6, 10, gather_output=False)
    torch.manual_seed(11)
    dense_column = nn.Linear(6, 10)
    torch.manual_seed(12)
    row = layers.RowParallelLinear(10, 5, input_is_parallel=True)
    torch.manual_seed(12)
    dense_row = nn.Linear(10, 5)
    x = torch.randn(4, 6, generator=g)
    target = torch.randint(0, 10, (4,), generator=g)
    model = nn.ModuleList([column, row])
    if device is not None:
        utils.move_model_to_device(model, device)
    xd = x.to(device) if device is not None else x
    hidden = column(xd)
    loss = parallel_cross_entropy(hidden, target.to(hidden.device), reduction="mean") + row(hidden).square().mean()
    loss.backward()
    dense_hidden = dense_column(x)
    dense_loss = F.cross_entropy(dense_hidden, target) + dense_row(dense_hidden).square().mean()
    dense_loss.backward()
    def close(a, b):
        return bool(torch.allclose(a.detach().cpu(), b.detach(), rtol=1e-5, atol=1e-5))

    out["equal"] = dict(loss=close(loss, dense_loss), column_grad=close(column.weight.grad, dense_column.weight.grad),
                        row_grad=close(row.weight.grad, dense_row.weight.grad),
                        row_bias_grad=close(row.bias.grad, dense_row.bias.grad))
    try:
        utils.initialize_fallback_parallel_state(device)
    except RuntimeError as e:
        out["again"] = str(e)
    return out


def _run_fallback_script(device_kind: str, env: dict, script: str = "_fallback_script") -> dict:
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = (f"import json, sys; from tests.test_utils import {script}; "
            f"print('RESULT' + json.dumps({script}({device_kind!r})))")
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", **env})
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT")]
    assert run.returncode == 0 and lines, run.stdout + run.stderr
    return json.loads(lines[-1][len("RESULT"):])


def _implicit_fallback_script(device_kind: str) -> dict:
    """Runs in a fresh process: a layer built before any parallel state falls back to a world of one, as NxD's does."""
    import warnings

    import torch.distributed as dist
    from torch import nn

    from nxdtp import layers

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(5)
        column = layers.ColumnParallelLinear(6, 10)
    torch.manual_seed(5)
    dense = nn.Linear(6, 10)
    x = torch.randn(3, 6)
    return dict(warned=[str(w.message) for w in caught], world=dist.get_world_size(),
                tp=ps.get_tensor_model_parallel_size(), equal=bool(torch.equal(column(x), dense(x))))


def test_a_layer_built_before_initialisation_falls_back_to_one_process():
    out = _run_fallback_script("cpu", {}, script="_implicit_fallback_script")
    assert out["world"] == 1 and out["tp"] == 1 and out["equal"], out
    assert any("model parallel is not initialized: falling back to a world of one process" in w for w in out["warned"])


def case_layer_before_initialisation_in_a_world_of_two():
    """In a world of two processes, a layer built before initialize_model_parallel says what it installed, and the
    initialisation that comes too late says where that came from."""
    from nxdtp import layers

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layers.ColumnParallelLinear(4, 4)
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=2)
    except RuntimeError as e:
        late = str(e)
    else:
        late = None
    return [str(w.message) for w in caught], late, ps.get_data_parallel_size()


def test_a_layer_built_before_initialisation_in_a_world_of_two_says_what_it_installed(worlds):
    for warned, late, dp in worlds(2).run(case_layer_before_initialisation_in_a_world_of_two,
                                           tensor_model_parallel_size=None):
        assert dp == 2
        assert any("falling back to tensor_model_parallel_size=1 over the 2 processes of this world" in w
                   and "call initialize_model_parallel(...) before building layers" in w for w in warned), warned
        assert late is not None and "already initialized (tensor_model_parallel_size=1, world size 2) (if not by " \
            "you: a parallel layer built before initialize_model_parallel installs this fallback" in late, late


def _fallback_world_at_exit_script(device_kind: str) -> dict:
    """Runs in a fresh process: reports, from an exit handler that runs after nxdtp's, whether the world of one that
    the fallback made is still up when the interpreter ends."""
    import atexit

    import torch.distributed as dist

    from nxdtp import layers

    atexit.register(lambda: print("AT_EXIT_INITIALIZED" + str(dist.is_initialized())))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        layers.ColumnParallelLinear(6, 10)
    return dict(world=dist.get_world_size())


def test_the_fallback_world_is_destroyed_before_the_interpreter_ends():
    """Left to interpreter shutdown, gloo's threads outlive it and abort a finished process (SIGABRT, "terminate called
    without an active exception"), which a loaded machine made likely: the world nxdtp made, nxdtp ends at exit."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = "from tests.test_utils import _fallback_world_at_exit_script as f; print('RESULT', f('cpu'))"
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "RESULT {'world': 1}" in run.stdout and "AT_EXIT_INITIALIZEDFalse" in run.stdout, run.stdout + run.stderr


USERS_WORLD_SCRIPT = """
import atexit
import torch.distributed as dist
from torch.distributed import distributed_c10d
from nxdtp import parallel_state as ps

def report():  # registered first, so it runs after nxdtp's exit handler
    print("AT_EXIT", len(distributed_c10d._world.pg_map), dist.is_initialized(), flush=True)
    dist.destroy_process_group()

atexit.register(report)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
ps.initialize_model_parallel(tensor_model_parallel_size=1)
print("MADE", len(distributed_c10d._world.pg_map), flush=True)
"""


def test_the_groups_nxdtp_made_are_released_at_exit_and_the_users_world_is_left_to_the_user():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", USERS_WORLD_SCRIPT], cwd=root, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    made = [int(line.split()[1]) for line in run.stdout.splitlines() if line.startswith("MADE")]
    assert made and made[0] > 1, run.stdout   # the user's world and nxdtp's groups
    assert "AT_EXIT 1 True" in run.stdout, run.stdout + run.stderr   # only the user's world is left


ALREADY = ("initialize_fallback_parallel_state: model parallel is already initialized; call "
           "nxdtp.parallel_state.destroy_model_parallel() first to replace it")


def test_initialize_fallback_parallel_state_on_cpu():
    out = _run_fallback_script("cpu", {})
    assert (out["backend"], out["world"], out["tp"], out["dp"]) == ("gloo", 1, 1, 1), out
    assert out["torch_seed"] == 123 and out["tracker"] == [], "no seeding off XLA (NxD seeds only there)"
    assert out["equal"] == dict(loss=True, column_grad=True, row_grad=True, row_bias_grad=True), out["equal"]
    assert out["again"] == ALREADY, out


@pytest.mark.xla
def test_initialize_fallback_parallel_state_on_xla():
    pytest.importorskip("torch_xla")
    out = _run_fallback_script("xla", {"PJRT_DEVICE": "CPU"})
    assert (out["backend"], out["world"], out["tp"], out["dp"]) == ("xla", 1, 1, 1), out
    # NxD's set_random_seed(0): Python's and numpy's generators, torch's, and the RNG tracker.
    assert out["torch_seed"] == 0 and out["seeded_like_zero"] == [True, True], out
    assert out["tracker"] == ["model-parallel-rng"], out
    assert out["equal"] == dict(loss=True, column_grad=True, row_grad=True, row_bias_grad=True), out["equal"]
    assert out["again"] == ALREADY, out


def case_fallback_in_an_existing_world():
    import torch.distributed as dist

    world = dist.get_world_size()
    utils.initialize_fallback_parallel_state()          # the pool's gloo world: tp=1, every rank a DP replica
    return (dist.get_world_size() == world, ps.get_tensor_model_parallel_size(), ps.get_data_parallel_size(),
            ps.get_data_parallel_rank() == dist.get_rank())


def test_initialize_fallback_parallel_state_keeps_an_existing_world(worlds):
    results = worlds(2).run(case_fallback_in_an_existing_world, tensor_model_parallel_size=None)
    assert results == [(True, 1, 2, True)] * 2


def test_set_tensor_model_parallel_attributes_takes_nxds_parameters():
    p = torch.nn.Parameter(torch.ones(2, 3))
    with ps.simulated_topology(world_size=4, rank=1, tensor_model_parallel_size=4):
        utils.set_tensor_model_parallel_attributes(p, True, 1, 1)          # num_partitions=-1: the TP size, as NxD
        assert (p.tensor_model_parallel, p.partition_dim, p.partition_stride, p.num_partitions) == (True, 1, 1, 4)
        utils.set_tensor_model_parallel_attributes(p, True, 0, 2, 2, None)
        assert (p.partition_dim, p.partition_stride, p.num_partitions) == (0, 2, 2)
        utils.set_tensor_model_parallel_attributes(p, True, 1, 1, 4, [0, 1, 2, 3])    # the identity: as None
        assert (p.partition_dim, p.num_partitions) == (1, 4)
        with pytest.raises(ValueError, match=r"rank_ordering=\[1, 0, 2, 3\] is not supported by nxdtp: "
                                             r"tensor-parallel rank r holds shard r; valid are None or \[0, 1, 2, 3\]"):
            utils.set_tensor_model_parallel_attributes(p, True, 0, 1, 4, [1, 0, 2, 3])


# ---- NxD 2.29's signatures: positional order, names and defaults -----------------------------------------------------

REQUIRED = object()


def check_nxd_signature(function, nxd_parameters):
    """``function`` takes NxD's parameters first, by position and by name, with NxD's defaults; nxdtp may add
    parameters after them, and may give a default to one NxD requires."""
    import inspect

    positional = [p for p in inspect.signature(function).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = [name for name, _ in nxd_parameters]
    assert [p.name for p in positional[:len(names)]] == names, (function.__qualname__, positional)
    for parameter, (name, default) in zip(positional, nxd_parameters):
        if default is not REQUIRED:
            assert parameter.default == default, (function.__qualname__, name, parameter.default, default)


NXD_UTILS = {
    "param_is_not_tensor_parallel_duplicate": [("param", REQUIRED)],
    "set_tensor_model_parallel_attributes": [("tensor", REQUIRED), ("is_parallel", REQUIRED), ("dim", REQUIRED),
                                             ("stride", REQUIRED), ("num_partitions", -1), ("rank_ordering", None)],
    "set_defaults_if_not_set_tensor_model_parallel_attributes": [("tensor", REQUIRED)],
    "copy_tensor_model_parallel_attributes": [("destination_tensor", REQUIRED), ("source_tensor", REQUIRED)],
    "ensure_divisibility": [("numerator", REQUIRED), ("denominator", REQUIRED)],
    "divide": [("numerator", REQUIRED), ("denominator", REQUIRED)],
    "split_tensor_along_dim": [("tensor", REQUIRED), ("dim", REQUIRED), ("num_partitions", REQUIRED),
                               ("contiguous_split_chunks", False)],
    "get_padding_length": [("numerator", REQUIRED), ("denominator", REQUIRED)],
    "split_tensor_along_last_dim": [("tensor", REQUIRED), ("num_partitions", REQUIRED),
                                    ("contiguous_split_chunks", False)],
    "split_tensor_along_second_dim": [("tensor", REQUIRED), ("num_partitions", REQUIRED),
                                      ("contiguous_split_chunks", False)],
    "is_torch_version_greater_than_2": [], "is_pjrt_device": [], "requires_init_pg_override": [],
    "cast_tensor": [("tensor", REQUIRED), ("from_dtype", torch.float32), ("to_dtype", torch.bfloat16)],
    "cast_all": [("state", REQUIRED), ("from_dtype", torch.float32), ("to_dtype", torch.bfloat16)],
    "cast_if_autocast_enabled": [],
    "move_all_tensor_to_cpu": [("data", REQUIRED), ("convert", True)],
    "get_local_world_size": [],
    "move_model_to_device": [("model", REQUIRED), ("device", REQUIRED)],
    "verify_casted_dtype": [("value", REQUIRED)],
    "indices_split_along_dim": [("tensor", REQUIRED), ("dim", REQUIRED), ("rank", REQUIRED),
                                ("num_partitions", REQUIRED)],
    "initialize_fallback_parallel_state": [("device", None)],
    "EmbeddingUtility.range_from_per_partition_vocab_size": [("per_partition_vocab_size", REQUIRED),
                                                             ("rank", REQUIRED), ("world_size", REQUIRED)],
    "EmbeddingUtility.range_from_global_vocab_size": [("global_vocab_size", REQUIRED), ("rank", REQUIRED),
                                                      ("world_size", REQUIRED)],
}


@pytest.mark.parametrize("name", sorted(NXD_UTILS))
def test_utils_signatures_are_nxds(name):
    function = utils
    for part in name.split("."):
        function = getattr(function, part)
    check_nxd_signature(function, NXD_UTILS[name])


def test_move_model_to_device_keeps_hand_set_attributes():
    """A parameter of a plain module marked by hand keeps its marks across a move that replaces Parameter objects."""
    model = torch.nn.Linear(4, 3)
    with ps.simulated_topology(world_size=2, rank=1, tensor_model_parallel_size=2):
        utils.set_tensor_model_parallel_attributes(model.weight, True, 0, 1)
    original = model.weight
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        utils.move_model_to_device(model, "cpu")
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    assert model.weight is not original, "the move did not replace the Parameter: nothing was tested"
    assert (model.weight.tensor_model_parallel, model.weight.partition_dim, model.weight.num_partitions) == (True, 0, 2)
    assert not hasattr(model.bias, "tensor_model_parallel")


# ---- NxD's neuronx_distributed.utils.batch_utils (nxdtp.utils.batch_utils) -------------------------------------------

def _batch():
    g = torch.Generator().manual_seed(3)
    return {"input_ids": torch.randint(0, 50, (2, 8), generator=g),
            "attention_mask": torch.ones(2, 8, dtype=torch.long), "labels": torch.randint(0, 50, (2, 8), generator=g)}


def test_get_batch_on_this_context_parallel_rank_is_the_identity_at_context_parallel_size_1():
    from nxdtp.utils.batch_utils import get_batch_on_this_context_parallel_rank

    check_nxd_signature(get_batch_on_this_context_parallel_rank, [("batch", REQUIRED)])
    batch = _batch()
    tensors = dict(batch)
    with ps.simulated_topology(world_size=4, rank=3, tensor_model_parallel_size=2):
        assert ps.get_context_model_parallel_size() == 1
        result = get_batch_on_this_context_parallel_rank(batch)
    # NxD returns the batch it was given at size 1: the same dict holding the same tensors, labels not shifted.
    assert result is batch and all(result[k] is tensors[k] for k in tensors) and result.keys() == tensors.keys()
    with pytest.raises(RuntimeError, match="model parallel is not initialized"):
        get_batch_on_this_context_parallel_rank(batch)


@pytest.mark.parametrize("size", [2, 4])
def test_get_batch_on_this_context_parallel_rank_refuses_a_larger_context_parallel_size(monkeypatch, size):
    # nxdtp's topology cannot have context parallelism, so the getter is made to report it: the function must read the
    # size from parallel_state (not assume 1) and refuse, naming the size, instead of returning the uncut batch.
    from nxdtp.utils.batch_utils import get_batch_on_this_context_parallel_rank

    monkeypatch.setattr(ps, "get_context_model_parallel_size", lambda: size)
    batch = _batch()
    with ps.simulated_topology(world_size=4, rank=0, tensor_model_parallel_size=2):
        with pytest.raises(ValueError, match=rf"context_parallel_size={size}: nxdtp has no context parallelism"):
            get_batch_on_this_context_parallel_rank(batch)
    assert torch.equal(batch["labels"], _batch()["labels"]), "the refused call changed the batch"


def test_shift_labels_moves_labels_one_position_left():
    from nxdtp.utils.batch_utils import shift_labels

    check_nxd_signature(shift_labels, [("batch", REQUIRED)])
    batch = _batch()
    shifted = shift_labels(batch)
    expected = torch.full_like(batch["labels"], -100)
    for position in range(batch["labels"].shape[1] - 1):   # position i gets the label of token i + 1
        expected[:, position] = batch["labels"][:, position + 1]
    assert torch.equal(shifted["labels"], expected) and shifted["labels"].dtype == batch["labels"].dtype
    assert shifted is not batch and shifted["input_ids"] is batch["input_ids"]
    assert torch.equal(batch["labels"], _batch()["labels"]), "the input batch was changed"
    assert shift_labels({"input_ids": batch["input_ids"]}) == {"input_ids": batch["input_ids"]}
