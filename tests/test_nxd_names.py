"""Every public name of NxD 2.29's ``neuronx_distributed.parallel_layers`` (and of its trainer API,
``neuronx_distributed.trainer``, including ``trainer/checkpoint.py`` at ``nxdtp.trainer.checkpoint``, and of
``neuronx_distributed.utils.batch_utils`` at ``nxdtp.utils.batch_utils``) is in nxdtp at the matching path, with NxD's
positional parameters, or is listed in docs/nxd_migration.md as not provided, with the reason.

The list below was read from NxD's source at release 2.29 (``parallel_layers/<module>.py``: every top-level function
and class whose name does not start with an underscore, with the parameters of the function or of the class's
``__init__``; and the names ``parallel_layers/__init__.py`` re-exports). ``None`` marks a name whose parameters are not
compared (re-exports, which are compared in their module, and autograd Functions, called through ``apply``).
"""

from __future__ import annotations

import importlib
import inspect
import os
import re

import pytest

import nxdtp

NXD_2_29 = {
    "__init__": dict.fromkeys([
        "parallel_state", "load", "save", "clip_grad_norm", "ColumnParallelLinear", "ParallelEmbedding",
        "RowParallelLinear", "parallel_cross_entropy", "copy_to_tensor_model_parallel_region",
        "gather_from_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
        "scatter_to_tensor_model_parallel_region", "initialize_model_parallel", "get_xla_rng_tracker",
        "model_parallel_xla_manual_seed", "copy_tensor_model_parallel_attributes", "move_model_to_device",
        "set_defaults_if_not_set_tensor_model_parallel_attributes", "set_tensor_model_parallel_attributes",
        "split_tensor_along_last_dim"]),
    "parallel_state": {
        "ascending_ring_PG_group": [
            "lnc_size", "cluster_ranks_nonexp", "cluster_ranks_exp", "tp", "dp", "pp",
            "ep_model_degree", "ep_data_degree", "cp"],
        "ascending_descending_ring_PG_group": [
            "lnc_size", "cluster_ranks_nonexp", "cluster_ranks_exp", "tp", "dp", "pp",
            "ep_model_degree", "ep_data_degree", "cp"],
        "PG_Group_Logic": ["func", "description"],
        "get_logic_chosen": ["lnc_size", "hardware_type", "tp"],
        "initialize_model_parallel": [
            "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
            "expert_model_parallel_size", "skip_collective_init", "lnc_size", "mesh_only"],
        "model_parallel_is_initialized": [],
        "get_world_group": ["as_list"],
        "get_tensor_model_parallel_group": ["as_list"],
        "get_tensor_model_parallel_replica_groups": [],
        "get_expert_model_parallel_group": ["as_list"],
        "get_expert_model_parallel_replica_groups": [],
        "get_data_parallel_group": ["as_list"],
        "get_data_parallel_replica_groups": [],
        "get_expert_data_parallel_group": ["as_list"],
        "get_expert_data_parallel_replica_groups": [],
        "get_tensor_model_parallel_size": [],
        "set_tensor_model_parallel_size": ["world_size"],
        "set_tensor_model_parallel_rank": ["rank"],
        "get_tensor_model_parallel_rank": [],
        "get_tensor_model_parallel_src_rank": [],
        "set_expert_model_parallel_size": ["world_size"],
        "get_expert_model_parallel_size": [],
        "set_expert_model_parallel_rank": ["rank"],
        "get_expert_model_parallel_rank": [],
        "get_expert_parallel_rank_from_global_rank": ["rank", "expert_parallel_group"],
        "get_experts_for_expert_parallel_rank": [
            "expert_parallel_rank", "total_number_of_experts", "expert_model_parallel_size",
            "expert_distribution"],
        "get_data_parallel_src_rank": [],
        "get_data_parallel_size": [],
        "get_data_parallel_rank": [],
        "get_expert_data_parallel_size": [],
        "get_expert_data_parallel_rank": [],
        "get_pipeline_model_parallel_group": ["as_list"],
        "get_pipeline_model_parallel_replica_groups": [],
        "get_pipeline_model_parallel_rank": [],
        "get_pipeline_model_parallel_sr_group": ["parity"],
        "get_pipeline_model_parallel_size": [],
        "get_context_model_parallel_group": ["as_list"],
        "get_context_model_parallel_replica_groups": [],
        "get_context_model_parallel_rank": [],
        "get_context_model_parallel_size": [],
        "set_context_model_parallel_size": ["world_size"],
        "get_context_model_parallel_src_tgt_pairs": [],
        "get_next_rank_group": ["as_list"],
        "get_next_rank_replica_groups": [],
        "get_prev_rank_group": ["as_list"],
        "get_prev_rank_replica_groups": [],
        "get_pipeline_model_parallel_next_rank": [],
        "get_pipeline_model_parallel_prev_rank": [],
        "destroy_model_parallel": [],
        "initialize_token_shuffle_group": ["token_shuffle_group_size"],
        "get_token_shuffle_group": ["as_list"],
        "get_token_shuffle_replica_groups": [],
        "get_token_shuffle_group_size": [],
        "destroy_token_shuffle_group": [],
        "is_tcp_store_available": [],
        "get_tcp_store": [],
        "initialize_pp_gloo_groups": [],
        "get_pp_gloo_group": [],
        "is_global_rank_zero": [],
        "create_pg_with_ranks": ["ranks"],
        "initialize_kv_group": ["kv_shared_group_size", "sequential_ranks_in_group"],
        "get_kv_shared_group": ["as_list"],
        "get_kv_shared_replica_groups": [],
        "get_kv_shared_group_size": [],
        "destroy_kv_group": [],
        "initialize_speculative_draft_group": ["group_size"],
        "get_speculative_draft_group": ["as_list"],
        "get_speculative_draft_replica_groups": [],
        "gather_python_object": ["obj", "group"],
        "set_aot_mode": ["mode"],
        "get_aot_mode": [],
        "arrange_kv_groups": [
            "num_tensor_model_parallel_groups", "tensor_model_parallel_size", "kv_shared_group_size",
            "sequential_ranks_in_group", "hardware_type"],
        "rmsg": ["msg"],
        "rmsg_ep": ["msg"],
        "get_rank_info_str": [],
        "get_zero1_sharding_groups": [],
    },
    "layers": {
        "create_local_weight": ["full_weight", "partition_dim", "per_partition_size", "stride", "out_weight"],
        "BaseParallelLayer": ["device"],
        "ParallelEmbedding": [
            "num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type",
            "scale_grad_by_freq", "sparse", "init_method", "device", "dtype", "shard_across_embedding",
            "pad", "sequence_parallel_enabled", "tensor_model_parallel_group", "use_spmd_rank",
            "sequence_dimension", "tile_cc", "rank_ordering", "collect_output"],
        "LinearWithAsyncCommunication": None,
        "linear_with_async_allreduce": [
            "input", "weight", "bias", "async_grad_allreduce", "sequence_parallel_enabled",
            "sequence_dimension", "autograd_func_class", "save_for_backward", "process_group",
            "reduce_dtype"],
        "BaseParallelLinear": ["device"],
        "ColumnParallelLinear": [
            "input_size", "output_size", "bias", "gather_output", "dtype", "device", "stride",
            "init_method", "sequence_parallel_enabled", "sequence_dimension", "keep_master_weight",
            "skip_bias_add", "pad", "pad_alignment_size_per_rank", "keep_padded_output",
            "tensor_model_parallel_group", "reduce_dtype", "rank_ordering"],
        "RowParallelLinear": [
            "input_size", "output_size", "bias", "input_is_parallel", "dtype", "device", "stride",
            "init_method", "sequence_parallel_enabled", "sequence_dimension", "keep_master_weight",
            "skip_bias_add", "pad", "reduce_output", "tensor_model_parallel_group", "reduce_dtype",
            "tile_cc", "rank_ordering"],
        "Conv2dWithInputGradAllReduce": None,
        "conv2d_with_weight_grad_allreduce": [
            "input", "weight", "bias", "stride", "padding", "allreduce_weight_grad"],
        "BaseParallelConv": [
            "in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups",
            "bias", "padding_mode", "partition_dim", "dtype", "device", "init_method",
            "keep_master_params", "partition_pad"],
        "OutputChannelParallelConv2d": [
            "in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups",
            "bias", "padding_mode", "gather_output", "dtype", "device", "init_method",
            "keep_master_weight", "partition_pad"],
        "InputChannelParallelConv2d": [
            "in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups",
            "bias", "padding_mode", "input_is_parallel", "dtype", "device", "init_method",
            "keep_master_weight", "partition_pad"],
        "SPMDRank": ["world_size", "tensor_model_parallel_size"],
    },
    "layer_norm": {
        "LayerNorm": [
            "normalized_shape", "eps", "elementwise_affine", "bias", "device", "dtype",
            "sequence_parallel_enabled"],
    },
    "mappings": {
        "nonzero_partition_dim_swap": ["func"],
        "copy_to_tensor_model_parallel_region": ["input_", "process_group"],
        "reduce_from_tensor_model_parallel_region": ["input_", "process_group"],
        "reduce_from_context_model_parallel_region": ["input_", "process_group"],
        "scatter_input_channels_to_tensor_model_parallel_region": ["input_"],
        "scatter_to_tensor_model_parallel_region": ["input_", "process_group"],
        "gather_from_tensor_model_parallel_region": ["input_", "process_group"],
        "scatter_to_sequence_parallel_region": ["input_", "sequence_dimension", "process_group"],
        "gather_from_sequence_parallel_region": [
            "input_", "sequence_dimension", "to_model_parallel", "process_group", "tile_cc"],
        "reduce_scatter_to_sequence_parallel_region": ["input_", "sequence_dimension", "process_group", "dtype"],
        "reduce_scatter_to_tensor_model_parallel_region_with_dim": ["input_", "partition_dim", "process_group"],
        "gather_from_tensor_model_parallel_region_with_dim": ["input_", "gather_dim", "process_group"],
        "enter_expert_parallel_region": ["x", "scatter_gather"],
        "exit_expert_parallel_region": ["x", "scatter_gather"],
        "scatter_to_process_group_spmd": ["input_", "partition_dim", "rank", "process_group"],
        "round_robin_scatter_to_process_group_spmd": ["input_", "partition_dim", "rank", "process_group"],
    },
    "loss_functions": {
        "DistributedLogprob": None,
        "from_parallel_logits_to_logprobs": ["vocab_parallel_logits", "target", "inference"],
        "parallel_cross_entropy": ["vocab_parallel_logits", "target", "label_smoothing"],
    },
    "grads": {
        "param_is_not_shared": ["param"],
        "get_grad_norm": ["parameters", "norm_type", "zero1_optimizer", "zero1_optimizer_groups", "force_spmd"],
        "clip_grad_norm": [
            "parameters", "max_norm", "norm_type", "zero1_optimizer", "zero1_optimizer_groups",
            "force_spmd"],
        "clip_grads_with_norm": ["parameters", "total_norm", "max_norm"],
        "bucket_allreduce_gradients": ["grads_list", "reduce_over_ep_group"],
        "allreduce_sequence_parallel_gradients": ["optimizer"],
        "allreduce_context_parallel_gradients": ["optimizer"],
    },
    "random": {
        "XLARNGStatesTracker": [],
        "get_xla_rng_tracker": [],
        "model_parallel_xla_manual_seed": ["seed"],
    },
    "checkpointing": {
        "ensure_directory_exists": ["filename"],
        "get_sharded_model_dict": ["model", "model_state_dict"],
        "save": ["checkpoint", "output_dir", "save_serially", "save_xser", "down_cast_bf16", "master_dp_only"],
        "load": [
            "chkpt_path", "model", "model_or_optimizer", "model_key", "load_xser", "sharded", "strict",
            "master_dp_only", "weights_only"],
    },
    "utils": {
        "EmbeddingUtility": None,
        "param_is_not_tensor_parallel_duplicate": ["param"],
        "set_tensor_model_parallel_attributes": [
            "tensor", "is_parallel", "dim", "stride", "num_partitions", "rank_ordering"],
        "set_defaults_if_not_set_tensor_model_parallel_attributes": ["tensor"],
        "copy_tensor_model_parallel_attributes": ["destination_tensor", "source_tensor"],
        "ensure_divisibility": ["numerator", "denominator"],
        "divide": ["numerator", "denominator"],
        "split_tensor_along_dim": ["tensor", "dim", "num_partitions", "contiguous_split_chunks"],
        "get_padding_length": ["numerator", "denominator"],
        "split_tensor_along_last_dim": ["tensor", "num_partitions", "contiguous_split_chunks"],
        "split_tensor_along_second_dim": ["tensor", "num_partitions", "contiguous_split_chunks"],
        "is_torch_version_greater_than_2": [],
        "is_pjrt_device": [],
        "requires_init_pg_override": [],
        "cast_tensor": ["tensor", "from_dtype", "to_dtype"],
        "cast_all": ["state", "from_dtype", "to_dtype"],
        "cast_if_autocast_enabled": [],
        "move_all_tensor_to_cpu": ["data", "convert"],
        "get_local_world_size": [],
        "move_model_to_device": ["model", "device"],
        "verify_casted_dtype": ["value"],
        "indices_split_along_dim": ["tensor", "dim", "rank", "num_partitions"],
        "initialize_fallback_parallel_state": ["device"],
    },
    # trainer/checkpoint.py (not parallel_layers): NxD's trainer checkpoint functions.
    "trainer.checkpoint": {
        "save_checkpoint": [
            "checkpoint_dir_str", "tag", "model", "optimizer", "scheduler", "user_content", "num_workers", "use_xser",
            "num_kept_ckpts", "async_save", "zero1_optimizer", "use_zero1_dcp", "avoid_saving_lower_precision_weights"],
        "load_checkpoint": [
            "path", "tag", "model", "optimizer", "scheduler", "num_workers", "strict", "use_zero1_dcp"],
        "has_checkpoint": ["checkpoint_dir_str"],
        "finalize_checkpoint": [],
        "CheckpointIOState": None,
    },
    # utils/batch_utils.py (not parallel_layers): NxD's per-batch helpers for context parallelism.
    "utils.batch_utils": {
        "shift_labels": ["batch"],
        "get_batch_on_this_context_parallel_rank": ["batch"],
    },
    "pad": {
        "get_number_of_extra_heads": ["n_head", "tp_degree"],
        "pad_model": ["model", "tp_degree", "n_heads", "wrapped_classes", "pad_hook_fn"],
        "generate_padding_mask": [
            "num_heads", "num_heads_with_pad", "num_kv_heads", "tp_degree", "tp_rank", "hardware_type"],
    },
}

