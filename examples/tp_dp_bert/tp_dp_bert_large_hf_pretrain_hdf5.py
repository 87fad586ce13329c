"""BERT pretraining (MLM + NSP) with tensor parallelism × data parallelism, on wikicorpus-format HDF5 shards.

The flags are those of neuronx-distributed's ``tp_dp_bert_large_hf_pretrain_hdf5.py``, so its tutorial's command works:

    torchrun --nproc_per_node=32 tp_dp_bert_large_hf_pretrain_hdf5.py --tensor_parallel_size 8 \\
        --steps_this_run 10 --batch_size 64 --grad_accum_usteps 64

The device is picked automatically (an XLA accelerator, else CUDA with NCCL, else CPU with gloo); see docs/tutorial.md.
Every rank of a TP group reads the same batches; the data-parallel (DP) ranks split each shard. Gradients are averaged
over the DP group only, and the loss of every micro-batch is normalised by the masked-token and sentence counts of the
whole global batch (all DP ranks, all accumulation micro-steps), so a TP × DP run computes what the dense model would
on the global batch.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The helpers the examples share (device and world, reporting, rank failures): examples/common.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "common"))

import pretraining_data  # noqa: E402
import rank_failure  # noqa: E402
import runtime as runtime_lib  # noqa: E402
from master_weights import MasterWeights  # noqa: E402
from training_log import MetricsFile, Throughput, TrainingLog  # noqa: E402

from nxdtp import checkpointing, comm, grads, move_model_to_device, parallel_state  # noqa: E402
from nxdtp.models import vocab_parallel_logits  # noqa: E402
from nxdtp.models.bert import attention_bias  # noqa: E402
from nxdtp.optimizer import (
    Lamb,  # noqa: E402
    NeuronZero1Optimizer,  # noqa: E402
)
from nxdtp.random import model_parallel_xla_manual_seed  # noqa: E402


class NonFiniteStepError(FloatingPointError):
    """A step's loss or pre-clip gradient norm is inf or NaN. Every rank raises it at the same step (the loss is
    all-reduced over DP, the norm over TP after the DP all-reduce), before that step's weights are saved."""

class WorldSizeError(ValueError):
    """--tensor_parallel_size does not fit the world torchrun started."""


# Errors whose message names the file or value and what is wrong: the user gets that line and a non-zero exit, not a
# traceback from inside the script.
INPUT_ERRORS = (WorldSizeError, pretraining_data.DataError, checkpointing.CheckpointIntegrityError,
                checkpointing.CheckpointLockedError, NonFiniteStepError)

# NxD's --debug model: the smallest BERT that still has every part.
DEBUG_MODEL = dict(num_hidden_layers=1, num_attention_heads=2, hidden_size=16, intermediate_size=64)


