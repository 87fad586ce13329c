"""nxdtp: tensor parallelism for PyTorch with neuronx-distributed's public names.

``import nxdtp`` gives the modules an NxD user knows (``nxdtp.parallel_state``, ``nxdtp.layers``, ``nxdtp.mappings``,
``nxdtp.loss_functions``, ``nxdtp.random``, ``nxdtp.grads``, ``nxdtp.utils``) and the common names below. Model plans
(``nxdtp.models.bert``) import transformers and are loaded on demand.
"""

from .version import __version__  # noqa: F401

from . import comm, grads, layer_norm, layers, loss_functions, mappings, optimizer, optimizers, pad, parallel_state, \
    random, spec, utils  # noqa: E402,F401
from .checkpointing import load, save  # noqa: E402
from .grads import allreduce_sequence_parallel_gradients, bucket_allreduce_gradients, clip_grad_norm, get_grad_norm  # noqa: E402
from .layers import ColumnParallelLinear, LayerNorm, ParallelEmbedding, RowParallelLinear  # noqa: E402
from .loss_functions import from_parallel_logits_to_logprobs, parallel_cross_entropy  # noqa: E402
from .optimizers import Lamb  # noqa: E402
from .parallel_state import destroy_model_parallel, initialize_model_parallel, model_parallel_is_initialized  # noqa: E402
from .plan import Plan, parallelize  # noqa: E402
from .random import checkpoint, get_xla_rng_tracker, model_parallel_xla_manual_seed  # noqa: E402
from .mappings import copy_to_tensor_model_parallel_region, gather_from_tensor_model_parallel_region, \
    reduce_from_tensor_model_parallel_region, scatter_to_tensor_model_parallel_region  # noqa: E402
from .trainer import finalize_checkpoint, has_checkpoint, load_checkpoint, save_checkpoint  # noqa: E402
from .utils import copy_tensor_model_parallel_attributes, move_model_to_device, \
    set_defaults_if_not_set_tensor_model_parallel_attributes, set_tensor_model_parallel_attributes, \
    split_tensor_along_last_dim  # noqa: E402
from . import trainer  # noqa: E402
from .trainer import initialize_parallel_model, initialize_parallel_optimizer, neuronx_distributed_config  # noqa: E402

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
