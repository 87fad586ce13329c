"""Llama pretraining with tensor parallelism × data parallelism and ZeRO-1, through NxD's trainer API.

neuronx-distributed's ``tp_zero1_llama_hf_pretrain.py`` with the same flags, log lines and metrics file, on XLA
devices (Trainium, TPU), GPUs (NCCL) and CPUs (gloo); NxD's tutorial command runs as is:

    torchrun --nproc_per_node=32 tp_zero1_llama_hf_pretrain.py --model_path 8B_config_llama3 \\
        --data_dir ~/examples_datasets/wikicorpus_llama3_tokenized_8k --tensor_parallel_size 32 --batch_size 1 \\
        --steps_this_run -1 --max_steps 10000 --warmup_steps 100 --lr 1.5e-4 --grad_accum_usteps 32 --seq_len 8192 \\
        --sequence_parallel_enabled --selective_checkpoint_enabled --logging_interval 1 --qkv_linear \\
        --kv_replicator 4 --use_mix_precision --use_zero_1

The script is written as NxD's is, against NxD's trainer API with ``import nxdtp as nxd``:
``neuronx_distributed_config``, ``initialize_parallel_model`` (its ``model_fn`` builds a Hugging Face
``LlamaForCausalLM`` from the config json, which nxdtp shards with its Llama plan), ``initialize_parallel_optimizer``
(ZeRO-1 with ``--use_zero_1``), ``save_checkpoint`` / ``load_checkpoint`` / ``has_checkpoint``. What differs from
NxD's script, flag by flag: docs/llama_example.md.

Every rank of a TP group reads the same batches; the DP ranks take NxD's interleaved rows. The loss of each
micro-batch is its summed token loss divided by the target-token count of the whole global batch (all DP ranks, all
accumulation micro-steps), so a TP × DP run computes what the dense model computes on the global batch; on packed
blocks (every position a target) that is NxD's ``outputs.loss / grad_accum_usteps`` averaged over DP.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import socket
import sys
import time
from typing import Any, Dict, List, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "common"))  # the helpers the examples share

import llama_data  # noqa: E402
import rank_failure  # noqa: E402
import runtime as runtime_lib  # noqa: E402
from training_log import MetricsFile, Throughput, TrainingLog  # noqa: E402

import nxdtp as nxd  # noqa: E402  (NxD's script: import neuronx_distributed as nxd)
from nxdtp import comm, parallel_state  # noqa: E402
from nxdtp.models import vocab_parallel_logits  # noqa: E402
from nxdtp.models.hf_loading import PretrainedDirectoryError  # noqa: E402


class WorldSizeError(ValueError):
    """--tensor_parallel_size does not fit the world torchrun started."""


class NonFiniteStepError(FloatingPointError):
    """A step's loss or pre-clip gradient norm is inf or NaN; every rank raises it at the same step."""


# Errors whose message names the file, flag or value and what is wrong: one line and exit status 1, no traceback.
INPUT_ERRORS = (WorldSizeError, llama_data.DataError, PretrainedDirectoryError, NonFiniteStepError)
CHECKPOINT_FORMAT_TAG = "step_{}"


