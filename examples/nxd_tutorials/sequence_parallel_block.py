# NxD's sequence parallelism on top of tensor parallelism, run by nxdtp.
#
# Follows: NxD docs (aws-neuron-sdk libraries/neuronx-distributed/activation_memory_reduction_developer_guide.rst),
# "Sequence Parallelism". Its lines are kept as written:
#   - "Model changes for Tensor-Parallel block": query_key_value = ColumnParallelLinear(..., stride=3,
#     gather_output=False, init_method=init_method, sequence_parallel_enabled=...) and dense = RowParallelLinear(...,
#     input_is_parallel=True, ...);
#   - "Model changes for Non-Tensor-Parallel block": layer_norm.LayerNorm(..., sequence_parallel_enabled=...), and
#     setattr(param, "sequence_parallel_enabled", sequence_parallel_enabled) for a norm of your own (an RMSNorm here);
#   - allreduce_sequence_parallel_gradients(optimizer), verbatim, called before optimizer.step();
#   - "Transposing the activations": transpose + scatter_to_sequence_parallel_region before the layers,
#     qkv.transpose(0,1) after the QKV projection and attn_output.transpose(0,1) before the output projection, and
#     gather_from_sequence_parallel_region(hidden_states, to_model_parallel=False) + transpose at the end.
# Lines that differ from NxD's code:
#   - from neuronx_distributed.parallel_layers.layers import ColumnParallelLinear, RowParallelLinear
#       -> from nxdtp.layers import ColumnParallelLinear, RowParallelLinear                        (the import)
#   - from neuronx_distributed.parallel_layers import layer_norm -> from nxdtp import layer_norm     (the import)
#   - from neuronx_distributed.parallel_layers.mappings import ... -> from nxdtp.mappings import ... (the imports; the
#     guide writes "form" for "from" twice)
#   - from neuronx_distributed.parallel_layers.parallel_state import get_tensor_model_parallel_size
#       -> from nxdtp.parallel_state import get_tensor_model_parallel_size                        (the import)
#   - the guide's `class class GPTNeoXAttentionNxD(GPTNeoXAttention)` (a typo) and `config.sequence_parallel_enabled`
#     inside forward (no `config` there) are written class AttentionNxD(nn.Module) and self.config...; the two
#     transposes in the attention are under `if self.config.sequence_parallel_enabled:`.
# Not NxD's: the guide elides the class bodies ("...."), so the rest of AttentionNxD, LayerNxD and ModelNxD is ours: a
# GPT-NeoX-like block (parallel residual, non-causal attention, no rotary embeddings) whose fused QKV projection is
# read as [Q; K; V] blocks, the layout stride=3 shards. BlockConfig, tiny_config and main are ours too.
#
# Run: torchrun --nproc_per_node=2 examples/nxd_tutorials/sequence_parallel_block.py

import math
import os
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from nxdtp import layer_norm
from nxdtp.layers import ColumnParallelLinear, RowParallelLinear
from nxdtp.mappings import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region
from nxdtp.parallel_state import get_tensor_model_parallel_size


@dataclass
class BlockConfig:
    hidden_size: int = 16
    num_attention_heads: int = 4
    num_hidden_layers: int = 2
    layer_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    sequence_parallel_enabled: bool = True


def _init_normal(std, w):
    return nn.init.normal_(w, mean=0.0, std=std)


