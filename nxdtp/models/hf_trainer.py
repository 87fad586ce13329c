"""``TensorParallelTrainer``: Hugging Face's ``Trainer`` for a model ``nxdtp.models`` parallelized.

Plain ``transformers.Trainer`` cannot train a Megatron-style TP model correctly: it wraps the model in DDP over the
whole world (whose start-up broadcast copies TP rank 0's shards over the others), gives each TP rank a different batch,
clips with a norm of the local shards, and saves rank 0's shards only. transformers 5 has a path for models that report
a tensor-parallel size (it builds accelerate's ``ParallelismConfig``: data split by DP rank only, no DDP), and this
subclass takes it, then supplies what no model attribute can reach:

* the DP gradient average (``nxdtp.grads.allreduce_gradients`` over the DP group, at the end of each accumulation
  window) and the sequence-parallel gradient sum;
* the TP-aware gradient norm and clipping (``nxdtp.grads.clip_grad_norm``), which Trainer logs as ``grad_norm``;
* checkpoints through ``nxdtp.checkpointing``: every rank writes its shards (model, optimizer, scheduler, the RNG
  tracker), and ``resume_from_checkpoint`` reads them back, beside Trainer's own trainer state and RNG files;
  ``save_model(dir)`` writes the dense HF directory (``model.save_pretrained``), which ``from_pretrained`` loads;
* full-vocabulary logits wherever something reads them (``nxdtp.models.logits``): evaluation, prediction,
  ``compute_loss_func``, label smoothing, a subclass's ``compute_loss``; the training forwards whose loss is the
  model's own keep them vocab-parallel. Evaluation results are gathered across processes over the DP group only, so
  ``compute_metrics`` and ``preprocess_logits_for_metrics`` see each sample once, as on the dense model;
* any other Trainer subclass, TRL's trainers among them, through ``tensor_parallel_trainer(SFTTrainer)``: TRL's fused
  LM head is then computed on the vocab-parallel shards (``nxdtp.models.fused_head``);
* on CPU (gloo) worlds, the ``ParallelismConfig`` accelerate refuses for them is installed after the accelerator is
  built, so a laptop runs the same path as a GPU machine.

bf16 (accelerate's autocast) needs nothing more. What it cannot do is refused when the trainer is built, with the
reason: transformers 4.x, DeepSpeed, FSDP, XLA devices, fp16 (the GradScaler is not TP-aware), push_to_hub and
``load_best_model_at_end``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import types

import torch
import transformers
from transformers.trainer import TRAINING_ARGS_NAME

from .. import checkpointing, comm, grads, parallel_state
from ..record import note_of
from .fused_head import models_of, refuse_trl_fused_heads_left, vocab_parallel_fused_heads
from .hf_integration import TrainedByNote
from .logits import has_vocab_parallel_head, model_and_wrapped, vocab_parallel_logits
from .trainer_resume import ResumeSource, checkpoint_at_this_size, reseed_by_rule

# The nxdtp tag inside each of Trainer's checkpoint-N directories: model, optimizer and scheduler shards. Weights
# saved by save_model() alone (save_only_model, or a user's trainer.save_model(dir)) go to MODEL_TAG.
TRAINING_TAG = "nxdtp_training"
MODEL_TAG = "nxdtp_model"
OLDEST_TRAINER = (5, 0)
_TRAINER_CLASSES: dict = {}
ONLINE_TRAINERS = ("GRPOTrainer", "RLOOTrainer", "OnlineDPOTrainer")
ONLINE_GENERATION = ("it generates completions for every process and hands each process its slice by process index, "
                     "so the ranks of a TP group would train on different samples; train with SFTTrainer or "
                     "DPOTrainer on generated data, or generate with model.generate and train with your own loop")
PUSH_TO_HUB = ("TensorParallelTrainer uploads nothing (Trainer's upload would take output_dir without the dense "
               "model); call trainer.save_model(dir) on every rank, then upload dir from one rank with "
               "huggingface_hub.HfApi().upload_folder(repo_id=..., folder_path=dir)")


def _model_and_args(next_init, positional: tuple, keywords: dict):
    """The model, the training arguments and a reference model (TRL's DPO) among the arguments a Trainer subclass's
    ``__init__`` (``next_init``) receives: their positions differ (DPOTrainer takes ``ref_model`` second)."""
    try:
        arguments = inspect.signature(next_init).bind_partial(*positional, **keywords).arguments
    except TypeError:
        arguments = {}
    model = arguments.get("model", keywords.get("model", positional[0] if positional else None))
    return model, arguments.get("args", keywords.get("args")), arguments.get("ref_model")


def tensor_parallel_trainer(trainer_class: type) -> type:
    """``trainer_class`` (a subclass of ``transformers.Trainer``: TRL's ``SFTTrainer`` or ``DPOTrainer``, or one's
    own) made to train an nxdtp-parallelized model as ``TensorParallelTrainer`` does: the
    class ``TensorParallel<Name>`` with ``TensorParallelTrainer`` before it, made once per class. Its arguments are
    ``trainer_class``'s. TRL's fused LM head is computed on the vocab-parallel shards (``nxdtp.models.fused_head``)."""
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, transformers.Trainer)):
        raise TypeError(f"tensor_parallel_trainer() takes a subclass of transformers.Trainer, not {trainer_class!r}")
    if issubclass(trainer_class, TensorParallelTrainer):
        return trainer_class
    if trainer_class not in _TRAINER_CLASSES:
        _TRAINER_CLASSES[trainer_class] = type(f"TensorParallel{trainer_class.__name__}",
                                               (TensorParallelTrainer, trainer_class), {"__module__": __name__})
    return _TRAINER_CLASSES[trainer_class]


def _refused_classes(trainer_class: type) -> list:
    """The Trainer subclasses in ``trainer_class``'s bases that cannot train a TP model, each as a sentence."""
    return [f"{cls.__name__}: {ONLINE_GENERATION}" for cls in trainer_class.__mro__
            if cls.__module__.startswith("trl.") and cls.__name__ in ONLINE_TRAINERS]


def _refusals(model, args) -> list:
    """What this trainer cannot do with ``args``, each as a sentence naming the setting."""
    reasons = []
    release = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    if release < OLDEST_TRAINER:
        reasons.append(f"transformers {transformers.__version__}: TensorParallelTrainer uses transformers 5's "
                       "tensor-parallel Trainer path; upgrade to transformers>=5")
    if getattr(args, "deepspeed", None):
        reasons.append("deepspeed: DeepSpeed would shard or replicate the already sharded parameters")
    if getattr(args, "fsdp", None):
        reasons.append(f"fsdp={args.fsdp!r}: FSDP over a TP-sharded model is not supported")
    if getattr(args, "fp16", False):
        reasons.append("fp16=True: the fp16 GradScaler unscales and checks for overflow rank by rank (one TP rank "
                       "could skip a step the others take, and clipping would see scaled gradients); use bf16=True "
                       "(on CPU accelerate ignores fp16 anyway and trains in fp32)")
    if getattr(args, "push_to_hub", False):
        reasons.append("push_to_hub=True: " + PUSH_TO_HUB)
    if getattr(args, "precompute_ref_log_probs", False):
        reasons.append("precompute_ref_log_probs=True: TRL names its cache of reference log-probabilities by a hash "
                       "of the model's state_dict, which holds nxdtp's layout records besides tensors; leave it False "
                       "(the reference model then runs beside the trained one)")
    if getattr(args, "load_best_model_at_end", False):
        reasons.append("load_best_model_at_end=True: not supported yet; reload a checkpoint-N with "
                       "resume_from_checkpoint instead")
    world, tp = parallel_state.get_world_size(), parallel_state.get_tensor_model_parallel_size()
    if world % tp != 0:
        reasons.append(f"world size {world} is not a multiple of tensor_model_parallel_size={tp}")
    return reasons


class TensorParallelTrainer(transformers.Trainer):
    """``transformers.Trainer`` for an nxdtp-parallelized model: the same arguments, equal to the dense model trained by
    ``Trainer`` on the global batch (DP size × per-device batch × accumulation steps)."""

    def __init__(self, *positional, **keywords):
        model, args, reference = _model_and_args(super().__init__, positional, keywords)
        name = type(self).__name__
        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError(f"{name} needs nxdtp's parallel state: call "
                               "nxdtp.parallel_state.initialize_model_parallel(tensor_model_parallel_size=...) and "
                               "nxdtp.models.parallelize_model(model) first")
        if not isinstance(model, torch.nn.Module) or not any(
                getattr(p, "tensor_model_parallel", False) for p in model.parameters()):
            raise TypeError(f"{name} trains a model sharded by nxdtp.models.parallelize_model; "
                            f"{type(model).__name__} has no tensor-parallel parameter (use transformers.Trainer for a "
                            "dense model, or pass the parallelized model itself rather than a name to load)")
        reasons = _refusals(model, args) + _refused_classes(type(self))
        if reasons:
            raise ValueError(f"{name} cannot run this configuration: " + "; ".join(reasons))
        tp = parallel_state.get_tensor_model_parallel_size()
        # transformers 5 reads these to build accelerate's ParallelismConfig(tp_size, dp_shard_size): the data is
        # then split by DP rank only and the model is not wrapped in DDP. Set here, not by parallelize_model, so that
        # plain Trainer never takes this path without the gradient averaging and clipping below. A PEFT model
        # (get_peft_model) hands attribute reads to the HF model it wraps: both get them.
        for target in model_and_wrapped(model):
            target._tp_size = tp
        # The forward's guard against plain Trainer; TRL may run a reference model while it is built (DPO's
        # precomputed log-probabilities).
        for target in model_and_wrapped(model) + (model_and_wrapped(reference) if reference is not None else []):
            note_of(target, TrainedByNote).trainer = name
        model.config.distributed_config = types.SimpleNamespace(dp_size=parallel_state.get_data_parallel_size())
        with vocab_parallel_fused_heads():
            super().__init__(*positional, **keywords)
        self._refuse_foreign_accelerator()
        refuse_trl_fused_heads_left(self)
        for target in models_of(self):   # a reference model TRL made itself
            note_of(target, TrainedByNote).trainer = name

    def _refuse_foreign_accelerator(self):
        if self.accelerator.distributed_type.name == "XLA":
            raise ValueError(f"{type(self).__name__} on an XLA device: accelerate all-reduces gradients over the whole "
                             "world there; train with nxdtp's own loop on XLA (docs/wrapping_hf_models.md). On a "
                             "machine without XLA devices where torch_xla is installed, set USE_TORCH_XLA=0 in the "
                             "environment (before transformers is imported) and TrainingArguments(use_cpu=True)")
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if self.accelerator.num_processes != world:
            # accelerate did not see the torchrun world (on CPUs it needs use_cpu=True to take gloo's): Trainer
            # would scale the loss by num_processes // tp_size = 0 and train nothing, without an error.
            raise ValueError(
                f"TensorParallelTrainer: accelerate sees {self.accelerator.num_processes} process(es) "
                f"(distributed type {self.accelerator.distributed_type.name}) in a torch.distributed world of {world}; "
                "on CPUs pass TrainingArguments(use_cpu=True) (and set USE_TORCH_XLA=0 where torch_xla is "
                "installed), on GPUs launch with torchrun so that every process has its own device")

    # ---- accelerate's ParallelismConfig on CPU worlds ----------------------------------------------------------------

    def _build_accelerator_args(self, **kwargs):
        arguments = super()._build_accelerator_args(**kwargs)
        self._nxdtp_parallelism_config = None
        if os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true") or not _has_accelerator_device():
            # accelerate 1.x refuses a ParallelismConfig for MULTI_CPU (gloo) worlds, though nothing in its
            # tensor-parallel path needs a GPU: install it after the accelerator is built (below).
            self._nxdtp_parallelism_config = arguments.pop("parallelism_config", None)
        return arguments

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        config = getattr(self, "_nxdtp_parallelism_config", None)
        if config is not None:
            state = self.accelerator.state
            state.parallelism_config = config
            state.device_mesh = config.get_device_mesh(self.accelerator.device.type)

    # ---- gradients ---------------------------------------------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.accelerator.sync_gradients:   # the last micro-batch of the accumulation window
            grads.allreduce_sequence_parallel_gradients(self.model)
            grads.allreduce_gradients(self.model)
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if _next_compute_loss(type(self)) is not transformers.Trainer.compute_loss:
            # A subclass's compute_loss (TRL's) reads what it needs of the model's outputs: the full logits, or TRL's
            # fused head's statistics (nxdtp.models.fused_head); its loss scaling is its own.
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        # Trainer's own compute_loss reads nothing but the model's loss unless it returns the outputs or computes the
        # loss from the logits itself: then the logits can stay vocab-parallel (no gather).
        # Decided before the call: Trainer takes the labels out of ``inputs`` when it computes the loss itself.
        models_loss = "labels" in inputs and self.compute_loss_func is None and self.label_smoother is None
        with self._logits_unread(models_loss and not return_outputs):
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                                 num_items_in_batch=num_items_in_batch)
        if models_loss:   # else the loss holds no load-balancing term to correct
            loss = _aux_loss_scaled_once(self, loss, outputs, num_items_in_batch)
        return (loss, outputs) if return_outputs else loss

    def _clip_grad_norm(self, model):
        return grads.clip_grad_norm(self.model.parameters(), self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        return grads.get_grad_norm(self.model.parameters()) if grad_norm is None else grad_norm

    # ---- evaluation and prediction: full-vocabulary logits, gathered over DP only ------------------------------------

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        with self._logits_unread(prediction_loss_only):
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def _logits_unread(self, only_the_loss_is_wanted: bool):
        """``vocab_parallel_logits`` (no gather) when only the model's loss is wanted and Trainer's own
        ``compute_loss``, which then reads nothing else, computes it; else nothing."""
        unread = (only_the_loss_is_wanted and _next_compute_loss(type(self)) is transformers.Trainer.compute_loss
                  and self.compute_loss_func is None and self.label_smoother is None
                  and has_vocab_parallel_head(self.model))
        return vocab_parallel_logits(self.model) if unread else contextlib.nullcontext()

    def evaluation_loop(self, *args, **kwargs):
        # Trainer resets gather_function to accelerate's gather_for_metrics at the end of every loop: set it each time.
        self.gather_function = functools.partial(self._gather_for_metrics,
                                                 use_gather_object=self.args.eval_use_gather_object)
        return super().evaluation_loop(*args, **kwargs)

    def _gather_for_metrics(self, data, use_gather_object=False):
        """accelerate's ``gather_for_metrics`` over the DP group only: the ranks of a TP group hold the same batch, and
        a gather over the world would count each of its samples TP times (and cut the last batch's padding at the
        wrong place). The remainder of the last batch is cut as accelerate cuts it, its count being of DP ranks."""
        from accelerate.utils import recursively_apply

        group = parallel_state.data_parallel_group()
        if not use_gather_object:
            try:
                recursively_apply(lambda x: x, data, error_on_other_type=True)
            except TypeError:
                use_gather_object = True
        if use_gather_object:
            data = [item for piece in comm.all_gather_object(data, group) for item in piece]
        else:
            data = recursively_apply(lambda t: comm.all_gather(t.reshape(1) if t.dim() == 0 else t, group, dim=0),
                                     data)
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            if use_gather_object:
                return data[:state.remainder]
            return recursively_apply(lambda t: t[:state.remainder], data)
        return data

    # ---- saving: the dense HF directory for save_model, every rank's shards for checkpoints --------------------------

    def save_model(self, output_dir=None, _internal_call=False):
        output_dir = output_dir or self.args.output_dir
        if _internal_call:
            if self.args.save_only_model:   # else _save_optimizer_and_scheduler writes the weights in its own tag
                checkpointing.save({"model": self.model}, output_dir, tag=MODEL_TAG)
            return
        # What HF's save_model writes: the model's dense HF directory (every rank takes part in its gathers; one
        # writes), the processing class and the training arguments.
        self.model.save_pretrained(output_dir, is_main_process=self.args.should_save)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def push_to_hub(self, *args, **kwargs):
        raise NotImplementedError(PUSH_TO_HUB)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        # HF's Trainer overwrites an earlier run's checkpoint-N files; nxdtp's tags are never overwritten (a complete
        # tag is what a crash falls back to), so a second run into the same output_dir would fail at its first save,
        # after training up to it. Say so before training.
        if not resume_from_checkpoint and self.args.save_strategy != "no":
            earlier = sorted(name for name in (os.listdir(self.args.output_dir) if os.path.isdir(self.args.output_dir)
                                               else []) if name.startswith("checkpoint-") and any(
                os.path.isdir(os.path.join(self.args.output_dir, name, tag)) for tag in (TRAINING_TAG, MODEL_TAG)))
            if earlier:
                raise FileExistsError(
                    f"TensorParallelTrainer: output_dir {self.args.output_dir!r} holds checkpoints of an earlier run "
                    f"({', '.join(earlier[:3])}{', ...' if len(earlier) > 3 else ''}), whose nxdtp tags a new run "
                    "cannot overwrite: resume with trainer.train(resume_from_checkpoint=True), or give another "
                    "output_dir, or delete those checkpoint-N directories")
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _save_optimizer_and_scheduler(self, output_dir):
        checkpointing.save({"model": self.model, "optimizer": checkpointing.unwrap.unwrap_optimizer(self.optimizer),
                            "scheduler": self.lr_scheduler}, output_dir, tag=TRAINING_TAG)

    # ---- resuming, at this run's TP and DP sizes whatever the checkpoint's (nxdtp.models.trainer_resume) ------------

    def _resume_source(self, checkpoint_dir) -> ResumeSource:
        cached = getattr(self, "_nxdtp_resume", None)
        if cached is None or cached[0] != checkpoint_dir:
            self._nxdtp_resume = (checkpoint_dir, checkpoint_at_this_size(checkpoint_dir, _tag_in(checkpoint_dir),
                                                                          self.args.output_dir))
        return self._nxdtp_resume[1]

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        source = self._resume_source(resume_from_checkpoint)
        checkpointing.load(source.directory, model=self.model, tag=source.tag)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None or _tag_in(checkpoint) != TRAINING_TAG:
            return
        source = self._resume_source(checkpoint)
        optimizer = checkpointing.unwrap.unwrap_optimizer(self.optimizer)   # accelerate's wrapper holds it
        checkpointing.load(source.directory, model=self.model, optimizer=optimizer, scheduler=self.lr_scheduler,
                           tag=source.tag, restore_rng_states=source.same_layout)

    def _load_rng_state(self, checkpoint):
        if checkpoint is None or self._resume_source(checkpoint).same_layout:
            return super()._load_rng_state(checkpoint)
        reseed_by_rule(self.args.seed, self.state.global_step)


def _aux_loss_scaled_once(trainer, loss, outputs, num_items_in_batch):
    """Trainer multiplies the loss by the DP size when it divides the token loss by the global token count (each rank's
    share of a sum, averaged over DP). A mixture of experts' load-balancing loss is no such share: nxdtp counts it over
    the DP batch on every rank (``nxdtp.models.moe``), so its DP mean is already the dense one; multiplied too, its
    gradient would be the DP size times the dense model's. Undo the multiplication for that term alone."""
    scaled = (trainer.args.average_tokens_across_devices and num_items_in_batch is not None
              and (trainer.model_accepts_loss_kwargs or trainer.compute_loss_func) and trainer.args.n_gpu <= 1)
    aux = outputs.get("aux_loss") if hasattr(outputs, "get") else None
    coefficient = getattr(trainer.accelerator.unwrap_model(trainer.model), "router_aux_loss_coef", None)
    if not scaled or aux is None or coefficient is None:
        return loss
    scale = trainer.accelerator.num_processes // trainer.get_tp_size()
    return loss - (scale - 1) * coefficient * aux


def _next_compute_loss(trainer_class: type):
    """The ``compute_loss`` that ``TensorParallelTrainer.compute_loss``'s ``super()`` call reaches in
    ``trainer_class``."""
    mro = trainer_class.__mro__
    for cls in mro[mro.index(TensorParallelTrainer) + 1:]:
        if "compute_loss" in vars(cls):
            return vars(cls)["compute_loss"]
    return None


def _tag_in(checkpoint_dir: str) -> str:
    for tag in (TRAINING_TAG, MODEL_TAG):
        if os.path.isdir(os.path.join(checkpoint_dir, tag)):
            return tag
    raise FileNotFoundError(f"{checkpoint_dir} holds no nxdtp checkpoint ({TRAINING_TAG}/ or {MODEL_TAG}/): was it "
                            "written by TensorParallelTrainer?")


def _has_accelerator_device() -> bool:
    return torch.cuda.is_available()
