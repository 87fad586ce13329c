"""ZeRO-1 over any DP-aligned sharding groups (issue 24): hybrid sharding, on gloo ranks.

``NeuronZero1Optimizer(sharding_groups=...)`` takes NxD's lists of global ranks. Groups that cut every DP group into
groups of one size k shard the optimizer state over k ranks and replicate it over the dp / k groups of a DP group; the
step reduce-scatters within the sharding group, all-reduces the shards over the replica group, divides by the DP size,
takes the pre-clip norm once per shard (over TP x sharding group), clips, steps, all-gathers within the sharding group.

* tp1 x dp4 sharded over strided pairs {0, 2}, {1, 3} (replicas {0, 1}, {2, 3}), tp2 x dp2 over single ranks (k = 1:
  no sharding, the state replicated over DP), and tp2 x dp4 over pairs (a world of 8, slow): after 3 AdamW steps with
  clipping that clips and 2 micro-steps of accumulation (in ``.grad``, and in ``main_grad`` with
  ``use_grad_acc_hook``), every parameter equals the dense model trained on the concatenated batch (test_zero1's
  reference), ``grad_norm`` equals the dense pre-clip norm at every step, the replicas of a shard hold the same
  master weights, and the state bytes are exactly those of 1/k of every parameter (<= plain AdamW's / k plus padding
  and step counters). test_device_worlds runs the tp1 x dp4 case on worlds whose default backend refuses CPU tensors
  ("xla", and tests/cpu_refusing_backend.py): the new groups' gloo twins carry them.
* Checkpoints (test_zero1_checkpoints' cases with ``sharding=2``) saved at tp1 x dp4 over pairs: only one replica of
  each shard is written (k files per TP rank, named by the sharding rank; the index records k); a resume at the saved
  layout is bit-exact; resumes at dp2, at dp4 over single ranks and over the DP group, into plain AdamW, and at tp2
  after ``nxdtp-merge --reshard 2`` equal the dense run; the plain merge writes the dense optimizer state.
* Groups that are not DP-aligned are refused naming them, the reason, and valid groups; the groups are made once.
* test_rank_independent_graphs traces the hybrid step for every rank of simulated tp2 x dp4 (pairs) and tp2 x dp2
  (single ranks) worlds: one graph, whose reduce-scatter / all-gather name the sharding groups and whose all-reduce
  names the replica groups.
"""

from __future__ import annotations

import os

import pytest
import torch

from nxdtp import parallel_state as ps
from nxdtp.optimizer import NeuronZero1Optimizer
from nxdtp.spec import FlatShardLayout

transformers = pytest.importorskip("transformers")

from tests import test_zero1_checkpoints as ckpt  # noqa: E402
from tests.test_zero1 import (  # noqa: E402
    INNER,
    TOL,
    _apply_lr_scale,
    _groups,
    _llama,
    _llama_batches,
    _parallelize,
    torch_clip_grad_norm_,
)

STEPS = 3


# ---- hybrid sharding equals dense ------------------------------------------------------------------------------------

def case_hybrid_equals_dense(sharding_groups, accumulate: str, max_norm: float = 0.5):
    from nxdtp import comm
    from tests.test_models_bert import _check_weights

    dp = ps.get_data_parallel_size()
    dense = _llama()
    parallel = _parallelize("llama", dense)
    optimizer_class, kwargs = INNER["adamw"]
    dense_opt = optimizer_class(_apply_lr_scale(_groups(dense.named_parameters()), kwargs["lr"]), **kwargs)
    zero = NeuronZero1Optimizer(_apply_lr_scale(_groups(parallel.named_parameters()), kwargs["lr"]), optimizer_class,
                                max_norm=max_norm, sharding_groups=sharding_groups,
                                use_grad_acc_hook=accumulate == "hook", **kwargs)
    k = len(sharding_groups[0])
    assert zero.sharding_group.size == k and zero.replica_group.size == dp // k
    assert zero.sharding_groups == sorted(sorted(g) for g in sharding_groups)
    what = f"tp={ps.get_tensor_model_parallel_size()} dp={dp} sharding {sharding_groups} accumulate={accumulate}"
    norms = []
    for step in range(STEPS):
        full, micro, scale = _llama_batches(step, dp, 2)
        dense_opt.zero_grad()
        dense(**full).loss.backward()
        dense_norm = torch_clip_grad_norm_(dense.parameters(), max_norm)
        assert dense_norm > 1.5 * max_norm, f"{what} step {step}: max_norm={max_norm} does not clip ({dense_norm})"
        dense_opt.step()

        zero.zero_grad(set_to_none=True)
        for batch in micro:
            (parallel(**batch).loss * scale).backward()
        zero.step()
        torch.testing.assert_close(zero.grad_norm, dense_norm.to(torch.float32), **TOL,
                                   msg=lambda m: f"{what} step {step} grad_norm: {m}")
        norms.append(float(zero.grad_norm))
    _check_weights(parallel, dense, what)

    # The replicas of a shard hold the same master weights and state.
    masters = torch.cat([s.detach().reshape(-1) for g in zero.base_optimizer.param_groups for s in g["params"]])
    replicas = comm.all_gather(masters.reshape(1, -1), zero.replica_group, dim=0)
    assert all(torch.equal(replicas[0], r) for r in replicas), f"{what}: replicas of a shard differ"

    params = list(parallel.parameters())
    layouts = [FlatShardLayout(tuple(p.shape), k) for p in params]
    measured = zero.state_bytes()
    return dict(norms=norms, state=measured["state"], master=measured["master"], n=len(params),
                numel=sum(p.numel() for p in params), shard_numel=sum(lay.shard_numel for lay in layouts),
                padding=sum(lay.padding for lay in layouts), k=k)


