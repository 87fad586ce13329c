"""Helpers every model family's plan uses: TP regions around attention and MLP blocks, sequence-parallel entry and
exit, RNG forks for dropout inside TP regions, logits gathering, and attention masks.

They are forward wrappers (``nxdtp.plan.wrap_forward``) and small functions; none of them names a model family.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .. import mappings, sequence_parallel_linear
from ..loss_functions import FullVocabularyNote
from ..plan import SEQUENCE_PARALLEL, TENSOR_PARALLEL, WrapForward, wrapper_factory
from ..random import get_xla_rng_tracker
from ..record import read_note
from ..topology import ParallelGroup
from .family import families_with_older_transformers, oldest_transformers

# The transformers releases each family's plan is written and tested against (setup.cfg's extras, docs/testing.md's CI
# matrix and docs/wrapping_hf_models.md's families table say the same): from each family's ``oldest_transformers``
# (BERT from 4.26, for NxD's BERT tutorial; every other family from 4.48, NxD's training examples) up to the newest 5.x.
# Inside the range, differences between releases are handled by feature detection in this package, never by version
# numbers.
NEWEST_MAJOR = 6


def supported_transformers(family: str) -> str:
    """The transformers versions ``family``'s plan supports, as a pip requirement range: ``">=4.48,<6"``."""
    return f">={'.'.join(map(str, oldest_transformers(family)))},<{NEWEST_MAJOR}"


def require_supported_transformers(family: str) -> None:
    """Refuse a transformers release ``family``'s plan was not written for: its module names or forwards may differ,
    and a plan that matched the wrong modules would compute wrong numbers rather than fail. Called when a plan is
    made, so the error comes before any model is changed."""
    import transformers

    version = transformers.__version__
    try:
        major_minor = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        raise ImportError(f"cannot read the transformers version {version!r}; nxdtp's {family} plan supports "
                          f"transformers{supported_transformers(family)}") from None
    if not oldest_transformers(family) <= major_minor < (NEWEST_MAJOR, 0):
        supported = supported_transformers(family)
        older = families_with_older_transformers()
        ranges = [f"{name}'s plan: {supported_transformers(name)}" for name in older if name != family]
        if family in older:
            ranges.append(f"the other families': {supported_transformers('')}")
        raise ImportError(f"transformers {version} is not supported by nxdtp's {family} plan: supported versions are "
                          f"{supported} ({'; '.join(ranges)}); pip install 'transformers{supported}'")


def check_model(model: nn.Module, plan_name: str, supported, sizes, group: ParallelGroup) -> None:
    """Refuse, before anything changes, a class outside ``supported`` and any of ``sizes`` (name → value) that the
    size of ``group`` (the plan's TP group) does not divide, naming the value."""
    name = type(model).__name__
    if supported is not None and name not in supported:
        raise TypeError(f"the {plan_name} plan supports {list(supported)}, not {name}")
    tp = group.size
    for what, value in sizes.items():
        if isinstance(value, int) and value % tp != 0:
            raise ValueError(f"{name} {what}={value} is not divisible by tensor_model_parallel_size={tp}; choose a "
                             "tensor_model_parallel_size that divides it")


def with_and_without_prefix(name: str, prefix: str) -> list:
    """``name`` and its variant with ``prefix`` added or removed: HF checkpoints store a base model's keys with or
    without the attribute it has in the task model (``model.``, ``transformer.``, ``bert.``)."""
    return [name, name[len(prefix):] if name.startswith(prefix) else prefix + name]


