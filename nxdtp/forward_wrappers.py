"""Change what one module instance does without changing its parameter names: ``wrap_forward`` (a wrapper around its
forward), ``add_mixin`` (a class mixed in first), ``call_with_parameters_as`` (its parameters read through a
differentiable view for one call). Each swaps the instance's class for a cached subclass made at run time, so
``isinstance``, ``state_dict`` keys, ``deepcopy`` and pickling are unchanged; how such a subclass pickles is here too.

The plans' styles (``nxdtp.plan``) and the input check (``nxdtp.agreement``) are built on it. It imports only the
layout algebra, so the modules that need it sit low in the layering.
"""

from __future__ import annotations

import functools
import inspect
import pickle
from typing import Callable, Dict, Tuple

import torch
from torch import nn

from .spec import ShardedModule

# ---- forward wrappers and mixins -------------------------------------------------------------------------------------

_WRAPPED_CLASSES: Dict[Tuple[type, str], type] = {}


def wrapper_factory(factory: Callable) -> Callable:
    """Decorate a module-level factory of forward wrappers (closures): cached, so equal arguments give the same
    function (``wrap_forward`` requires one function per wrapper name), and each wrapper remembers the factory and its
    arguments, so a module wrapped with it can be pickled (``torch.save(model)``) and rebuilt in another process."""
    cached = functools.lru_cache(maxsize=None)(factory)

    @functools.wraps(factory)
    def make(*args):
        return _made_by(make, args, cached(*args))

    return make


def _made_by(factory: Callable, args: tuple, wrapper: Callable) -> Callable:
    wrapper._nxdtp_made_by = (factory, args)
    return wrapper


def wrap_forward(module: nn.Module, wrapper_name: str, wrapper: Callable) -> None:
    """Make ``module`` call ``wrapper(super_forward, *args, **kwargs)`` instead of its forward.

    The module's class is swapped for a subclass (cached per class and wrapper), so parameter names, ``state_dict``
    keys, ``deepcopy`` and ``isinstance`` checks are all unchanged. The module pickles (``torch.save(model)``) when
    ``wrapper`` is a module-level function or made by a ``wrapper_factory``: the subclass is rebuilt on load.
    """
    module.__class__ = _wrapped_class(type(module), wrapper_name, wrapper)


def _wrapped_class(base: type, wrapper_name: str, wrapper: Callable) -> type:
    if getattr(base, "_nxdtp_wrapper", None) == wrapper_name:
        return base
    key = (base, wrapper_name)
    if key in _WRAPPED_CLASSES and _WRAPPED_CLASSES[key]._nxdtp_wrapper_function is not wrapper:
        raise ValueError(f"wrapper name {wrapper_name!r} is already used for {base.__name__} with another function; "
                         "give each wrapper function its own name")
    if key not in _WRAPPED_CLASSES:
        def forward(self, *args, **kwargs):
            return wrapper(super(cls, self).forward, *args, **kwargs)

        # The wrapped forward shows the base forward's parameters: HF reads them from
        # ``inspect.signature(model.forward)`` (generate computes ``position_ids`` from a left-padded attention mask
        # only if forward names them, Trainer keeps only the dataset columns forward names). Without this they would see
        # ``(*args, **kwargs)``.
        try:
            forward.__signature__ = inspect.signature(base.forward)
        except (TypeError, ValueError):
            pass
        cls = _dynamic_subclass(base, ("wrap", wrapper_name, wrapper), {
            "forward": forward, "_nxdtp_wrapper": wrapper_name, "_nxdtp_wrapper_function": wrapper})
        _WRAPPED_CLASSES[key] = cls
    return _WRAPPED_CLASSES[key]


_MIXED_CLASSES: Dict[Tuple[type, type], type] = {}


def add_mixin(module: nn.Module, mixin: type) -> None:
    """Put ``mixin`` (a module-level class) first in ``module``'s class, for what a forward wrapper cannot change:
    attributes and properties other code reads and writes on the module. Like ``wrap_forward``, the class is swapped
    for a cached subclass, so names, ``state_dict`` keys, ``deepcopy``, pickling and ``isinstance`` are unchanged."""
    module.__class__ = _mixed_class(type(module), mixin)


def _mixed_class(base: type, mixin: type) -> type:
    if issubclass(base, mixin):
        return base
    if (base, mixin) not in _MIXED_CLASSES:
        _MIXED_CLASSES[(base, mixin)] = _dynamic_subclass(base, ("mixin", mixin), {})
    return _MIXED_CLASSES[(base, mixin)]


# ---- pickling modules whose class nxdtp swapped ----------------------------------------------------------------------
# The subclasses made by wrap_forward and for sequence-parallel parameters are made at run time, under their base's
# name, so pickle cannot find them by name. Each records how it was made from an importable class (its recipe); a
# module of such a class pickles as "rebuild the class from the recipe, then restore the module's state".

