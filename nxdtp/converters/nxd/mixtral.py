"""Import a Mixtral checkpoint written by NxD into a dense HF ``MixtralForCausalLM`` directory: ``llama.Planner`` with
NxD's MoE for each layer's MLP, experts held transposed and split over TP and, with expert parallelism, over the EP
ranks' files (docs/checkpoints.md, "Mixtral")."""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ...models.moe import NAME as MOE_FAMILY
from ...spec import ParamSpec
from .llama import LAYER, Laid, Planner, load_decoder_config
from .reader import (
    AUTO,
    ExpertPieces,
    NxdCheckpointError,
    NxdSource,
    RankFiles,
    RankShard,
    check_pieces,
    check_saved_ep,
    import_checkpoint,
    open_expert_shards,
)

_CLASSES = {"mixtral": ("MixtralConfig", "MixtralForCausalLM")}
MODEL_TYPES = tuple(_CLASSES)

# NxD's keys of a layer's MoE (after "model.layers.N.") and the HF keys they become.
ROUTER = "mlp.router.linear_router.weight"
GATE_UP = "mlp.expert_mlps.mlp_op.gate_up_proj.weight"
DOWN = "mlp.expert_mlps.mlp_op.down_proj.weight"
HF_ROUTER, HF_GATE_UP, HF_DOWN = "mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
# HF holds an expert's matrix as (out, in), NxD's ExpertFused*ParallelLinear as (in, out): dims 1 and 2 swap.
EXPERT_SWAP = (1, 2)


def is_expert(key: str) -> bool:
    """Whether NxD splits ``key`` over the expert-parallel ranks (what its trainer marks ``expert_model_parallel``)."""
    return ".mlp.expert_mlps." in key


class _Planner(Planner):
    """Checks an NxD Mixtral checkpoint against the config and says how to build each dense tensor: the Llama
    planner, with the MoE for the MLP. ``ranks[t][e]`` is the file of TP rank t and EP rank e."""

    MODEL = "NxD's Mixtral model"

    def __init__(self, config, model_class, ranks: Sequence[Sequence[RankShard]], files: RankFiles, progress: bool):
        super().__init__(config, model_class, [row[0] for row in ranks], files, progress)
        self.ranks, self.ep, self.experts = ranks, len(ranks[0]), config.num_local_experts
        # A reader per TP rank of its piece of each expert tensor, every expert in it (from its EP ranks' files).
        self.pieces = [ExpertPieces(row) for row in ranks]
        self.handles = {f"{row[0].path} (TP rank {t}, experts of {len(row)} EP rank(s))": pieces
                        for t, (row, pieces) in enumerate(zip(ranks, self.pieces))}

    def plan(self, dtype: Optional[torch.dtype]) -> NxdSource:
        first = LAYER.format(0) + GATE_UP
        if first in self.keys and self.shards[0].get(first).dim() == 3:
            check_saved_ep(self.files, self.shards[0], first, self.experts)
        if self.experts % self.ep:
            raise NxdCheckpointError(
                f"{self.files.directory}: the config's num_local_experts={self.experts} cannot be split over the "
                f"{self.ep} expert-parallel ranks whose files are present ({self.files.entry_name(0, self.ep - 1)} is "
                f"the last), so NxD cannot have written this checkpoint: it gives each EP rank num_local_experts / ep "
                f"consecutive experts; check num_local_experts, or whether files of further EP ranks are missing")
        return super().plan(dtype)

    def _mlp(self, layer: str) -> None:
        if layer + "mlp.gate_up_proj.weight" in self.keys:
            raise NxdCheckpointError(
                f"{self.shards[0].path}: '{layer}mlp.gate_up_proj.weight' is a dense MLP (NxD's Mixtral model with "
                "moe_frequency > 1), which HF's MixtralForCausalLM has no place for: every layer must be a mixture "
                "of experts (moe_frequency 1)")
        if layer + ROUTER in self.keys:
            self._replicated(layer + ROUTER, layer + HF_ROUTER)
        hidden, intermediate = self.hidden, self.shapes[layer + HF_DOWN][2]
        local, part = self.experts // self.ep, intermediate // self.tp
        per_rank = f"{local} of the {self.experts} experts per EP rank, each"
        self._experts(layer, GATE_UP, HF_GATE_UP, 2, 2, f"{per_rank} {hidden} hidden rows by this TP rank's {part} "
                      f"gate columns, then its {part} up columns, of intermediate_size {intermediate}")
        self._experts(layer, DOWN, HF_DOWN, 1, 1, f"{per_rank} this TP rank's {part} rows of intermediate_size "
                      f"{intermediate} by {hidden} hidden columns")

    def _experts(self, layer: str, name: str, hf_name: str, dim: int, stride: int, how: str) -> None:
        """NxD's expert tensor ``name`` (the HF tensor ``hf_name`` with dims 1 and 2 swapped), split along ``dim`` over
        the TP ranks with ``stride`` and into consecutive experts over the EP ranks."""
        key, hf_key = layer + name, layer + hf_name
        if key not in self.keys:
            return  # the HF key is then reported missing
        experts, rows, columns = self.shapes[hf_key]
        full = (experts, columns, rows)
        if full[dim] % (self.tp * stride):
            raise NxdCheckpointError(f"'{key}': intermediate_size {full[dim] // stride} cannot be split over "
                                     f"{self.tp} TP ranks, so NxD cannot have written it at this degree")
        spec = ParamSpec(full_shape=full, partition_dim=dim, num_partitions=self.tp, stride=stride,
                         expert_partitions=self.ep)
        dtype = check_pieces([shard for row in self.ranks for shard in row], key, spec, how)
        for pieces in self.pieces:
            pieces.specs[key] = spec
        self.producers[hf_key] = (dtype, Laid(key, spec.with_all_experts(), handles=list(self.handles),
                                              swap=EXPERT_SWAP))
        self.consumed.add(key)

    @staticmethod
    def _nxd_name(key: str) -> str:
        layer = key[:key.index(".mlp.") + 1] if ".mlp." in key else ""
        for nxd, hf in ((ROUTER, HF_ROUTER), (GATE_UP, HF_GATE_UP), (DOWN, HF_DOWN)):
            if key == layer + hf:
                return f"NxD stores it as '{layer + nxd}'"
        return Planner._nxd_name(key)


def merge_nxd_checkpoint(checkpoint_dir: str, config_json, output_dir: str, force: bool = False,
                         progress: bool = True, model_key: Optional[str] = AUTO, dtype: Optional[torch.dtype] = None,
                         tag: Optional[str] = None, verify_checksums: bool = True) -> str:
    """Merge an NxD Mixtral checkpoint (any TP and EP degree) into a dense HF directory, checked before anything is
    written, atomically; return ``output_dir`` (arguments: docs/api.md)."""
    config, model_class = load_decoder_config(config_json, _CLASSES, MOE_FAMILY, __name__)

    def layout(shards: List[RankShard], files: RankFiles, dtype: Optional[torch.dtype]) -> NxdSource:
        ranks = open_expert_shards(files, shards, model_key, progress, verify_checksums, is_expert)
        return _Planner(config, model_class, ranks, files, progress).plan(dtype)

    return import_checkpoint(checkpoint_dir, output_dir, config, model_class.__name__, layout, force=force,
                             progress=progress, model_key=model_key, tag=tag, dtype=dtype,
                             verify_checksums=verify_checksums, reads_experts=True)