def gather_vocab_logits(vocab_parallel_logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """All-gather vocab-parallel logits over TP and drop the padded columns. The full-vocabulary logits a
    parallelized model's forward returns by default (they carry a ``FullVocabularyNote``) are returned as they are."""
    if read_note(vocab_parallel_logits, FullVocabularyNote).full:
        return vocab_parallel_logits
    full = mappings.gather_from_tensor_model_parallel_region(vocab_parallel_logits)
    return full[..., :vocab_size]


def attention_bias(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A ``[batch, seq]`` 0/1 padding mask in the form BERT-style encoders (BERT, RoBERTa) use as given, without first
    reading a value back to the host.

    Pass this instead of the 2-D mask on XLA: from a 2-D mask transformers' SDPA path first checks whether any token is
    padded (``mask.all()``), a device-to-host read that executes a separate graph in every forward. The numbers are
    the same as with the 2-D mask. The form depends on how the installed transformers builds BERT's mask:

    * transformers 5: the ``[batch, 1, 1, seq]`` additive mask (0 where attended, the dtype's minimum where padded),
      which it uses as given;
    * transformers 4 (``get_extended_attention_mask``, which accepts 2-D and 3-D masks only): the 0/1 mask as
      ``[batch, 1, seq]`` in ``dtype``, which it turns into the same additive mask on the device.
    """
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [batch, seq], got shape {list(attention_mask.shape)}")
    if _builds_extended_attention_masks():
        return attention_mask[:, None, :].to(dtype)
    keep = attention_mask[:, None, None, :].to(torch.bool)
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)


def _builds_extended_attention_masks() -> bool:
    """Whether the installed transformers' encoders build their additive mask with ``get_extended_attention_mask``
    (transformers 4), rather than taking a 4-D mask as given (transformers 5)."""
    from transformers import PreTrainedModel

    return hasattr(PreTrainedModel, "get_extended_attention_mask")


@dataclasses.dataclass
class WholeSequenceNote:
    """On every module of a model in ``generation_mode``: its sequence-parallel wrapper runs without the split."""
    whole: bool = False


def splits_sequence(module: nn.Module) -> bool:
    """Whether ``module``'s sequence-parallel wrapper splits the sequence now: always, except in
    ``nxdtp.models.generation.generation_mode``, which runs a sequence-parallel model without splitting the sequence
    (a decode step has one token, which no split divides) by setting every module's ``WholeSequenceNote``; the
    sequence-parallel wrappers below then act as their plain TP counterparts."""
    return not read_note(module, WholeSequenceNote).whole


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


# The wrapper factories are cached (wrap_forward keys its subclasses by wrapper name and requires one function per name)
# and remember their arguments, so wrapped models pickle: nxdtp.plan.wrapper_factory.
@wrapper_factory
def tensor_parallel_block(sequence_dimension: int, sequence_parallel: bool, forks_dropout):
    """A forward wrapper for a block whose column-parallel input projections (Q/K/V, or gate/up) all read the same
    ``hidden_states``: one entry region for all of them, so backward sums their input gradients with a single
    all-reduce (or, with sequence parallelism, gathers the sequence once and reduce-scatters once; the projections
    keep only the sequence shard for backward and share one re-gather there; in generation_mode, where the sequence
    stays whole, the plain entry region). ``forks_dropout(module)`` says whether the block's dropout draws per-rank
    masks."""

    def wrapper(forward, hidden_states, *args, **kwargs):
        if sequence_parallel and splits_sequence(forward.__self__):
            hidden_states = sequence_parallel_linear.gather_keeping_shard(hidden_states, sequence_dimension)
        else:
            hidden_states = mappings.copy_to_tensor_model_parallel_region(hidden_states)
        return maybe_forked(forks_dropout(forward.__self__), forward, hidden_states, *args, **kwargs)

    return wrapper


@wrapper_factory
def scatter_sequence_of_input(sequence_dimension: int):
    """A forward wrapper that splits the first argument along the sequence: where a sequence-parallel region starts
    (except in generation_mode)."""

    def wrapper(forward, hidden_states, *args, **kwargs):
        if not splits_sequence(forward.__self__):
            return forward(hidden_states, *args, **kwargs)
        return forward(mappings.scatter_to_sequence_parallel_region(hidden_states,
                                                                    sequence_dimension=sequence_dimension),
                       *args, **kwargs)

    return wrapper


@wrapper_factory
def gather_sequence_of_output(sequence_dimension: int):
    """A forward wrapper that gathers a tensor output along the sequence for replicated consumers (backward splits):
    where a sequence-parallel region ends (except in generation_mode, where the output is whole already). A
    column-parallel LM head after it keeps only the shard for backward and re-gathers it there
    (``nxdtp.sequence_parallel_linear``)."""

    def wrapper(forward, *args, **kwargs):
        if not splits_sequence(forward.__self__):
            return forward(*args, **kwargs)
        shard = forward(*args, **kwargs)
        full = mappings.gather_from_sequence_parallel_region(shard, to_model_parallel=False,
                                                             sequence_dimension=sequence_dimension)
        # A column-parallel LM head reading it keeps only the shard for backward.
        return sequence_parallel_linear.remember_shard(full, shard, sequence_dimension)

    return wrapper


# ---- the wrappers above as plan styles -------------------------------------------------------------------------------

def tensor_parallel_block_style(wrapper_name: str, sequence_dimension: int, sequence_parallel: bool,
                                forks_dropout) -> WrapForward:
    """The style that opens one TP region for a block's column-parallel projections (``tensor_parallel_block``);
    with sequence parallelism its wrapper is named ``<wrapper_name>_sp``."""
    return WrapForward(wrapper_name + ("_sp" if sequence_parallel else ""),
                       tensor_parallel_block(sequence_dimension, sequence_parallel, forks_dropout),
                       opens=TENSOR_PARALLEL)


def sequence_parallel_entry(sequence_dimension: int) -> WrapForward:
    """The style of the module whose input is where the sequence-parallel region starts (the first layer)."""
    return WrapForward("nxdtp_sequence_parallel_entry", scatter_sequence_of_input(sequence_dimension),
                       opens=SEQUENCE_PARALLEL)


def sequence_parallel_exit(sequence_dimension: int) -> WrapForward:
    """The style of the module whose output is where the sequence-parallel region ends (the final norm)."""
    return WrapForward("nxdtp_sequence_parallel_exit", gather_sequence_of_output(sequence_dimension),
                       closes=SEQUENCE_PARALLEL)
