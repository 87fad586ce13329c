"""Text generation (transformers' ``model.generate``) on parallelized causal LMs, and the mode it runs in.

Training keeps the Megatron layout: sequence parallelism splits the hidden states along the sequence. Decoding needs
two things of a parallelized model:

* **Full logits.** HF's greedy search, sampling and beam search take ``argmax`` / top-k / ``multinomial`` over the last
  dimension of ``outputs.logits``; on a vocab-parallel head's shard the ids would be local and every rank would pick
  a different token. The forward returns full-vocabulary logits by default (``nxdtp.models.logits``), and generation
  makes sure of it even inside ``vocab_parallel_logits``. The gathered tensor holds the same bytes on every rank, so
  logits processors compute the same scores everywhere and equal seeds draw equal samples: every rank generates the
  same tokens. With ``logits_to_keep`` / ``num_logits_to_keep`` (which HF's ``generate`` passes) only the last
  position's logits are computed and gathered: ``batch x vocab`` values per step.
* **The whole sequence.** Each step after the prompt feeds one token, which no sequence split divides over TP, and a
  prompt may have any length. So generation runs a sequence-parallel model without the split: every rank holds the
  whole sequence, and each sequence-parallel region becomes the plain TP region (the block entries copy instead of
  all-gathering, the row-parallel layers all-reduce instead of reduce-scattering, nothing is scattered or gathered
  around the layers). That is exactly the model sharded without sequence parallelism, dropout included. The KV cache
  is the same either way: attention always sees the whole sequence, so it caches the same keys and values.

``generation_mode(model)`` is that mode. A parallelized causal LM's ``generate`` runs entirely inside it, so HF's own
decoding loops (and whatever calls ``generate``: pipelines, Trainer's ``predict_with_generate``) work unchanged. Use it
directly for a decoding loop of your own.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

from .. import comm
from ..plan import add_mixin
from ..record import note_of, read_note
from ..topology import expert_parallel_group, get_topology
from .common import WholeSequenceNote
from .logits import full_logits


@dataclasses.dataclass
class GenerationNote:
    """On a model: how many ``generation_mode`` contexts are open on it, and whether it splits the sequence outside
    them (it has sequence-parallel parameters, so its forward must then run without gradients)."""
    depth: int = 0
    suspends_sequence_parallelism: bool = False


def in_generation_mode(model: nn.Module) -> bool:
    return read_note(model, GenerationNote).depth > 0


@contextlib.contextmanager
def generation_mode(model: nn.Module):
    """Run ``model`` (a causal LM parallelized by nxdtp) as for decoding: its outputs' ``logits`` are the
    full-vocabulary logits, ``[..., config.vocab_size]``, the same on every TP rank (the loss, given labels, is still
    computed on the vocab-parallel shards), and a sequence-parallel model runs without splitting the sequence, so any
    length runs, one token included. ``model.generate`` enters it by itself. Under sequence parallelism the forward
    must run under ``torch.no_grad()``: without the split the norms compute complete gradients, which
    ``allreduce_sequence_parallel_gradients`` would then multiply by TP. Re-entrant."""
    if not isinstance(model, _GeneratesFromFullLogits):
        raise TypeError(f"generation_mode() needs a causal language model parallelized by nxdtp (parallelize_model or "
                        f"from_pretrained_sharded of a class with transformers' generate); {type(model).__name__} is "
                        "not one")
    note = note_of(model, GenerationNote)
    depth = note.depth
    switched_off = _run_whole_sequence(model) if depth == 0 else None
    note.depth = depth + 1
    try:
        with full_logits(model):
            yield model
    finally:
        note.depth = depth
        if depth == 0:
            _split_sequence_again(model, switched_off)


def _run_whole_sequence(model: nn.Module) -> list:
    """Make every sequence-parallel region of ``model`` the plain TP region: the plans' forward wrappers read
    their module's ``WholeSequenceNote`` (``nxdtp.models.common``), nxdtp's layers their
    ``sequence_parallel_enabled``. Returns the layers switched off."""
    note_of(model, GenerationNote).suspends_sequence_parallelism = any(
        getattr(p, "sequence_parallel_enabled", False) for p in model.parameters())
    switched_off = []
    for module in model.modules():
        note_of(module, WholeSequenceNote).whole = True
        if module.__dict__.get("sequence_parallel_enabled") is True:
            module.sequence_parallel_enabled = False
            switched_off.append(module)
    return switched_off


def _split_sequence_again(model: nn.Module, switched_off: list) -> None:
    for module in model.modules():
        note_of(module, WholeSequenceNote).whole = False
    for module in switched_off:
        module.sequence_parallel_enabled = True
    note_of(model, GenerationNote).suspends_sequence_parallelism = False


class _GeneratesFromFullLogits:
    """Mixed into a parallelized causal LM (``support_hf_generation``): ``generate`` runs in ``generation_mode``, and
    a sequence-parallel model's calls in that mode must run without gradients."""

    def generate(self, *args, **kwargs):
        _refuse_unsupported(self, kwargs)
        _keep_expert_parallel_ranks_together(self, kwargs)
        with generation_mode(self):
            return super().generate(*args, **kwargs)

    def _has_unfinished_sequences(self, this_peer_finished: bool, synced_gpus: bool, device, *args, **kwargs):
        """HF's check under ``synced_gpus``, its all-reduce through ``nxdtp.comm`` over the world: the backend follows
        the flag's device (a CPU model on an NCCL-like world sums it over the gloo twin, which HF's
        ``dist.all_reduce`` on the default group cannot)."""
        if not synced_gpus:
            return super()._has_unfinished_sequences(this_peer_finished, synced_gpus, device, *args, **kwargs)
        unfinished = torch.tensor(0.0 if this_peer_finished else 1.0, device=device)
        return bool(comm.all_reduce(unfinished, get_topology().world).item() != 0.0)

    def __call__(self, *args, **kwargs):
        if not in_generation_mode(self):
            return super().__call__(*args, **kwargs)
        if read_note(self, GenerationNote).suspends_sequence_parallelism and torch.is_grad_enabled():
            raise RuntimeError(
                f"{type(self).__name__} was parallelized with sequence_parallel=True and is in generation_mode, which "
                "runs it without splitting the sequence: its forward must run under torch.no_grad() (with gradients, "
                "the norms' gradients would be complete, and allreduce_sequence_parallel_gradients would multiply "
                "them by the TP size). Train outside generation_mode")
        return super().__call__(*args, **kwargs)