# ---- flags -----------------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # neuronx-distributed's flags, with its defaults.
    p.add_argument("--data_dir", default="~/examples_datasets/bert_pretrain_wikicorpus_tokenized_hdf5_seqlen128/",
                   help="directory of *_training_*.hdf5 shards (build_pretraining_data.py writes them)")
    p.add_argument("--output_dir", default="./output", help="checkpoints, logs and TensorBoard events")
    p.add_argument("--metrics_file", default="results.json", help="NxD-format JSON metrics file")
    p.add_argument("--optimizer", default="AdamW", type=_optimizer_name, help="AdamW or LAMB")
    p.add_argument("--batch_size", type=int, default=8, help="micro-batch size per data-parallel rank")
    p.add_argument("--max_steps", type=int, default=28125, help="optimizer steps of the whole schedule")
    p.add_argument("--steps_this_run", type=int, default=128,
                   help="stop when the global step reaches this value (-1: run to --max_steps)")
    p.add_argument("--shards_per_ckpt", type=int, default=1,
                   help="save a checkpoint each time this many data shards are finished (0: only at the end)")
    p.add_argument("--seed", type=int, default=12349, help="model initialisation, data order and dropout")
    p.add_argument("--lr", type=float, default=4e-4, help="peak learning rate")
    p.add_argument("--seq_len", type=int, default=None, help="must match the data's sequence length if given")
    p.add_argument("--debug", action="store_true", help=f"use a tiny model ({DEBUG_MODEL})")
    p.add_argument("--max_pred_len", type=int, default=20, help="masked positions per sequence in the data")
    p.add_argument("--warmup_steps", type=int, default=2000,
                   help="optimizer steps of linear warmup from 0 to --lr; then linear decay to 0 at --max_steps")
    p.add_argument("--grad_accum_usteps", type=int, default=64, help="micro-batches per optimizer step")
    p.add_argument("--enable_pt_autocast", action="store_true", help="torch.autocast to bf16 (weights stay fp32)")
    p.add_argument("--print_grad_norm", action="store_true", help="append the pre-clip grad norm to each LOG line")
    p.add_argument("--minimal_ckpt", action="store_true", help="save the model only, no optimizer or scheduler")
    p.add_argument("--test_checkpointing", action="store_true",
                   help="after the final save, load it back into a fresh model and check every tensor")
    p.add_argument("--resume_ckpt", action="store_true", help="resume from a checkpoint (see --resume_ckpt_path)")
    p.add_argument("--resume_ckpt_path", default=None,
                   help="checkpoint directory to resume from; None means --output_dir")
    p.add_argument("--resume_step", type=int, default=-1, help="resume from this step's tag (default: the newest)")
    p.add_argument("--tensor_parallel_size", type=int, default=2,
                   help="ranks per tensor-parallel group (contiguous); the world size must be a multiple of it")
    # NxD's flags of its Llama script (tp_zero1_llama_hf_pretrain.py).
    p.add_argument("--use_zero_1", action="store_true",
                   help="ZeRO-1: shard the optimizer state and fp32 master weights over the DP group "
                        "(nxdtp.optimizer.NeuronZero1Optimizer over --optimizer)")
    p.add_argument("--use_mix_precision", action="store_true",
                   help="with --use_zero_1: bf16 weights and compute, fp32 master shards in the ZeRO-1 optimizer, "
                        "gradients accumulated in fp32")
    # nxdtp's flags.
    p.add_argument("--sequence_parallel", action="store_true", help="Megatron sequence parallelism inside TP groups")
    p.add_argument("--activation_checkpointing", action="store_true",
                   help="recompute each encoder layer in backward (RNG-tracker aware)")
    p.add_argument("--bf16", action="store_true", help="bf16 weights and compute, fp32 master weights and loss")
    p.add_argument("--model_config", default=None,
                   help="local Hugging Face config directory (or config.json); default: BERT-large, uncased vocab")
    p.add_argument("--init_from", default=None,
                   help="start from the weights of a local Hugging Face BERT directory (config.json and "
                        "model.safetensors or pytorch_model.bin); each rank reads only its slices. Its config is "
                        "the model's unless --model_config is given. Not read when resuming.")
    p.add_argument("--dropout", type=float, default=None,
                   help="override hidden and attention dropout (0 makes runs comparable step by step)")
    p.add_argument("--make_vocab_size_divisible_by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this times --tensor_parallel_size (Megatron's default; "
                        "odd shard widths make the MLM head's matrix multiplies slower). Merging strips the padding.")
    p.add_argument("--max_grad_norm", type=float, default=1.0,
                   help="clip the global (TP-aware) gradient norm to this")
    p.add_argument("--save_every_steps", type=int, default=0, help="also save every N optimizer steps (0: off)")
    p.add_argument("--keep_last_ckpts", type=int, default=None, help="keep only the newest N checkpoints")
    p.add_argument("--device", default="auto", choices=runtime_lib.DEVICE_CHOICES,
                   help="auto: an XLA accelerator if present, else CUDA, else CPU; xla on a CPU-only machine is "
                        "XLA:CPU")
    p.add_argument("--ddp", action="store_true",
                   help="average gradients with torch DistributedDataParallel over the DP group instead of nxdtp's "
                        "bucketed all-reduce (CPU/CUDA)")
    p.add_argument("--collective_timeout_s", type=_collective_timeout,
                   default=os.environ.get(runtime_lib.COLLECTIVE_TIMEOUT_ENV,
                                          str(runtime_lib.DEFAULT_COLLECTIVE_TIMEOUT_S)),
                   help="seconds a rank waits in a collective for its peers before it fails, and with it the job; "
                        f"the default comes from ${runtime_lib.COLLECTIVE_TIMEOUT_ENV} when set "
                        "(see docs/troubleshooting.md)")
    return p


def _collective_timeout(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r} (from the flag or ${runtime_lib.COLLECTIVE_TIMEOUT_ENV}) is not a "
                                         "positive, finite number of seconds")
    return seconds


