"""What ``nxdtp verify`` runs: the job (sizes, steps, tolerance), the dense model it builds on every rank (from a
Hugging Face config, shrunk unless the real size is asked, or from a factory of the user's), the plan, and the batches.

Everything here is deterministic given the job: every rank builds the same dense model and draws the same global batch,
so the dense reference needs no tensor sent between processes.
"""

from __future__ import annotations

import dataclasses
import os
import pkgutil
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..plan import Plan

OPTIMIZERS = ("adamw", "sgd")
# The tiny configs: heads of HEAD_DIM features, 2 * tp query heads, at most MAX_LAYERS layers.
HEAD_DIM = 8
MAX_LAYERS = 2
TINY_VOCAB = 128
# Perturbation of parameters whose elements are all equal (zero biases, unit norms), which would hide a wrong split.
PERTURBATION = 0.1


@dataclasses.dataclass(frozen=True)
class Job:
    """One verification: every rank of a world of ``tp * dp`` processes runs it. ``config`` (a transformers config,
    already shrunk or not) with ``model_class`` (a transformers class name), or ``factory`` ("module:function" giving
    the model); ``plan`` ("module:attr": a ``Plan``, or a function giving one; None: the model family's plan);
    ``batch`` ("module:function" called as ``function(batch_size, seq_len, generator)``, giving a dict of tensors whose
    dim 0 is the batch; None: token ids from the model's vocabulary as inputs and labels). ``batch_size`` is per DP
    rank. ``state_path``: the dense model's initial state, saved once by the launching process."""

    tp: int = 2
    dp: int = 1
    steps: int = 3
    seed: int = 0
    batch_size: int = 2
    seq_len: int = 16
    atol: float = 1e-5
    rtol: float = 1e-5
    optimizer: str = "adamw"
    lr: float = 1e-3
    config: Any = None
    model_class: Optional[str] = None
    factory: Optional[str] = None
    plan: Optional[str] = None
    batch: Optional[str] = None
    state_path: Optional[str] = None


def check_job(job: Job) -> None:
    """Raise ValueError naming the first value of ``job`` that cannot run."""
    for name in ("tp", "dp", "steps", "batch_size", "seq_len"):
        value = getattr(job, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: must be an integer >= 1")
    for name in ("atol", "rtol", "lr"):
        value = getattr(job, name)
        if not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name}={value!r}: must be a number >= 0")
    if job.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={job.optimizer!r}: must be one of {OPTIMIZERS}")


def resolve(reference: str, what: str) -> Any:
    """The object ``module:attr`` names (the current directory importable, as with ``python -m``); ValueError naming
    ``reference`` when it does not resolve."""
    module_name, colon, attr = reference.partition(":")
    if not colon or not module_name or not attr:
        raise ValueError(f"{what} {reference!r}: expected 'module:attribute', e.g. 'my_models:build'")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return pkgutil.resolve_name(reference)
    except ImportError as e:
        raise ValueError(f"{what} {reference!r}: cannot import module {module_name!r} ({e})") from None
    except AttributeError:
        raise ValueError(f"{what} {reference!r}: module {module_name!r} has no attribute {attr!r}") from None


def plan_of(job: Job) -> Optional[Plan]:
    """The job's plan (None: the family's, as ``parallelize_model`` picks it)."""
    if job.plan is None:
        return None
    plan = resolve(job.plan, "--plan")
    if callable(plan) and not isinstance(plan, Plan):
        plan = plan()
    if not isinstance(plan, Plan):
        raise ValueError(f"--plan {job.plan!r} is a {type(plan).__name__}, not an nxdtp.Plan (or a function giving "
                         "one)")
    return plan