# NxD 2.29's trainer API (``src/neuronx_distributed/trainer/``): the package's names, ``trainer/model.py``'s
# ``NxDModel`` and ``trainer/optimizer.py``'s ``NxDOptimizer``, all at ``nxdtp.trainer``. Its checkpoint names
# (``save_checkpoint``, ``load_checkpoint``, ...) are listed where nxdtp.trainer.checkpoint is tested.
NXD_TRAINER_2_29 = {
    "trainer": {
        "neuronx_distributed_config": [
            "tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size", "context_parallel_size",
            "pipeline_config", "optimizer_config", "activation_checkpoint_config", "pad_model", "sequence_parallel",
            "model_init_config", "lora_config", "mixed_precision_config", "sequential_move_factor", "lnc_size"],
        "initialize_parallel_model": ["nxd_config", "model_fn", "include_buffers"],
        "initialize_parallel_optimizer": ["nxd_config", "optimizer_class", "parameters"],
        "NxDModel": ["module", "nxd_config"],
        "NxDOptimizer": ["optimizer", "nxd_config"],
        "hooks": None,
    },
}
# Also at NxD's top level (``neuronx_distributed.X``), and so at ``nxdtp.X``.
NXD_TOP_LEVEL_TRAINER_NAMES = ["neuronx_distributed_config", "initialize_parallel_model",
                               "initialize_parallel_optimizer"]
