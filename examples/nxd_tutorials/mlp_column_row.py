# NxD's tensor-parallel MLP, run by nxdtp: ColumnParallelLinear(gather_output=False) ->
# RowParallelLinear(input_is_parallel=True).
#
# Follows (NxD docs, aws-neuron-sdk libraries/neuronx-distributed/):
#   - model_builder_v2_api_reference.rst, "Example: Build and run torch module with ModelBuilder": the Model class (a
#     parallel MLP and its dense twin) and the lines torch.manual_seed(0) / cpu_model = Model(is_distributed=False) /
#     cpu_out = cpu_model(input) / torch.testing.assert_close(cpu_out, neuron_out), verbatim.
#   - tp_developer_guide.rst, "Final Training script": output = model(...); loss = loss_fn(output, labels);
#     loss.backward(); clip_grad_norm(model.parameters(), max_norm).
# Lines that differ from NxD's code:
#   - from neuronx_distributed.parallel_layers import ColumnParallelLinear, RowParallelLinear, clip_grad_norm,
#         parallel_state
#       -> from nxdtp import ColumnParallelLinear, RowParallelLinear, clip_grad_norm, parallel_state     (the import)
#   - grad_norm = clip_grad_norm(...): the guide drops the returned pre-clip norm; NxD returns it too.
# Not NxD's: the Neuron-only ModelBuilder trace/compile and shard_checkpoint/set_weights steps are left out;
# dense_check.load_dense stands in for shard_checkpoint. loss_fn, train_step and main are ours (the guide leaves
# loss_fn and the data to the user).
#
# Run: torchrun --nproc_per_node=2 examples/nxd_tutorials/mlp_column_row.py

import os

import torch
import torch.nn as nn

from nxdtp import ColumnParallelLinear, RowParallelLinear, clip_grad_norm, parallel_state


class Model(nn.Module):
    def __init__(self, is_distributed=True):
        super().__init__()
        if is_distributed:
            self.layer1 = ColumnParallelLinear(1024, 1024, gather_output=False)
            self.layer2 = RowParallelLinear(1024, 1024, input_is_parallel=True)
        else:
            self.layer1 = nn.Linear(1024, 1024)
            self.layer2 = nn.Linear(1024, 1024)
    def forward(self, x):
        x = self.layer1(x)
        return self.layer2(x)


loss_fn = nn.MSELoss()


def train_step(model, inputs, labels, max_norm):
    output = model(inputs)
    loss = loss_fn(output, labels)
    loss.backward()
    grad_norm = clip_grad_norm(model.parameters(), max_norm)
    return output, loss, grad_norm


def main():
    from dense_check import load_dense, max_grad_diff

    torch.distributed.init_process_group("gloo")
    tp = int(os.environ.get("TP", os.environ["WORLD_SIZE"]))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)

    torch.manual_seed(0)
    cpu_model = Model(is_distributed=False)
    model = Model()
    load_dense(model, cpu_model)

    input = torch.ones(32, 1024)
    cpu_out = cpu_model(input)
    neuron_out = model(input)
    torch.testing.assert_close(cpu_out, neuron_out)

    labels = torch.randn(32, 1024, generator=torch.Generator().manual_seed(1))
    _, loss, grad_norm = train_step(model, input, labels, max_norm=0.5)
    dense_loss = loss_fn(cpu_model(input), labels)
    dense_loss.backward()
    dense_norm = torch.nn.utils.clip_grad_norm_(cpu_model.parameters(), 0.5)
    print(f"rank {torch.distributed.get_rank()}: output equals dense; loss {loss.item():.6f} (dense "
          f"{dense_loss.item():.6f}), pre-clip grad norm {grad_norm.item():.6f} (dense {dense_norm.item():.6f}), "
          f"max |clipped grad - dense slice| {max_grad_diff(model, cpu_model):.1e}")
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
