"""``model.save_pretrained(directory)`` on a parallelized Hugging Face model: the dense HF directory, from the live
shards, as ``nxdtp-merge`` writes it from a checkpoint.

HF's own method would hand each rank's shards, and the nxdtp specs that travel in ``state_dict()``, to safetensors
(which fails on the specs, and would otherwise write one rank's pieces as if they were the model). Parallelized models
get this method instead (``finish_hf_model`` mixes it in). Every rank calls it, as with HF under
``torch.distributed``: the weights are gathered over the tensor-parallel group one tensor at a time and written by one
rank (``nxdtp.checkpointing.dense.save_dense``, the writer ``nxdtp-merge`` uses too), then that rank writes
``config.json`` and, for models that generate, ``generation_config.json`` with HF's own methods. Every rank returns
once the files are complete.

HF's keyword arguments: ``max_shard_size`` (HF's shard plan, huggingface_hub's, and its default for the installed
release), ``is_main_process`` (the lowest rank passing True writes) and ``state_dict`` (this rank's shards, as
``model.state_dict()`` gives them) are honoured. ``push_to_hub=True``, ``safe_serialization=False``, a ``variant``
and ``distributed_checkpoint=True`` are refused, naming why. ``token`` and ``save_function`` are accepted and unused, as
HF leaves them unused when it writes safetensors without uploading; so are ``save_peft_format`` and
``save_original_format``, which change nothing for a model without adapters or weight conversions. Any other keyword
(HF passes them to the hub upload) is refused.
"""

from __future__ import annotations

import copy
import inspect
import os
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..checkpointing.dense import WEIGHTS_NAME, Layout, save_dense
from ..plan import add_mixin

_ACCEPTED_UNUSED = ("token", "save_function", "save_peft_format", "save_original_format")


def save_pretrained(model: nn.Module, save_directory, is_main_process: bool = True,
                    state_dict: Optional[Dict[str, Any]] = None, *, push_to_hub: bool = False, max_shard_size=None,
                    safe_serialization: bool = True, variant: Optional[str] = None,
                    distributed_checkpoint: bool = False, **kwargs) -> None:
    """Write the dense HF directory of the parallelized HF ``model`` (a collective: every rank calls it); what
    ``model.save_pretrained`` does on a parallelized model. See the module docstring for the keywords."""
    directory = os.fspath(save_directory)
    what = f"save_pretrained({directory!r})"
    if max_shard_size is None:
        max_shard_size = _hf_default_max_shard_size()

    def check() -> None:
        if push_to_hub:
            raise ValueError(f"{what}: push_to_hub=True is not supported by nxdtp (it uploads nothing: training jobs "
                             "often have no network); save, then upload the directory from one rank with "
                             "huggingface_hub.HfApi().upload_folder(repo_id=..., folder_path=...)")
        if safe_serialization is not True:
            raise ValueError(f"{what}: safe_serialization={safe_serialization!r} is not supported, only True: nxdtp "
                             "streams safetensors one tensor at a time, while pytorch_model.bin (torch.save) needs the "
                             "whole model in memory at once (transformers 5 writes safetensors only). nxdtp-merge "
                             "--format bin writes one from a checkpoint saved with nxdtp.checkpointing.save")
        if variant is not None:
            raise ValueError(f"{what}: variant={variant!r} is not supported, only None (the files are named "
                             f"{WEIGHTS_NAME} or model-0000i-of-0000n.safetensors)")
        if distributed_checkpoint:
            raise ValueError(f"{what}: distributed_checkpoint=True is not supported; to save a sharded training "
                             "checkpoint use nxdtp.checkpointing.save, which nxdtp-merge turns into this directory")
        unknown = sorted(set(kwargs) - set(_ACCEPTED_UNUSED))
        if unknown:
            raise TypeError(f"{what}: unexpected keyword argument(s) {unknown} (HF passes such arguments to the hub "
                            "upload, which nxdtp does not do); nxdtp accepts is_main_process, state_dict, push_to_hub "
                            "(False), max_shard_size, safe_serialization (True), variant (None), "
                            f"distributed_checkpoint (False) and, unused, {list(_ACCEPTED_UNUSED)}")
        if getattr(model, "_hf_peft_config_loaded", False):
            raise ValueError(f"{what}: the model has PEFT adapters loaded; nxdtp saves whole models, not adapters")
        if state_dict is not None and not isinstance(state_dict, dict):
            raise TypeError(f"{what}: state_dict must be a dict (this rank's model.state_dict()) or None, got "
                            f"{type(state_dict).__name__}")

    def plan_files(layout: Layout, held: Dict[str, Tuple[str, int]]) -> Dict[str, List[str]]:
        return _hf_shard_plan(layout, held, max_shard_size, what)

    def index_metadata(layout: Layout) -> Dict[str, Any]:
        # HF records the parameter count (each tied parameter once), not counting buffers.
        parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        return {"total_parameters": sum(torch.Size(shape).numel() for key, _, shape in layout if key in parameters)}

    save_dense(model, directory, state_dict=state_dict, is_writer=bool(is_main_process), plan_files=plan_files,
               index_metadata=index_metadata, write_beside=lambda d: _write_configs(model, d), check=check, what=what)


