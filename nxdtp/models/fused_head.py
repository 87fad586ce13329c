"""TRL's fused LM head, computed on the vocab-parallel shards.

TRL's trainers (SFT, DPO, GRPO, ...) call ``add_fused_lm_head(model)``, which replaces the model's ``forward`` with one
that, given ``fused_lm_head=True``, runs the backbone and multiplies the hidden states by ``lm_head.weight`` itself to
get each label's log-probability (and the entropy, the top-1 hit, ...) without building the logits. On a parallelized
model that weight is this rank's vocabulary slice: the softmax would run over a fraction of the vocabulary, and the run
would train, wrongly, without an error. While ``TensorParallelTrainer`` builds a TRL trainer,
``vocab_parallel_fused_heads()`` follows each of TRL's ``add_fused_lm_head`` calls with this module's forward: the
same outputs, computed from the LM head's vocab-parallel logits by
``nxdtp.loss_functions.vocab_parallel_token_statistics`` (two small all-reduces per forward, no gather). It holds
this rank's ``[tokens, vocabulary / tp]`` logits and a few fp32 temporaries of that size for the backward, where
TRL's kernel tiles the full vocabulary.

TRL's settings for the head (temperature, logit scale and soft-capping, the outputs asked for, the forward it wrapped)
are read from its forward's closure; a TRL release whose fused head keeps other names is refused by name.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import types

import torch
from torch import nn

from ..loss_functions import vocab_parallel_token_statistics
from .logits import model_and_wrapped, vocab_parallel_head, vocabulary_sizes

TRL_FORWARD_NAME = "_fused_forward"
TRL_SETTINGS = ("original_forward", "backbone_attr", "temperature", "logit_scale", "final_logit_softcapping",
                "cast_lm_head_to_fp32", "outputs")
STATISTICS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


@contextlib.contextmanager
def vocab_parallel_fused_heads():
    """While a TRL trainer is built: each ``add_fused_lm_head(model)`` TRL calls is followed at once by nxdtp's fused
    forward on ``model`` when its head is vocab-parallel, before anything else runs the model or wraps its forward
    (accelerate's mixed-precision wrapper, DPO's precomputed reference log-probabilities). TRL's modules that hold the
    function get the wrapped one for the duration only."""
    utils = sys.modules.get("trl.trainer.utils")
    original = utils.__dict__.get("add_fused_lm_head") if utils is not None else None
    if original is None:   # TRL not imported: no TRL trainer is being built
        yield
        return

    def add_fused_lm_head(model, *args, **kwargs):
        original(model, *args, **kwargs)
        _use_vocab_parallel_fused_forward(model)

    holders = [module for name, module in list(sys.modules.items())
               if name.startswith("trl.") and getattr(module, "__dict__", {}).get("add_fused_lm_head") is original]
    for module in holders:
        module.add_fused_lm_head = add_fused_lm_head
    try:
        yield
    finally:
        for module in holders:
            module.add_fused_lm_head = original


def refuse_trl_fused_heads_left(trainer) -> None:
    """After a TRL trainer is built: refuse, by name, a model whose vocab-parallel head TRL's own fused head still
    reads (fitted where ``vocab_parallel_fused_heads`` did not see it), and TRL's MoE load-balancing loss."""
    for model in models_of(trainer):
        if vocab_parallel_head(model) is None:
            continue   # a dense reference model, or a head HF's tp_plan left whole: TRL's own head is right
        if any(_is_trl_fused_forward(model.__dict__.get(name)) for name in ("forward", "_original_forward")):
            raise NotImplementedError(
                f"{type(trainer).__name__}: TRL fitted its fused LM head on {type(model).__name__} where nxdtp could "
                "not replace it; it would take its softmax over this rank's vocabulary shard")
        if getattr(trainer, "aux_loss_enabled", False):
            raise NotImplementedError(
                f"{type(trainer).__name__} with a mixture-of-experts load-balancing loss (router_aux_loss_coef="
                f"{getattr(trainer, 'router_aux_loss_coef', None)}): TRL computes it from router logits nxdtp's expert "
                "layers reduce differently; set router_aux_loss_coef=0.0 in the trainer's config, or train with "
                "TensorParallelTrainer")