# ---- flags -----------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # NxD's flags, with NxD's defaults.
    p.add_argument("--model_path", type=str, default=None,
                   help="directory holding the Llama config.json (or the file itself); weights are not read")
    p.add_argument("--training_config", type=str, default=None,
                   help="NxD's tp_pp script's name for --model_path; either may be given")
    p.add_argument("--data_dir", type=str, default=None,
                   help="pre-tokenized packed dataset: NxD's get_dataset.py output or build_llama_data.py's")
    p.add_argument("--output_dir", type=str, default="./output", help="logs, TensorBoard events, the step log")
    p.add_argument("--metrics_file", type=str, default="results.json", help="NxD-format JSON metrics file")
    p.add_argument("--batch_size", type=int, default=8, help="micro-batch size per data-parallel rank")
    p.add_argument("--max_steps", type=int, default=None, help="optimizer steps of the whole LR schedule")
    p.add_argument("--steps_this_run", type=int, default=None,
                   help="stop when the global step reaches this value (-1 or unset: run to --max_steps)")
    p.add_argument("--seed", type=int, default=12349, help="model initialisation")
    p.add_argument("--lr", type=float, default=4e-4, help="peak learning rate")
    p.add_argument("--warmup_steps", type=int, default=2000, help="linear warmup steps, then linear decay to 0")
    p.add_argument("--grad_accum_usteps", type=int, default=64, help="micro-batches per optimizer step")
    p.add_argument("--print_grad_norm", action="store_true", help="append the pre-clip grad norm to each LOG line")
    p.add_argument("--tensor_parallel_size", type=int, default=2, help="ranks per tensor-parallel group")
    p.add_argument("--context_parallel_size", type=int, default=1, help="accepted at 1 only: no context parallelism")
    p.add_argument("--expert_parallel_size", type=int, default=1,
                   help="ranks of an expert-parallel group (a mixture of experts; it divides the data-parallel size)")
    p.add_argument("--capacity_factor", type=float, default=None,
                   help="NxD's Mixtral flag; accepted unset only: the Hugging Face model's experts are dropless")
    p.add_argument("--seq_len", type=int, default=2048, help="sequence length; must equal the data's block length")
    p.add_argument("--use_mix_precision", action="store_true",
                   help="with --use_zero_1: bf16 weights and compute, fp32 master shards (AdamW_FP32OptimParams), "
                        "gradients accumulated in fp32")
    p.add_argument("--use_zero_1", action="store_true",
                   help="ZeRO-1: optimizer state and fp32 master weights sharded over the data-parallel group")
    p.add_argument("--num_layers", type=int, default=-1, help="override the config's num_hidden_layers")
    p.add_argument("--sequence_parallel_enabled", action="store_true", help="Megatron sequence parallelism")
    p.add_argument("--selective_checkpoint_enabled", action="store_true",
                   help="recompute only the attention blocks in backward (default: every decoder layer, as NxD)")
    p.add_argument("--use_meta_device_init", action="store_true",
                   help="build the model on the meta device, then initialise each module's own shard")
    p.add_argument("--logging_interval", type=int, default=1, help="print a LOG line every N steps")
    p.add_argument("--qkv_linear", action="store_true",
                   help="accepted: nxdtp's Llama plan shards q/k/v column-parallel and repeats KV heads itself")
    p.add_argument("--kv_replicator", type=int, default=1,
                   help="NxD's KV-head replication factor: checked against the config, repetition is automatic")
    p.add_argument("--use_gpu_compatible_precision", type=int, default=1,
                   help="1 (NxD's default): fp32 master weights with ZeRO-1; 0: NxD's XLA_USE_BF16 / "
                        "XLA_DOWNCAST_BF16 precision, XLA devices only")
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.999)
    p.add_argument("--checkpoint_freq", type=int, default=100000, help="save every N optimizer steps")
    p.add_argument("--checkpoint_dir", type=str, default=None, help="where checkpoints are saved and loaded")
    p.add_argument("--pretrained_weight", action="store_true",
                   help="start from the model weights saved under tag 'pretrained_weight' in --checkpoint_dir")
    p.add_argument("--loading_step", type=str, default="-1",
                   help='resume from the checkpoint of this step; "-1": none; "latest_if_exists": the newest, if any')
    p.add_argument("--num_kept_checkpoint", type=int, default=-1, help="keep the newest N checkpoints (-1: all)")
    p.add_argument("--hidden_size", type=int, default=-1, help="override the config's hidden_size")
    p.add_argument("--use_flash_attention", type=int, default=1,
                   help="NxD's flash-attention kernel; here 1 selects torch's scaled_dot_product_attention, 0 eager")
    p.add_argument("--fuse_qkv", type=int, default=1, help="accepted: the plan keeps q/k/v as HF's three layers")
    p.add_argument("--transpose_nki_inputs", type=int, default=1, help="accepted: a Neuron kernel layout, unused")
    # nxdtp's flags.
    p.add_argument("--device", default="auto", choices=runtime_lib.DEVICE_CHOICES,
                   help="auto: an XLA accelerator if present, else CUDA, else CPU")
    p.add_argument("--collective_timeout_s", type=float,
                   default=float(os.environ.get(runtime_lib.COLLECTIVE_TIMEOUT_ENV,
                                                runtime_lib.DEFAULT_COLLECTIVE_TIMEOUT_S)),
                   help="seconds a rank waits in a collective for its peers before the job fails")
    p.add_argument("--no_activation_checkpointing", action="store_true",
                   help="recompute nothing (NxD always recomputes: the decoder layers, or the attention blocks)")
    return p


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model_path and args.training_config and os.path.abspath(args.model_path) != os.path.abspath(
            args.training_config):
        parser.error(f"--model_path {args.model_path} and --training_config {args.training_config} name different "
                     "configs; give one")
    args.model_path = args.model_path or args.training_config
    if args.model_path is None:
        parser.error("--model_path (or --training_config) is required: a directory with the Llama config.json")
    if args.data_dir is None:
        parser.error("--data_dir is required: build one with examples/tp_zero1_llama/build_llama_data.py")
    if args.max_steps is None:
        parser.error("--max_steps is required (optimizer steps of the LR schedule)")
    if args.steps_this_run is None or args.steps_this_run < 0:
        args.steps_this_run = args.max_steps
    for name in ("batch_size", "max_steps", "grad_accum_usteps", "tensor_parallel_size", "seq_len",
                 "logging_interval", "kv_replicator"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)} must be >= 1")
    if not 0 <= args.lr < float("inf"):
        parser.error(f"--lr {args.lr} must be a finite number >= 0")
    if args.warmup_steps < 0:
        parser.error(f"--warmup_steps {args.warmup_steps} must be >= 0")
    if args.context_parallel_size != 1:
        parser.error(f"--context_parallel_size {args.context_parallel_size}: nxdtp has no context parallelism; "
                     "the valid value is 1")
    if args.capacity_factor is not None:
        parser.error(f"--capacity_factor {args.capacity_factor}: the Hugging Face model nxdtp shards routes every "
                     "token to its experts (dropless), as the dense model it must equal does; leave the flag out "
                     "(NxD's capacity with token dropping is in nxdtp.modules.moe, for NxD's own model file)")
    if args.expert_parallel_size < 1:
        parser.error(f"--expert_parallel_size {args.expert_parallel_size} must be >= 1")
    if args.expert_parallel_size > 1 and args.use_zero_1 and args.checkpoint_dir and args.checkpoint_freq > 0:
        parser.error(f"--use_zero_1 with --expert_parallel_size {args.expert_parallel_size} and checkpoints: ZeRO-1's "
                     "expert shards are not checkpointed yet; drop --use_zero_1, or --checkpoint_freq 0")
    if args.use_mix_precision and not args.use_zero_1:
        parser.error("--use_mix_precision keeps fp32 master weights in the ZeRO-1 optimizer's shards: add "
                     "--use_zero_1 (NxD's own script raises too: master weights need ZeRO-1)")
    if args.use_gpu_compatible_precision not in (0, 1):
        parser.error(f"--use_gpu_compatible_precision {args.use_gpu_compatible_precision} must be 0 or 1")
    if args.use_gpu_compatible_precision == 0 and runtime_lib.choose_device_kind(args.device) != "xla":
        parser.error("--use_gpu_compatible_precision 0 is NxD's XLA_USE_BF16 / XLA_DOWNCAST_BF16 precision, which "
                     "only XLA devices have; on CPUs and GPUs use --use_mix_precision --use_zero_1 (bf16 weights, "
                     "fp32 master shards)")
    if args.loading_step not in ("-1", "latest_if_exists") and not args.loading_step.isdigit():
        parser.error(f'--loading_step {args.loading_step!r} must be a step number, "-1" or "latest_if_exists"')
    if (args.loading_step != "-1" or args.pretrained_weight) and not args.checkpoint_dir:
        parser.error("--loading_step and --pretrained_weight load from --checkpoint_dir: give it")
    if args.checkpoint_freq < 0:
        parser.error(f"--checkpoint_freq {args.checkpoint_freq} must be >= 0 (0: never save)")
    world_size = os.environ.get("WORLD_SIZE", "")
    if world_size.isdigit() and int(world_size) % args.tensor_parallel_size:
        parser.error(f"--tensor_parallel_size {args.tensor_parallel_size} does not divide the world size "
                     f"{world_size} (torchrun's WORLD_SIZE)")
    if not 0 < args.collective_timeout_s < float("inf"):
        parser.error(f"--collective_timeout_s {args.collective_timeout_s} must be a positive number of seconds")
    try:
        config = load_config(args)
    except (OSError, ValueError) as error:
        parser.error(str(error))
    if (getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0)
            and not (args.selective_checkpoint_enabled or args.no_activation_checkpointing)):
        parser.error(f"{args.model_path}: a mixture of experts trained with its load-balancing loss cannot recompute "
                     "whole decoder layers (transformers records the router logits inside them, and a recomputed "
                     "layer's would carry no gradient): add --selective_checkpoint_enabled (recompute the attention) "
                     "or --no_activation_checkpointing")
    tp = args.tensor_parallel_size
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if args.kv_replicator != 1 and (kv_heads * args.kv_replicator) % tp:
        parser.error(f"--kv_replicator {args.kv_replicator}: {kv_heads} KV heads x {args.kv_replicator} is not a "
                     f"multiple of --tensor_parallel_size {tp} (NxD's GQA layer would refuse it too)")
    if args.use_gpu_compatible_precision == 0:
        # As NxD: bf16 on the device, by the XLA bridge.
        os.environ["XLA_DOWNCAST_BF16" if args.use_mix_precision else "XLA_USE_BF16"] = "1"
    os.environ["NEURON_RT_STOCHASTIC_ROUNDING_EN"] = "0" if args.use_gpu_compatible_precision else "1"
    return args