class AttentionNxD(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.head_size = config.hidden_size // config.num_attention_heads
        self.num_attention_heads = config.num_attention_heads // get_tensor_model_parallel_size()
        init_method = partial(_init_normal, config.initializer_range)
        self.query_key_value = ColumnParallelLinear(
                                 config.hidden_size,
                                 3 * config.hidden_size,
                                 stride=3,
                                 gather_output=False,
                                 init_method=init_method,
                                 sequence_parallel_enabled=self.config.sequence_parallel_enabled,
                             )
        self.dense = RowParallelLinear(
                         config.hidden_size,
                         config.hidden_size,
                         input_is_parallel=True,
                         init_method=init_method,
                         sequence_parallel_enabled=self.config.sequence_parallel_enabled,
                     )

    def forward(self, hidden_states):
        # Within the attention module
        qkv = self.query_key_value(hidden_states)

        if self.config.sequence_parallel_enabled:
            qkv = qkv.transpose(0,1)
        batch, seq = qkv.shape[:2]
        query, key, value = (t.reshape(batch, seq, self.num_attention_heads, self.head_size).transpose(1, 2)
                             for t in qkv.chunk(3, dim=-1))
        scores = query @ key.transpose(-1, -2) / math.sqrt(self.head_size)
        attn_output = (scores.softmax(dim=-1) @ value).transpose(1, 2).reshape(batch, seq, -1)

        if self.config.sequence_parallel_enabled:
            attn_output = attn_output.transpose(0,1)
        attn_output = self.dense(attn_output)
        return attn_output


class MLPNxD(nn.Module):
    def __init__(self, config):
        super().__init__()
        init_method = partial(_init_normal, config.initializer_range)
        self.dense_h_to_4h = ColumnParallelLinear(config.hidden_size, 4 * config.hidden_size, gather_output=False,
                                                  init_method=init_method,
                                                  sequence_parallel_enabled=config.sequence_parallel_enabled)
        self.dense_4h_to_h = RowParallelLinear(4 * config.hidden_size, config.hidden_size, input_is_parallel=True,
                                               init_method=init_method,
                                               sequence_parallel_enabled=config.sequence_parallel_enabled)

    def forward(self, hidden_states):
        return self.dense_4h_to_h(nn.functional.gelu(self.dense_h_to_4h(hidden_states)))


class LayerNxD(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = layer_norm.LayerNorm(
                                 config.hidden_size,
                                 eps=config.layer_norm_eps,
                                 sequence_parallel_enabled=config.sequence_parallel_enabled
                               )
        self.post_attention_layernorm = layer_norm.LayerNorm(
                                             config.hidden_size,
                                             eps=config.layer_norm_eps,
                                             sequence_parallel_enabled=config.sequence_parallel_enabled
                                         )
        self.attention = AttentionNxD(config)
        self.mlp = MLPNxD(config)

    def forward(self, hidden_states):
        # GPT-NeoX's parallel residual: x + attn(ln1(x)) + mlp(ln2(x)), token-wise outside the attention.
        return (hidden_states + self.attention(self.input_layernorm(hidden_states))
                + self.mlp(self.post_attention_layernorm(hidden_states)))


class ModelNxD(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([LayerNxD(config) for _ in range(config.num_hidden_layers)])
        self.final_norm = nn.RMSNorm(config.hidden_size, eps=config.layer_norm_eps)
        sequence_parallel_enabled = config.sequence_parallel_enabled
        for param in self.final_norm.parameters():
            param.sequence_parallel_enabled = sequence_parallel_enabled

    def forward(self, hidden_states):
        """[batch, seq, hidden] in and out."""
        # NxD Core code change: sequence parallel uses seq_len as the 0-th dim
        if self.config.sequence_parallel_enabled:
            hidden_states = hidden_states.transpose(0, 1).contiguous()
            hidden_states = scatter_to_sequence_parallel_region(hidden_states)
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        hidden_states = self.final_norm(hidden_states)
        if self.config.sequence_parallel_enabled:
            hidden_states = gather_from_sequence_parallel_region(hidden_states, to_model_parallel=False)
            hidden_states = hidden_states.transpose(0, 1).contiguous()
        return hidden_states


def allreduce_sequence_parallel_gradients(optimizer):
    """ All-reduce layernorm parameters across model parallel nodes when sequence parallelism is used.
        Modified from megatron-lm:
        https://gitlab-master.nvidia.com/ADLR/megatron-lm/-/blob/3f91f09bb2ab32f9904b47f46f19d2fc3f518ed8/megatron/training.py#L425
    """
    from nxdtp.mappings import reduce_from_tensor_model_parallel_region
    grads = []
    for param_group in optimizer.__getstate__()['param_groups']:
        for group, params in param_group.items():
            if group == 'params':
                for p in params:
                    if isinstance(p, torch.Tensor) and p.grad is not None:
                        sequence_parallel_param = getattr(p, 'sequence_parallel_enabled', False)
                        if sequence_parallel_param:
                            grads.append(p.grad.data)
    for grad in grads:
        reduce_from_tensor_model_parallel_region(grad)


def main():
    torch.distributed.init_process_group("gloo")
    from nxdtp import parallel_state

    tp = int(os.environ.get("TP", os.environ["WORLD_SIZE"]))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(0)
    model = ModelNxD(BlockConfig())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hidden_states = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    model(hidden_states).square().mean().backward()
    ln = model.layers[0].input_layernorm.weight
    before = ln.grad.clone()
    allreduce_sequence_parallel_gradients(optimizer)
    print(f"rank {torch.distributed.get_rank()}: LayerNorm weight grad changed by the guide's all-reduce: "
          f"{not torch.equal(before, ln.grad)}")
    optimizer.step()
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