def build_dense(job: Job) -> nn.Module:
    """The dense model: built under the job's seed, with parameters whose elements are all equal perturbed, then the
    launching process's initial state loaded where it saved one. In eval mode: dropout off in both runs."""
    torch.manual_seed(job.seed)
    if job.factory is not None:
        model = resolve(job.factory, "--factory")()
        if not isinstance(model, nn.Module):
            raise ValueError(f"--factory {job.factory!r} returned a {type(model).__name__}, not a torch.nn.Module")
    else:
        import transformers

        if not hasattr(transformers, job.model_class or ""):
            raise ValueError(f"model class {job.model_class!r} is not a transformers class")
        model = getattr(transformers, job.model_class)(job.config)
    model = model.float()
    perturb_constant_parameters(model, job.seed)
    if job.state_path is not None:
        model.load_state_dict(torch.load(job.state_path, map_location="cpu", weights_only=True))
    return model.eval()


def perturb_constant_parameters(model: nn.Module, seed: int) -> List[str]:
    """Add ``PERTURBATION * N(0, 1)`` to every parameter whose elements are all equal (fresh zero biases and unit norm
    weights would hide a wrong split of them); return their names."""
    g = torch.Generator().manual_seed(seed + 1)
    names = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.numel() > 0 and bool((p == p.reshape(-1)[0]).all()):
                p.add_(PERTURBATION * torch.randn(p.shape, generator=g, dtype=p.dtype))
                names.append(name)
    return names