# ---- the model -------------------------------------------------------------------------------------------------------

def load_config(args: argparse.Namespace):
    """The config of --model_path with NxD's overrides (--num_layers, --hidden_size, --seq_len): a Llama config, or
    another decoder family's that nxdtp shards (Mixtral: examples/tp_ep_mixtral; a config without model_type is
    Llama's). A damaged or mistyped config is a PretrainedDirectoryError naming the file."""
    from transformers import LlamaConfig

    from nxdtp.models.hf_loading import read_config

    path = args.model_path
    file = path if os.path.isfile(path) else os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"--model_path {path}: no config.json there (give a directory with a Llama "
                                "config.json, or the file)")
    config = read_config(file, None if _names_its_model_type(file) else LlamaConfig)
    config.use_cache = False
    config.max_position_embeddings = max(config.max_position_embeddings, args.seq_len)
    if args.num_layers > 0:
        config.num_hidden_layers = args.num_layers
    if args.hidden_size != -1:
        config.hidden_size = args.hidden_size
    config.head_dim = config.hidden_size // config.num_attention_heads
    # NxD's config keys for its own modeling file; HF's Llama ignores them, the merged config.json would carry them.
    for key in ("sequence_parallel_enabled", "selective_checkpoint_enabled"):
        if hasattr(config, key):
            delattr(config, key)
    config._attn_implementation = "sdpa" if args.use_flash_attention > 0 else "eager"
    return config


