"""One Hugging Face Trainer run for tests/test_trainer.py, in a process of its own: ``python tests/trainer_runs.py
dense OUT`` trains the dense model on the global batch; under torchrun, ``tp OUT --tp 2`` trains the nxdtp-parallelized
copy with TensorParallelTrainer (``plain OUT``: with transformers.Trainer, which must refuse). Both write their
per-step log (loss, grad norm) to OUT/log.json and their final weights (the dense model's ``model.safetensors``; the
TP run's nxdtp tag, which the test merges).

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


def dense_model():
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      attention_bias=True, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():   # randomise everything, biases and norms included
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


class Samples(torch.utils.data.Dataset):
    """Token ids with labels; some label positions ignored, so the token count differs per sample."""

    def __init__(self):
        g = torch.Generator().manual_seed(2)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
        self.labels = self.ids.clone()
        self.labels[torch.rand(SAMPLES, SEQ, generator=g) < 0.25] = -100

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def training_arguments(out: str, per_device: int, accumulation: int, **extra):
    """SGD: the final weights then differ from dense's as the gradients do. (Adam divides each gradient element by
    its own running scale, so an element that is zero in exact arithmetic, such as the key bias's, turns rounding
    noise into full-size steps; the gradients themselves are compared through the logged pre-clip norms.)"""
    import transformers

    return transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
        learning_rate=1e-2, max_grad_norm=0.5, logging_steps=1, report_to=[], optim="sgd", seed=3, data_seed=4,
        dataloader_drop_last=True, use_cpu=True, disable_tqdm=True, **{"max_steps": 4, "save_strategy": "no", **extra})


def _log(trainer):
    return [{"step": e["step"], "loss": e["loss"], "grad_norm": float(e["grad_norm"])}
            for e in trainer.state.log_history if "loss" in e]


def run_dense(out: str, per_device: int, accumulation: int) -> None:
    import transformers

    trainer = transformers.Trainer(model=dense_model(), args=training_arguments(out, per_device, accumulation),
                                   train_dataset=Samples())
    trainer.train()
    trainer.save_model(out)
    with open(os.path.join(out, "log.json"), "w") as f:
        json.dump(_log(trainer), f)


def run_tp(out: str, tp: int, per_device: int, accumulation: int, save_steps: int, resume: str, max_steps: int,
           plain: bool = False):
    import torch.distributed as dist
    import transformers

    from nxdtp import parallel_state
    from nxdtp.models import parallelize_model
    from nxdtp.models.trainer import TensorParallelTrainer

    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model = parallelize_model(copy.deepcopy(dense_model()))
    saving = dict(save_strategy="steps", save_steps=save_steps) if save_steps else {}
    trainer_class = transformers.Trainer if plain else TensorParallelTrainer   # plain: what an HF user tries first
    trainer = trainer_class(model=model, args=training_arguments(out, per_device, accumulation,
                                                                         max_steps=max_steps, **saving),
                                    train_dataset=Samples())
    trainer.train(resume_from_checkpoint=resume or None)
    trainer.save_model(os.path.join(out, "final"))
    if dist.get_rank() == 0:
        with open(os.path.join(out, "log.json"), "w") as f:
            json.dump(_log(trainer), f)
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
    a = parser.parse_args()
    if a.kind == "dense":
        run_dense(a.out, a.per_device, a.accumulation)
    else:
        run_tp(a.out, a.tp, a.per_device, a.accumulation, a.save_steps, a.resume, a.max_steps, a.kind == "plain")