def _dynamic_subclass(base: type, step: tuple, namespace: dict) -> type:
    root, steps = getattr(base, "_nxdtp_recipe", (base, ()))
    namespace = dict(namespace, _nxdtp_recipe=(root, steps + (step,)), __reduce_ex__=_reduce_dynamic_instance,
                     __module__=base.__module__, __qualname__=base.__qualname__)
    bases = (base,) if step[0] == "wrap" else (step[1], base) if step[0] == "mixin" else (base, ShardedModule)
    return type(base.__name__, bases, namespace)


def _picklable_step(step: tuple) -> tuple:
    if step[0] != "wrap":
        return step
    _, name, wrapper = step
    made_by = getattr(wrapper, "_nxdtp_made_by", None)
    if made_by is not None:
        return ("wrap_made_by", name) + made_by
    if "<locals>" in getattr(wrapper, "__qualname__", "<locals>"):
        return ("wrap", name, _LocalWrapper(name, wrapper))
    return step


class _LocalWrapper:
    """A local forward wrapper in a class recipe: ``copy.deepcopy`` keeps it, pickling it is refused with a clear
    message (pickle itself would only say "Can't pickle local object")."""

    def __init__(self, name: str, function: Callable):
        self.name, self.function = name, function

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        raise pickle.PicklingError(
            f"the forward wrapper {wrapper_name_of(self.function)} ({self.name!r}) is a local function, which cannot "
            "be pickled; make it a module-level function, or make it with a factory decorated by "
            "nxdtp.plan.wrapper_factory")


def wrapper_name_of(wrapper: Callable) -> str:
    return f"{getattr(wrapper, '__module__', '?')}.{getattr(wrapper, '__qualname__', repr(wrapper))}"


def _reduce_dynamic_instance(self, protocol):
    reduced = object.__reduce_ex__(self, max(protocol, 2))  # (copyreg.__newobj__, (cls,), state, ...)
    root, steps = type(self)._nxdtp_recipe
    return (_new_of_recipe, (root, tuple(_picklable_step(s) for s in steps))) + tuple(reduced[2:])


def _class_of_recipe(root: type, steps: tuple) -> type:
    cls = root
    for step in steps:
        if step[0] == "wrap":
            wrapper = step[2].function if isinstance(step[2], _LocalWrapper) else step[2]
            cls = _wrapped_class(cls, step[1], wrapper)
        elif step[0] == "wrap_made_by":
            _, name, factory, args = step
            cls = _wrapped_class(cls, name, factory(*args))
        elif step[0] == "spec_owning":
            cls = spec_owning_class(cls)
        elif step[0] == "mixin":
            cls = _mixed_class(cls, step[1])
        else:
            raise pickle.UnpicklingError(f"unknown nxdtp class recipe step {step!r} (pickled by another nxdtp "
                                         "version?)")
    return cls


def _new_of_recipe(root: type, steps: tuple):
    cls = _class_of_recipe(root, steps)
    return cls.__new__(cls)


# ---- parameters read through a view for one call --------------------------------------------------------------------

def call_with_parameters_as(forward, transform: Callable[[torch.Tensor], torch.Tensor], *args, **kwargs):
    """Call a module's ``forward`` while its own parameters read as ``transform(parameter)``: a differentiable view
    (a transpose, an autograd region) that the forward uses in their place, so gradients reach the real parameters.
    The module's code is unchanged; parameter names and state dicts are too. The swap lives on the module for the
    duration of the call, so one module must not run this forward from two threads at once."""
    module = forward.__self__
    return call_with_parameters(forward, {name: transform(param) for name, param in module._parameters.items()
                                           if param is not None}, *args, **kwargs)


def call_with_parameters(forward, replacements: Dict[str, torch.Tensor], *args, **kwargs):
    """``forward(*args, **kwargs)`` with the module's parameters named in ``replacements`` read as the given tensors."""
    module = forward.__self__
    originals = dict(module._parameters)
    try:
        # Direct dict access: the transformed tensor is not a leaf, so it cannot be registered as a Parameter.
        module._parameters.update(replacements)
        return forward(*args, **kwargs)
    finally:
        module._parameters.update(originals)



# ---- classes that own specs ------------------------------------------------------------------------------------------

_SPEC_OWNING_CLASSES: Dict[type, type] = {}


def spec_owning_class(base: type) -> type:
    """``base`` with ShardedModule mixed in (one class per base, made once): what a module of ``base`` becomes when a
    style records specs on it, keeping its parameter names."""
    if base not in _SPEC_OWNING_CLASSES:
        _SPEC_OWNING_CLASSES[base] = _dynamic_subclass(base, ("spec_owning",), {})
    return _SPEC_OWNING_CLASSES[base]


def has_own_forward(module: nn.Module, base: type) -> bool:
    """Whether ``module``'s class (a subclass of ``base``) computes something other than ``base.forward``."""
    return type(module).forward is not base.forward
