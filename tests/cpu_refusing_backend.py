"""A torch.distributed backend that refuses CPU tensors, standing in for NCCL (or any device backend) on a CPU machine.

A world started with it as its default backend behaves like a GPU world for everything nxdtp does with CPU tensors
(building and sharding a model before the device move, pretrained loading, checkpoint coordination, host-side metrics):
every such collective must go over nxdtp's gloo groups, or it fails here as it would fail on NCCL. Tensors of other
devices are passed on to gloo, which is what makes it a backend and not just a wall.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup

NAME = "cpu_refusing"


class CpuRefusingProcessGroup(ProcessGroup):
    def __init__(self, store, rank: int, size: int, timeout):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)

    def getBackendName(self) -> str:
        return NAME

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    @staticmethod
    def _refuse_cpu(operation: str, *tensors: torch.Tensor) -> None:
        for tensor in tensors:
            if tensor.device.type == "cpu":
                raise RuntimeError(f"{NAME} backend ({operation}): a CPU tensor of shape {tuple(tensor.shape)} reached "
                                   "a group of a device backend, which NCCL would refuse too")

    def allreduce(self, tensors, opts):
        self._refuse_cpu("allreduce", *tensors)
        return self._gloo.allreduce(tensors, opts)

    def allgather(self, output_lists, inputs, opts=None):
        self._refuse_cpu("allgather", *inputs)
        return self._gloo.allgather(output_lists, inputs)

    def _allgather_base(self, output, input, opts):
        self._refuse_cpu("all_gather_into_tensor", input)
        return self._gloo._allgather_base(output, input)

    def broadcast(self, tensors, opts):
        self._refuse_cpu("broadcast", *tensors)
        return self._gloo.broadcast(tensors, opts)

    def reduce_scatter(self, outputs, input_lists, opts):
        self._refuse_cpu("reduce_scatter", *outputs)
        return self._gloo.reduce_scatter(outputs, input_lists, opts)

    def _reduce_scatter_base(self, output, input, opts):
        self._refuse_cpu("reduce_scatter_tensor", input)
        return self._gloo._reduce_scatter_base(output, input, opts)

    def barrier(self, opts):
        return self._gloo.barrier(opts)


def register() -> None:
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, CpuRefusingProcessGroup, devices=["cuda"])