def _names_its_model_type(file: str) -> bool:
    """Whether the config file says its model_type (unreadable: no; read_config then says what is wrong)."""
    import json

    try:
        with open(file, "rb") as f:
            raw = json.load(f)
    except ValueError:
        return False
    return isinstance(raw, dict) and "model_type" in raw


def dense_model(config):
    """The Hugging Face causal LM of ``config``'s family (``LlamaForCausalLM`` for a Llama config), freshly
    initialised from the current seed: what every rank builds and the dense reference trains."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)


def get_model(flags: argparse.Namespace):
    """NxD's ``model_fn``: the dense Hugging Face model, which ``initialize_parallel_model`` shards. Every rank builds
    it from the same seed (``set_seed`` before), so each TP rank keeps its slice of the same dense weights."""
    model = dense_model(load_config(flags))
    if flags.use_mix_precision:
        model.to(torch.bfloat16)  # the fp32 master shards are made from these values by ZeRO-1
    return model


def init_weights(module: torch.nn.Module, device: torch.device) -> None:
    """``param_init_fn`` for --use_meta_device_init: each module initialises its own (already sharded) parameters,
    as NxD's ``init_weights`` does: parallel layers by their ``init_weight_cpu``, RMSNorms to ones."""
    if hasattr(module, "init_weight_cpu"):
        module.init_weight_cpu()
    elif hasattr(module, "initialize_weight_biases"):
        module.initialize_weight_biases()
    elif type(module).__name__.endswith("RMSNorm"):
        with torch.no_grad():
            module.weight.fill_(1.0)


