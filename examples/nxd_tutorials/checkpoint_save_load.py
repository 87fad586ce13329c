# NxD's parallel_layers save / load with the "model" key, run by nxdtp.
#
# Follows (NxD docs, aws-neuron-sdk libraries/neuronx-distributed/):
#   - tp_developer_guide.rst, "Saving Model": neuronx_distributed.parallel_layers.save({'epoch': ..., 'model':
#     model.state_dict(), 'optimizer_state_dict': ..., 'loss': ...}, PATH), "the same key during model load";
#   - api-reference-guide-training.rst, "Load Checkpoint": neuronx_distributed.parallel_layers.load(load_dir,
#     model_or_optimizer=None, model_key='model', load_xser=False, sharded=True), which loads this rank's shard into
#     the model and returns the rest of the saved dict;
#   - tutorials/inference.rst ("Inference with Tensor Parallelism"): torch.save({"model": model.state_dict()},
#     "bert.pt") of a dense model, then get_model(), whose ParallelSelfAttention / ParallelSelfOutput are loaded from
#     that unsharded file with neuronx_distributed.parallel_layers.load("bert.pt", model, sharded=False). Verbatim.
# Lines that differ from NxD's code:
#   - import neuronx_distributed -> import nxdtp, and neuronx_distributed.parallel_layers.save / .load ->
#     nxdtp.save / nxdtp.load (the module path; nxdtp re-exports save and load at the top, as NxD's parallel_layers)
#   - from neuronx_distributed.parallel_layers import layers, parallel_state -> from nxdtp import layers, parallel_state
#   - the guide's save dict ends with a literal "..." entry (not Python); left out.
#   - get_model: AutoModelForSequenceClassification.from_pretrained(name, torchscript=True) ->
#     AutoModelForSequenceClassification.from_config(config) (no downloads), and "bert.pt" is a parameter.
# Not NxD's: save_dense's arguments, load_checkpoint (the guide stops at save; this loads per the API reference and
# hands the optimizer its state, as the saved dict's keys suggest), and main.
# transformers 5: see bert_attention_swap.py about super().__init__(config, position_embedding_type).
#
# Run: torchrun --nproc_per_node=2 examples/nxd_tutorials/checkpoint_save_load.py /tmp/nxd_tutorial_checkpoint

import sys

import torch
from transformers import AutoModelForSequenceClassification
from transformers.models.bert.modeling_bert import BertSelfAttention, BertSelfOutput

import nxdtp
from nxdtp import layers, parallel_state


def save_checkpoint(model, optimizer, epoch, loss, PATH):
    nxdtp.save({
                'epoch': epoch,
                'model': model.state_dict(),
                'optimizer_state_dict': optimizer.state_dict(),
                'loss': loss,
                }, PATH)


def load_checkpoint(PATH, model, optimizer):
    checkpoint = nxdtp.load(PATH, model, model_key='model')
    optimizer.load_state_dict(checkpoint['optimizer_state_dict'])
    return checkpoint['epoch'], checkpoint['loss']


def save_dense(model, path="bert.pt"):
    torch.save({"model":model.state_dict()}, path)


def get_model(config, checkpoint_path="bert.pt"):
    model = AutoModelForSequenceClassification.from_config(config)
    # Here we build a model with tensor-parallel layers.
    # Note: If you already have a Model class that does this, we can use that directly
    # and load the checkpoint in it.
    class ParallelSelfAttention(BertSelfAttention):
        def __init__(self, config, position_embedding_type=None):
            super().__init__(config, position_embedding_type)
            self.query = layers.ColumnParallelLinear(config.hidden_size, self.all_head_size, gather_output=False)
            self.key = layers.ColumnParallelLinear(config.hidden_size, self.all_head_size, gather_output=False)
            self.value = layers.ColumnParallelLinear(config.hidden_size, self.all_head_size, gather_output=False)
            self.num_attention_heads = self.num_attention_heads // parallel_state.get_tensor_model_parallel_size()
            self.all_head_size = self.all_head_size // parallel_state.get_tensor_model_parallel_size()

    class ParallelSelfOutput(BertSelfOutput):
        def __init__(self, config):
            super().__init__(config)
            self.dense = layers.RowParallelLinear(config.hidden_size,
                                    config.hidden_size,
                                    input_is_parallel=True)

    for layer in model.bert.encoder.layer:
        layer.attention.self = ParallelSelfAttention(model.config)
        layer.attention.output = ParallelSelfOutput(model.config)

    # Here we created a checkpoint as mentioned above. We pass sharded=False, since the checkpoint
    # we obtained is unsharded. In case you are using the checkpoint from the tensor-parallel training,
    # you can set the sharded=True, as that checkpoint will contain shards from each tp rank.
    nxdtp.load(checkpoint_path, model, sharded=False)

    # These io aliases would enable us to mark certain input tensors as state tensors. These
    # state tensors are going to be device tensors.
    io_aliases = {}
    return model, io_aliases


def main(argv=None):
    import os

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bert_attention_swap import get_model as get_training_model
    from bert_attention_swap import loss_fn, tiny_config

    root = (argv or sys.argv[1:] or ["/tmp/nxd_tutorial_checkpoint"])[0]
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=int(os.environ.get("TP", 2)))
    torch.manual_seed(0)
    config = tiny_config()
    ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 1])
    for what, run in (("save and load with the 'model' key", lambda: _round_trip(get_training_model, loss_fn, config,
                                                                                   ids, labels, root)),
                      ("load an unsharded file with sharded=False", lambda: _unsharded(config, ids, root))):
        try:
            print(f"rank {torch.distributed.get_rank()}: {what}: {run()}")
        except Exception as e:  # noqa: BLE001 - show every step's outcome
            print(f"rank {torch.distributed.get_rank()}: {what}: FAILED with {type(e).__name__}: {e}")
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def _round_trip(get_training_model, loss_fn, config, ids, labels, root):
    import os

    model = get_training_model(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss = loss_fn(model(ids), labels)
    loss.backward()
    optimizer.step()
    save_checkpoint(model, optimizer, epoch=1, loss=loss.detach(), PATH=os.path.join(root, "trained"))
    fresh = get_training_model(config)
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    epoch, saved_loss = load_checkpoint(os.path.join(root, "trained"), fresh, fresh_optimizer)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    return f"epoch {epoch}, loss {float(saved_loss):.6f}, parameters equal after loading: {same}"


def _unsharded(config, ids, root):
    import os

    path = os.path.join(root, "bert.pt")
    dense = AutoModelForSequenceClassification.from_config(config)
    if torch.distributed.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        save_dense(dense, path)
    torch.distributed.barrier()
    model, _ = get_model(config, path)
    return f"max |logits - dense| {(model(ids).logits - dense(ids).logits).abs().max().item():.1e}"


if __name__ == "__main__":
    main()