def vocab_size_of(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    size = getattr(config, "vocab_size", None) or getattr(model, "vocab_size", None)
    if not isinstance(size, int):
        raise ValueError(f"{type(model).__name__} has no config.vocab_size or vocab_size to draw token ids from; give "
                         "--batch module:function for its inputs")
    return size


def global_batch(job: Job, model: nn.Module, step: int) -> Dict[str, torch.Tensor]:
    """Step ``step``'s batch of ``batch_size * dp`` rows, the same on every rank."""
    g = torch.Generator().manual_seed(job.seed * 1000 + step)
    rows = job.batch_size * job.dp
    if job.batch is not None:
        batch = resolve(job.batch, "--batch")(rows, job.seq_len, g)
        if not isinstance(batch, dict):
            raise ValueError(f"--batch {job.batch!r} returned a {type(batch).__name__}, not a dict of tensors")
        return batch
    ids = torch.randint(0, vocab_size_of(model), (rows, job.seq_len), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def dp_slice(batch: Dict[str, Any], job: Job, dp_rank: int) -> Dict[str, Any]:
    """DP rank ``dp_rank``'s rows of the global batch (what is not a tensor of ``batch_size * dp`` rows, whole)."""
    rows = job.batch_size * job.dp
    start = dp_rank * job.batch_size
    return {key: value[start:start + job.batch_size] if torch.is_tensor(value) and value.dim() > 0
            and value.shape[0] == rows else value for key, value in batch.items()}


def loss_of(output: Any, where: str) -> torch.Tensor:
    """The scalar loss of a model's output: the output itself, its ``.loss``, or its first item."""
    for candidate in (output, getattr(output, "loss", None),
                      output[0] if isinstance(output, (tuple, list)) and output else None):
        if torch.is_tensor(candidate) and candidate.dim() == 0:
            return candidate
    raise ValueError(f"the {where} model's output ({type(output).__name__}) holds no scalar loss: nxdtp verify calls "
                     "model(**batch) and needs a 0-dim tensor, an output with .loss, or a tuple whose first item is "
                     "the loss (give labels in --batch)")


# ---- the tiny config of the same architecture ------------------------------------------------------------------------

def _key(config, name: str) -> str:
    return getattr(config, "attribute_map", {}).get(name, name)


def tiny_config(config, tp: int, seq_len: int) -> Tuple[Any, List[str]]:
    """A config of the same architecture at a size that runs in seconds, every size TP must divide divisible by
    ``tp``: at most ``MAX_LAYERS`` layers, ``2 * tp`` query heads of ``HEAD_DIM`` features (key-value heads: as many
    as the query heads where the model has as many, else ``min(kv, tp)``), feed-forward 4x hidden, a vocabulary of
    ``TINY_VOCAB`` (a multiple of ``tp``); returns it and what was changed ("name old -> new")."""
    d = config.to_dict()
    heads = 2 * tp
    hidden = heads * HEAD_DIM
    changes: Dict[str, Any] = {}
    old_heads = d.get(_key(config, "num_attention_heads"))
    kv = d.get("num_key_value_heads")
    changes[_key(config, "num_hidden_layers")] = min(d.get(_key(config, "num_hidden_layers")) or MAX_LAYERS,
                                                     MAX_LAYERS)
    changes[_key(config, "num_attention_heads")] = heads
    if kv is not None:
        changes["num_key_value_heads"] = heads if kv == old_heads else min(kv, tp)
    if d.get("head_dim") is not None:
        changes["head_dim"] = HEAD_DIM
    changes[_key(config, "hidden_size")] = hidden
    for name in ("intermediate_size", "n_inner", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if d.get(name) is not None:
            changes[name] = 4 * hidden
    for name in ("num_local_experts", "num_experts"):
        if d.get(name):
            changes[name] = min(d[name], 4)
    changes[_key(config, "vocab_size")] = TINY_VOCAB if TINY_VOCAB % tp == 0 else 16 * tp
    positions = _key(config, "max_position_embeddings")
    if isinstance(d.get(positions), int) and d[positions] < seq_len:
        raise ValueError(f"--seq-len {seq_len}: longer than the model's {positions}={d[positions]}")
    return _rebuilt(config, d, changes)


def _rebuilt(config, d: Dict[str, Any], changes: Dict[str, Any]) -> Tuple[Any, List[str]]:
    notes = [f"{name} {d.get(name)} -> {value}" for name, value in changes.items() if d.get(name) != value]
    layers_key = _key(config, "num_hidden_layers")
    old_layers, layers = d.get(layers_key), changes[layers_key]
    d.update(changes)
    for name, value in list(d.items()):
        if isinstance(value, list) and old_layers and len(value) == old_layers and layers != old_layers:
            d[name] = value[:layers]   # per-layer lists (layer_types)
    vocab = changes[_key(config, "vocab_size")]
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id"):
        value = d.get(name)
        if isinstance(value, int) and value >= vocab:
            d[name] = vocab - 1
        elif isinstance(value, list):
            d[name] = [min(v, vocab - 1) for v in value]
    return type(config).from_dict(d), notes


def read_hf_config(source: str, model_class: Optional[str] = None) -> Tuple[Any, str]:
    """(config, transformers class name) from a model directory holding config.json, a config.json file, or a model
    type transformers knows ('llama', 'gpt2', ...). The class: ``model_class``, else the config's first architecture,
    else the model type's causal-LM class, else its masked-LM class."""
    import transformers

    if os.path.isdir(source) or source.endswith(".json"):
        path = os.path.join(source, "config.json") if os.path.isdir(source) else source
        if not os.path.isfile(path):
            raise ValueError(f"{source!r}: no config file at {path}")
        try:
            config = transformers.AutoConfig.from_pretrained(path)
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{path}: transformers cannot read this config ({e})") from None
    else:
        try:
            config = transformers.AutoConfig.for_model(source)
        except ValueError:
            raise ValueError(f"{source!r} is neither a directory, a .json file nor a model type transformers "
                             "knows (e.g. 'llama', 'gpt2', 'bert')") from None
    return config, model_class or default_model_class(config)


def default_model_class(config) -> str:
    """The config's first architecture transformers has, else the first of its causal-LM and masked-LM classes that
    nxdtp can shard (a family's plan), else the first of them."""
    import transformers

    from ..models import supported_models

    for name in getattr(config, "architectures", None) or []:
        if hasattr(transformers, name):
            return name
    candidates = []
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForMaskedLM):
        model_class = getattr(auto, "_model_mapping", {}).get(type(config), None)
        if model_class is not None:
            candidates.append(model_class.__name__)
    supported = [name for name in candidates if name in supported_models()]
    if supported or candidates:
        return (supported or candidates)[0]
    raise ValueError(f"{type(config).__name__} names no architecture and has no causal-LM or masked-LM class; give "
                     "--model-class")
