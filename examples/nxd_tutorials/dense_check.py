# Not NxD tutorial code: the helper the scripts' main() functions use to show "equals dense" when run by hand.
#
# load_dense(model, dense) copies a dense model's parameters into a tensor-parallel model with the same parameter names,
# keeping on each rank the slice that the parameter's NxD attributes name (tensor_model_parallel, partition_dim,
# partition_stride), the way NxD's parallel_layers.checkpointing.get_sharded_model_dict shards a full checkpoint.
# tests/test_nxd_tutorials.py does not use it: the tests slice with their own code and check the attributes against
# NxD's documented layout.

import torch

from nxdtp import parallel_state


def shard(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This TP rank's slice of ``full`` for ``param``: 1/tp of each of the ``partition_stride`` blocks."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    rank = parallel_state.get_tensor_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_size()
    dim, stride = param.partition_dim, param.partition_stride
    return torch.cat([block.chunk(tp, dim=dim)[rank] for block in full.chunk(stride, dim=dim)], dim=dim)


def load_dense(model: torch.nn.Module, dense: torch.nn.Module) -> None:
    full = dict(dense.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(shard(full[name].detach(), param))


def max_grad_diff(model: torch.nn.Module, dense: torch.nn.Module) -> float:
    full = dict(dense.named_parameters())
    return max((p.grad - shard(full[n].grad, p)).abs().max().item() for n, p in model.named_parameters())
