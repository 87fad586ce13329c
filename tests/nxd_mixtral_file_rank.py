"""One rank of tests/test_nxd_model_files.py's Mixtral cases, launched by torchrun: NxD's Mixtral MoE model file (its
imports pointed at nxdtp, in the directory given) against a dense Hugging Face Mixtral.

    torchrun --nproc_per_node=W tests/nxd_mixtral_file_rank.py MODEL_FILE_DIR OUT_DIR TP EP

Every rank draws the same dense weights (every parameter random, router and norms included) and gives NxD's model
this rank's pieces of them (its experts, its TP share); NxD's model runs one forward and backward with NxD's loss
(sequence parallelism on, as NxD's Mixtral example requires), the gradients are reduced as NxD's optimizer wrapper
does (the sequence-parallel sum over TP, NxD's two DP passes), and every rank compares its gradient pieces with the
dense model's, whose objective is the same: HF's cross-entropy plus ``router_aux_loss_coef / top_k`` times HF's
load-balancing loss, which is NxD's ``load_balancing_loss_func`` times ``top_k``. Rank 0 writes ``result.json``.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

model_dir, out_dir, tp, ep = sys.argv[1:5]
tp, ep = int(tp), int(ep)
dist.init_process_group("gloo")
from nxdtp import parallel_state as ps  # noqa: E402
from nxdtp.grads import allreduce_gradients, allreduce_sequence_parallel_gradients  # noqa: E402
from nxdtp.spec import split_along  # noqa: E402

ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
sys.path.insert(0, model_dir)
import modeling_mixtral_moe_nxd as nxd_mixtral  # noqa: E402
from transformers import MixtralConfig, MixtralForCausalLM  # noqa: E402

EXPERTS, TOP_K, COEF = 4, 2, 0.2
config = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
                       num_experts_per_tok=TOP_K, max_position_embeddings=64, tie_word_embeddings=False,
                       rms_norm_eps=1e-5, router_aux_loss_coef=COEF, output_router_logits=True, sliding_window=None)
# The attributes NxD's Mixtral pretraining script sets on the config before it builds the model.
config.use_cache = False
config.pretraining_tp = 1
config.sequence_parallel_enabled = True
config.selective_checkpoint_enabled = False
config.qkv_linear = False
config.kv_shared_group_size = 1
config.use_flash_attention = False
config.moe_frequency = 1
config.capacity_factor = None       # dropless, as HF's Mixtral

torch.manual_seed(1234)
dense = MixtralForCausalLM(config)
with torch.no_grad():
    g = torch.Generator().manual_seed(5)
    for param in dense.parameters():
        param.add_(torch.randn(param.shape, generator=g) * 0.2)
dense.router_aux_loss_coef = COEF / TOP_K   # NxD's aux loss is HF's divided by top_k
nxd = nxd_mixtral.MixtralForCausalLM(config)
tp_rank, ep_group = ps.get_tensor_model_parallel_rank(), ps.expert_parallel_group()


def dense_tensor(name: str, dense_state) -> torch.Tensor:
    """The dense tensor of NxD's parameter ``name``, in NxD's layout (experts as (E, in, out) matrices)."""
    if ".mlp.router.linear_router." in name:
        return dense_state[name.replace(".mlp.router.linear_router.", ".block_sparse_moe.gate.")]
    experts = name.replace(".mlp.expert_mlps.mlp_op.", ".block_sparse_moe.experts.{}.")
    if name.endswith("gate_up_proj.weight"):
        return torch.stack([torch.cat([dense_state[experts.replace("{}.gate_up_proj", f"{e}.w1")],
                                       dense_state[experts.replace("{}.gate_up_proj", f"{e}.w3")]]).T
                            for e in range(EXPERTS)])
    if name.endswith("down_proj.weight") and ".expert_mlps." in name:
        return torch.stack([dense_state[experts.replace("{}.down_proj", f"{e}.w2")].T for e in range(EXPERTS)])
    return dense_state[name]


def local_piece(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    if getattr(param, "expert_model_parallel", False):
        per_rank = full.shape[0] // ep_group.size
        full = full.narrow(0, ep_group.rank * per_rank, per_rank)
    if getattr(param, "tensor_model_parallel", False):
        full = split_along(full, param.partition_dim, tp_rank, tp, param.partition_stride)
    return full


dense_weights = {k: v.detach() for k, v in dense.state_dict().items()}
with torch.no_grad():
    for name, param in nxd.named_parameters():
        param.copy_(local_piece(param, dense_tensor(name, dense_weights)))

g = torch.Generator().manual_seed(7)
input_ids = torch.randint(0, config.vocab_size, (2, 16), generator=g)   # the same batch on every rank
out = nxd(input_ids=input_ids, labels=input_ids)
out.loss.backward()
allreduce_sequence_parallel_gradients(torch.optim.SGD(nxd.parameters(), lr=0.0))
allreduce_gradients(nxd)   # NxD's two passes: DP average; experts over their expert data-parallel group

dense_out = dense(input_ids=input_ids, labels=input_ids)
dense_out.loss.backward()
dense_grads = {n: p.grad for n, p in dense.named_parameters()}
worst = {}
for name, param in nxd.named_parameters():
    expected = local_piece(param, dense_tensor(name, dense_grads))
    worst[name] = (param.grad - expected).abs().max().item()
result = {"nxd_loss": out.loss.item(), "dense_loss": dense_out.loss.item(),
          "nxd_ce": (out.loss - COEF * out.aux_loss).item(),
          "dense_ce": (dense_out.loss - dense.router_aux_loss_coef * dense_out.aux_loss).item(),
          "nxd_aux_times_top_k": out.aux_loss.item() * TOP_K, "dense_aux": dense_out.aux_loss.item(),
          "grad_diff": worst, "dense_grad_max": max(g.abs().max().item() for g in dense_grads.values()),
          "experts_on_this_rank": nxd.model.layers[0].mlp.expert_mlps.mlp_op.gate_up_proj.weight.shape[0]}
gathered = [None] * dist.get_world_size()
dist.all_gather_object(gathered, result)
if dist.get_rank() == 0:
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(gathered, f)
dist.barrier()
ps.destroy_model_parallel()
dist.destroy_process_group()