def activation_checkpoint_config(args: argparse.Namespace):
    if args.no_activation_checkpointing:
        return None
    if args.selective_checkpoint_enabled:
        # NxD recomputes its CoreAttention module (softmax(QK^T)V); HF's decoders have no such module, the nearest is
        # the whole attention block (LlamaAttention, MixtralAttention, ...).
        import importlib

        model_type = load_config(args).model_type
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        wanted = model_type.replace("_", "") + "attention"     # qwen2_moe: Qwen2MoeAttention
        found = [value for name, value in vars(module).items() if name.lower() == wanted]
        if not found:
            raise ValueError(f"--selective_checkpoint_enabled: transformers' {model_type} model has no attention "
                             f"class named like {wanted!r} to recompute; use the default full recompute or "
                             "--no_activation_checkpointing")
        return found[0]
    return "full"


def mixed_precision_config(args: argparse.Namespace) -> Dict[str, bool]:
    """NxD's ``get_mixed_precision_config``, for ZeRO-1 only: master weights and fp32 gradient accumulation live in
    the ZeRO-1 optimizer (NxD's script raises without --use_zero_1 at its default precision; here they are off)."""
    on = bool(args.use_gpu_compatible_precision) and args.use_zero_1
    return {"use_master_weights": on, "use_fp32_grad_acc": on, "use_master_weights_in_ckpt": False}


def optimizer_groups(model) -> List[Dict[str, Any]]:
    # As NxD: no weight decay on biases and norms.
    no_decay = ("bias", "norm")
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if not any(nd in n for nd in no_decay)]},
            {"params": [p for n, p in named if any(nd in n for nd in no_decay)], "weight_decay": 0.0}]


def optimizer_class(args: argparse.Namespace):
    if args.use_mix_precision:
        from nxdtp.optimizer import AdamW_FP32OptimParams

        return AdamW_FP32OptimParams, {}
    # NxD imports transformers' AdamW (eps 1e-6), which transformers 5 removed; torch's with the same eps.
    return torch.optim.AdamW, {"eps": 1e-6}


def linear_schedule_with_warmup(optimizer, warmup_steps: int, max_steps: int):
    """transformers' get_linear_schedule_with_warmup (NxD's schedule), as a LambdaLR."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / max(1, warmup_steps)
        return max(0.0, (max_steps - step) / max(1, max_steps - warmup_steps))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---- the run ---------------------------------------------------------------------------------------------------------

class StepTimes:
    """Seconds of one optimizer step spent in forward, backward, the optimizer and checkpointing. On eager devices
    they are wall-clock times (CUDA synchronised at each boundary); on XLA they are tracing times, the device work
    runs in the step's graph."""

    def __init__(self, rt: runtime_lib.Runtime):
        self.rt = rt
        self.times = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0, "checkpoint": 0.0}
        self.last = self._now()

    def _now(self) -> float:
        if self.rt.kind == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def mark(self, phase: str) -> None:
        now = self._now()
        self.times[phase] += now - self.last
        self.last = now


def get_loading_tag(flags: argparse.Namespace) -> Optional[str]:
    """NxD's: "-1" loads nothing; "latest_if_exists" the newest checkpoint (tag None) or nothing; N the step's."""
    if flags.loading_step == "-1":
        return "-1"
    if flags.loading_step == "latest_if_exists":
        return None if nxd.has_checkpoint(flags.checkpoint_dir) else "-1"
    return CHECKPOINT_FORMAT_TAG.format(flags.loading_step)


def run(args: argparse.Namespace, spawned_by_xla: bool = False) -> Dict[str, Any]:
    timeout = datetime.timedelta(seconds=args.collective_timeout_s)
    rt = runtime_lib.start(args.device, timeout, spawned_by_xla=spawned_by_xla)
    failures = rank_failure.RankFailures(rt.rank, rt.world_size) if rt.owns_world and rt.world_size > 1 else None
    try:
        summary = train_llama(args, rt, failures)
    except BaseException as error:
        if failures is not None and not isinstance(error, NonFiniteStepError):
            failures.exit(error, with_traceback=not isinstance(error, INPUT_ERRORS))
        _leave_world(rt, failures)
        raise
    _leave_world(rt, failures)
    return summary


def _leave_world(rt: runtime_lib.Runtime, failures) -> None:
    parallel_state.destroy_model_parallel()
    runtime_lib.stop(rt)
    if failures is not None:
        failures.close()