NXD_2_29.update(NXD_TRAINER_2_29)

_DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "nxd_migration.md")
_ROW = re.compile(r"^\| `(?P<module>[a-z_.]+)\.(?P<name>[A-Za-z0-9_]+)` \| (?P<status>same|different|not provided) \|"
                  r" (?P<note>.*) \|$")


def _doc_rows():
    rows = {}
    with open(_DOC, encoding="utf-8") as f:
        for line in f:
            match = _ROW.match(line.rstrip("\n"))
            if match:
                key = (match["module"], match["name"])
                assert key not in rows, f"docs/nxd_migration.md lists {key} twice"
                rows[key] = (match["status"], match["note"].strip())
    return rows


def _nxdtp_module(module: str):
    return nxdtp if module == "__init__" else importlib.import_module(f"nxdtp.{module}")


def _parameters(obj):
    target = obj.__init__ if inspect.isclass(obj) else obj
    return [p.name for p in inspect.signature(target).parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)][1 if inspect.isclass(obj) else 0:]


_ALL = [(module, name) for module, names in NXD_2_29.items() for name in names]


def test_the_table_lists_every_nxd_name_once():
    rows = _doc_rows()
    listed = {key for key in rows if key[0] in NXD_2_29}
    assert not set(_ALL) - listed, f"NxD names missing from docs/nxd_migration.md: {sorted(set(_ALL) - listed)}"
    assert not listed - set(_ALL), \
        f"docs/nxd_migration.md lists names NxD 2.29 does not have: {sorted(listed - set(_ALL))}"