def _optimizer_name(value: str) -> str:
    if value.lower() not in ("adamw", "lamb"):
        raise argparse.ArgumentTypeError(f"--optimizer {value!r} is not supported: use AdamW or LAMB")
    return value.lower()


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps_this_run < 0:
        args.steps_this_run = args.max_steps
    for name in ("batch_size", "max_steps", "grad_accum_usteps", "tensor_parallel_size", "max_pred_len",
                 "make_vocab_size_divisible_by"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)} must be >= 1")
    for name in ("warmup_steps", "shards_per_ckpt", "save_every_steps"):
        if getattr(args, name) < 0:
            parser.error(f"--{name} {getattr(args, name)} must be >= 0")
    if args.warmup_steps > args.max_steps:
        parser.error(f"--warmup_steps {args.warmup_steps} exceeds --max_steps {args.max_steps}")
    if args.bf16 and args.enable_pt_autocast:
        parser.error("--bf16 and --enable_pt_autocast are alternatives: bf16 weights, or fp32 weights with autocast")
    if args.use_mix_precision and not args.use_zero_1:
        parser.error("--use_mix_precision gives bf16 weights over the fp32 master shards of --use_zero_1; without "
                     "ZeRO-1 use --bf16 (bf16 weights over a whole fp32 master copy)")
    if args.use_zero_1 and args.bf16:
        parser.error("--use_zero_1 shards the fp32 master weights itself: use --use_mix_precision with it, not --bf16 "
                     "(which would keep a whole fp32 master copy on every rank besides the shards)")
    if args.use_zero_1 and args.ddp:
        parser.error("--use_zero_1 reduce-scatters the gradients over the DP group itself; --ddp would all-reduce "
                     "them too, so use one or the other")
    if args.use_mix_precision and args.enable_pt_autocast:
        parser.error("--use_mix_precision and --enable_pt_autocast are alternatives: bf16 weights, or fp32 weights "
                     "with autocast")
    if args.dropout is not None and not 0 <= args.dropout < 1:
        parser.error(f"--dropout {args.dropout} must be in [0, 1)")
    if args.init_from is not None and args.debug:
        parser.error("--init_from loads a model's weights; --debug would change its shapes")
    if args.resume_ckpt_path and not args.resume_ckpt:
        args.resume_ckpt = True
    if args.enable_pt_autocast:
        os.environ.setdefault("NEURON_RT_STOCHASTIC_ROUNDING_EN", "1")  # as NxD does: bf16 rounding on Trainium
    if args.ddp and args.bf16:
        parser.error("--ddp averages the model's own gradients; with --bf16 they are reduced on the fp32 master "
                     "copy instead, so use one or the other")
    world_size = os.environ.get("WORLD_SIZE", "")  # set by torchrun; an XLA launch counts its devices later
    if world_size.isdigit() and int(world_size) % args.tensor_parallel_size:
        parser.error(f"--tensor_parallel_size {args.tensor_parallel_size} does not divide the world size "
                     f"{world_size} (torchrun's WORLD_SIZE)")
    try:
        load_config(args)  # a damaged or mistyped config is a usage error, before any process group starts
    except (OSError, ValueError) as error:
        parser.error(str(error))
    return args


# ---- model and optimizer ---------------------------------------------------------------------------------------------

def load_config(args: argparse.Namespace):
    """The model's BertConfig: --model_config (a directory or a JSON file), else --init_from's, else BERT-large.
    Damage is a PretrainedDirectoryError naming the file (nxdtp.models.hf_loading.read_config: bad JSON, a value of
    the wrong type, a key BertConfig does not know that looks like a misspelling of one it does)."""
    from transformers import BertConfig

    from nxdtp.models.hf_loading import read_config

    if args.model_config is None and args.init_from is not None:
        if not os.path.isfile(os.path.join(args.init_from, "config.json")):
            raise FileNotFoundError(f"--init_from {args.init_from}: no config.json there (give a Hugging Face model "
                                    "directory)")
        config = read_config(args.init_from, BertConfig)
    elif args.model_config is None:
        # BERT-large uncased, written out so that no hub access is needed.
        config = BertConfig(vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                            intermediate_size=4096, max_position_embeddings=512, type_vocab_size=2)
    else:
        path = args.model_config
        file = path if os.path.isfile(path) else os.path.join(path, "config.json")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"--model_config {path}: no config.json there (give a Hugging Face config "
                                    "directory or a config JSON file)")
        config = read_config(file, BertConfig)
    if args.debug:
        for key, value in DEBUG_MODEL.items():
            setattr(config, key, value)
    if args.dropout is not None:
        config.hidden_dropout_prob = config.attention_probs_dropout_prob = args.dropout
    return config


