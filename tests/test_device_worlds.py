"""nxdtp on worlds whose default torch.distributed backend is not gloo, as on every real accelerator.

Two such worlds run on a CPU machine: torch_xla's "xla" backend (what the example starts on Trainium and TPU), whose
groups refuse CPU tensors as NCCL's do, and tests/cpu_refusing_backend.py, a stand-in for NCCL or any other device
backend. The dense-equality tests of the gloo suite run unchanged in both: they pass only if every CPU-tensor collective
(model build, sharding, pretrained loading, checkpoints, loss and metric reductions) goes over nxdtp's gloo groups.
On XLA worlds the groups also carry the full mesh, so NxD-style ``torch.distributed`` calls with nxdtp's groups name
every replica group; and checkpoint saving runs the pending graph on every rank before any rank reads to the host.
"""

import os
import re

import pytest
import torch

from nxdtp import cli as merge_cli
from nxdtp import parallel_state as ps
from tests import (
    test_checkpointing,
    test_comm,
    test_grads,
    test_layers,
    test_loss_functions,
    test_models_bert,
    test_models_bert_loading,
    test_zero1,
)
from tests.test_example_pretrain import data_dir, model_config  # noqa: F401 - fixtures

DEVICE_BACKENDS = ("xla", "cpu_refusing")


@pytest.fixture(params=DEVICE_BACKENDS)
def device_worlds(request, worlds):
    """Like ``worlds``, but every pool's default backend is ``request.param``."""
    return lambda world_size: worlds(world_size, request.param)


# ---- the gloo suite's dense-equality cases, unchanged ----------------------------------------------------------------

def test_collectives_equal_dense_math(device_worlds):
    test_comm.test_collectives_equal_dense_math(device_worlds, world=2, tp=2)


def test_linear_and_embedding_layers_equal_dense(device_worlds):
    test_layers.test_same_seed_construction_equals_dense_slice(device_worlds, world=2, tp=2)
    test_layers.test_linear_layers_equal_dense(device_worlds, world=2, tp=2)
    test_layers.test_parallel_embedding_equals_dense(device_worlds, world=2, tp=2)
    test_layers.test_sequence_parallel_equals_dense(device_worlds, world=2, tp=2)


def test_grads_and_loss_equal_dense(device_worlds):
    test_grads.test_grad_norm_clip_and_dp_allreduce_equal_dense(device_worlds, world=2, tp=2)
    test_loss_functions.test_parallel_cross_entropy_matches_dense(device_worlds, world=2, tp=2)


def test_parallelize_bert_forward_backward_equals_dense(device_worlds):
    test_models_bert.test_pretraining_equals_dense(device_worlds, world=2, tp=2)


def test_from_pretrained_sharded_equals_from_pretrained(device_worlds, tmp_path):
    test_models_bert_loading.test_from_pretrained_sharded_equals_from_pretrained(device_worlds, tmp_path, world=2,
                                                                                  tp=2)


def test_checkpoint_save_load_resumes_exactly(device_worlds, tmp_path):
    test_checkpointing.test_resume_is_exact_with_optimizer_scheduler_and_rng(device_worlds, tmp_path, world=2)


# ZeRO-1's reduce-scatter, norm and all-gather of CPU tensors must take the gloo twins of the DP and TP groups.
ZERO1_CONFIGS = [(4, 2, "llama", "adamw", 2.0, "hook", 0.5), (4, 1, "bert", "lamb", 2.0, "none", 0.5)]


@pytest.mark.parametrize("world,tp,model,inner,norm_type,accumulate,max_norm", ZERO1_CONFIGS,
                         ids=["tp2xdp2-llama-adamw-acc_hook", "tp1xdp4-bert-lamb"])
def test_zero1_equals_dense(device_worlds, world, tp, model, inner, norm_type, accumulate, max_norm):
    test_zero1.test_zero1_equals_dense(device_worlds, world, tp, model, inner, norm_type, accumulate, max_norm)


