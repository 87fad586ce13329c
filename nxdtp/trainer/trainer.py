"""NxD's trainer API: ``neuronx_distributed_config``, ``initialize_parallel_model``, ``initialize_parallel_optimizer``.

A facade over nxdtp's core (docs/nxd_migration.md, "Trainer API"): the config is NxD 2.29's dict, filled as NxD fills
it; the model is built (on the meta device if asked), parallelized when it is a plain Hugging Face model, materialised
module by module with the user's ``param_init_fn`` and wrapped in ``NxDModel`` with activation checkpointing by
``nxdtp.models.activation_checkpointing``; the optimizer is ``nxdtp.optimizer.NeuronZero1Optimizer`` or the user's
class, wrapped in ``NxDOptimizer``.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import math
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .. import comm, parallel_state
from ..optimizer import NeuronZero1Optimizer
from ..spec import ShardedModule
from ..utils import get_local_world_size, move_model_to_device
from .model import NxDModel
from .optimizer import NxDOptimizer

logger = logging.getLogger(__name__)

# NxD's defaults (trainer.py of NxD 2.29; pinned by its test/unit_test/wrapper/test_nxd_config.py).
DEFAULT_SEQUENTIAL_MOVE_FACTOR = 11
DEFAULT_MAX_GRAD_NORM = 1.0


def _fill_default(config: dict, key: str, value, how: str) -> None:
    """NxD's default filling: set a missing ``key`` of a user's dict in place, warning as NxD words it."""
    if key not in config:
        _warn_default(f"{key} is not set, {how}")
        config[key] = value


def _warn_default(message: str) -> None:
    # NxD logs each filled default on global rank 0 (and on a process outside any world).
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.warning(message)


def _refuse_size(name: str, value: Any, what: str) -> None:
    if value != 1:
        raise ValueError(f"neuronx_distributed_config: {name}={value!r} is not supported: nxdtp does tensor, data and "
                         f"expert parallelism, with no {what}; the valid value is {name}=1 (the default)")


def _check_dict(name: str, value: Any, known: Tuple[str, ...]) -> None:
    """Refuse a ``value`` that is not a dict, or has a key NxD's config does not read (a misspelt key would leave its
    option at the default without a word)."""
    if not isinstance(value, dict):
        raise TypeError(f"neuronx_distributed_config: {name} must be a dict (or None for NxD's defaults); got "
                        f"{type(value).__name__} {value!r}")
    unknown = [key for key in value if key not in known]
    if unknown:
        hints = {key: difflib.get_close_matches(str(key), known, n=1) for key in unknown}
        meant = "".join(f"; did you mean {hint[0]!r} for {key!r}?" for key, hint in hints.items() if hint)
        raise ValueError(f"neuronx_distributed_config: {name} has keys {unknown} that NxD's config does not have; its "
                         f"keys are {list(known)}{meant}")


def neuronx_distributed_config(
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    expert_parallel_size: int = 1,
    context_parallel_size: int = 1,
    pipeline_config: Optional[dict] = None,
    optimizer_config: Optional[dict] = None,
    activation_checkpoint_config: Any = None,
    pad_model: bool = False,
    sequence_parallel: bool = False,
    model_init_config: Optional[dict] = None,
    lora_config: Any = None,
    mixed_precision_config: Optional[dict] = None,
    sequential_move_factor: int = DEFAULT_SEQUENTIAL_MOVE_FACTOR,
    lnc_size: int = 1,
    *,
    device: Any = None,
) -> Dict[str, Any]:
    """NxD's config dict, with NxD's defaults filled in (dicts passed in are filled in place, as NxD does, and each
    filled default is logged as a warning on rank 0). Initializes model parallelism when torch.distributed is up and
    model parallelism is not initialized yet.

    ``expert_parallel_size`` E splits each DP group into expert-parallel groups of E ranks (NxD's layout, see
    ``initialize_model_parallel``); E must divide the DP size.
    Refused by name: pipeline and context parallel sizes other than 1, ``lnc_size`` other than 1, a
    ``lora_config`` (use PEFT on the model: docs/wrapping_hf_models.md), ``meta_device_init`` without a
    ``param_init_fn`` (``ValueError``, as NxD). ``pipeline_config`` is kept in the dict and unused, as NxD does at
    pipeline size 1. ``device`` (nxdtp only, keyword-only) is where ``initialize_parallel_model`` moves the model:
    None keeps it where it was built (CPU), except on a world whose default backend is XLA, where it goes to the XLA
    device as NxD's does.
    """
    _refuse_unsupported(tensor_parallel_size, pipeline_parallel_size, expert_parallel_size, context_parallel_size,
                        lnc_size, lora_config)
    optimizer_config = _filled_optimizer_config(optimizer_config)
    mixed_precision_config = _filled_mixed_precision_config(mixed_precision_config,
                                                            optimizer_config["zero_one_enabled"])
    model_init_config = _filled_model_init_config(model_init_config, sequential_move_factor)

    config = {
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
        "expert_parallel_size": expert_parallel_size,
        "context_parallel_size": context_parallel_size,
        "pipeline_config": pipeline_config,
        "optimizer_config": optimizer_config,
        "activation_checkpoint_config": activation_checkpoint_config,
        "pad_model": pad_model,
        "sequence_parallel": sequence_parallel,
        "model_init_config": model_init_config,
        "lora_config": lora_config,
        "mixed_precision_config": mixed_precision_config,
        "lnc_size": lnc_size,
    }
    if device is not None:
        config["device"] = torch.device(device)
    if dist.is_initialized():
        _initialize_model_parallel(config)
        if parallel_state.is_global_rank_zero():
            logger.info("NxD config: %s", config)
    return config


def _refuse_unsupported(tensor_parallel_size: Any, pipeline_parallel_size: Any, expert_parallel_size: Any,
                        context_parallel_size: Any, lnc_size: Any, lora_config: Any) -> None:
    """Refuse by name the parallelisms and options of NxD that nxdtp does not have, and a bad TP size."""
    _refuse_size("pipeline_parallel_size", pipeline_parallel_size, "pipeline parallelism")
    _refuse_size("context_parallel_size", context_parallel_size, "context parallelism")
    if not (isinstance(expert_parallel_size, int) and expert_parallel_size >= 1):
        raise ValueError(f"neuronx_distributed_config: expert_parallel_size={expert_parallel_size!r} must be an int "
                         ">= 1")
    if lnc_size != 1:
        raise ValueError(f"neuronx_distributed_config: lnc_size={lnc_size!r} is not supported: it selects Trainium's "
                         "logical-core replica-group layouts, which nxdtp does not use; the valid value is lnc_size=1")
    if not (isinstance(tensor_parallel_size, int) and tensor_parallel_size >= 1):
        raise ValueError(f"neuronx_distributed_config: tensor_parallel_size={tensor_parallel_size!r} must be an int "
                         ">= 1")
    if lora_config is not None:
        raise ValueError(
            f"neuronx_distributed_config: lora_config={lora_config!r} is not supported: NxD's LoraModel (its own "
            "LoRA layers, adapter-only checkpoints, merge_lora) is not reproduced. nxdtp trains LoRA through Hugging "
            "Face PEFT on the parallelized model: peft.get_peft_model(nxd_model.module, peft.LoraConfig(...)) "
            "(docs/wrapping_hf_models.md); pass lora_config=None")


def _filled_optimizer_config(optimizer_config: Optional[dict]) -> dict:
    """NxD's optimizer_config defaults: the whole dict for None, else the missing keys filled in place."""
    if optimizer_config is None:
        return {"zero_one_enabled": False, "grad_clipping": True, "max_grad_norm": DEFAULT_MAX_GRAD_NORM}
    _check_dict("optimizer_config", optimizer_config, ("zero_one_enabled", "grad_clipping", "max_grad_norm"))
    _fill_default(optimizer_config, "zero_one_enabled", False, "automatically set it to False.")
    _fill_default(optimizer_config, "grad_clipping", True, "automatically set it to True.")
    if optimizer_config["grad_clipping"]:
        _fill_default(optimizer_config, "max_grad_norm", DEFAULT_MAX_GRAD_NORM, "automatically set it to one.")
    return optimizer_config


