"""nxdtp: tensor parallelism for PyTorch with neuronx-distributed's public names.

``import nxdtp`` gives the modules an NxD user knows (``nxdtp.parallel_state``, ``nxdtp.layers``, ``nxdtp.mappings``,
``nxdtp.loss_functions``, ``nxdtp.random``, ``nxdtp.grads``, ``nxdtp.utils``) and the common names below. Model plans
(``nxdtp.models.bert``) import transformers and are loaded on demand.
"""

from . import (
    comm,
    grads,
    layer_norm,
    layers,
    loss_functions,
    mappings,
    optimizer,  # noqa: F401
    optimizers,
    pad,
    parallel_state,
    random,
    spec,
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
from .optimizers import Lamb
from .parallel_state import destroy_model_parallel, initialize_model_parallel, model_parallel_is_initialized
from .plan import Plan, parallelize
from .random import checkpoint, get_xla_rng_tracker, model_parallel_xla_manual_seed
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
    "__version__", "comm", "grads", "layer_norm", "layers", "loss_functions", "mappings", "optimizers", "pad",
    "parallel_state", "random",
    "spec", "utils", "Lamb",
    "ColumnParallelLinear", "RowParallelLinear", "ParallelEmbedding", "LayerNorm",
    "parallel_cross_entropy", "from_parallel_logits_to_logprobs",
    "initialize_model_parallel", "destroy_model_parallel", "model_parallel_is_initialized",
    "get_grad_norm", "clip_grad_norm", "bucket_allreduce_gradients", "allreduce_sequence_parallel_gradients",
    "model_parallel_xla_manual_seed", "get_xla_rng_tracker", "checkpoint", "move_model_to_device",
    "Plan", "parallelize", "save", "load",
    "copy_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region", "scatter_to_tensor_model_parallel_region",
    "copy_tensor_model_parallel_attributes", "set_tensor_model_parallel_attributes", "split_tensor_along_last_dim",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "trainer", "neuronx_distributed_config", "initialize_parallel_model", "initialize_parallel_optimizer",
    "save_checkpoint", "load_checkpoint", "has_checkpoint", "finalize_checkpoint",
]