def test_zero1_hybrid_sharding_equals_dense(device_worlds):
    """ZeRO-1 sharded over pairs of each DP group (issue 24): the sharding and replica groups made after
    initialize_model_parallel get gloo twins (and, on XLA worlds, the full mesh), and the step equals dense."""
    from tests import test_zero1_groups

    test_zero1_groups.test_hybrid_sharding_equals_dense(device_worlds, 4, 1, [[0, 2], [1, 3]], "grad")


@pytest.mark.slow  # two pools per backend (a world of 4, then 2): about 50 s each on 2 cores
def test_zero1_checkpoint_saves_and_resumes_at_another_dp_size(device_worlds, tmp_path):
    """A ZeRO-1 checkpoint saved at tp2 x dp2 and resumed at tp2 x dp1 (its flat shards re-cut): the host copies,
    tag agreement and re-cutting of ZeRO-1 state take the gloo twins; the resumed step equals the dense run."""
    from tests import test_zero1_checkpoints

    directory = str(tmp_path / "ckpt")
    device_worlds(4).run(test_zero1_checkpoints.case_save, tensor_model_parallel_size=2, directory=directory)
    device_worlds(2).run(test_zero1_checkpoints.case_resume, tensor_model_parallel_size=2, directory=directory)


# ---- which group each device's tensors use ---------------------------------------------------------------------------

def case_groups_by_device():
    import torch.distributed as dist

    default_backend = dist.get_backend()
    out = {"default": default_backend, "host": dist.get_backend(ps.get_topology().host_process_group)}
    for group in (ps.tensor_parallel_group(), ps.data_parallel_group()):
        out[group.kind] = {
            "cpu": dist.get_backend(group.cpu_process_group),
            "device": dist.get_backend(group.process_group),
            "nxd_getter_is_device_group": (ps.get_tensor_model_parallel_group() if group.kind == "tensor"
                                           else ps.get_data_parallel_group()) is group.process_group,
            "mesh": getattr(group.process_group, "_mesh", None),
        }
    return out


def case_nxd_style_all_reduce_names_every_replica_group():
    """NxD's own code calls ``dist.all_reduce(xla_tensor, group=get_tensor_model_parallel_group())``: trace it."""
    import torch.distributed as dist
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()
    replica_groups = {}
    # The XLA:CPU runtime is a world of 1, where xm.all_reduce would return its input without lowering a collective.
    # The HLO is only read, never run.
    os.environ["XLA_ALWAYS_ALLREDUCE"] = "1"
    try:
        for kind, group in (("tensor", ps.get_tensor_model_parallel_group()), ("data", ps.get_data_parallel_group())):
            torch_xla._XLAC._set_all_reduce_token(xm._get_device_context().device, None)
            tensor = torch.ones(4, device=device)
            dist.all_reduce(tensor, group=group)
            hlo = torch_xla._XLAC._get_xla_tensors_hlo([tensor])
            replica_groups[kind] = re.findall(r"all-reduce\(.*replica_groups=(\{[\d,{}]*\})", hlo)
    finally:
        del os.environ["XLA_ALWAYS_ALLREDUCE"]
        torch_xla._XLAC._set_all_reduce_token(xm._get_device_context().device, None)
    return replica_groups


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_every_group_has_a_gloo_twin_for_cpu_tensors(worlds, backend):
    for rank, result in enumerate(worlds(2, backend).run(case_groups_by_device, tensor_model_parallel_size=2)):
        assert result["default"] == backend and result["host"] == "gloo", result
        for kind in ("tensor", "data"):
            assert result[kind]["cpu"] == "gloo", (rank, kind, result)
            assert result[kind]["device"] == backend, (rank, kind, result)
            assert result[kind]["nxd_getter_is_device_group"], (rank, kind, result)


def test_a_gloo_world_uses_one_group_for_everything(worlds):
    for result in worlds(2).run(case_groups_by_device, tensor_model_parallel_size=2):
        assert result["host"] == "gloo" and result["default"] == "gloo", result
        assert result["tensor"]["cpu"] == result["tensor"]["device"] == "gloo", result