def _hf_default_max_shard_size():
    """The installed transformers' default (transformers 5: "50GB"; 4.x: "5GB"), so a parallelized model shards its
    files as the dense model would."""
    from transformers import PreTrainedModel

    return inspect.signature(PreTrainedModel.save_pretrained).parameters["max_shard_size"].default


def _hf_shard_plan(layout: Layout, held: Dict[str, Tuple[str, int]], max_shard_size, what: str
                   ) -> Dict[str, List[str]]:
    """HF's own shard plan for the dense tensors (huggingface_hub's shard splitting, which transformers uses), computed
    from shapes alone: meta tensors stand in for tensors not gathered yet. The parts of one held tensor (``held``: a
    mixture of experts' experts, saved one by one) are views of one storage in transformers' save, which the split
    keeps in one file and counts once: so here too."""
    from huggingface_hub import split_state_dict_into_shards_factory

    stand_ins = {key: torch.empty(shape, dtype=dtype, device="meta") for key, dtype, shape in layout}
    key_of = {id(tensor): key for key, tensor in stand_ins.items()}

    def storage_size(tensor: torch.Tensor) -> int:
        key = key_of[id(tensor)]
        return held[key][1] if key in held else tensor.numel() * tensor.element_size()

    pattern = WEIGHTS_NAME.replace(".safetensors", "{suffix}.safetensors")
    try:
        split = split_state_dict_into_shards_factory(
            stand_ins, get_storage_size=storage_size, filename_pattern=pattern, max_shard_size=max_shard_size,
            get_storage_id=lambda tensor: held.get(key_of[id(tensor)], (None,))[0])
    except (ValueError, TypeError, AttributeError):
        raise ValueError(f"{what}: max_shard_size={max_shard_size!r} is not a size: pass a number of bytes or a "
                         "string such as '5GB', '500MB' or '2GiB'") from None
    if not split.filename_to_tensors:  # no tensors at all: one empty file, as HF writes
        return {WEIGHTS_NAME: []}
    return {name: list(keys) for name, keys in split.filename_to_tensors.items()}


def _write_configs(model: nn.Module, directory: str) -> None:
    """config.json, and generation_config.json for models that generate, as HF's save_pretrained writes them (with
    HF's own methods): the config records the class and the dtype. The live model's config is left unchanged."""
    config = copy.deepcopy(model.config)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    # transformers 5 (and 4.56+) call the field `dtype`; older releases `torch_dtype`.
    setattr(config, "dtype" if hasattr(type(config), "dtype") else "torch_dtype", str(dtype).split(".")[1])
    config.architectures = [type(model).__name__]
    config.save_pretrained(directory)
    generation_config = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if generation_config is not None and (can_generate is None or can_generate()):
        generation_config.save_pretrained(directory)


class SavesDensePretrained:
    """Mixed into a parallelized HF model by ``finish_hf_model``: its ``save_pretrained`` writes the dense directory
    (``nxdtp.models.save_pretrained``); ``push_to_hub`` and ``resize_token_embeddings``, which would act on one rank's
    shards, raise saying what to do instead. A module-level class, so the model still deep-copies and pickles."""

    # Keyword-only after state_dict: transformers 4 and 5 order the later parameters differently (4.x has
    # save_function fourth), so a positional argument there would bind to the wrong one.
    def save_pretrained(self, save_directory, is_main_process: bool = True, state_dict=None, *,
                        push_to_hub: bool = False, max_shard_size=None, safe_serialization: bool = True, variant=None,
                        distributed_checkpoint: bool = False, **kwargs) -> None:
        save_pretrained(self, save_directory, is_main_process=is_main_process, state_dict=state_dict,
                        push_to_hub=push_to_hub, max_shard_size=max_shard_size,
                        safe_serialization=safe_serialization, variant=variant,
                        distributed_checkpoint=distributed_checkpoint, **kwargs)

    def push_to_hub(self, *args, **kwargs):
        # HF's push_to_hub saves (a collective here) and uploads from whichever rank calls it: on every rank, each would
        # upload; on rank 0 alone, its save would wait for ranks that never join.
        raise NotImplementedError(
            f"push_to_hub on a tensor-parallel (nxdtp) {type(self).__name__}: call model.save_pretrained(dir) on every "
            "rank, then upload dir from one rank (huggingface_hub.HfApi().upload_folder(repo_id=..., folder_path=dir))")

    def resize_token_embeddings(self, *args, **kwargs):
        # HF's resize replaces nn.Embedding / nn.Linear modules; the vocab-parallel ones hold a shard of the rows.
        raise NotImplementedError(
            f"resize_token_embeddings on a tensor-parallel (nxdtp) {type(self).__name__}: its embedding and LM head "
            "are vocab-parallel shards; resize the dense model (dense.resize_token_embeddings(n)) before "
            "nxdtp.models.parallelize_model, or save_pretrained, resize the dense model, and from_pretrained_sharded")


def support_save_pretrained(model: nn.Module) -> None:
    """Give the parallelized HF ``model`` (the root the plan was applied to) the dense ``save_pretrained``."""
    if callable(getattr(model, "save_pretrained", None)):
        add_mixin(model, SavesDensePretrained)