def _check_state_bytes(results):
    for r in results:
        k, n = r["k"], r["n"]
        plain = 8 * r["numel"] + 4 * n       # torch AdamW: exp_avg, exp_avg_sq (fp32) and a step counter per parameter
        assert r["state"] == 8 * r["shard_numel"] + 4 * n, r
        assert r["master"] == 4 * r["shard_numel"], r
        assert r["state"] <= plain / k + 8 * r["padding"] / k + 4 * n, r
        if k > 1:
            assert r["state"] < 0.6 * plain, r   # about half of plain AdamW's for pairs
    assert all(r["norms"] == results[0]["norms"] for r in results), [r["norms"] for r in results]


HYBRID = [
    # (world, tp, sharding groups, accumulate)
    (4, 1, [[0, 2], [1, 3]], "grad"),
    (4, 1, [[0, 1], [2, 3]], "hook"),
    (4, 2, [[0], [1], [2], [3]], "grad"),
    pytest.param(8, 2, [[0, 2], [4, 6], [1, 3], [5, 7]], "grad", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("world,tp,sharding_groups,accumulate", HYBRID,
                         ids=["tp1xdp4-pairs-strided", "tp1xdp4-pairs-hook", "tp2xdp2-singles", "tp2xdp4-pairs"])
def test_hybrid_sharding_equals_dense(worlds, world, tp, sharding_groups, accumulate):
    _check_state_bytes(worlds(world).run(case_hybrid_equals_dense, tensor_model_parallel_size=tp,
                                         sharding_groups=sharding_groups, accumulate=accumulate))


# ---- checkpoints -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved_pairs(worlds, tmp_path_factory):
    """A ZeRO-1 checkpoint saved at tp1 x dp4 sharded over pairs after 2 steps; each rank's parameters after the
    third."""
    directory = str(tmp_path_factory.mktemp("zero1_pairs") / "ckpt")
    after = worlds(4).run(ckpt.case_save, tensor_model_parallel_size=1, directory=directory, sharding=2)
    return directory, after


def test_one_replica_of_each_shard_is_written(saved_pairs):
    directory, _ = saved_pairs
    index = ckpt._index(directory)
    assert index["data_parallel_size"] == 4
    assert index["optimizer"]["zero1"] == {"layout": "flat", "sharding_group_size": 2, "optimizer_dtype": "float32"}
    files = sorted(f for f in index["files"] if f.startswith("optim/tp_rank"))
    assert files == ["optim/tp_rank_00_dp_rank_00.safetensors", "optim/tp_rank_00_dp_rank_01.safetensors"], files
    assert sorted(os.listdir(os.path.join(ckpt._tag(directory), "optim"))) == [
        "state.json", "tp_rank_00_dp_rank_00.safetensors", "tp_rank_00_dp_rank_01.safetensors"]


def test_resume_at_the_saved_sharding_is_bit_exact(saved_pairs, worlds, tmp_path):
    from safetensors.torch import load_file

    directory, after = saved_pairs
    resumed = worlds(4).run(ckpt.case_resume, tensor_model_parallel_size=1, directory=directory, sharding=2)
    for rank, (a, b) in enumerate(zip(after, resumed)):
        assert ckpt._same(a, b) == [], f"rank {rank}: resumed parameters differ from the uninterrupted run"
    again = str(tmp_path / "again")
    worlds(4).run(ckpt.case_resave, tensor_model_parallel_size=1, directory=directory, again=again, sharding=2)
    for d in range(2):
        relative = f"optim/tp_rank_00_dp_rank_{d:02d}.safetensors"
        first, second = (load_file(os.path.join(ckpt._tag(x), relative)) for x in (directory, again))
        assert ckpt._same(first, second) == [], relative


@pytest.mark.parametrize("world,sharding", [(2, 0), (4, 1), (4, 0)], ids=["dp2", "dp4-singles", "dp4-dp-group"])
def test_resume_at_another_dp_size_or_sharding(saved_pairs, worlds, world, sharding):
    directory, _ = saved_pairs
    worlds(world).run(ckpt.case_resume, tensor_model_parallel_size=1, directory=directory, sharding=sharding)


def test_resume_into_plain_adamw(saved_pairs, worlds):
    directory, _ = saved_pairs
    worlds(4).run(ckpt.case_resume, tensor_model_parallel_size=1, directory=directory, kind="plain")


def test_reshard_to_tp2_and_resume(saved_pairs, worlds, tmp_path):
    from nxdtp.cli import main

    directory, _ = saved_pairs
    out = str(tmp_path / "tp2")
    assert main([directory, out, "--reshard", "2", "--no-progress"]) in (0, None)
    index = ckpt._index(out)
    assert index["optimizer"]["zero1"]["sharding_group_size"] == 2
    assert sorted(f for f in index["files"] if f.startswith("optim/tp_rank")) == [
        f"optim/tp_rank_{t:02d}_dp_rank_{d:02d}.safetensors" for t in range(2) for d in range(2)]
    worlds(4).run(ckpt.case_resume, tensor_model_parallel_size=2, directory=out)


def test_plain_merge_writes_the_dense_optimizer_state(saved_pairs, worlds, tmp_path):
    from nxdtp.cli import main

    directory, _ = saved_pairs
    out = str(tmp_path / "dense")
    assert main([directory, out, "--no-progress"]) == 0
    worlds(1).run(ckpt.case_merged_optimizer_continues, out=out, kind="zero1")


# ---- refusals and groups ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("groups,reason", [
    ([[0, 1], [2, 3], [4, 5], [6, 7]], r"groups \[\[0, 1\], \[2, 3\], \[4, 5\], \[6, 7\]\] span several data-parallel"),
    ([[0, 2, 4], [6], [1, 3, 5], [7]], r"the groups have different sizes \[1, 3\]"),
    ([[0, 2], [4, 6]], r"ranks \[1, 3, 5, 7\] are in no group"),
    ([[0, 2], [2, 4, 6], [1, 3], [5, 7]], r"ranks \[2\] are in more than one group"),
    ([[0, 2], [4, 8], [1, 3], [5, 7]], r"ranks \[8\] are not in the world of 8"),
    ([0, 2, 4, 6], r"it is not a list of lists of global ranks"),
])
def test_groups_that_are_not_dp_aligned_are_refused(groups, reason):
    valid = (r"Valid sharding groups cut each data-parallel group of \[\[0, 2, 4, 6\], \[1, 3, 5, 7\]\] into groups of "
             r"one size k dividing the DP size 4 .* size 2: \[\[0, 2\], \[4, 6\], \[1, 3\], \[5, 7\]\]")
    with ps.simulated_topology(world_size=8, rank=3, tensor_model_parallel_size=2):
        with pytest.raises(ValueError, match=rf"ZeRO-1 sharding groups .* are not DP-aligned: {reason}.*\. {valid}"):
            NeuronZero1Optimizer([torch.nn.Parameter(torch.ones(3))], torch.optim.AdamW, sharding_groups=groups)
        from nxdtp.grads import get_grad_norm

        with pytest.raises(ValueError, match=f"not DP-aligned: {reason}"):
            get_grad_norm([torch.nn.Parameter(torch.ones(3))], zero1_optimizer=True, zero1_optimizer_groups=groups)