def test_xla_groups_carry_the_full_mesh(worlds):
    world = worlds(4, "xla")
    tp_lists, dp_lists = [[0, 1], [2, 3]], [[0, 2], [1, 3]]
    for rank, result in enumerate(world.run(case_groups_by_device, tensor_model_parallel_size=2)):
        assert result["tensor"]["mesh"] == tp_lists, (rank, result)
        assert result["data"]["mesh"] == dp_lists, (rank, result)
    traced = world.run(case_nxd_style_all_reduce_names_every_replica_group, tensor_model_parallel_size=2)
    for rank, replica_groups in enumerate(traced):
        assert replica_groups == {"tensor": ["{{0,1},{2,3}}"], "data": ["{{0,2},{1,3}}"]}, (rank, replica_groups)


def test_tp2_dp2_bert_on_an_xla_world_equals_dense(worlds):
    # The TP x DP global-batch case of the gloo suite, on a 4-rank "xla" world (DP groups are strided).
    test_models_bert.test_tp2_dp2_global_batch_equals_dense(lambda world_size: worlds(world_size, "xla"))


# ---- checkpoint saving on XLA: the pending graph runs on every rank first --------------------------------------------

def case_save_runs_the_pending_graph_first(root: str, down_cast_bf16: bool):
    """tp=1 x dp=2 on XLA:CPU: only DP rank 0 writes the model, so any graph run by a host read would run on it
    alone."""
    import torch_xla
    import torch_xla.debug.metrics as met

    from nxdtp import layers
    from nxdtp.checkpointing import load, save, save_load
    from nxdtp.utils import move_model_to_device

    def executions() -> int:
        return met.counter_value("ExecuteComputation") or 0

    device = torch_xla.device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(layers.ColumnParallelLinear(8, 16, gather_output=False),
                                layers.RowParallelLinear(16, 8, input_is_parallel=True))
    move_model_to_device(model, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch_xla.sync()
    # A step left pending, as a training loop leaves it when it saves before its graph boundary.
    model(torch.randn(4, 8).to(device)).square().sum().backward()
    optimizer.step()

    at_first_write = []
    original_write = save_load._write_tensors

    def recording_write(path, *args, **kwargs):
        if os.path.basename(os.path.dirname(path)) == "model":  # the optimizer's rank files are written by it too
            at_first_write.append(executions())
        return original_write(path, *args, **kwargs)

    before = executions()
    save_load._write_tensors = recording_write
    try:
        save({"model": model, "optimizer": optimizer, "global_step": 1}, root, down_cast_bf16=down_cast_bf16)
    finally:
        save_load._write_tensors = original_write
    after_save = executions()
    saved = {k: v.cpu() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}

    torch.manual_seed(1)
    fresh = torch.nn.Sequential(layers.ColumnParallelLinear(8, 16, gather_output=False),
                                layers.RowParallelLinear(16, 8, input_is_parallel=True))
    move_model_to_device(fresh, device)
    torch_xla.sync()
    before_load = executions()
    load(root, model=fresh)
    after_load = executions()
    loaded = {k: v.cpu() for k, v in fresh.state_dict().items() if isinstance(v, torch.Tensor)}
    expected = {k: v.to(torch.bfloat16).float() if down_cast_bf16 else v for k, v in saved.items()}
    return dict(in_save=after_save - before,
                before_first_write=(at_first_write[0] - before) if at_first_write else None,
                writes=len(at_first_write), in_load=after_load - before_load,
                loaded_equal=all(torch.equal(loaded[k], expected[k]) for k in expected))


@pytest.mark.parametrize("down_cast_bf16", [False, True], ids=["fp32", "bf16"])
def test_save_on_xla_runs_the_pending_graph_on_every_rank_first(worlds, tmp_path, down_cast_bf16):
    results = worlds(2, "xla").run(case_save_runs_the_pending_graph_first, tensor_model_parallel_size=1,
                                   root=str(tmp_path / "ckpt"), down_cast_bf16=down_cast_bf16)
    writer, other = results
    assert writer["writes"] == 1 and other["writes"] == 0, results  # DP rank 0 writes, DP rank 1 does not
    # The pending step ran inside save, on both ranks, before the writer's first host read ...
    assert writer["in_save"] >= 1 and writer["before_first_write"] == writer["in_save"], results
    # ... and nothing else ran on one rank only: the ranks executed the same graphs.
    assert other["in_save"] == writer["in_save"], results
    assert writer["in_load"] == other["in_load"], results
    assert writer["loaded_equal"] and other["loaded_equal"], results


# ---- the example, started inside such a world ------------------------------------------------------------------------

def _train_example(pool, argv):
    from tests.test_example_pretrain import case_train

    return pool.run(case_train, tensor_model_parallel_size=None, argv=argv)


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_the_example_builds_trains_saves_and_resumes_in_the_world(worlds, backend, data_dir, model_config, tmp_path):  # noqa: F811 - fixtures
    from tests.test_example_pretrain import assert_curves_agree, losses, step_log, training_argv

    def argv(name, tp, dp, steps=4, *extra):
        args = training_argv(data_dir, model_config, str(tmp_path / name), tp, dp, 8, 1, 4, 2e-3, 0.0, *extra)
        args[args.index("--steps_this_run") + 1] = str(steps)
        return args

    _train_example(worlds(2), argv("gloo", 2, 1))
    reference = losses(str(tmp_path / "gloo"))
    # Build, shard, train 2 steps and save; resume and train to step 4: the gloo world's curve, bit for bit.
    _train_example(worlds(2, backend), argv("split", 2, 1, 2))
    _train_example(worlds(2, backend), argv("split", 2, 1, 4, "--resume_ckpt"))
    resumed = step_log(str(tmp_path / "split"))
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["loss"] for r in resumed] == reference
    # DDP over the DP group of CPU tensors takes the gloo twin; TP=1 x DP=2 is the same global batch.
    _train_example(worlds(2, backend), argv("ddp", 1, 2, 4, "--ddp"))
    assert_curves_agree(losses(str(tmp_path / "ddp")), reference, 1e-4)
    # Merge (no device needed), then start new runs from the merged weights: TP=2 in this world, TP=1 x DP=2 on gloo.
    merged = str(tmp_path / "merged")
    assert merge_cli.main([str(tmp_path / "gloo"), merged]) == 0
    _train_example(worlds(2, backend), argv("from_merged_tp2", 2, 1, 2, "--init_from", merged))
    _train_example(worlds(2), argv("from_merged_dp2", 1, 2, 2, "--init_from", merged))
    from_merged = losses(str(tmp_path / "from_merged_tp2"))
    assert_curves_agree(from_merged, losses(str(tmp_path / "from_merged_dp2")), 1e-4)
    # The trained weights were really loaded: the first batch's loss is below the untrained model's.
    assert from_merged[0] < reference[0] - 0.05, (from_merged, reference)