def _filled_mixed_precision_config(mixed_precision_config: Optional[dict], zero_one: Any) -> dict:
    """NxD's mixed_precision_config defaults (master weights and fp32 gradient accumulation follow ZeRO-1)."""
    if mixed_precision_config is None:
        return {"use_master_weights": zero_one, "use_fp32_grad_acc": zero_one, "use_master_weights_in_ckpt": False}
    _check_dict("mixed_precision_config", mixed_precision_config,
                ("use_master_weights", "use_fp32_grad_acc", "use_master_weights_in_ckpt"))
    _fill_default(mixed_precision_config, "use_master_weights", zero_one, "automatically set it.")
    _fill_default(mixed_precision_config, "use_fp32_grad_acc", zero_one, "automatically set it.")
    _fill_default(mixed_precision_config, "use_master_weights_in_ckpt", False, "automatically set it to False.")
    return mixed_precision_config


def _filled_model_init_config(model_init_config: Optional[dict], sequential_move_factor: int) -> dict:
    """NxD's model_init_config defaults; meta-device init without a param_init_fn is refused."""
    if model_init_config is None:
        return {"sequential_move_factor": sequential_move_factor, "meta_device_init": False, "param_init_fn": None}
    _check_dict("model_init_config", model_init_config,
                ("sequential_move_factor", "meta_device_init", "param_init_fn"))
    _fill_default(model_init_config, "sequential_move_factor", sequential_move_factor,
                  f"automatically set it to {sequential_move_factor}.")
    _fill_default(model_init_config, "meta_device_init", False, "automatically set it to False.")
    # NxD checks only that the key is there; nxdtp also refuses an explicit None, which NxD would fail on later.
    if model_init_config["meta_device_init"] and model_init_config.get("param_init_fn") is None:
        raise ValueError("param_init_fn must be provided when meta_device_init is True: the model is built "
                         "without values, and param_init_fn(module, device) gives them")
    return model_init_config


