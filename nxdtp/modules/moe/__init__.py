"""NxD's mixture-of-experts modules (``neuronx_distributed.modules.moe``): experts split over the expert-parallel
group, each expert's MLP over the tensor-parallel group."""
from .expert_mlps import ExpertMLPs
from .loss_function import load_balancing_loss_func
from .model import MoE
from .model_utils import ACT2FN
from .routing import RouterSinkhorn, RouterTopK
from .shared_experts import SharedExperts

__all__ = ["ACT2FN", "ExpertMLPs", "MoE", "RouterSinkhorn", "RouterTopK", "SharedExperts", "load_balancing_loss_func"]