def test_the_example_on_an_xla_device_resumes_loads_pretrained_and_keeps_bf16_masters(worlds, data_dir,  # noqa: F811 - fixtures
                                                                                       model_config, tmp_path):  # noqa: F811 - fixtures
    """--device xla in an "xla" world of one process (XLA:CPU runs one replica per process): the model is built and
    sharded on the host, moved to the device, saved with the step's graph synced, resumed, and started from merged
    weights, with the code the CPU runs use."""
    from nxdtp.checkpointing import CheckpointIndex, resolve_tag
    from tests.test_example_pretrain import assert_curves_agree, losses, step_log, training_argv

    pool = worlds(1, "xla")

    def argv(name, steps, *extra):
        args = training_argv(data_dir, model_config, str(tmp_path / name), 1, 1, 8, 1, 4, 2e-3, 0.0, *extra)
        args[args.index("--steps_this_run") + 1] = str(steps)
        args[args.index("--device") + 1] = "xla"
        return args

    _train_example(pool, argv("straight", 4))
    straight = step_log(str(tmp_path / "straight"))
    _train_example(pool, argv("split", 2))
    _train_example(pool, argv("split", 4, "--resume_ckpt"))
    resumed = step_log(str(tmp_path / "split"))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    # The resumed run's steps after its first two compile nothing (its graphs are the uninterrupted run's).
    assert resumed[-1]["xla_uncached_compiles"] == resumed[-2]["xla_uncached_compiles"], resumed

    merged = str(tmp_path / "merged")
    assert merge_cli.main([str(tmp_path / "straight"), merged]) == 0
    _train_example(pool, argv("from_merged", 1, "--init_from", merged))
    assert losses(str(tmp_path / "from_merged"))[0] < straight[0]["loss"] - 0.05

    # --bf16 on the device: bf16 compute, fp32 master weights (what the checkpoint holds) and an fp32 loss.
    _train_example(pool, argv("bf16", 4, "--bf16"))
    assert_curves_agree(losses(str(tmp_path / "bf16")), [r["loss"] for r in straight], 0.05 * straight[0]["loss"])
    index = CheckpointIndex.read(resolve_tag(str(tmp_path / "bf16"), None))
    assert {entry.dtype for entry in index.tensors.values() if entry.dtype.startswith(("float", "bfloat"))} == \
        {"float32"}, index.tensors