def _refuse_unsupported(model: nn.Module, kwargs: dict) -> None:
    """Refuse, before transformers starts, what would decode wrongly or fail obscurely on a parallelized model."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    # DoLa applies the LM head to intermediate hidden states itself: vocab-parallel logits nxdtp never sees.
    dola_layers = kwargs.get("dola_layers", getattr(config, "dola_layers", None))
    if dola_layers is not None:
        raise NotImplementedError(
            f"generate(dola_layers={dola_layers!r}) on a parallelized {type(model).__name__}: DoLa applies the LM head "
            "to intermediate hidden states itself, which gives vocab-parallel logits. Use greedy search, sampling or "
            "beam search (dola_layers=None)")
    # Caches that generate builds by name (static, sliding_window, hybrid, ...) are allocated for the config's KV head
    # count, not this rank's, unless the installed transformers sizes their layers from the first keys they store.
    implementation = kwargs.get("cache_implementation", getattr(config, "cache_implementation", None))
    if implementation not in (None, "dynamic") and not _caches_sized_from_keys():
        import transformers

        raise NotImplementedError(
            f"generate(cache_implementation={implementation!r}) on a parallelized {type(model).__name__} under "
            f"transformers {transformers.__version__}: this release allocates such caches for the config's "
            f"{getattr(model.config, 'num_key_value_heads', None)} KV heads, while each rank holds only its own. Leave "
            "cache_implementation unset (the dynamic cache), or use a transformers release whose static cache layers "
            "size themselves from the keys (StaticLayer.lazy_initialization, transformers 5)")


def _keep_expert_parallel_ranks_together(model: nn.Module, kwargs: dict) -> None:
    """With experts split over ranks that decode different prompts (expert parallelism), every rank must run every
    step, even after its own sequences ended: ``synced_gpus=True`` (HF's option) unless the caller chose."""
    if expert_parallel_group().size == 1 or not any(getattr(p, "expert_model_parallel", False)
                                                      for p in model.parameters()):
        return
    if kwargs.get("synced_gpus") is False:
        raise ValueError(f"generate(synced_gpus=False) on {type(model).__name__} with expert_model_parallel_size="
                         f"{expert_parallel_group().size}: a rank that stopped early would leave the others waiting "
                         "in the experts' all-to-all; pass synced_gpus=True (the default here)")
    kwargs["synced_gpus"] = True


def _caches_sized_from_keys() -> bool:
    """Whether the installed transformers sizes a static cache's layers from the first keys stored (its layered caches
    do), rather than from the config's head count."""
    from transformers import cache_utils

    return hasattr(getattr(cache_utils, "StaticLayer", None), "lazy_initialization")


def _is_generative(model: nn.Module) -> bool:
    """Whether ``model``'s class generates: one of its classes inherits transformers' ``GenerationMixin`` directly
    (transformers 4.x's ``PreTrainedModel`` does for every model, encoders included, so it does not count)."""
    try:
        from transformers import GenerationMixin, PreTrainedModel
    except ImportError:
        return False
    return any(GenerationMixin in cls.__bases__ for cls in type(model).__mro__ if cls is not PreTrainedModel)


def support_hf_generation(model: nn.Module) -> None:
    """Make ``generate`` on the parallelized ``model`` give the dense model's tokens on every rank (module docstring);
    models that do not generate are left as they are."""
    if _is_generative(model):
        add_mixin(model, _GeneratesFromFullLogits)
