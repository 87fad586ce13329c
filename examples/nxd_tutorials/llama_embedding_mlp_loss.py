# NxD's vocab-parallel embedding, fused gate/up MLP, vocab-parallel LM head and parallel_cross_entropy, run by nxdtp.
#
# Follows: NxD's Llama training code, examples/training/llama/modeling_llama_nxd.py in aws-neuron/neuronx-distributed
# (release 2.29; the model of the "Llama TP + ZeRO-1" tutorial), the parts that use the parallel_layers API:
#   - LlamaModel.__init__: embed_tokens = ParallelEmbedding(...), verbatim;
#   - LlamaMLP: __init__ (gate_up_proj = ColumnParallelLinear(stride=2, gather_output=False), down_proj =
#     RowParallelLinear(input_is_parallel=True)) and forward, verbatim but for two branches (below);
#   - LlamaForCausalLM: lm_head = ColumnParallelLinear(gather_output=False), and the loss block of forward
#     (shift, parallel_cross_entropy on the vocab-parallel logits, mask of -100 labels, mean), verbatim.
# Lines that differ from NxD's code:
#   - from neuronx_distributed.parallel_layers.layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear
#       -> from nxdtp.layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear      (the import)
#   - from neuronx_distributed.parallel_layers.loss_functions import parallel_cross_entropy
#       -> from nxdtp.loss_functions import parallel_cross_entropy                                    (the import)
#   - from neuronx_distributed.parallel_layers.parallel_state import get_tensor_model_parallel_size
#       -> from nxdtp.parallel_state import get_tensor_model_parallel_size                            (the import)
#   - LlamaMLP.forward: the pretraining_tp > 1 branch and the selective-checkpointing branch are left out (the config
#     turns both off; the second calls a checkpoint function defined elsewhere in NxD's file); the loss block's
#     context-parallel branch and XLA_DOWNCAST_BF16 branch likewise.
# Not NxD's: TinyCausalLM (it holds the three pieces in the order NxD's model calls them; decoder layers, norms and
# rotary embeddings are left out), tiny_config and main. The NxD-only config fields (sequence_parallel_enabled,
# selective_checkpoint_enabled) are set on a transformers LlamaConfig, as NxD's training scripts do.
#
# Run: torchrun --nproc_per_node=2 examples/nxd_tutorials/llama_embedding_mlp_loss.py

import os
from functools import partial

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaMLP as LlamaMLPHF

from nxdtp.layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear
from nxdtp.loss_functions import parallel_cross_entropy
from nxdtp.parallel_state import get_tensor_model_parallel_size


def _init_normal(std, w):
    return nn.init.normal_(w, mean=0.0, std=std)


class LlamaMLP(LlamaMLPHF):
    def __init__(self, config):
        nn.Module.__init__(self)
        self.config = config
        self.pretraining_tp = config.pretraining_tp
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.act_fn = ACT2FN[config.hidden_act]

        init_method = partial(_init_normal, config.initializer_range)
        self.gate_up_proj = ColumnParallelLinear(
            self.hidden_size,
            2 * self.intermediate_size,
            stride=2,
            bias=False,
            gather_output=False,
            init_method=init_method,
            sequence_parallel_enabled=self.config.sequence_parallel_enabled,
            dtype=self.config.torch_dtype,
        )
        self.down_proj = RowParallelLinear(
            self.intermediate_size,
            self.hidden_size,
            bias=False,
            input_is_parallel=True,
            init_method=init_method,
            sequence_parallel_enabled=self.config.sequence_parallel_enabled,
            dtype=self.config.torch_dtype,
        )
        self.split_size = self.intermediate_size // get_tensor_model_parallel_size()

    def forward(self, x):
        gate_proj, up_proj = self.gate_up_proj(x).split(self.split_size, dim=2)
        intermediate_states = self.act_fn(gate_proj) * up_proj
        down_proj = self.down_proj(intermediate_states)

        return down_proj


class TinyCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size

        init_method = partial(_init_normal, config.initializer_range)
        self.embed_tokens = ParallelEmbedding(
            config.vocab_size, config.hidden_size, self.padding_idx, init_method=init_method,
            sequence_parallel_enabled=config.sequence_parallel_enabled, dtype=config.torch_dtype,
        )
        self.mlp = LlamaMLP(config)
        self.lm_head = ColumnParallelLinear(
            config.hidden_size,
            config.vocab_size,
            bias=False,
            gather_output=False,
            init_method=init_method,
            sequence_parallel_enabled=config.sequence_parallel_enabled,
            dtype=self.config.torch_dtype,
        )

    def forward(self, input_ids, labels=None):
        hidden_states = self.embed_tokens(input_ids)
        hidden_states = hidden_states + self.mlp(hidden_states)
        logits = self.lm_head(hidden_states)
        logits = logits.to(torch.float32)

        loss = None
        if labels is not None:
            # Shift so that tokens < n predict n
            shift_logits = logits[..., :-1, :].clone().contiguous()
            shift_labels = labels[..., 1:].contiguous()
            # Flatten the tokens
            loss_fct = parallel_cross_entropy
            shift_logits = shift_logits.view(-1, shift_logits.size(-1))

            shift_labels = shift_labels.view(-1)
            # Enable model parallelism
            shift_labels = shift_labels.to(shift_logits.device)
            per_token_loss = loss_fct(shift_logits, shift_labels)
            valid_mask = (shift_labels != -100).float()
            per_token_loss = per_token_loss * valid_mask

            denom = valid_mask.sum().clamp_min(1.0)
            loss = per_token_loss.sum() / denom

        return loss, logits


def tiny_config():
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_attention_heads=4,
                         num_hidden_layers=1, pad_token_id=0, dtype=torch.float32)
    config.sequence_parallel_enabled = False
    config.selective_checkpoint_enabled = False
    return config


def main():
    torch.distributed.init_process_group("gloo")
    from nxdtp import parallel_state

    tp = int(os.environ.get("TP", os.environ["WORLD_SIZE"]))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(0)
    model = TinyCausalLM(tiny_config())
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :2] = -100
    loss, logits = model(ids, labels)
    loss.backward()
    print(f"rank {torch.distributed.get_rank()}: loss {loss.item():.6f}, vocab-parallel logits {tuple(logits.shape)}, "
          f"embedding grad norm {model.embed_tokens.weight.grad.norm().item():.6f}")
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