# ---- attention heads TP does not divide, and NxD's GQA layer, on device worlds ---------------------------------------

@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_grouped_query_zero_heads_and_gqa_layer_equal_dense(worlds, backend):
    # The rank-local mask of zero heads and the summed KV-copy gradients, where CPU tensors must use the gloo twins.
    from tests import test_models_decoders, test_qkv_linear

    four = lambda world_size: worlds(world_size, backend)  # noqa: E731
    test_models_decoders.test_grouped_query_heads_tp_does_not_divide_are_padded(four, sp=False)
    test_qkv_linear.test_gqa_block_equals_dense_at_tp4(four, multiplier=2, fuse=True, sp=False)


# ---- save_pretrained on device worlds --------------------------------------------------------------------------------

def test_save_pretrained_equals_merge_and_loads_in_transformers(device_worlds, tmp_path):
    # The gathers are CPU broadcasts: on these worlds they must take the gloo twins of the TP groups.
    from tests import test_save_pretrained

    test_save_pretrained.test_save_pretrained_equals_merge_and_loads_in_transformers(device_worlds, tmp_path, "gpt2",
                                                                                     2, 2)


def case_save_pretrained_from_an_xla_device(root: str):
    """A parallelized GPT-2 moved to the XLA device, with an update left pending, saves what the same update gives on
    CPU: the pending graph runs on every rank before any rank reads a tensor to the host."""
    import torch_xla

    from nxdtp.utils import move_model_to_device
    from tests.test_save_pretrained import _parallel

    on_cpu, on_xla = _parallel("gpt2"), _parallel("gpt2")
    move_model_to_device(on_xla, torch_xla.device())
    torch_xla.sync()
    with torch.no_grad():
        for model in (on_cpu, on_xla):
            for param in model.parameters():
                param.mul_(1.5)   # pending on XLA until the save runs it
    on_cpu.save_pretrained(os.path.join(root, "cpu"))
    on_xla.save_pretrained(os.path.join(root, "xla"))
    return True


def test_save_pretrained_from_an_xla_device(worlds, tmp_path):
    worlds(2, "xla").run(case_save_pretrained_from_an_xla_device, tensor_model_parallel_size=2, root=str(tmp_path))
    with open(tmp_path / "cpu" / "model.safetensors", "rb") as a, open(tmp_path / "xla" / "model.safetensors",
                                                                       "rb") as b:
        assert a.read() == b.read()