@pytest.mark.parametrize("module,name", _ALL, ids=lambda v: str(v))
def test_name_is_provided_with_nxd_parameters_or_documented_as_not_provided(module, name):
    status, note = _doc_rows()[(module, name)]
    provided = hasattr(_nxdtp_module(module), name)
    if status == "not provided":
        assert not provided, f"nxdtp.{module}.{name} exists but the table says 'not provided'"
        assert len(note) > 20, f"{module}.{name}: 'not provided' needs the reason in the table"
        return
    assert provided, f"nxdtp.{module}.{name} is missing (the table says {status!r})"
    if status == "different":
        assert len(note) > 20, f"{module}.{name}: 'different' needs the how and why in the table"
    expected = NXD_2_29[module][name]
    if expected is None:
        return
    actual = _parameters(getattr(_nxdtp_module(module), name))
    assert actual[:len(expected)] == expected, (
        f"nxdtp.{module}.{name} parameters {actual} do not start with NxD 2.29's {expected}")


def test_nxd_top_level_trainer_names_are_nxdtp_top_level_names():
    for name in NXD_TOP_LEVEL_TRAINER_NAMES:
        assert getattr(nxdtp, name) is getattr(nxdtp.trainer, name), name
        assert name in nxdtp.__all__, name


# The neuronx_distributed imports at the top of NxD 2.29's Llama pretraining script
# (examples/training/llama/tp_zero1_llama_hf_pretrain/tp_zero1_llama_hf_pretrain.py), as its user writes them.
NXD_LLAMA_PRETRAINING_IMPORTS = """
import neuronx_distributed as nxd
from neuronx_distributed.parallel_layers import parallel_state
from neuronx_distributed.parallel_layers.utils import requires_init_pg_override
from neuronx_distributed.utils.adamw_fp32_optim_params import AdamW_FP32OptimParams
from neuronx_distributed.utils.batch_utils import get_batch_on_this_context_parallel_rank
"""
# The prefix change docs/nxd_migration.md describes: parallel_layers' modules are nxdtp's, the rest keep their path.
NXD_PREFIXES = [(r"\bneuronx_distributed\.parallel_layers\b", "nxdtp"), (r"\bneuronx_distributed\b", "nxdtp")]


def test_nxd_llama_pretraining_imports_change_only_their_prefix():
    source = NXD_LLAMA_PRETRAINING_IMPORTS
    for pattern, replacement in NXD_PREFIXES:
        source = re.sub(pattern, replacement, source)
    assert "neuronx_distributed" not in source and "from nxdtp.utils.batch_utils import" in source
    names = {}
    exec(compile(source, "<NxD's imports, prefix changed>", "exec"), names)

    from nxdtp.optimizer import AdamW_FP32OptimParams
    from nxdtp.utils import batch_utils

    assert names["nxd"] is nxdtp and names["parallel_state"] is nxdtp.parallel_state
    assert names["requires_init_pg_override"] is nxdtp.utils.requires_init_pg_override
    assert names["AdamW_FP32OptimParams"] is AdamW_FP32OptimParams
    assert names["get_batch_on_this_context_parallel_rank"] is batch_utils.get_batch_on_this_context_parallel_rank
