"""Helpers every model family's plan uses: TP regions around attention and MLP blocks, sequence-parallel entry and
exit, RNG forks for dropout inside TP regions, logits gathering, and attention masks.

They are forward wrappers (``nxdtp.plan.wrap_forward``) and small functions; none of them names a model family.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .. import mappings
from ..parallel_state import tensor_parallel_group
from ..plan import wrap_forward
from ..random import checkpoint, get_xla_rng_tracker


# The transformers releases the plans are written and tested against (setup.cfg's extras say the same): >= 5.0, < 6.
# transformers 4.48 does not pass yet; what fails there is listed in issue 11's notes.
OLDEST_TRANSFORMERS, NEWEST_MAJOR = (5, 0), 6


def require_supported_transformers() -> None:
    """Refuse a transformers release the plans were not written for: its module names or forwards may differ, and a
    plan that matched the wrong modules would compute wrong numbers rather than fail."""
    import transformers

    version = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    if not OLDEST_TRANSFORMERS <= version < (NEWEST_MAJOR, 0):
        oldest = ".".join(map(str, OLDEST_TRANSFORMERS))
        raise ImportError(f"transformers {transformers.__version__} is not supported by nxdtp.models: supported "
                          f"versions are >={oldest},<{NEWEST_MAJOR} (pip install 'transformers>={oldest},<{NEWEST_MAJOR}')")


def check_model(model: nn.Module, plan_name: str, supported, sizes) -> None:
    """Refuse, before anything changes, a class outside ``supported`` and any of ``sizes`` (name → value) that the
    tensor-parallel size does not divide, naming the value."""
    name = type(model).__name__
    if supported is not None and name not in supported:
        raise TypeError(f"the {plan_name} plan supports {list(supported)}, not {name}")
    tp = tensor_parallel_group().size
    for what, value in sizes.items():
        if isinstance(value, int) and value % tp != 0:
            raise ValueError(f"{name} {what}={value} is not divisible by tensor_model_parallel_size={tp}; choose a "
                             "tensor_model_parallel_size that divides it")


def with_and_without_prefix(name: str, prefix: str) -> list:
    """``name`` and its variant with ``prefix`` added or removed: HF checkpoints store a base model's keys with or
    without the attribute it has in the task model (``model.``, ``transformer.``, ``bert.``)."""
    return [name, name[len(prefix):] if name.startswith(prefix) else prefix + name]


def gather_vocab_logits(vocab_parallel_logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """All-gather vocab-parallel logits and drop the padded columns (for evaluation or inspection, not the loss)."""
    full = mappings.gather_from_tensor_model_parallel_region(vocab_parallel_logits)
    return full[..., :vocab_size]


def attention_bias(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A ``[batch, seq]`` 0/1 padding mask as the ``[batch, 1, 1, seq]`` additive mask HF attention applies.

    Pass this instead of the 2-D mask on XLA: from a 2-D mask transformers first checks whether any token is padded
    (``mask.all()``), a device-to-host read that executes a separate graph in every forward. A 4-D mask is used as
    given. The numbers are the same: 0 where attended, the dtype's minimum where padded.
    """
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [batch, seq], got shape {list(attention_mask.shape)}")
    keep = attention_mask[:, None, None, :].to(torch.bool)
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)


def checkpoint_layers(model: nn.Module) -> nn.Module:
    """Recompute each transformer layer (BERT's encoder layers, GPT-2's and Llama's decoder blocks: every transformers
    ``GradientCheckpointingLayer``) in backward instead of storing its activations.

    Uses ``nxdtp.random.checkpoint``, which replays the RNG tracker's states as well as the default generators, so
    dropout inside TP regions draws the forward's masks again (HF's ``gradient_checkpointing_enable`` restores only
    the default generator). On XLA the recompute is fenced by an optimization barrier so the compiler cannot merge it
    with the forward. Returns the model.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"checkpoint_layers() found no transformer layer (transformers' GradientCheckpointingLayer) "
                         f"in {type(model).__name__}")
    for layer in layers:
        wrap_forward(layer, "nxdtp_activation_checkpoint", _checkpointed_layer)
    return model


def _checkpointed_layer(forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    # A KV cache would be appended to again when backward recomputes the layer (HF turns caching off under its own
    # checkpointing for the same reason).
    for cache in ("past_key_values", "layer_past"):
        if kwargs.get(cache) is not None:
            kwargs[cache] = None
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    return checkpoint(forward, *args, **kwargs)


def dropping(module: nn.Module) -> bool:
    """Whether ``module`` would draw a dropout mask in this forward."""
    return module.training and any(isinstance(m, nn.Dropout) and m.p > 0 for m in module.modules())


def never_drops(module: nn.Module) -> bool:
    """For blocks without dropout inside their TP region."""
    return False


def maybe_forked(fork: bool, forward, *args, **kwargs):
    """Run ``forward`` under the TP RNG tracker's fork when ``fork``: dropout inside a TP region then draws a different
    mask on each TP rank, as each rank holds different heads or tokens."""
    if not fork:
        return forward(*args, **kwargs)
    with get_xla_rng_tracker().fork():
        return forward(*args, **kwargs)


# The wrapper factories are cached: wrap_forward keys its subclasses by wrapper name and requires one function per name.
@functools.lru_cache(maxsize=None)
def tensor_parallel_block(sequence_dimension: int, sequence_parallel: bool, forks_dropout):
    """A forward wrapper for a block whose column-parallel input projections (Q/K/V, or gate/up) all read the same
    ``hidden_states``: one entry region for all of them, so backward sums their input gradients with a single
    all-reduce (or, with sequence parallelism, gathers the sequence once and reduce-scatters once).
    ``forks_dropout(module)`` says whether the block's dropout draws per-rank masks."""

    def wrapper(forward, hidden_states, *args, **kwargs):
        if sequence_parallel:
            hidden_states = mappings.gather_from_sequence_parallel_region(hidden_states, to_model_parallel=True,
                                                                          sequence_dimension=sequence_dimension)
        else:
            hidden_states = mappings.copy_to_tensor_model_parallel_region(hidden_states)
        return maybe_forked(forks_dropout(forward.__self__), forward, hidden_states, *args, **kwargs)

    return wrapper


@functools.lru_cache(maxsize=None)
def scatter_sequence_of_input(sequence_dimension: int):
    """A forward wrapper that splits the first argument along the sequence: where a sequence-parallel region starts."""

    def wrapper(forward, hidden_states, *args, **kwargs):
        return forward(mappings.scatter_to_sequence_parallel_region(hidden_states, sequence_dimension=sequence_dimension),
                       *args, **kwargs)

    return wrapper


@functools.lru_cache(maxsize=None)
def gather_sequence_of_output(sequence_dimension: int):
    """A forward wrapper that gathers a tensor output along the sequence for replicated consumers (backward splits):
    where a sequence-parallel region ends."""

    def wrapper(forward, *args, **kwargs):
        return mappings.gather_from_sequence_parallel_region(forward(*args, **kwargs), to_model_parallel=False,
                                                             sequence_dimension=sequence_dimension)

    return wrapper