def test_groups_and_their_replicas_are_made_once():
    with ps.simulated_topology(world_size=8, rank=5, tensor_model_parallel_size=2):
        sharding, replica = ps.zero1_groups([[6, 4], [0, 2], [1, 3], [5, 7]])   # any order: ranks taken ascending
        assert (sharding.kind, sharding.ranks, replica.kind, replica.ranks) == ("zero1_sharding", (5, 7),
                                                                               "zero1_replica", (1, 5))
        assert replica.replica_groups_as_lists() == [[0, 4], [1, 5], [2, 6], [3, 7]]
        assert ps.zero1_groups(sharding) == (sharding, replica)
        assert ps.zero1_groups([[0, 2], [1, 3], [4, 6], [5, 7]])[0] is sharding
        assert len(ps.get_topology().zero1_groups) == 1
        # The DP groups and the single ranks are groups the topology has already: nothing is made for them.
        topology = ps.get_topology()
        assert ps.zero1_groups(None) == (topology.data_parallel, topology.singleton)
        assert ps.zero1_groups(ps.get_data_parallel_group(as_list=True)) == (topology.data_parallel, topology.singleton)
        assert ps.zero1_groups([[r] for r in range(8)]) == (topology.singleton, topology.data_parallel)
        assert len(ps.get_topology().zero1_groups) == 1
        opt = NeuronZero1Optimizer([torch.nn.Parameter(torch.ones(3))], torch.optim.AdamW, lazy_init=True,
                                   sharding_groups=[[0, 4], [2, 6], [1, 5], [3, 7]])
        assert opt.sharding_group.ranks == (1, 5) and opt.replica_group.ranks == (5, 7)
        assert opt.sharding_groups == [[0, 4], [1, 5], [2, 6], [3, 7]]
