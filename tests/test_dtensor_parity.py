"""nxdtp's layers equal PyTorch's DTensor tensor parallelism on the same weights and inputs (issue 27, item 4).

A job moving from nxdtp (or NxD) to native TP replaces each nxdtp layer by a plain module and a DTensor style. Here,
on a gloo world of 2 (tp=2), each pair gets the same full weights and inputs, and must give the same outputs (local
shards compared to local shards), input gradients and weight gradients (nxdtp's local shard against the DTensor
gradient's local shard), fp32 within 1e-5:

ColumnParallelLinear against ColwiseParallel (with and without a replicated output), RowParallelLinear against
RowwiseParallel, ParallelEmbedding against RowwiseParallel on nn.Embedding, a sequence-parallel LayerNorm + column +
row block against SequenceParallel + Colwise/Rowwise with Shard(d) layouts, and parallel_cross_entropy against
F.cross_entropy under loss_parallel(); docs/devices.md has the table.

NxD's sequence parallelism splits dim 0 of [seq, batch, hidden] activations; DTensor's `SequenceParallel` and HF split
dim 1 of [batch, seq, hidden]. Both are compared.
"""

from __future__ import annotations

import pytest
import torch

TOL = dict(rtol=1e-5, atol=1e-5)


def _mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))


def _rank_and_size():
    from nxdtp import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_size()


def _shard(full, dim):
    from nxdtp.sharded_init import shard_of

    rank, tp = _rank_and_size()
    return shard_of(full, dim, rank, tp).contiguous()


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _local(tensor):
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _close(ours, theirs, what):
    torch.testing.assert_close(_local(ours).detach(), _local(theirs).detach(), **TOL, msg=lambda m: f"{what}: {m}")


def _linear(full_weight, full_bias):
    linear = torch.nn.Linear(full_weight.shape[1], full_weight.shape[0])
    with torch.no_grad():
        linear.weight.copy_(full_weight)
        linear.bias.copy_(full_bias)
    return linear


# ---- cases (run on every rank) ---------------------------------------------------------------------------------------

def case_column(gather_output: bool):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from nxdtp.layers import ColumnParallelLinear

    weight, bias = _randn(8, 6, seed=1), _randn(8, seed=2)
    ours = ColumnParallelLinear(6, 8, bias=True, gather_output=gather_output)
    with torch.no_grad():
        ours.weight.copy_(_shard(weight, 0))
        ours.bias.copy_(_shard(bias, 0))
    style = ColwiseParallel(output_layouts=Replicate()) if gather_output else ColwiseParallel()
    theirs = parallelize_module(_linear(weight, bias), _mesh(), style)
    x = _randn(3, 4, 6, seed=3)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ours, y_theirs = ours(x_ours), theirs(x_theirs)
    _close(y_ours, y_theirs, "output")
    upstream = _randn(3, 4, 8, seed=4)
    upstream = upstream if gather_output else _shard(upstream, -1)
    (y_ours * upstream).sum().backward()
    (_local(y_theirs) * upstream).sum().backward()
    _close(x_ours.grad, x_theirs.grad, "input gradient")
    _close(ours.weight.grad, theirs.weight.grad, "weight gradient")
    _close(ours.bias.grad, theirs.bias.grad, "bias gradient")


def case_row():
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    from nxdtp.layers import RowParallelLinear

    weight, bias = _randn(6, 8, seed=5), _randn(6, seed=6)
    ours = RowParallelLinear(8, 6, bias=True, input_is_parallel=True)
    with torch.no_grad():
        ours.weight.copy_(_shard(weight, 1))
        ours.bias.copy_(bias)
    theirs = parallelize_module(_linear(weight, bias), _mesh(), RowwiseParallel())
    x = _shard(_randn(3, 4, 8, seed=7), -1)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ours, y_theirs = ours(x_ours), theirs(x_theirs)
    _close(y_ours, y_theirs, "output")
    upstream = _randn(3, 4, 6, seed=8)
    (y_ours * upstream).sum().backward()
    (_local(y_theirs) * upstream).sum().backward()
    _close(x_ours.grad, x_theirs.grad, "input gradient")
    _close(ours.weight.grad, theirs.weight.grad, "weight gradient")
    _close(ours.bias.grad, theirs.bias.grad, "bias gradient")


def case_embedding():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    from nxdtp.layers import ParallelEmbedding

    table = _randn(10, 6, seed=9)
    ours = ParallelEmbedding(10, 6)
    with torch.no_grad():
        ours.weight.copy_(_shard(table, 0))
    dense = torch.nn.Embedding(10, 6)
    with torch.no_grad():
        dense.weight.copy_(table)
    theirs = parallelize_module(dense, _mesh(), RowwiseParallel(input_layouts=Replicate()))
    ids = torch.randint(0, 10, (3, 5), generator=torch.Generator().manual_seed(10))
    y_ours, y_theirs = ours(ids), theirs(ids)
    _close(y_ours, y_theirs, "output")
    upstream = _randn(3, 5, 6, seed=11)
    (y_ours * upstream).sum().backward()
    (_local(y_theirs) * upstream).sum().backward()
    # torch 2.9's DTensor returns this gradient replicated (the whole table's), though the weight is Shard(0): compare
    # this rank's rows of it.
    _close(ours.weight.grad, _shard(theirs.weight.grad.full_tensor(), 0), "weight gradient")