def _initialize_model_parallel(nxd_config: Dict[str, Any]) -> None:
    tp, ep = nxd_config["tensor_parallel_size"], nxd_config.get("expert_parallel_size", 1)
    if parallel_state.model_parallel_is_initialized():
        current = (parallel_state.get_tensor_model_parallel_size(), parallel_state.get_expert_model_parallel_size())
        if current != (tp, ep):
            experts = ep != 1 or current[1] != 1
            asked = f"tensor_parallel_size={tp}" + (f", expert_parallel_size={ep}" if experts else "")
            have = f"tensor_model_parallel_size={current[0]}" + (
                f", expert_model_parallel_size={current[1]}" if experts else "")
            raise ValueError(f"{asked} but model parallelism is already initialized with {have}; call "
                             "destroy_model_parallel() first")
        return
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)


# ---- the model ------------------------------------------------------------------------------------------------------

def _is_hf_model(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def _is_parallelized(model: nn.Module) -> bool:
    return any(isinstance(m, ShardedModule) for m in model.modules())


@contextlib.contextmanager
def _built_on_meta(include_buffers: bool):
    if include_buffers:
        with torch.device("meta"):
            yield
    else:
        from ..models.hf_loading import parameters_on_meta

        with parameters_on_meta():
            yield


def _target_device(nxd_config: Dict[str, Any]) -> Optional[torch.device]:
    device = nxd_config.get("device")
    if device is not None:
        return torch.device(device)
    return comm.xla_world_device()


def _materialise(model: nn.Module, param_init_fn: Optional[Callable]) -> None:
    """NxD's ``reinit_model``, module by module: each module's own meta parameters get (uninitialised) CPU storage,
    then ``param_init_fn(module, cpu)`` fills them. Ties (one parameter in two modules) and the parameters' attributes
    (TP and sequence-parallel marks) are kept. Meta buffers get CPU storage too (``include_buffers=True``), to be
    filled by ``param_init_fn``. Only ``param_init_fn`` draws: at most one layer's dense weight exists at a time."""
    cpu = torch.device("cpu")
    made: Dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for module in model.modules():
            for name, param in module._parameters.items():
                if param is None:
                    continue
                if id(param) not in made:
                    value = torch.empty_like(param, device=cpu) if param.is_meta else param
                    new = param if value is param else nn.Parameter(value, requires_grad=param.requires_grad)
                    if new is not param:
                        new.__dict__.update(param.__dict__)
                    made[id(param)] = new
                module._parameters[name] = made[id(param)]
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.is_meta:
                    module._buffers[name] = torch.empty_like(buffer, device=cpu)
            if param_init_fn is not None:
                param_init_fn(module, cpu)
    for module in model.modules():
        if isinstance(module, ShardedModule):
            module.reattach_spec_attributes()
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if meta:
        raise RuntimeError(f"initialize_parallel_model: parameters still on the meta device after param_init_fn: "
                           f"{meta[:5]}")


def _activation_checkpoint_classes(config: Any, base_model: nn.Module, model: nn.Module) -> tuple:
    if config == "full":
        names = getattr(base_model, "_no_split_modules", None) if _is_hf_model(base_model) else None
        if not names:
            raise RuntimeError('activation_checkpoint_config="full" is only supported for Hugging Face transformers '
                               f"models (it checkpoints their _no_split_modules classes); {type(base_model).__name__} "
                               "is not one: pass the module class (or a list of classes) to checkpoint")
        classes = []
        for name in names:
            # The class by name, the base-most of that name in a module's MRO: parallelization swaps modules' classes
            # for per-module subclasses of the same name (nxdtp.plan.wrap_forward), which isinstance of the base
            # still matches.
            found = next((c for m in model.modules() for c in reversed(type(m).__mro__) if c.__name__ == name), None)
            if found is None:
                raise RuntimeError(f'activation_checkpoint_config="full": no module of class {name} (from '
                                   f"{type(base_model).__name__}._no_split_modules) in the model")
            classes.append(found)
        return tuple(classes)
    classes = tuple(config) if isinstance(config, (list, tuple)) else (config,)
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(f'activation_checkpoint_config={config!r} must be None, "full", a torch.nn.Module class or a '
                        "list of them")
    return classes


def initialize_parallel_model(nxd_config: Dict[str, Any], model_fn: Callable[..., nn.Module],
                              include_buffers: bool = False, *model_args, **model_kwargs) -> NxDModel:
    """Build ``model_fn(*model_args, **model_kwargs)`` and return it tensor-parallel, in an ``NxDModel``.

    Steps, as NxD's: model parallelism is initialized if it is not; with ``model_init_config["meta_device_init"]`` the
    model is built on the meta device (parameters only, or buffers too with ``include_buffers``). A plain Hugging Face
    model (one without nxdtp parallel layers) is then parallelized by ``nxdtp.models.parallelize_model`` (with
    ``sequence_parallel`` and, with ``pad_model``, zero heads where TP does not divide them): on the meta device that
    costs no memory. With a ``param_init_fn`` every module is materialised on CPU and given its values by
    ``param_init_fn(module, device)``, module by module, the local ranks of a host taking turns in groups of
    ``sequential_move_factor``; the parallel layers offer NxD's ``init_weight_cpu()`` / ``initialize_weight_biases()``
    for it. ``pad_model`` on a model that came parallel pads its heads with ``nxdtp.pad.pad_model``, as NxD does. The
    model moves to the config's device (see ``neuronx_distributed_config``), is wrapped in ``NxDModel``, and
    ``activation_checkpoint_config`` ("full": the HF model's ``_no_split_modules`` classes; a class or a list of
    classes) makes those modules recompute in backward through ``nxdtp.random.checkpoint``, which replays the RNG
    tracker. Module names and state_dict keys do not change.
    """
    _check_include_buffers(include_buffers)
    _initialize_model_parallel(nxd_config)
    meta_init, param_init_fn, factor = _model_init_settings(nxd_config)
    sequence_parallel = nxd_config["sequence_parallel"]

    # Local ranks take turns in waves of `factor` (NxD's sequential move), so at most `factor` processes of a host
    # hold a model being built on CPU at once.
    local_rank = parallel_state.get_rank() % get_local_world_size()
    waves = math.ceil(get_local_world_size() / factor)
    model = base_model = None
    for wave in range(waves):
        if local_rank // factor == wave:
            if meta_init:
                with _built_on_meta(include_buffers):
                    model = model_fn(*model_args, **model_kwargs)
            else:
                model = model_fn(*model_args, **model_kwargs)
            base_model = model
            parallelized_here = _is_hf_model(model) and not _is_parallelized(model)
            model = _made_parallel(model, nxd_config, param_init_fn, parallelized_here, sequence_parallel)
        if waves > 1:
            comm.barrier()
    if parallelized_here:
        from ..plan import broadcast_replicated_state

        broadcast_replicated_state(model)  # replicated parameters equal TP rank 0's, as parallelize_model's default

    nxd_model = NxDModel(model, nxd_config)
    ac_config = nxd_config["activation_checkpoint_config"]
    if ac_config is not None:
        from ..models.activation_checkpointing import checkpoint_modules

        checkpoint_modules(model, _activation_checkpoint_classes(ac_config, base_model, model))
    return nxd_model


def _check_include_buffers(include_buffers: Any) -> None:
    if not isinstance(include_buffers, bool) and include_buffers not in (0, 1):
        # NxD's signature puts include_buffers third: initialize_parallel_model(nxd_config, get_model, config) would
        # take config for it and call get_model() without arguments.
        raise TypeError(f"initialize_parallel_model(): include_buffers must be True or False, got a "
                        f"{type(include_buffers).__name__}; it is the third parameter, as in NxD, and model_fn's "
                        "arguments come after it: "
                        "initialize_parallel_model(nxd_config, model_fn, False, *model_args, **model_kwargs)")


def _model_init_settings(nxd_config: Dict[str, Any]) -> Tuple[bool, Optional[Callable], int]:
    """``(meta_device_init, param_init_fn, sequential_move_factor)`` of the config, checked (a config dict may have
    been written by hand rather than by neuronx_distributed_config)."""
    for key in ("pipeline_parallel_size", "context_parallel_size"):
        _refuse_size(key, nxd_config.get(key, 1), key.replace("_size", "").replace("_", " "))
    init_config = nxd_config["model_init_config"]
    meta_init = init_config["meta_device_init"]
    param_init_fn = init_config.get("param_init_fn")
    if meta_init and param_init_fn is None:
        raise ValueError("param_init_fn must be provided when meta_device_init is True")
    factor = init_config.get("sequential_move_factor", DEFAULT_SEQUENTIAL_MOVE_FACTOR)
    if not (isinstance(factor, int) and factor >= 1):
        raise ValueError(f"model_init_config['sequential_move_factor']={factor!r} must be an int >= 1")
    return meta_init, param_init_fn, factor


def _made_parallel(model: nn.Module, nxd_config: Dict[str, Any], param_init_fn: Optional[Callable],
                   parallelize: bool, sequence_parallel: bool) -> nn.Module:
    """The built model made what NxD's trainer hands over: parallelized (a plain HF model), given its values
    (``param_init_fn``), its heads padded (``pad_model`` on a model that came parallel), on the config's device."""
    base_model = model
    if parallelize:
        model = _parallelize_hf_model(model, sequence_parallel, bool(nxd_config["pad_model"]))
    if param_init_fn is not None:
        _materialise(model, param_init_fn)
    if nxd_config["pad_model"] and not parallelize:
        if not _is_hf_model(base_model):
            raise ValueError("pad_model=True is only supported for Hugging Face models (it reads "
                             "config.num_attention_heads), as in NxD")
        from ..pad import pad_model

        model = pad_model(model, parallel_state.get_tensor_model_parallel_size(), model.config.num_attention_heads)
    device = _target_device(nxd_config)
    if device is not None and device.type != "cpu":
        model = move_model_to_device(model, device)
    return model


def _parallelize_hf_model(model: nn.Module, sequence_parallel: bool, pad_heads: bool) -> nn.Module:
    from ..models import parallelize_model
    from ..models.attention_styles import HeadsNotDivisibleError

    try:
        # Replicated state is broadcast after the waves: the ranks of a TP group may build in different ones.
        return parallelize_model(model, sequence_parallel=sequence_parallel, broadcast_replicated=False,
                                 pad_heads=pad_heads)
    except HeadsNotDivisibleError as e:   # its advice names parallelize_model's pad_heads
        raise HeadsNotDivisibleError(
            str(e).replace("pass pad_heads=True", "pass pad_model=True to neuronx_distributed_config (zero "
                           "heads are added, as NxD's pad_model does)")) from None


# ---- the optimizer --------------------------------------------------------------------------------------------------

def initialize_parallel_optimizer(nxd_config: Dict[str, Any], optimizer_class: type, parameters,
                                  **defaults) -> NxDOptimizer:
    """``optimizer_class`` over ``parameters`` (parameters or parameter groups, ``**defaults`` its hyper-parameters)
    in an ``NxDOptimizer``.

    With ``optimizer_config["zero_one_enabled"]`` it is ``nxdtp.optimizer.NeuronZero1Optimizer`` (sharded over the
    data-parallel group, clipping at ``max_grad_norm``: NxD forgets to pass it and clips at 1.0), with
    ``use_fp32_grad_acc`` accumulating in fp32 ``main_grad`` (``use_grad_acc_hook``, ``higher_cc_precision``) and
    ``use_master_weights_in_ckpt`` as ``save_master_weights``; its master shards are fp32 whatever
    ``use_master_weights`` says. Without ZeRO-1 it is ``optimizer_class`` itself, and ``NxDOptimizer.step`` averages
    the gradients over DP and clips; ``use_master_weights``, ``use_fp32_grad_acc`` and ``use_master_weights_in_ckpt``
    need ZeRO-1 and raise ``RuntimeError`` otherwise, as in NxD.
    """
    optimizer_config = nxd_config["optimizer_config"]
    mixed = nxd_config["mixed_precision_config"]
    defaults.pop("decoupled_weight_decay", None)  # as NxD: torch's Adam has it, AdamW does not
    if optimizer_config["zero_one_enabled"]:
        clipping = bool(optimizer_config["grad_clipping"])
        zero1 = dict(grad_clipping=clipping, max_norm=optimizer_config.get("max_grad_norm") if clipping else None,
                     pin_layout=False, sharding_groups=parallel_state.get_data_parallel_replica_groups(),
                     grad_norm_groups=parallel_state.get_tensor_model_parallel_replica_groups(),
                     save_master_weights=bool(mixed["use_master_weights_in_ckpt"]))
        if mixed["use_fp32_grad_acc"]:
            zero1.update(use_grad_acc_hook=True, higher_cc_precision=True)
        optimizer = NeuronZero1Optimizer(parameters, optimizer_class, **zero1, **defaults)
    else:
        if mixed["use_master_weights"]:
            raise RuntimeError("mixed_precision_config['use_master_weights']=True needs the ZeRO-1 optimizer "
                               "(optimizer_config={'zero_one_enabled': True}), which keeps the fp32 master weights; "
                               "without it set use_master_weights=False (as NxD requires)")
        if mixed["use_fp32_grad_acc"] or mixed["use_master_weights_in_ckpt"]:
            raise RuntimeError("mixed_precision_config['use_fp32_grad_acc'] and ['use_master_weights_in_ckpt'] need "
                               "the ZeRO-1 optimizer (optimizer_config={'zero_one_enabled': True}); without it set "
                               "them to False (as NxD requires)")
        optimizer = optimizer_class(parameters, **defaults)
    return NxDOptimizer(optimizer, nxd_config)
