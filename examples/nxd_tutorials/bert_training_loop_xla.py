# NxD's tensor-parallel training loop on an XLA device, run by nxdtp.
#
# Follows: NxD docs (aws-neuron-sdk libraries/neuronx-distributed/tp_developer_guide.rst), "Final Training script",
# with the model and dataloader of its "Creating Model" and "Creating DataLoader" sections (bert_attention_swap.py).
# Lines that differ from NxD's code:
#   - from neuronx_distributed.parallel_layers import parallel_state, clip_grad_norm
#       -> from nxdtp import parallel_state, clip_grad_norm                                          (the import)
#   - import neuronx_distributed -> import nxdtp, and from neuronx_distributed import parallel_layers
#       -> import nxdtp as parallel_layers                                                          (the imports)
#   - neuronx_distributed.parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
#       -> nxdtp.parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_model_parallel_size):
#     NxD 2.29 has no module neuronx_distributed.parallel_state (it is
#     neuronx_distributed.parallel_layers.parallel_state), and the size is a flag here (default 2, as the guide) so
#     that one XLA:CPU process can run it at 1.
#   - xm.optimizer_step(optimzer, ...) -> xm.optimizer_step(optimizer, ...): the guide's typo, a NameError in NxD too.
# Not NxD's: train() and main() wrap the guide's lines; the guide leaves input_file, max_pred_length, mini_batch_size,
# worker_init, YourNewlyBuiltParallelModel, loss_fn, optimizer, scheduler, max_norm and device to the user; the
# batches go to the device through torch_xla's MpDeviceLoader, as NxD's BERT example does.
#
# What xm.optimizer_step(optimizer, groups=DP groups) does is torch_xla's, not nxdtp's: it sums the gradients over the
# DP group and scales by 1 / (XLA world size), so at TP=2 x DP=2 the gradients are the DP average / 2 (the same under
# NxD). docs/nxd_migration.md gives the nxdtp replacement (grads.allreduce_gradients(model), then optimizer.step()).
#
# Run on a machine whose XLA runtime spans the ranks (Trainium, TPU):
#   torchrun --nproc_per_node=2 examples/nxd_tutorials/bert_training_loop_xla.py
# On CPU (XLA:CPU is one replica per process):
#   PJRT_DEVICE=CPU python examples/nxd_tutorials/bert_training_loop_xla.py --tensor_model_parallel_size 1

import argparse
import os
import sys

import torch
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl

import nxdtp
import nxdtp as parallel_layers
from nxdtp import clip_grad_norm, parallel_state

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bert_attention_swap import create_pretraining_dataset, get_model, loss_fn, tiny_config, write_dataset  # noqa: E402


def YourNewlyBuiltParallelModel(config):
    return get_model(config)


def train(model, dataloader, optimizer, scheduler, max_norm):
    for inputs, labels in dataloader:
        output = model(*inputs)
        loss = loss_fn(output, labels)
        loss.backward()
        # Here we use clip_grad_norm from neuronx_distributed as that
        # can handle tensor parallel ranks
        clip_grad_norm(model.parameters(), max_norm)
        # For the optimzer step, we have to pass the data_parallel group
        xm.optimizer_step(
            optimizer,
            groups=parallel_state.get_data_parallel_group(as_list=True)
        )
        optimizer.zero_grad()
        scheduler.step()


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--tensor_model_parallel_size", type=int, default=2)
    tensor_model_parallel_size = parser.parse_args(argv).tensor_model_parallel_size
    import torch_xla.distributed.xla_backend  # noqa: F401 - registers the "xla" process-group backend

    if "WORLD_SIZE" not in os.environ:  # python, not torchrun: a world of one
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29511", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.distributed.init_process_group("xla", init_method="env://")

    nxdtp.parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_model_parallel_size)
    input_file = "/tmp/nxd_tutorial_bert_data.pt"
    if torch.distributed.get_rank() == 0:
        write_dataset(input_file, num_samples=32)
    xm.rendezvous("dataset written")
    dataloader = create_pretraining_dataset(
     input_file, max_pred_length=8, mini_batch_size=4, worker_init=None)

    torch.manual_seed(0)
    config = tiny_config()
    device = xm.xla_device()
    model = YourNewlyBuiltParallelModel(config)
    # We have to move the model to device using this API, because when
    # we move model to device using .to(device), the model parameter's
    # attributes aren't preserved. This causes some of the tensor parallel
    # attributes to be lost. Hence, this API takes care of preserving the
    # tensor parallel attributes.
    parallel_layers.move_model_to_device(model, device)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    train(model, pl.MpDeviceLoader(dataloader, device), optimizer, scheduler, max_norm=1.0)
    xm.mark_step()
    print(f"rank {torch.distributed.get_rank()}: trained {len(dataloader)} steps; "
          f"classifier weight sum {model.classifier.weight.sum().item():.6f}")


if __name__ == "__main__":
    main()
