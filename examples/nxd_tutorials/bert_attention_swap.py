# NxD's BERT tensor-parallel attention swap and DP-rank dataloader, run by nxdtp.
#
# Follows (NxD docs, aws-neuron-sdk libraries/neuronx-distributed/):
#   - tp_developer_guide.rst, "Creating DataLoader": create_pretraining_dataset, verbatim but for one name (below).
#   - tp_developer_guide.rst, "Creating Model": ParallelSelfAttention and ParallelSelfOutput, verbatim but for one name.
#   - tutorials/inference.rst ("Inference with Tensor Parallelism"), get_model(): the loop that puts the two classes
#     into every encoder layer.
# Lines that differ from NxD's code:
#   - from neuronx_distributed.parallel_layers import ColumnParallelLinear, RowParallelLinear, parallel_state
#       -> from nxdtp import ColumnParallelLinear, RowParallelLinear, parallel_state            (the import)
#   - parallel_state.get_data_parallel_world_size() -> parallel_state.get_data_parallel_size(): the guide's name is
#     not defined in NxD 2.29's parallel_state (NxD's own BERT example calls get_data_parallel_size).
#   - parallel_state.get_tensor_parallel_size() -> parallel_state.get_tensor_model_parallel_size(): the same; NxD's
#     inference tutorial and BERT example call get_tensor_model_parallel_size.
#   - get_model(config): the tutorial builds from_pretrained(name, torchscript=True); this builds from a config
#     (no downloads) with the default dict outputs.
# Not NxD's: pretraining_dataset (NxD's example reads HDF5 shards; this one reads a torch.save'd dict), loss_fn,
# tiny_config, write_dataset and main.
# transformers 5: BertSelfAttention.__init__ is (config, is_causal=False, layer_idx=None), so the guide's
# super().__init__(config, position_embedding_type) sets is_causal=None, which SDPA attention rejects; tiny_config
# picks attn_implementation="eager", which does not read it. Under transformers 4.x the guide's call is as written.
#
# Run: torchrun --nproc_per_node=4 examples/nxd_tutorials/bert_attention_swap.py      (TP=2 x DP=2; TP=... to change)

import os

import torch
import torch.nn.functional as F
import transformers
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from nxdtp import ColumnParallelLinear, RowParallelLinear, parallel_state


class pretraining_dataset(Dataset):
    """A torch.save'd dict of input_ids, attention_mask, token_type_ids [N, S] and labels [N]."""

    def __init__(self, input_file, max_pred_length):
        data = torch.load(input_file, weights_only=True)
        self.inputs = (data["input_ids"], data["attention_mask"], data["token_type_ids"])
        self.labels = data["labels"]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return tuple(t[index] for t in self.inputs), self.labels[index]


def create_pretraining_dataset(
    input_file, max_pred_length, mini_batch_size, worker_init
):
    train_data = pretraining_dataset(
        input_file=input_file, max_pred_length=max_pred_length
    )
    # To distribute the data across different workers in the world,
    # we use the DistributedSampler. The num_replicas should be equal
    # to the data_parallel_world_size. Note: data_parallel_rank=0 can have
    # multiple tensor parallel ranks and each of these should get the same
    # data.
    train_sampler = DistributedSampler(
        train_data,
        num_replicas=parallel_state.get_data_parallel_size(),
        rank=parallel_state.get_data_parallel_rank(),
    )
    train_dataloader = DataLoader(
        train_data,
        sampler=train_sampler,
        batch_size=mini_batch_size,
        num_workers=0,
        worker_init_fn=worker_init,
        drop_last=True,
        pin_memory=True,
    )
    return train_dataloader


class ParallelSelfAttention(transformers.models.bert.modeling_bert.BertSelfAttention):
    def __init__(self, config, position_embedding_type=None):
        super().__init__(config, position_embedding_type)

        self.query = ColumnParallelLinear(config.hidden_size,
                                          self.all_head_size,
                                          gather_output=False)
        self.key = ColumnParallelLinear(config.hidden_size,
                                        self.all_head_size,
                                        gather_output=False)
        self.value = ColumnParallelLinear(config.hidden_size,
                                          self.all_head_size,
                                          gather_output=False)
        # Since we shard the number of attention heads across tensor parallel
        # ranks, each rank would have a subset of heads, hence, we update
        # the num_attention_heads here.
        tp_size = parallel_state.get_tensor_model_parallel_size()
        self.num_attention_heads = self.num_attention_heads // tp_size
        self.all_head_size = self.all_head_size // tp_size


class ParallelSelfOutput(transformers.models.bert.modeling_bert.BertSelfOutput):
    def __init__(self, config):
        super().__init__(config)
        self.dense = RowParallelLinear(config.hidden_size,
                                       config.hidden_size,
                                       input_is_parallel=True)


def get_model(config):
    model = transformers.AutoModelForSequenceClassification.from_config(config)
    for layer in model.bert.encoder.layer:
        layer.attention.self = ParallelSelfAttention(model.config)
        layer.attention.output = ParallelSelfOutput(model.config)
    return model


def loss_fn(output, labels):
    return F.cross_entropy(output.logits, labels)


def tiny_config(**overrides):
    kwargs = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32,
                  max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                  attn_implementation="eager")
    kwargs.update(overrides)
    return transformers.BertConfig(**kwargs)


def write_dataset(path, num_samples=16, seq_len=8, vocab_size=64, seed=0):
    """Random ids, a padded tail in the attention mask, two segments, binary labels."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (num_samples,), generator=g)
    attention_mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
    token_type_ids = (torch.arange(seq_len)[None, :] >= seq_len // 2).long().expand(num_samples, -1).contiguous()
    torch.save({"input_ids": torch.randint(0, vocab_size, (num_samples, seq_len), generator=g),
                "attention_mask": attention_mask, "token_type_ids": token_type_ids,
                "labels": torch.randint(0, 2, (num_samples,), generator=g)}, path)


def main():
    import tempfile

    from dense_check import load_dense, max_grad_diff

    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=int(os.environ.get("TP", 2)))
    torch.manual_seed(0)
    config = tiny_config()
    dense = transformers.AutoModelForSequenceClassification.from_config(config)
    model = get_model(config)
    load_dense(model, dense)
    path = os.path.join(tempfile.gettempdir(), "nxd_tutorial_bert_data.pt")
    if torch.distributed.get_rank() == 0:
        write_dataset(path)
    torch.distributed.barrier()
    for inputs, labels in create_pretraining_dataset(path, max_pred_length=8, mini_batch_size=4, worker_init=None):
        loss = loss_fn(model(*inputs), labels)
        loss.backward()
        dense_loss = loss_fn(dense(*inputs), labels)
        dense_loss.backward()
        print(f"rank {torch.distributed.get_rank()} (DP rank {parallel_state.get_data_parallel_rank()}): loss "
              f"{loss.item():.6f}, dense {dense_loss.item():.6f}, max |grad - dense slice| "
              f"{max_grad_diff(model, dense):.1e}")
        break
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