def build_model(args: argparse.Namespace, config, device: torch.device, pretrained: bool = False):
    """The sharded model, built and sharded on the host on every device, then moved: ``pretrained`` reads the
    --init_from weights (each rank its slices), otherwise every rank builds the dense model from the same seed and
    keeps its slices, so TP equals dense at step 0."""
    from transformers import BertForPreTraining

    from nxdtp.models import checkpoint_layers, from_pretrained_sharded, parallelize_model

    torch.manual_seed(args.seed)
    if pretrained:
        model = from_pretrained_sharded(args.init_from, model_class=BertForPreTraining, config=config,
                                        sequence_parallel=args.sequence_parallel,
                                        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    else:
        model = BertForPreTraining(config)
        parallelize_model(model, sequence_parallel=args.sequence_parallel,
                          make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    if args.activation_checkpointing:
        checkpoint_layers(model)
    move_model_to_device(model, device)
    if args.use_mix_precision:
        model.to(torch.bfloat16)  # the fp32 master shards are made from these values by the ZeRO-1 optimizer
    model.train()
    return model


def parameter_groups(model: torch.nn.Module, weight_decay: float = 0.01) -> List[Dict[str, Any]]:
    # As in NxD's example: no weight decay on biases and LayerNorm weights.
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if name.endswith("bias") or "LayerNorm" in name else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(args: argparse.Namespace, model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    groups = parameter_groups(model)
    if args.optimizer == "lamb":
        optimizer_class, options = Lamb, dict(lr=args.lr, trust_clip=True)
    else:
        # The fused kernel exists for CPU and CUDA (about 6x faster than the per-tensor loop on CPU); XLA traces the
        # loop.
        optimizer_class, options = torch.optim.AdamW, dict(lr=args.lr, eps=1e-6, fused=device.type in ("cpu", "cuda"))
    if not args.use_zero_1:
        return optimizer_class(groups, **options)
    # ZeRO-1 over the same optimizer: it averages the gradients over DP (reduce-scatter), clips at --max_grad_norm by
    # the global pre-clip norm (kept in optimizer.grad_norm), steps its fp32 shards and all-gathers the parameters.
    # With --use_mix_precision the bf16 gradients of the micro-batches accumulate in fp32 (use_grad_acc_hook).
    return NeuronZero1Optimizer(groups, optimizer_class, optimizer_dtype=torch.float32, grad_clipping=True,
                                max_norm=args.max_grad_norm, use_grad_acc_hook=args.use_mix_precision, **options)


class LinearWarmupDecay:
    """Learning rate rising linearly to the peak over ``warmup_steps``, then falling linearly to 0 at ``max_steps``."""

    def __init__(self, optimizer: torch.optim.Optimizer, peak_lr: float, warmup_steps: int, max_steps: int):
        self.optimizer, self.peak_lr = optimizer, peak_lr
        self.warmup_steps, self.max_steps = warmup_steps, max_steps
        self.step_count = 0
        self._apply()

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.peak_lr * step / self.warmup_steps
        return self.peak_lr * max(0.0, (self.max_steps - step) / max(1, self.max_steps - self.warmup_steps))

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step_count)

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    def state_dict(self) -> Dict[str, Any]:
        return {"step_count": self.step_count, "peak_lr": self.peak_lr, "warmup_steps": self.warmup_steps,
                "max_steps": self.max_steps}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.step_count = int(state["step_count"])
        self._apply()


# ---- the training step -----------------------------------------------------------------------------------------------

class Trainer:
    def __init__(self, args: argparse.Namespace, rt: runtime_lib.Runtime):
        self.args, self.rt = args, rt
        self.dp_group = parallel_state.data_parallel_group()
        self.config = load_config(args)
        # A resumed run loads every weight from its checkpoint: reading --init_from too would be wasted.
        self.model = build_model(args, self.config, rt.device,
                                 pretrained=args.init_from is not None and not args.resume_ckpt)
        self.master = MasterWeights(self.model) if args.bf16 else None
        # With --bf16 the optimizer, clipping and checkpoints work on the fp32 master model.
        self.weights = self.master.master if self.master else self.model
        self.compute_dtype = torch.bfloat16 if args.bf16 or args.use_mix_precision else torch.float32
        self.optimizer = build_optimizer(args, self.weights, rt.device)
        self.ddp = None
        if args.ddp:
            if rt.is_xla:
                raise ValueError("--ddp is for CPU and CUDA runs; on XLA the DP average is nxdtp's all-reduce")
            # DDP divides by its group's size: over the DP group that is exactly nxdtp's DP average.
            self.ddp = torch.nn.parallel.DistributedDataParallel(
                self.model, process_group=self.dp_group.process_group_for(rt.device.type),
                device_ids=[rt.device.index] if rt.kind == "cuda" else None)
        self.scheduler = LinearWarmupDecay(self.optimizer, args.lr, args.warmup_steps, args.max_steps)
        self.global_step = 0
        self.consumed_sequences = 0     # global (all DP ranks), for resuming the data where it stopped
        self.saved_step: Optional[int] = None

    # Counting both denominators over the whole global batch before any backward is what makes every micro-batch's
    # loss a term of the global mean: the DP average of the gradients is then the dense gradient.
    def _global_counts(self, micro_batches: List[List[torch.Tensor]]):
        local = torch.stack([sum((b[3] != -100).sum() for b in micro_batches).float(),
                             torch.tensor(float(sum(b[4].numel() for b in micro_batches)), device=self.rt.device)])
        total = comm.all_reduce(local, self.dp_group, op="sum")
        return total[0], total[1]

    def train_step(self, micro_batches: List[List[torch.Tensor]]):
        """One optimizer step over ``grad_accum_usteps`` micro-batches; returns (loss, pre-clip grad norm) tensors."""
        mlm_count, nsp_count = self._global_counts(micro_batches)
        step_loss = torch.zeros((), device=self.rt.device)
        for i, (input_ids, segment_ids, input_mask, masked_lm_labels, next_sentence_labels) in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            # DDP all-reduces in the backward of the last micro-batch only.
            syncing = self.ddp.no_sync() if self.ddp is not None and not last else contextlib.nullcontext()
            with syncing:
                # Only the loss is read: the MLM logits stay vocab-parallel. Autocast covers the forward only, as
                # PyTorch recommends.
                with self.rt.autocast(self.args.enable_pt_autocast), vocab_parallel_logits(self.model):
                    outputs = (self.ddp or self.model)(
                        input_ids=input_ids, attention_mask=attention_bias(input_mask, self.compute_dtype),
                        token_type_ids=segment_ids,
                        labels=masked_lm_labels, next_sentence_label=next_sentence_labels,
                        mlm_denominator=mlm_count, nsp_denominator=nsp_count)
                loss = outputs.loss.float()
                loss.backward()
            if self.master is not None:
                self.master.gradients_to_master()  # accumulate in fp32, micro-batch by micro-batch
            step_loss = step_loss + loss.detach()
        if self.args.sequence_parallel:
            # NxD's call, kept: parallelize_model's BERT sums these gradients inside backward already, and the call
            # skips parameters marked so (grad_allreduced_in_backward).
            grads.allreduce_sequence_parallel_gradients(self.weights)
        if self.args.use_zero_1:
            self.optimizer.step()  # reduce-scatter over DP, clip, step the shards, all-gather the parameters
            grad_norm = self.optimizer.grad_norm
            self.optimizer.zero_grad(set_to_none=True)
        else:
            if self.ddp is None:
                grads.allreduce_gradients(self.weights)
            grad_norm = grads.clip_grad_norm(self.weights.parameters(), self.args.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self.master is not None:
            self.master.master_to_model()
        self.scheduler.step()
        # Each rank's loss is its share of the global mean, scaled by the DP size (see the loss wrapper).
        step_loss = comm.all_reduce(step_loss, self.dp_group, op="sum") / self.dp_group.size
        return step_loss, grad_norm

    # ---- checkpoints -------------------------------------------------------------------------------------------------

    def checkpoint_dict(self, epoch: int) -> Dict[str, Any]:
        state: Dict[str, Any] = {"model": self.weights, "global_step": self.global_step, "epoch": epoch,
                                 "consumed_sequences": self.consumed_sequences,
                                 "batch_size": self.args.batch_size, "data_parallel_size": self.dp_group.size,
                                 "grad_accum_usteps": self.args.grad_accum_usteps, "bf16": self.args.bf16,
                                 "use_zero_1": self.args.use_zero_1, "use_mix_precision": self.args.use_mix_precision}
        if not self.args.minimal_ckpt:
            state["optimizer"] = self.optimizer
            state["scheduler"] = self.scheduler
        return state

    def save(self, epoch: int) -> str:
        if self.saved_step == self.global_step:
            return os.path.join(self.args.output_dir, checkpointing.tags.tag_for_step(self.global_step))
        tag_dir = checkpointing.save(self.checkpoint_dict(epoch), self.args.output_dir,
                                     keep_last=self.args.keep_last_ckpts)
        self.saved_step = self.global_step
        if self.rt.is_root:
            print(f"saved checkpoint {tag_dir}", flush=True)
        return tag_dir

    def resume(self) -> None:
        args = self.args
        directory = args.resume_ckpt_path or args.output_dir
        tag = checkpointing.tags.tag_for_step(args.resume_step) if args.resume_step >= 0 else None
        tag_dir = checkpointing.resolve_tag(directory, tag)
        minimal = checkpointing.CheckpointIndex.read(tag_dir).optimizer is None
        state = checkpointing.load(directory, model=self.weights, tag=tag,
                                   optimizer=None if minimal else self.optimizer,
                                   scheduler=None if minimal else self.scheduler)
        same_layout = state.get("data_parallel_size") == self.dp_group.size
        rng_files = os.path.join(tag_dir, "rng")
        if same_layout and os.path.isdir(rng_files) and len(os.listdir(rng_files)) == self.rt.world_size:
            checkpointing.restore_rng(tag_dir, self.rt.rank)
        elif self.rt.is_root:
            # A resharded checkpoint or another DP size has no RNG state for this rank: dropout restarts from the
            # seed, so the run continues correctly but not bit for bit.
            print(f"note: {tag_dir} has no RNG state for this layout (world {self.rt.world_size}); dropout continues "
                  f"from --seed {args.seed}", flush=True)
        if self.master is not None:
            self.master.master_to_model()
        if minimal and self.args.use_zero_1:
            # No optimizer state: the master shards, made from the weights before the load, are made again from the
            # loaded ones.
            self.optimizer.init_zero()
        self.global_step = int(state["global_step"])
        self.consumed_sequences = int(state.get("consumed_sequences", 0))
        if os.path.abspath(directory) == os.path.abspath(args.output_dir):
            self.saved_step = self.global_step  # this step's tag is the one just loaded: never written again
            newer = [t for t in checkpointing.list_tags(directory)
                     if (checkpointing.tags.step_of(t) or -1) > self.global_step]
            if newer:
                raise ValueError(f"resuming {directory} at step {self.global_step}, but it already holds the newer "
                                 f"checkpoint(s) {newer}, which this run would collide with: resume into a new "
                                 f"--output_dir with --resume_ckpt_path {directory} (and --resume_step)")
        if minimal:
            self.scheduler.load_state_dict({"step_count": self.global_step})
        if self.rt.is_root:
            print(f"resumed from {directory} at step {self.global_step}"
                  + (" (model only: optimizer state starts fresh)" if minimal else ""), flush=True)

    def verify_checkpoint(self, tag_dir: str) -> None:
        """--test_checkpointing: a fresh model loaded from the checkpoint must equal the trained one, tensor by
        tensor."""
        fresh = build_model(self.args, self.config, self.rt.device)
        checkpointing.load(self.args.output_dir, model=fresh, tag=os.path.basename(tag_dir))
        trained = self.weights.state_dict()
        for name, tensor in fresh.state_dict().items():
            if isinstance(tensor, torch.Tensor) and not torch.equal(tensor.cpu(), trained[name].cpu().to(tensor.dtype)):
                raise RuntimeError(f"--test_checkpointing: {name} differs after loading {tag_dir}")
        if self.rt.is_root:
            print(f"checkpoint {tag_dir} verified: every tensor reloads exactly", flush=True)


# ---- the run ---------------------------------------------------------------------------------------------------------

def _batches_to_skip(trainer: Trainer) -> int:
    """The micro-batch count to skip so that a resumed run reads the data where the saved run stopped."""
    per_rank_batch = trainer.args.batch_size
    skip, remainder = divmod(trainer.consumed_sequences, per_rank_batch * trainer.dp_group.size)
    if remainder and trainer.rt.is_root:
        print(f"warning: the checkpoint consumed {trainer.consumed_sequences} sequences, not a multiple of this run's "
              f"global micro-batch {per_rank_batch * trainer.dp_group.size}; the data resumes at the batch boundary "
              "before it", flush=True)
    return skip


def run(args: argparse.Namespace, spawned_by_xla: bool = False) -> Dict[str, Any]:
    timeout = datetime.timedelta(seconds=args.collective_timeout_s)
    rt = runtime_lib.start(args.device, timeout, spawned_by_xla=spawned_by_xla)
    # A multi-rank run that started the world ends its process when this rank fails, so no peer waits for it (see
    # rank_failure.py); inside a caller's world (a test pool, a notebook) the error is the caller's to handle.
    failures = rank_failure.RankFailures(rt.rank, rt.world_size) if rt.owns_world and rt.world_size > 1 else None
    try:
        try:
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tensor_parallel_size,
                                                     timeout=timeout)
        except ValueError as error:
            raise WorldSizeError(f"--tensor_parallel_size {args.tensor_parallel_size}: {error}") from None
        summary = _train(args, rt, failures)
    except BaseException as error:
        # A non-finite step stops every rank at the same step: an orderly end, the groups can be released.
        if failures is not None and not isinstance(error, NonFiniteStepError):
            failures.exit(error, with_traceback=not isinstance(error, INPUT_ERRORS))
        _leave_world(rt, failures)
        raise
    _leave_world(rt, failures)
    return summary


def _leave_world(rt: runtime_lib.Runtime, failures: Optional[rank_failure.RankFailures]) -> None:
    parallel_state.destroy_model_parallel()
    runtime_lib.stop(rt)
    if failures is not None:
        failures.close()


def _train(args: argparse.Namespace, rt: runtime_lib.Runtime,
           failures: Optional[rank_failure.RankFailures] = None) -> Dict[str, Any]:
    dp_group = parallel_state.data_parallel_group()
    files = pretraining_data.list_training_shards(args.data_dir, dp_group.size)
    trainer = Trainer(args, rt)
    # After the model is built (which seeds and draws itself): dropout starts from the seed on every layout.
    model_parallel_xla_manual_seed(args.seed)
    if args.resume_ckpt:
        trainer.resume()

    sequences_per_step = args.batch_size * dp_group.size * args.grad_accum_usteps
    consumed_batches = _batches_to_skip(trainer)
    batches = pretraining_data.PretrainingBatches(
        files, args.batch_size, args.max_pred_len, dp_group.size, dp_group.rank, args.seed, seq_len=args.seq_len,
        vocab_size=trainer.config.vocab_size, skip_batches=consumed_batches,
        log=(lambda line: print(line, flush=True)) if rt.is_root else None)
    device_batches = rt.device_batches(batches)

    log = metrics = None
    if rt.is_root:
        os.makedirs(args.output_dir, exist_ok=True)
        log = TrainingLog(args.output_dir, args.print_grad_norm,
                          f"tblogs_{time.strftime('%m%d%y_%H%M')}_{args.optimizer}_tp{args.tensor_parallel_size}"
                          f"_dp{dp_group.size}_lr{args.lr}_bs{args.batch_size}_acc{args.grad_accum_usteps}")
        metrics = MetricsFile(args.metrics_file)
        metrics.store_parameters(_run_parameters(args, trainer, rt, dp_group.size))
        print(f"training on {rt.kind} ({rt.device}): world {rt.world_size} = tensor parallel "
              f"{args.tensor_parallel_size} x data parallel {dp_group.size}; {len(files)} shard(s) in {args.data_dir}",
              flush=True)

    throughput = Throughput(sequences_per_step)
    shards_done = 0
    epoch = batches.epoch_at(consumed_batches)
    shard = batches.position_at(consumed_batches)
    start_time = time.time()
    final_loss = None

    def report(step: int, epoch_now: int, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float) -> None:
        nonlocal final_loss
        loss_value, norm_value = loss.item(), grad_norm.item()
        finite = math.isfinite(loss_value) and math.isfinite(norm_value)
        if finite:
            final_loss = loss_value
        if log is not None:  # the LOG line of the bad step too (with its grad-norm), then the reason for stopping
            log.step(epoch_now, step, loss_value, lr, throughput.tick(), norm_value, rt.graph_counters())
        if not finite:
            last = "none" if trainer.saved_step is None else f"step {trainer.saved_step}"
            message = (f"step {step}: non-finite step_loss : {loss_value} grad-norm : {norm_value}; stopping without "
                       f"saving step {step} (last checkpoint: {last}); lower --lr, or check the data")
            if log is not None:
                print(f"LOG {time.asctime()} - ({epoch_now}, {step}) ERROR {message}", flush=True)
            raise NonFiniteStepError(message)

    while trainer.global_step < args.steps_this_run and trainer.global_step < args.max_steps:
        if failures is not None:
            failures.stage = f"step {trainer.global_step + 1}"
        rank_failure.inject_fault_if_requested(rt.rank, trainer.global_step + 1)
        micro_batches = [next(device_batches) for _ in range(args.grad_accum_usteps)]
        lr = trainer.optimizer.param_groups[0]["lr"]
        loss, grad_norm = trainer.train_step(micro_batches)
        trainer.global_step += 1
        trainer.consumed_sequences += sequences_per_step
        epoch = batches.epoch_at(consumed_batches + args.grad_accum_usteps - 1)  # of this step's last batch
        consumed_batches += args.grad_accum_usteps
        rt.after_step(report, trainer.global_step, epoch, loss, grad_norm, lr)
        rt.end_step()
        if args.save_every_steps and trainer.global_step % args.save_every_steps == 0:
            trainer.save(epoch)
        if batches.position_at(consumed_batches) != shard:
            shard = batches.position_at(consumed_batches)
            shards_done += 1
            if args.shards_per_ckpt and shards_done % args.shards_per_ckpt == 0:
                trainer.save(epoch)

    if failures is not None:
        failures.stage = f"the final save after step {trainer.global_step}"
    tag_dir = trainer.save(epoch)
    if args.test_checkpointing:
        trainer.verify_checkpoint(tag_dir)
    summary = {"global_step": trainer.global_step, "final_loss": final_loss, "checkpoint": tag_dir,
               "minutes": (time.time() - start_time) / 60}
    if rt.is_root:
        throughputs = [r["throughput"] for r in log.records] or [0.0]
        extra = {"Epoch": epoch, "Global step": trainer.global_step}
        metrics.store_metrics([
            {"name": "Final loss", "value": final_loss, "additional_data": extra},
            {"name": "Time to train", "value": round(summary["minutes"], 4), "units": "minutes",
             "additional_data": extra},
            {"name": "Average throughput", "value": round(sum(throughputs) / len(throughputs), 4), "units": "seq/s",
             "additional_data": extra},
            {"name": "Peak throughput", "value": max(throughputs), "units": "seq/s", "additional_data": extra},
        ])
        log.close()
        loss_text = "no step run (already at --steps_this_run)" if final_loss is None else f"loss {final_loss:.4f}"
        print(f"done: step {trainer.global_step}, {loss_text}, checkpoint {tag_dir}", flush=True)
    return summary


def _run_parameters(args, trainer: Trainer, rt: runtime_lib.Runtime, dp_size: int) -> Dict[str, Any]:
    return {
        "Model": "BertForPreTraining", "Model configuration": json.loads(trainer.config.to_json_string()),
        "World size": rt.world_size, "Tensor parallel degree": args.tensor_parallel_size,
        "Data parallel degree": dp_size, "Batch size": args.batch_size, "Total steps": args.steps_this_run,
        "Seed": args.seed, "Optimizer": args.optimizer, "Learning rate": args.lr,
        "Data type": ("bfloat16" if args.bf16 else "bfloat16 + fp32 master shards" if args.use_mix_precision
                      else "fp32 + bf16 autocast" if args.enable_pt_autocast else "float32"),
        "ZeRO-1": args.use_zero_1,
        "Gradient accumulation microsteps": args.grad_accum_usteps, "Warmup steps": args.warmup_steps,
        "Sequence parallel": args.sequence_parallel, "Activation checkpointing": args.activation_checkpointing,
        "Device": rt.kind, "Dataset": os.path.basename(os.path.normpath(args.data_dir)),
        "Environment variables": {k: v for k, v in os.environ.items() if k.startswith(("NEURON", "XLA", "PJRT"))},
    }


def _xla_spawned_main(index: int, argv: List[str]) -> None:
    run(parse_args(argv), spawned_by_xla=True)


def main(argv: Optional[List[str]] = None) -> None:
    runtime_lib.run_main(sys.argv[1:] if argv is None else argv, parse_args, run, _xla_spawned_main, INPUT_ERRORS)


if __name__ == "__main__":
    main()
