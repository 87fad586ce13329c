"""One Hugging Face Trainer run for tests/test_trainer.py, in a process of its own: ``python tests/trainer_runs.py
dense OUT`` trains the dense model on the global batch; under torchrun, ``tp OUT --tp 2`` trains the nxdtp-parallelized
copy with TensorParallelTrainer (``plain OUT``: with transformers.Trainer, which must refuse). Both write their
per-step log (loss, grad norm) to OUT/log.json and their final weights with ``trainer.save_model`` (an HF directory:
OUT itself for the dense run, OUT/final for the TP run). ``--precision bf16|fp16`` sets TrainingArguments' switch.
With ``--eval`` the trained model is then evaluated (``trainer.evaluate`` with a token-accuracy ``compute_metrics``
and an argmax ``preprocess_logits_for_metrics``) and asked for predictions (``trainer.predict``, full logits) on an
eval set of EVAL_SAMPLES and a prediction set of PREDICT_SAMPLES (not a multiple of the global eval batch):
OUT/eval.json holds both metric dictionaries, OUT/predictions.npy and OUT/label_ids.npy what ``predict`` returned.

Trainer picks an XLA device whenever torch_xla is installed unless USE_TORCH_XLA=0, so the test sets it; it must be
set before transformers is imported.
"""

from __future__ import annotations

import argparse
import copy
import json
import os

import torch

VOCAB, SEQ, SAMPLES = 67, 8, 16
TRAINING_OVERRIDES: dict = {}   # TrainingArguments every run of this process takes (--label_smoothing)
EVAL_SAMPLES, PREDICT_SAMPLES = 8, 9


def dense_model(family: str = "llama"):
    """A tiny Llama, or (``family="mixtral"``) a tiny Mixtral of 4 experts whose loss includes the load-balancing
    loss, or (``"bert"``, ``"roberta"``) a tiny masked-LM encoder without dropout."""
    torch.manual_seed(0)
    model = _untrained_model(family)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():   # randomise everything, biases and norms included
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def _untrained_model(family: str):
    import transformers

    if family in ("bert", "roberta"):
        config_class = transformers.BertConfig if family == "bert" else transformers.RobertaConfig
        config = config_class(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                              attention_probs_dropout_prob=0.0)
        model_class = transformers.BertForMaskedLM if family == "bert" else transformers.RobertaForMaskedLM
        return model_class(config)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=32, tie_word_embeddings=False)
    if family == "mixtral":
        config = transformers.MixtralConfig(**common, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                                            router_aux_loss_coef=0.3, output_router_logits=True)
        return transformers.MixtralForCausalLM(config)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, intermediate_size=64, attention_bias=True))


class Samples(torch.utils.data.Dataset):
    """Token ids with labels; some label positions ignored, so the token count differs per sample."""

    def __init__(self, count: int = SAMPLES, seed: int = 2):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (count, SEQ), generator=g)
        self.labels = self.ids.clone()
        self.labels[torch.rand(count, SEQ, generator=g) < 0.25] = -100

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def token_accuracy(prediction) -> dict:
    """compute_metrics: next-token accuracy by argmax (predictions are logits, or ids from argmax_ids)."""
    import numpy as np

    predicted, labels = np.asarray(prediction.predictions), np.asarray(prediction.label_ids)
    if predicted.ndim == 3:
        predicted = predicted.argmax(-1)
    predicted, labels = predicted[:, :-1], labels[:, 1:]
    counted = labels != -100
    # The id sum tells apart argmaxes over the wrong vocabulary (a TP rank's shard holds local ids) even where an
    # untrained model's accuracy is near 0 either way.
    return {"accuracy": float((predicted[counted] == labels[counted]).mean()), "counted": int(counted.sum()),
            "argmax_id_sum": int(predicted[counted].sum())}


def argmax_ids(logits, labels):
    """preprocess_logits_for_metrics: keep the argmax ids instead of the logits."""
    return logits.argmax(-1)


def evaluate_and_predict(trainer, out: str, write: bool) -> None:
    import numpy as np

    trainer.args.dataloader_drop_last = False   # predict's last batch is incomplete (padded and cut back at dp2)
    evaluated = trainer.evaluate(eval_dataset=Samples(EVAL_SAMPLES, seed=5))
    trainer.preprocess_logits_for_metrics = None   # predict: the full logits
    predicted = trainer.predict(Samples(PREDICT_SAMPLES, seed=6))
    if write:
        with open(os.path.join(out, "eval.json"), "w") as f:
            json.dump({"evaluate": evaluated, "predict": predicted.metrics}, f)
        np.save(os.path.join(out, "predictions.npy"), predicted.predictions)
        np.save(os.path.join(out, "label_ids.npy"), predicted.label_ids)


def precision_arguments(precision: str) -> dict:
    return {"fp32": {}, "bf16": dict(bf16=True), "fp16": dict(fp16=True)}[precision]


