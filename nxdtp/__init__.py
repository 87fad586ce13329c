"""nxdtp: tensor parallelism for PyTorch with neuronx-distributed's public names.

``import nxdtp`` gives the names below, grouped by what a user does with them, and the modules an NxD user knows
(``nxdtp.parallel_state``, ``nxdtp.layers``, ``nxdtp.mappings``, ``nxdtp.loss_functions``, ``nxdtp.random``,
``nxdtp.grads``, ``nxdtp.utils``, ``nxdtp.checkpointing``, ``nxdtp.optimizer``, ``nxdtp.trainer``). Importing it does
not import transformers: the model plans load it when a model is sharded.
"""

import sys
import warnings

from . import (
    grads,
    layers,
    loss_functions,
    mappings,
    optimizer,
    parallel_state,
    random,
    trainer,
    utils,
)
from .checkpointing import load, save
from .grads import allreduce_sequence_parallel_gradients, bucket_allreduce_gradients, clip_grad_norm, get_grad_norm
from .layers import ColumnParallelLinear, LayerNorm, ParallelEmbedding, RowParallelLinear
from .loss_functions import from_parallel_logits_to_logprobs, parallel_cross_entropy
from .mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from .models import from_pretrained_sharded, parallelize_model, save_pretrained
from .optimizer import Lamb, NeuronZero1Optimizer
from .parallel_state import destroy_model_parallel, initialize_model_parallel, model_parallel_is_initialized
from .plan import Plan, parallelize
from .random import get_xla_rng_tracker, model_parallel_xla_manual_seed
from .trainer import (
    finalize_checkpoint,
    has_checkpoint,
    initialize_parallel_model,
    initialize_parallel_optimizer,
    load_checkpoint,
    neuronx_distributed_config,
    save_checkpoint,
)
from .utils import (
    copy_tensor_model_parallel_attributes,
    move_model_to_device,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
    split_tensor_along_last_dim,
)
from .version import __version__

__all__ = [
    "__version__",
    # The topology: the tensor- and data-parallel groups every other name works over.
    "initialize_model_parallel", "destroy_model_parallel", "model_parallel_is_initialized",
    # Shard a model: parallelize_model (a supported family's plan, or your Plan); nxdtp.parallelize is the same call
    # with a Plan, under the name the plan primitive has always had.
    "parallelize_model", "Plan", "parallelize", "from_pretrained_sharded", "save_pretrained",
    # Checkpoint files: sharded, self-describing save and load (nxdtp.checkpointing).
    "save", "load",
    # NxD's trainer API (nxdtp.trainer): a config, a parallel model and optimizer, NxD-style checkpoints.
    "neuronx_distributed_config", "initialize_parallel_model", "initialize_parallel_optimizer",
    "save_checkpoint", "load_checkpoint", "has_checkpoint", "finalize_checkpoint",
    # Layers, losses, gradients and optimizers of a hand-built TP model.
    "ColumnParallelLinear", "RowParallelLinear", "ParallelEmbedding", "LayerNorm",
    "parallel_cross_entropy", "from_parallel_logits_to_logprobs",
    "get_grad_norm", "clip_grad_norm", "bucket_allreduce_gradients", "allreduce_sequence_parallel_gradients",
    "Lamb", "NeuronZero1Optimizer", "move_model_to_device",
    # The rest of NxD's neuronx_distributed.parallel_layers package names (its __init__), for `from nxdtp import ...`.
    "copy_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region", "scatter_to_tensor_model_parallel_region",
    "copy_tensor_model_parallel_attributes", "set_tensor_model_parallel_attributes",
    "set_defaults_if_not_set_tensor_model_parallel_attributes", "split_tensor_along_last_dim",
    "model_parallel_xla_manual_seed", "get_xla_rng_tracker",
    # NxD's modules.
    "parallel_state", "layers", "mappings", "loss_functions", "random", "grads", "utils", "optimizer", "trainer",
]

# Names that leave the top level, kept one release: name -> (module, attribute or None for the module itself, why).
_MOVED = {
    "checkpoint": ("nxdtp.random", "checkpoint",
                   "activation recompute is too easily confused with nxdtp.checkpointing (checkpoint files); "
                   "nxdtp.models.checkpoint_layers applies it to a model's layers"),
    "optimizers": ("nxdtp.optimizer", None, "one optimizer package: Lamb is nxdtp.optimizer.Lamb (and nxdtp.Lamb)"),
}


def __getattr__(name: str):
    if name not in _MOVED:
        raise AttributeError(f"module 'nxdtp' has no attribute {name!r}")
    module_name, attribute, why = _MOVED[name]
    where = module_name if attribute is None else f"{module_name}.{attribute}"
    warnings.warn(f"nxdtp.{name} is deprecated and goes in the next release: use {where} ({why})",
                  DeprecationWarning, stacklevel=2)
    module = sys.modules[module_name]
    return module if attribute is None else getattr(module, attribute)
