"""Mixtral pretraining with tensor × expert × data parallelism, through NxD's trainer API.

neuronx-distributed trains Mixtral with its own model file (``modeling_mixtral_moe_nxd.py``, built from NxD's MoE
modules) under PyTorch Lightning (``run_mixtral_pretrain_ptl.sh``). This is NxD's trainer-API flow for the same model:
``neuronx_distributed_config(tensor_parallel_size=T, expert_parallel_size=E, ...)``, ``initialize_parallel_model``
on Hugging Face's ``MixtralForCausalLM`` (nxdtp's MoE plan: each rank holds 1/E of the experts and 1/T of each
expert's intermediate dimension, tokens reach their experts by an all-to-all over the expert-parallel group, routing is
dropless, the load-balancing loss is counted over the data-parallel batch), ``initialize_parallel_optimizer`` (NxD's
two gradient passes: experts over the expert data-parallel group), ``save_checkpoint`` / ``load_checkpoint``.

    torchrun --nproc_per_node=4 examples/tp_ep_mixtral/tp_ep_mixtral_pretrain.py \\
        --model_path examples/tp_ep_mixtral/configs/mixtral_tiny --data_dir DATA --tensor_parallel_size 2 \\
        --expert_parallel_size 2 --sequence_parallel_enabled --batch_size 4 --max_steps 100 --lr 3e-3 ...

NxD's Mixtral flags that apply: ``--tensor_parallel_size``, ``--expert_parallel_size``, ``--sequence_parallel_enabled``,
``--selective_checkpoint_enabled``, ``--use_zero_1``, ``--use_mix_precision``, ``--use_meta_device_init``,
``--batch_size``, ``--grad_accum_usteps``, ``--max_steps``, ``--steps_this_run``, ``--warmup_steps``, ``--lr``,
``--seq_len``, ``--model_path``, ``--data_dir``. ``--capacity_factor`` is refused (the Hugging Face model is
dropless), and so are ``--pipeline_parallel_size`` and ``--min_lr`` (no pipeline parallelism; the schedule is linear
warmup then linear decay, not NxD's cosine). The training loop, its data, logs, metrics and checkpoints are the Llama
example's: examples/tp_zero1_llama/tp_zero1_llama_hf_pretrain.py builds the decoder family its config.json names.
docs/mixtral_example.md says what differs from NxD's Mixtral example.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tp_zero1_llama"))

import tp_zero1_llama_hf_pretrain as pretrain  # noqa: E402

if __name__ == "__main__":
    pretrain.main()
