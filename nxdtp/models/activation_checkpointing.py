"""Activation checkpointing of parallelized Hugging Face models, by nxdtp's call or by HF's own switch.

Two ways in, one behaviour:

* ``checkpoint_layers(model)`` runs each transformer layer under ``nxdtp.random.checkpoint``;
* ``model.gradient_checkpointing_enable()`` (or ``activation_checkpointing_enable()``, or HF Trainer's
  ``gradient_checkpointing=True``) on a parallelized model runs HF's own checkpoint function (its keyword arguments
  kept), which parallelization wrapped in ``TensorParallelCheckpoint``.

Either way the recompute in backward replays the RNG tracker's states as well as the default generators (dropout
inside TP regions draws the forward's masks again), and never writes a KV cache a second time. A cache is recognised
by what it is (an instance of transformers' ``Cache``), wherever it is passed (any keyword, any position), not by
argument names, which transformers releases rename. An empty cache is kept out of the checkpointed call (HF turns
caching off under its checkpointing for the same reason); a cache already holding tokens is refused, since leaving it
out would change the result and keeping it would append the recompute's keys to it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from typing import Any

import torch
from torch import nn

from ..plan import add_mixin, wrap_forward
from ..random import ReplayedOnRecompute, checkpoint, xla_tensors
from ..record import note_of, read_note


def transformer_layers(model: nn.Module) -> list:
    """The layers HF's own gradient checkpointing recomputes one at a time (BERT's encoder layers, GPT-2's and Llama's
    decoder blocks), in module order.

    Newer transformers releases make every such layer a ``GradientCheckpointingLayer``. Older ones (4.x before that
    class) put HF's ``gradient_checkpointing`` switch on the module that runs the layers (``BertEncoder``,
    ``GPT2Model``, ``LlamaModel``), which checkpoints each entry of its layer list: those entries are the layers.
    """
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        GradientCheckpointingLayer = None
    if GradientCheckpointingLayer is not None:
        return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    return [layer for module in model.modules() if "gradient_checkpointing" in vars(module)
            for child in module.children() if isinstance(child, nn.ModuleList) for layer in child]


def checkpoint_layers(model: nn.Module) -> nn.Module:
    """Recompute each transformer layer (those HF's gradient checkpointing recomputes: ``transformer_layers``) in
    backward instead of storing its activations.

    Uses ``nxdtp.random.checkpoint``, which replays the RNG tracker's states as well as the default generators, so
    dropout inside TP regions draws the forward's masks again. On XLA the recompute is fenced by an optimization
    barrier so the compiler cannot merge it with the forward. KV caches are kept out of the checkpointed call (module
    docstring). Returns the model.
    """
    layers = transformer_layers(model)
    if not layers:
        raise ValueError(f"checkpoint_layers() found no transformer layer (the layers transformers' gradient "
                         f"checkpointing recomputes) in {type(model).__name__}")
    for layer in layers:
        wrap_forward(layer, "nxdtp_activation_checkpoint", _checkpointed_layer)
    return model


def checkpoint_modules(model: nn.Module, classes) -> list:
    """Recompute, in backward, every submodule of ``model`` that is an instance of one of ``classes`` (a class or a
    sequence of them), as ``checkpoint_layers`` does for transformer layers: ``nxdtp.random.checkpoint`` (RNG tracker
    replayed, KV caches kept out). A module inside another checkpointed one is not wrapped again. Module names, and so
    ``state_dict`` keys, do not change. Returns the wrapped modules; ``ValueError`` if there is none."""
    classes = tuple(classes) if isinstance(classes, (list, tuple)) else (classes,)
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(f"activation checkpointing needs torch.nn.Module classes; got {classes!r}")
    wrapped = []
    for module in model.modules():
        if isinstance(module, classes) and not any(_is_descendant(module, outer) for outer in wrapped):
            wrapped.append(module)
    if not wrapped:
        raise ValueError(f"activation checkpointing: {type(model).__name__} has no module of the classes "
                         f"{[c.__name__ for c in classes]}")
    for module in wrapped:
        wrap_forward(module, "nxdtp_activation_checkpoint", _checkpointed_layer)
    return wrapped


def _is_descendant(module: nn.Module, outer: nn.Module) -> bool:
    return any(m is module for m in outer.modules())


def _checkpointed_layer(forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    args, kwargs = without_kv_caches(args, kwargs, type(forward.__self__).__name__)
    return checkpoint(forward, *args, **kwargs)


# ---- KV caches -------------------------------------------------------------------------------------------------------

def is_kv_cache(value) -> bool:
    """Whether ``value`` is a transformers KV cache object (which layers append to in place). Legacy tuple caches are
    not: a layer reads them and returns new tuples, so a recompute sees exactly what the forward saw."""
    cache_utils = sys.modules.get("transformers.cache_utils")  # a cache object exists only once this is imported
    cache_class = getattr(cache_utils, "Cache", None)
    return cache_class is not None and isinstance(value, cache_class)


def without_kv_caches(args: tuple, kwargs: dict, layer: str):
    """``args`` and ``kwargs`` with every empty KV cache replaced by ``None``, so neither the forward nor the recompute
    of a checkpointed layer writes to it. A cache holding tokens already raises ``ValueError`` naming ``layer`` and
    the argument."""

    def kept_out(where, value):
        if not is_kv_cache(value):
            return value
        held = value.get_seq_length()
        if held:
            raise ValueError(
                f"activation checkpointing of {layer}: its {where} is a KV cache ({type(value).__name__}) already "
                f"holding {held} tokens; recomputing the layer in backward would append to it again, and leaving it "
                "out would ignore those tokens. Train without a filled cache (use_cache=False, no past_key_values), "
                "run the cached forward under torch.no_grad(), or turn checkpointing off for it")
        return None

    return (tuple(kept_out(f"argument {i}", a) for i, a in enumerate(args)),
            {name: kept_out(f"argument {name!r}", a) for name, a in kwargs.items()})


def _without_kv_caches_in_partial(function, layer: str):
    """HF's transformers 5 layers hand their checkpoint function ``partial(forward, self, **kwargs)``: the cache, if
    any, is among the partial's keywords."""
    if not isinstance(function, functools.partial):
        return function
    args, keywords = without_kv_caches(function.args, function.keywords, layer)
    return functools.partial(function.func, *args, **keywords)


# ---- HF's own switch -------------------------------------------------------------------------------------------------

class TensorParallelCheckpoint:
    """What a parallelized model's modules hold as HF's ``_gradient_checkpointing_func``: HF's checkpoint function
    (``torch.utils.checkpoint.checkpoint`` with the user's keyword arguments), called with KV caches kept out and the
    checkpointed function wrapped in ``nxdtp.random.ReplayedOnRecompute``; on XLA, where torch.utils.checkpoint does
    not run, ``nxdtp.random.checkpoint`` instead. A module-level class, so a model with checkpointing on deep-copies
    and pickles as HF's own function does."""

    def __init__(self, hf_checkpoint_function):
        self.hf_checkpoint_function = hf_checkpoint_function

    def __call__(self, function, *args, **kwargs):
        if torch.is_grad_enabled():
            layer = _layer_name(function)
            function = _without_kv_caches_in_partial(function, layer)
            args, kwargs = without_kv_caches(args, kwargs, layer)
        if xla_tensors(args):
            # torch.utils.checkpoint cannot run on XLA (it looks for a torch.xla device module); nxdtp's checkpoint
            # replays the same states and fences the recompute so XLA does not merge it with the forward. The
            # partial's keywords become the checkpoint's inputs, so tensors among them get their gradients.
            if isinstance(function, functools.partial):
                return checkpoint(function.func, *function.args, *args, **function.keywords, **kwargs)
            return checkpoint(function, *args, **kwargs)
        return self.hf_checkpoint_function(ReplayedOnRecompute(function), *args, **kwargs)


def _layer_name(function) -> str:
    """The class name of the layer HF checkpoints: ``partial(forward, layer, ...)`` in transformers 5,
    ``layer.__call__`` in 4.x."""
    owner = function.args[0] if isinstance(function, functools.partial) and function.args else \
        getattr(function, "__self__", function)
    return type(owner).__name__


@dataclasses.dataclass
class CheckpointFunctionNote:
    """On a module: the checkpoint function HF's gradient checkpointing assigned it, wrapped to replay nxdtp's RNG."""
    function: Any = None


class _ReplaysNxdtpRngUnderHFCheckpointing:
    """Mixed into every module of a parallelized model that carries HF's ``gradient_checkpointing`` switch: whatever
    checkpoint function HF's ``_set_gradient_checkpointing`` assigns there is stored wrapped in
    ``TensorParallelCheckpoint``, whichever entry point assigned it (the model's ``gradient_checkpointing_enable``,
    its ``activation_checkpointing_enable``, a base model's, PEFT's or Trainer's call of them)."""

    @property
    def _gradient_checkpointing_func(self):
        function = read_note(self, CheckpointFunctionNote).function
        if function is None:
            raise AttributeError(f"{type(self).__name__} has no _gradient_checkpointing_func: gradient checkpointing "
                                 "was never enabled")
        return function

    @_gradient_checkpointing_func.setter
    def _gradient_checkpointing_func(self, function) -> None:
        if not isinstance(function, TensorParallelCheckpoint):
            function = TensorParallelCheckpoint(function)
        note_of(self, CheckpointFunctionNote).function = function


class _RefusesOldHFCheckpointing:
    """Mixed in instead on models in HF's old checkpointing format (transformers 4.26's BERT, before 4.35), whose
    modules call ``torch.utils.checkpoint`` themselves: nothing can replay the tracker there, so turning the switch on
    is refused."""

    # The value stays in the instance dictionary, where transformer_layers looks for the switch.
    @property
    def gradient_checkpointing(self) -> bool:
        return self.__dict__.get("gradient_checkpointing", False)

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, value: bool) -> None:
        if value:
            import transformers

            raise NotImplementedError(
                f"gradient_checkpointing_enable() on a parallelized {type(self).__name__} under transformers "
                f"{transformers.__version__}: this release's models call torch.utils.checkpoint themselves, which "
                "cannot replay nxdtp's RNG tracker, so dropout in the recompute would differ from the forward. Use "
                "nxdtp.models.checkpoint_layers(model), or transformers>=4.35")
        self.__dict__["gradient_checkpointing"] = False


def support_hf_checkpointing(model: nn.Module) -> None:
    """Make HF's activation-checkpointing switch on ``model`` (a parallelized HF model) replay nxdtp's RNG states and
    keep KV caches out of the recompute, or refuse it where the installed transformers cannot (old format)."""
    set_switch = getattr(model, "_set_gradient_checkpointing", None)
    if set_switch is None:
        return
    old_format = "value" in inspect.signature(set_switch).parameters
    mixin = _RefusesOldHFCheckpointing if old_format else _ReplaysNxdtpRngUnderHFCheckpointing
    for module in model.modules():
        if not hasattr(module, "gradient_checkpointing"):
            continue
        switched_on = bool(module.gradient_checkpointing)
        installed = module.__dict__.pop("_gradient_checkpointing_func", None)
        add_mixin(module, mixin)
        if old_format:
            module.gradient_checkpointing = switched_on  # refused if it was turned on before parallelization
        elif installed is not None:
            module._gradient_checkpointing_func = installed  # turned on before parallelization: wrap what HF set