def with_lora(model):
    """LoRA (PEFT) on every projection, its factors seeded alike for the dense and the TP run (PEFT makes the dense
    factors on each rank; nxdtp keeps each rank's part). Gaussian A, so that both factors train from the first step."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(11)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights="gaussian",
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"]))


def training_arguments(out: str, per_device: int, accumulation: int, use_cpu: bool = True, **extra):
    """SGD: the final weights then differ from dense's as the gradients do. (Adam divides each gradient element by
    its own running scale, so an element that is zero in exact arithmetic, such as the key bias's, turns rounding
    noise into full-size steps; the gradients themselves are compared through the logged pre-clip norms.)"""
    import transformers

    return transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=per_device, per_device_eval_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        learning_rate=1e-2, max_grad_norm=0.5, logging_steps=1, report_to=[], optim="sgd", seed=3, data_seed=4,
        dataloader_drop_last=True, use_cpu=use_cpu, disable_tqdm=True,
        **{"max_steps": 4, "save_strategy": "no", **extra, **TRAINING_OVERRIDES})


def _log(trainer):
    return [{"step": e["step"], "loss": e["loss"], "grad_norm": float(e["grad_norm"])}
            for e in trainer.state.log_history if "loss" in e]


def metric_arguments(evaluate: bool, custom_loss: bool = False) -> dict:
    metrics = dict(compute_metrics=token_accuracy, preprocess_logits_for_metrics=argmax_ids) if evaluate else {}
    return {**metrics, "compute_loss_func": z_loss_cross_entropy} if custom_loss else metrics


def z_loss_cross_entropy(outputs, labels, num_items_in_batch=None):
    """A user's loss on ``outputs.logits`` (Trainer's compute_loss_func): next-token cross entropy plus a z-loss
    (the squared log-normaliser), summed over the counted tokens and divided by Trainer's global count."""
    logits = outputs.logits[:, :-1].float()
    targets = labels[:, 1:]
    counted = targets != -100
    log_z = logits.logsumexp(-1)
    nll = log_z - logits.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    total = ((nll + 1e-2 * log_z ** 2) * counted).sum()
    return total / (counted.sum() if num_items_in_batch is None else num_items_in_batch)


def run_dense(out: str, per_device: int, accumulation: int, precision: str, evaluate: bool, lora: bool,
              family: str, custom_loss: bool = False) -> None:
    import transformers

    model = with_lora(dense_model(family)) if lora else dense_model(family)
    trainer = transformers.Trainer(model=model, train_dataset=Samples(), **metric_arguments(evaluate, custom_loss),
                                   args=training_arguments(out, per_device, accumulation,
                                                           **precision_arguments(precision)))
    trainer.train()
    trainer.save_model(out)
    with open(os.path.join(out, "log.json"), "w") as f:
        json.dump(_log(trainer), f)
    if evaluate:
        evaluate_and_predict(trainer, out, write=True)


def run_tp(out: str, tp: int, per_device: int, accumulation: int, save_steps: int, resume: str, max_steps: int,
           precision: str, evaluate: bool, plain: bool = False, lora: bool = False, use_cpu: bool = True,
           family: str = "llama", ep: int = 1, custom_loss: bool = False):
    import torch.distributed as dist
    import transformers

    from nxdtp import parallel_state
    from nxdtp.models import parallelize_model
    from nxdtp.models.hf_trainer import TensorParallelTrainer

    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    model = parallelize_model(copy.deepcopy(dense_model(family)))
    if lora:
        model = with_lora(model)
    saving = dict(save_strategy="steps", save_steps=save_steps) if save_steps else {}
    trainer_class = transformers.Trainer if plain else TensorParallelTrainer   # plain: what an HF user tries first
    trainer = trainer_class(model=model, train_dataset=Samples(), **metric_arguments(evaluate, custom_loss),
                            args=training_arguments(out, per_device, accumulation, max_steps=max_steps, **saving,
                                                    use_cpu=use_cpu, **precision_arguments(precision)))
    trainer.train(resume_from_checkpoint=resume or None)
    trainer.save_model(os.path.join(out, "final"))
    if dist.get_rank() == 0:
        with open(os.path.join(out, "log.json"), "w") as f:
            json.dump(_log(trainer), f)
    if evaluate:
        evaluate_and_predict(trainer, out, write=dist.get_rank() == 0)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["dense", "tp", "plain"])
    parser.add_argument("out")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--per_device", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--save_steps", type=int, default=0)
    parser.add_argument("--max_steps", type=int, default=4)
    parser.add_argument("--resume", default="")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--eval", action="store_true")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (PEFT) on every projection")
    parser.add_argument("--no_use_cpu", action="store_true", help="leave TrainingArguments' use_cpu False")
    parser.add_argument("--model", choices=["llama", "mixtral", "bert", "roberta"], default="llama")
    parser.add_argument("--ep", type=int, default=1, help="expert_model_parallel_size (mixtral)")
    parser.add_argument("--custom_loss", action="store_true", help="Trainer's compute_loss_func on outputs.logits")
    parser.add_argument("--label_smoothing", action="store_true", help="TrainingArguments(label_smoothing_factor=0.1)")
    a = parser.parse_args()
    if a.label_smoothing:
        TRAINING_OVERRIDES["label_smoothing_factor"] = 0.1
    if a.kind == "dense":
        run_dense(a.out, a.per_device, a.accumulation, a.precision, a.eval, a.lora, a.model, a.custom_loss)
    else:
        run_tp(a.out, a.tp, a.per_device, a.accumulation, a.save_steps, a.resume, a.max_steps, a.precision, a.eval,
               a.kind == "plain", a.lora, not a.no_use_cpu, a.model, a.ep, a.custom_loss)