def train_llama(flags: argparse.Namespace, rt: runtime_lib.Runtime, failures=None) -> Dict[str, Any]:
    from transformers import set_seed

    set_seed(flags.seed)
    model_init_config = ({"meta_device_init": True, "param_init_fn": init_weights} if flags.use_meta_device_init
                         else None)
    try:
        nxd_config = nxd.neuronx_distributed_config(
            tensor_parallel_size=flags.tensor_parallel_size,
            context_parallel_size=flags.context_parallel_size,
            expert_parallel_size=flags.expert_parallel_size,
            optimizer_config={"zero_one_enabled": flags.use_zero_1, "grad_clipping": True, "max_grad_norm": 1.0},
            sequence_parallel=flags.sequence_parallel_enabled,
            activation_checkpoint_config=activation_checkpoint_config(flags),
            model_init_config=model_init_config,
            mixed_precision_config=mixed_precision_config(flags),
            device=rt.device,
        )
    except ValueError as error:
        if "divide" in str(error) or "world" in str(error):
            layout = f"--tensor_parallel_size {flags.tensor_parallel_size}" + (
                f" --expert_parallel_size {flags.expert_parallel_size}" if flags.expert_parallel_size > 1 else "")
            raise WorldSizeError(f"{layout}: {error}") from None
        raise
    # The data before the model: a wrong directory fails in seconds, not after the model is built.
    data = llama_data.PackedBlocks(flags.data_dir)
    if data.seq_len != flags.seq_len:
        raise llama_data.DataError(f"--seq_len {flags.seq_len} but the blocks in --data_dir {flags.data_dir} are "
                                   f"{data.seq_len} tokens long: pass --seq_len {data.seq_len}")
    # HF Llama's rotary buffers are computed from the config at construction: only parameters go on meta.
    model = nxd.initialize_parallel_model(nxd_config, get_model, False, flags)
    dp_group = parallel_state.data_parallel_group()
    dp_size = parallel_state.get_data_parallel_size()
    is_root = rt.is_root
    config = model.config

    cls, extra = optimizer_class(flags)
    optimizer = nxd.initialize_parallel_optimizer(nxd_config, cls, optimizer_groups(model), lr=flags.lr,
                                                  betas=(flags.beta1, flags.beta2), weight_decay=flags.weight_decay,
                                                  **extra)
    optimizer.zero_grad()
    scheduler = linear_schedule_with_warmup(optimizer, flags.warmup_steps, flags.max_steps)

    # Resume (NxD's loading logic), or NxD's --pretrained_weight.
    epoch = global_step = consumed_sequences = 0
    tag = get_loading_tag(flags)
    if tag != "-1":
        user_content = nxd.load_checkpoint(flags.checkpoint_dir, tag=tag, model=model, optimizer=optimizer,
                                           scheduler=scheduler)
        if user_content is not None:
            epoch, global_step = int(user_content["epoch"]), int(user_content["global_step"])
            consumed_sequences = int(user_content.get("consumed_sequences", 0))
            if is_root:
                print(f"resumed from {flags.checkpoint_dir} ({tag or 'newest'}) at step {global_step}", flush=True)
            stop_at = min(flags.steps_this_run, flags.max_steps)
            if is_root and global_step >= stop_at:
                print(f"nothing to train: the checkpoint is at step {global_step} and this run stops at step {stop_at} "
                      "(--max_steps, --steps_this_run); raise them to train on, or give another --checkpoint_dir to "
                      "start afresh", flush=True)
    elif flags.pretrained_weight:
        nxd.load_checkpoint(flags.checkpoint_dir, tag="pretrained_weight", model=model, optimizer=None,
                            scheduler=None)
        if flags.use_zero_1:
            optimizer.optimizer.init_zero()  # the master shards, made from the weights before the load, again

    global_micro_batch = flags.batch_size * dp_size
    skip = consumed_sequences // global_micro_batch
    batches = llama_data.MicroBatches(data, flags.batch_size, dp_size, parallel_state.get_data_parallel_rank(),
                                      config.vocab_size, skip=skip)
    device_batches = rt.device_batches(batches)
    sequences_per_step = global_micro_batch * flags.grad_accum_usteps

    log = metrics = None
    model_dtype = str(model.dtype)
    if is_root:
        os.makedirs(flags.output_dir, exist_ok=True)
        log = TrainingLog(flags.output_dir, flags.print_grad_norm,
                          f"neuron_tblogs_{time.strftime('%m%d%y_%H%M')}_{model_dtype.replace('torch.', '')}"
                          f"_w{dp_size}_lr{flags.lr}_bs{flags.batch_size}_acc{flags.grad_accum_usteps}"
                          f"_warmup{flags.warmup_steps}_max{flags.max_steps}_xla{rt.is_xla}_{socket.gethostname()}")
        metrics = MetricsFile(flags.metrics_file)
        print("--------TRAINING CONFIG----------")
        print(flags)
        print("--------MODEL CONFIG----------")
        print(config)
        print("---------------------------------")
        if not flags.checkpoint_dir:
            print("note: no --checkpoint_dir, so no checkpoints are saved", flush=True)
        print(f"training on {rt.kind} ({rt.device}): world {rt.world_size} = tensor parallel "
              f"{flags.tensor_parallel_size} x data parallel {dp_size} (expert parallel "
              f"{flags.expert_parallel_size}); ZeRO-1 {flags.use_zero_1}; "
              f"{llama_data.describe(data)}", flush=True)
        metrics.store_parameters({
            "Model": config.model_type, "Model configuration": str(config), "World size": rt.world_size,
            "Data parallel degree": dp_size, "Batch size": flags.batch_size, "Total steps": flags.steps_this_run,
            "Seed": flags.seed, "Optimizer": str(optimizer), "Data type": model_dtype,
            "Gradient accumulation microsteps": flags.grad_accum_usteps, "Warmup steps": flags.warmup_steps,
            "Dataset": os.path.basename(os.path.normpath(flags.data_dir)),
            "Environment variables": {k: v for k, v in os.environ.items() if k.startswith(("NEURON", "XLA"))},
        })

    # NxD's Throughput: a moving window of 10 steps' worth of logged intervals.
    throughput = Throughput(sequences_per_step * flags.logging_interval, window=math.ceil(10 / flags.logging_interval))
    throughputs: List[float] = []
    train_start = time.time()
    training_ustep = skip
    final_loss: Optional[float] = None
    saved_tag: Optional[str] = None

    def report(step: int, epoch_now: int, loss: torch.Tensor, grad_norm: Optional[torch.Tensor], lr: float,
               times: Dict[str, float]) -> None:
        nonlocal final_loss
        loss_value = loss.item()
        norm_value = float("nan") if grad_norm is None else grad_norm.item()
        finite = math.isfinite(loss_value) and (grad_norm is None or math.isfinite(norm_value))
        if finite:
            final_loss = loss_value
        if log is not None and (step % flags.logging_interval == 0 or not finite):
            seqs = throughput.tick()
            throughputs.append(seqs)
            step_s = sum(times.values())
            log.step(epoch_now, step, loss_value, lr, seqs, norm_value,
                     {**{f"{k}_s": v for k, v in times.items()}, "tokens_per_s": seqs * flags.seq_len,
                      **rt.graph_counters()})
            print(f"TIME ({epoch_now}, {step}) forward : {times['forward']:.3f} s backward : {times['backward']:.3f} s"
                  f" optimizer : {times['optimizer']:.3f} s checkpoint : {times['checkpoint']:.3f} s step : "
                  f"{step_s:.3f} s throughput : {seqs * flags.seq_len:.1f} tokens/s", flush=True)
        if not finite:
            raise NonFiniteStepError(f"step {step}: non-finite step_loss : {loss_value} grad-norm : {norm_value}; "
                                     "stopping; lower --lr, or check the data")

    def save(step: int, epoch_now: int) -> str:
        tag_name = CHECKPOINT_FORMAT_TAG.format(step)
        user_content = {"epoch": epoch_now, "global_step": step, "cli_args": vars(flags),
                        "consumed_sequences": consumed_sequences, "data_parallel_size": dp_size}
        # NxD's positional call: (dir, tag, model, optimizer, scheduler, user_content, num_workers, use_xser,
        # num_kept_ckpts).
        nxd.save_checkpoint(flags.checkpoint_dir, tag_name, model, optimizer, scheduler, user_content, 8, True,
                            flags.num_kept_checkpoint if flags.num_kept_checkpoint > 0 else None)
        return tag_name

    if is_root:
        print(f"Epoch {epoch} begin {time.asctime()}", flush=True)
    while global_step < flags.steps_this_run and global_step < flags.max_steps:
        if failures is not None:
            failures.stage = f"step {global_step + 1}"
        rank_failure.inject_fault_if_requested(rt.rank, global_step + 1)
        micro_batches = [next(device_batches) for _ in range(flags.grad_accum_usteps)]
        timer = StepTimes(rt)
        lr = optimizer.param_groups[0]["lr"]
        # The global target count: every micro-batch's summed loss is divided by it (scaled by the DP size, since
        # the gradients are averaged over DP), so the step's gradient is the dense model's on the global batch.
        targets = sum((b["labels"][:, 1:] != llama_data.IGNORE_INDEX).sum() for b in micro_batches)
        total = comm.all_reduce(targets.to(torch.float32).reshape(1), dp_group, op="sum")
        num_items = total[0] / dp_size
        step_loss = torch.zeros((), device=rt.device)
        for batch in micro_batches:
            with vocab_parallel_logits(model):   # only the loss is read: the logits stay vocab-parallel
                outputs = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                                labels=batch["labels"], num_items_in_batch=num_items)
            loss = outputs.loss
            timer.mark("forward")
            loss.backward()
            timer.mark("backward")
            step_loss = step_loss + loss.detach().float()
            training_ustep += 1
        optimizer.step()   # NxDOptimizer: SP gradients over TP, DP average (or ZeRO-1's reduce-scatter), clip
        grad_norm = optimizer.grad_norm
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        reduced_loss = comm.all_reduce(step_loss.reshape(1), dp_group, op="sum")[0] / dp_size
        timer.mark("optimizer")
        global_step += 1
        consumed_sequences += sequences_per_step
        epoch = batches.epoch_of(training_ustep - 1)
        due = flags.checkpoint_dir and flags.checkpoint_freq > 0 and global_step % flags.checkpoint_freq == 0
        if rt.is_xla:
            rt.after_step(report, global_step, epoch, reduced_loss, grad_norm, lr, timer.times)
            rt.end_step()
            if due:
                saved_tag = save(global_step, epoch)
        else:
            # A non-finite step is never saved: report() stops the run at it, so it runs first when the values are bad.
            finite = math.isfinite(reduced_loss.item()) and (grad_norm is None or math.isfinite(grad_norm.item()))
            if due and finite:
                saved_tag = save(global_step, epoch)
                timer.mark("checkpoint")
            report(global_step, epoch, reduced_loss, grad_norm, lr, timer.times)
        if batches.epoch_of(training_ustep) != epoch and is_root:
            print(f"Epoch {epoch + 1} begin {time.asctime()}", flush=True)

    nxd.finalize_checkpoint()   # waits for asynchronous saves (none here: NxD's call saves synchronously)
    minutes = (time.time() - train_start) / 60
    summary = {"global_step": global_step, "final_loss": final_loss, "checkpoint": saved_tag, "minutes": minutes}
    if is_root:
        extra = {"Epoch": epoch, "Global step": global_step, "Microstep": training_ustep}
        print(f"Epoch {epoch} step {global_step} end {time.asctime()} loss {final_loss} perf "
              f"{throughputs[-1] if throughputs else None} seq/sec (at train microstep {training_ustep} time "
              f"{time.time()} from beginning time {train_start})", flush=True)
        later = throughputs[math.ceil(10 / flags.logging_interval):] or throughputs
        metrics.store_metrics([
            {"name": "Loss", "value": final_loss, "additional_data": extra},
            {"name": "Throughput", "value": throughputs[-1] if throughputs else None, "units": "seq/s",
             "additional_data": extra},
            {"name": "Final loss", "value": final_loss, "additional_data": extra},
            {"name": "Time to train", "value": round(minutes, 4), "units": "minutes", "additional_data": extra},
            {"name": "Average throughput", "value": round(sum(later) / len(later), 4) if later else None,
             "units": "seq/s", "additional_data": extra},
            {"name": "Peak throughput", "value": max(throughputs) if throughputs else None, "units": "seq/s",
             "additional_data": extra},
        ])
        log.close()
        print(f"done: step {global_step}, loss {final_loss}, checkpoint "
              f"{os.path.join(flags.checkpoint_dir, saved_tag) if saved_tag else 'none saved'}", flush=True)
    return summary


def _xla_spawned_main(index: int, argv: List[str]) -> None:
    run(parse_args(argv), spawned_by_xla=True)


def main(argv: Optional[List[str]] = None) -> None:
    runtime_lib.run_main(sys.argv[1:] if argv is None else argv, parse_args, run, _xla_spawned_main, INPUT_ERRORS)


if __name__ == "__main__":
    main()
