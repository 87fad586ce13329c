"""One rank of tests/test_nxd_model_files.py, launched by torchrun: NxD's Llama model file (its imports pointed at
nxdtp, in the directory given) against a dense Hugging Face Llama.

    torchrun --nproc_per_node=W tests/nxd_model_file_rank.py MODEL_FILE_DIR OUT TP KV_HEADS KV_MULTIPLIER [FLAG...]

FLAG: sp, qkv_linear, fuse_qkv, selective, init_weights. Each rank builds NxD's LlamaForCausalLM, randomises every
parameter (replicated ones equally on every TP rank, KV copies equally), runs one forward and backward with NxD's loss
on one batch, and all-reduces the sequence-parallel gradients over TP as NxD's optimizer wrapper does. DP rank 0 of
each TP rank saves its weights and gradients in NxD's checkpoint layout (``tp_rank_XX_pp_rank_00/checkpoint.pt``);
rank 0 merges both with ``nxdtp-merge --from-nxd`` and writes ``result.json``: NxD's loss, and the dense HF model's loss
and gradients on the same batch from the merged weights. With ``init_weights``, NxD's own ``init_weights`` (the
script's ``param_init_fn``) runs first, and ``init.json`` records whether every DP replica got the same values.
"""

import json
import os
import subprocess
import sys
import zlib

import torch
import torch.distributed as dist

model_dir, out, tp, kv_heads, kv_multiplier, *flags = sys.argv[1:]
tp, kv_heads, kv_multiplier, flags = int(tp), int(kv_heads), int(kv_multiplier), set(flags)
dist.init_process_group("gloo")
from nxdtp import parallel_state as ps  # noqa: E402
from nxdtp.grads import allreduce_sequence_parallel_gradients  # noqa: E402

ps.initialize_model_parallel(tensor_model_parallel_size=tp)
sys.path.insert(0, model_dir)
import modeling_llama_nxd as nxd_llama  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=kv_heads, max_position_embeddings=64, tie_word_embeddings=False,
                     rms_norm_eps=1e-5)
# The attributes NxD's pretraining script sets on the config before it builds the model.
config.use_cache = False
config.pretraining_tp = 1
config.torch_dtype = torch.float32
config.sequence_parallel_enabled = "sp" in flags
config.selective_checkpoint_enabled = "selective" in flags
config.qkv_linear = "qkv_linear" in flags
config.fuse_qkv = "fuse_qkv" in flags
config.kv_shared_group_size = kv_multiplier
config.use_flash_attention = False
config.transpose_nki_inputs = False
rank = dist.get_rank()
if rank == 0:
    config.save_pretrained(os.path.join(out, "config"))

torch.manual_seed(1234)  # NxD's script seeds every rank alike before it builds the model
model = nxd_llama.LlamaForCausalLM(config)
tp_rank, dp_rank = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
if "init_weights" in flags:
    for module in model.modules():
        nxd_llama.init_weights(module, "cpu")
    local = {n: p.detach().clone() for n, p in model.named_parameters()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (tp_rank, local))
    differ = sorted({n for t, other in gathered if t == tp_rank for n in local if not torch.equal(local[n], other[n])})
    if rank == 0:
        with open(os.path.join(out, "init.json"), "w") as f:
            json.dump({"differ_across_dp": differ}, f)

with torch.no_grad():
    for name, param in model.named_parameters():
        copies = kv_multiplier > 1 and name.endswith(("weight_k", "weight_v"))  # KV copies stay equal
        per_rank = getattr(param, "tensor_model_parallel", False) and not copies
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + (1000 * tp_rank if per_rank else 0))
        param.add_(torch.randn(param.shape, generator=g) * 0.2)

g = torch.Generator().manual_seed(7)
input_ids = torch.randint(0, config.vocab_size, (4, 16), generator=g)
labels = input_ids.clone()
labels[0, :3] = -100
loss = model(input_ids=input_ids, labels=labels).loss
loss.backward()
allreduce_sequence_parallel_gradients(torch.optim.SGD(model.parameters(), lr=0.0))

if dp_rank == 0:
    weights = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    for what, state in (("weights", weights), ("grads", grads)):
        directory = os.path.join(out, what, f"tp_rank_{tp_rank:02d}_pp_rank_00")
        os.makedirs(directory, exist_ok=True)
        torch.save({"model": state}, os.path.join(directory, "checkpoint.pt"))
dist.barrier()
if rank == 0:
    for what in ("weights", "grads"):
        subprocess.run([sys.executable, "-m", "nxdtp.cli", os.path.join(out, what),
                        os.path.join(out, what + "_hf"), "--from-nxd", "--config",
                        os.path.join(out, "config", "config.json"), "--no-progress"], check=True)
    dense = LlamaForCausalLM.from_pretrained(os.path.join(out, "weights_hf"), attn_implementation="eager")
    dense_loss = dense(input_ids=input_ids, labels=labels).loss
    dense_loss.backward()
    from safetensors.torch import load_file

    merged_grads = load_file(os.path.join(out, "grads_hf", "model.safetensors"))
    grad_diff = {n: (merged_grads[n] - p.grad).abs().max().item() for n, p in dense.named_parameters()}
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"nxd_loss": loss.item(), "dense_loss": dense_loss.item(), "grad_diff": grad_diff,
                   "dense_grad_max": max(p.grad.abs().max().item() for p in dense.parameters())}, f)
dist.barrier()
ps.destroy_model_parallel()
dist.destroy_process_group()