def case_sequence_parallel_block(sequence_dim: int):
    """LayerNorm -> column -> GELU -> row, activations split along the sequence outside the TP region."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    from nxdtp.grads import allreduce_sequence_parallel_gradients
    from nxdtp.layers import ColumnParallelLinear, LayerNorm, RowParallelLinear

    hidden, inner = 6, 8
    norm_w, norm_b = 1 + 0.2 * _randn(hidden, seed=12), 0.2 * _randn(hidden, seed=13)
    up_w, up_b, down_w, down_b = (_randn(inner, hidden, seed=14), _randn(inner, seed=15),
                                  _randn(hidden, inner, seed=16), _randn(hidden, seed=17))

    class Block(torch.nn.Module):
        def __init__(self, norm, up, down):
            super().__init__()
            self.norm, self.up, self.down = norm, up, down

        def forward(self, x):
            return self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    ours = Block(LayerNorm(hidden, sequence_parallel_enabled=True),
                 ColumnParallelLinear(hidden, inner, gather_output=False, sequence_parallel_enabled=True,
                                      sequence_dimension=sequence_dim),
                 RowParallelLinear(inner, hidden, input_is_parallel=True, sequence_parallel_enabled=True,
                                   sequence_dimension=sequence_dim))
    with torch.no_grad():
        ours.norm.weight.copy_(norm_w)
        ours.norm.bias.copy_(norm_b)
        ours.up.weight.copy_(_shard(up_w, 0))
        ours.up.bias.copy_(_shard(up_b, 0))
        ours.down.weight.copy_(_shard(down_w, 1))
        ours.down.bias.copy_(down_b)
    dense_norm = torch.nn.LayerNorm(hidden)
    with torch.no_grad():
        dense_norm.weight.copy_(norm_w)
        dense_norm.bias.copy_(norm_b)
    theirs = parallelize_module(
        Block(dense_norm, _linear(up_w, up_b), _linear(down_w, down_b)), _mesh(),
        {"norm": SequenceParallel(sequence_dim=sequence_dim),
         "up": ColwiseParallel(input_layouts=Shard(sequence_dim)),
         "down": RowwiseParallel(output_layouts=Shard(sequence_dim))})
    full = _randn(8, 3, hidden, seed=18) if sequence_dim == 0 else _randn(3, 8, hidden, seed=18)
    x = _shard(full, sequence_dim)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ours, y_theirs = ours(x_ours), theirs(x_theirs)
    _close(y_ours, y_theirs, "output (this rank's sequence shard)")
    upstream = _shard(_randn(*full.shape, seed=19), sequence_dim)
    (y_ours * upstream).sum().backward()
    (_local(y_theirs) * upstream).sum().backward()
    allreduce_sequence_parallel_gradients(ours)  # what the optimizer wrapper (or nxdtp's plans) do each step
    _close(x_ours.grad, x_theirs.grad, "input gradient")
    for name in ("norm.weight", "norm.bias", "up.weight", "up.bias", "down.weight", "down.bias"):
        mine, native = ours.get_parameter(name).grad, theirs.get_parameter(name).grad
        if name.startswith("norm") or name == "down.bias":  # replicated: DTensor's gradient is the whole one
            native = native.full_tensor()
        _close(mine, native, f"{name} gradient")


def case_vocab_parallel_loss():
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    from nxdtp.loss_functions import parallel_cross_entropy

    logits = _randn(12, 10, seed=20)
    target = torch.randint(0, 10, (12,), generator=torch.Generator().manual_seed(21))
    target[3] = -100
    local = _shard(logits, -1)
    ours_in, theirs_in = local.clone().requires_grad_(), local.clone().requires_grad_()
    ours = parallel_cross_entropy(ours_in, target)  # per token, ignored targets giving 0
    dtensor = DTensor.from_local(theirs_in, _mesh(), [Shard(1)])
    with loss_parallel():
        theirs = torch.nn.functional.cross_entropy(dtensor, target, reduction="none", ignore_index=-100)
        _close(ours, theirs.full_tensor(), "per-token loss")
        mean_theirs = torch.nn.functional.cross_entropy(dtensor, target, ignore_index=-100)
        mean_theirs.backward()
    mean_ours = ours.sum() / (target != -100).sum()
    _close(mean_ours, mean_theirs.full_tensor(), "mean loss")
    mean_ours.backward()
    _close(ours_in.grad, theirs_in.grad, "logit gradient")


# ---- tests -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("gather_output", [False, True], ids=["colwise", "colwise_replicate_output"])
def test_column_parallel_linear_equals_colwise_parallel(worlds, gather_output):
    worlds(2).run(case_column, tensor_model_parallel_size=2, gather_output=gather_output)


def test_row_parallel_linear_equals_rowwise_parallel(worlds):
    worlds(2).run(case_row, tensor_model_parallel_size=2)


def test_parallel_embedding_equals_rowwise_parallel_embedding(worlds):
    worlds(2).run(case_embedding, tensor_model_parallel_size=2)


@pytest.mark.parametrize("sequence_dim", [0, 1], ids=["nxd_seq_first", "dtensor_batch_first"])
def test_sequence_parallel_block_equals_sequence_parallel_style(worlds, sequence_dim):
    worlds(2).run(case_sequence_parallel_block, tensor_model_parallel_size=2, sequence_dim=sequence_dim)


def test_parallel_cross_entropy_equals_loss_parallel(worlds):
    worlds(2).run(case_vocab_parallel_loss, tensor_model_parallel_size=2)