def _is_trl_fused_forward(forward) -> bool:
    code = getattr(getattr(forward, "__func__", forward), "__code__", None)
    return getattr(code, "co_name", None) == TRL_FORWARD_NAME   # functools.wraps renamed the function, not its code


def _use_vocab_parallel_fused_forward(model: nn.Module) -> None:
    trl_forward = model.__dict__.get("forward")
    if _is_trl_fused_forward(trl_forward) and vocab_parallel_head(model) is not None:
        model.forward = types.MethodType(_vocab_parallel_fused_forward(model, _trl_settings(trl_forward)), model)


def models_of(trainer) -> list:
    """The models ``trainer`` runs: its model and a reference model (TRL's DPO, GRPO), and the HF models that PEFT
    models among them wrap."""
    models = []
    for model in (getattr(trainer, "model", None), getattr(trainer, "ref_model", None)):
        if isinstance(model, nn.Module):
            models.extend(m for m in model_and_wrapped(model) if m not in models)
    return models


def _trl_settings(trl_forward) -> dict:
    """TRL's settings of a fused head, from its forward's closure; refused by name when they are not all there."""
    settings = inspect.getclosurevars(trl_forward.__func__).nonlocals
    missing = [name for name in TRL_SETTINGS if name not in settings]
    if missing:
        import trl

        raise NotImplementedError(f"TRL {trl.__version__}'s fused LM head does not keep {missing} where nxdtp reads "
                                  "them, so nxdtp cannot compute it on the vocab-parallel shards; use a TRL release "
                                  "in nxdtp's tested range (pip install 'nxdtp[trl]')")
    return {name: settings[name] for name in TRL_SETTINGS}


def _vocab_parallel_fused_forward(model: nn.Module, settings: dict):
    """The forward that replaces TRL's on ``model``: TRL's signature and outputs, its fused path on the shards."""
    original = settings["original_forward"]

    @functools.wraps(type(model).forward)
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            extra = {"labels": labels, "shift_labels": shift_labels, "num_items_in_batch": num_items_in_batch}
            return original(*args, **kwargs, **{key: value for key, value in extra.items() if value is not None})
        kwargs["use_cache"] = False
        hidden = getattr(self, settings["backbone_attr"])(*args, **kwargs).last_hidden_state
        logits = _head_logits(self, hidden, settings)
        if shift_labels is None:   # position t scores label t + 1
            logits, labels = logits[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        return _fused_outputs(self, logits, labels.to(logits.device), num_items_in_batch, settings)

    return forward


def _head_logits(model: nn.Module, hidden: torch.Tensor, settings: dict) -> torch.Tensor:
    """The LM head's vocab-parallel logits of ``hidden``, scaled, soft-capped and divided by the temperature as TRL's
    kernel does, in fp32."""
    head = vocab_parallel_head(model)
    autocast = contextlib.nullcontext()
    if settings["cast_lm_head_to_fp32"]:
        hidden = hidden.float()
        autocast = torch.autocast(hidden.device.type, enabled=False)
    with autocast:
        logits = head(hidden).float() * settings["logit_scale"]
    cap = settings["final_logit_softcapping"]
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    return logits / settings["temperature"]


def _fused_outputs(model: nn.Module, logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch, settings: dict):
    """TRL's ``FusedCausalLMOutput`` from vocab-parallel logits: each statistic TRL asked for, zero (False) where the
    label is ignored, and the loss as TRL's head computes it."""
    from trl.trainer.utils import FusedCausalLMOutput

    mask = labels != -100
    statistics = vocab_parallel_token_statistics(logits, labels.clamp(min=0),
                                                 vocabulary_sizes(vocab_parallel_head(model))[1])
    asked = set(settings["outputs"]) | {"log_probs"}
    values = {name: statistics[name].masked_fill(~mask, 0) if name in asked else None for name in STATISTICS}
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return FusedCausalLMOutput(loss=-values["log_probs"].sum() / count, label_mask=mask, **values)
