"""One TRL run for tests/test_trl.py, in a process of its own: ``python tests/trl_runs.py sft dense OUT`` trains the
dense tiny Llama with TRL's SFTTrainer (``dpo``: DPOTrainer, the reference model a copy of the initial one) on the
global batch; under torchrun ``sft tp OUT --tp 2`` trains the nxdtp-parallelized copy with
``tensor_parallel_trainer(SFTTrainer)``. Each writes its per-step log (every number TRL logs) to OUT/log.json and its
final weights with ``trainer.save_model`` (OUT itself for the dense run, OUT/final for the TP run).

The data: token ids of different lengths (so the collators pad and mask), from a word-level tokenizer built here (no
hub access): SFT on pre-tokenized ``input_ids``, DPO on prompt / chosen / rejected texts.
"""

from __future__ import annotations

import argparse
import copy
import json
import os

import torch

from tests.trainer_runs import VOCAB, dense_model

SAMPLES = 16


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(VOCAB - 2)}
    words.update({"<pad>": VOCAB - 2, "<eos>": VOCAB - 1})
    backend = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


def _words(g, low: int, high: int) -> str:
    length = int(torch.randint(low, high, (), generator=g))
    return " ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 2, (length,), generator=g))


def dataset(kind: str):
    from datasets import Dataset

    g = torch.Generator().manual_seed(7)
    if kind == "sft":
        rows = [{"input_ids": torch.randint(0, VOCAB - 2, (int(torch.randint(4, 9, (), generator=g)),),
                                            generator=g).tolist()} for _ in range(SAMPLES)]
    else:
        rows = [{"prompt": _words(g, 2, 5), "chosen": _words(g, 1, 4), "rejected": _words(g, 1, 4)}
                for _ in range(SAMPLES)]
    return Dataset.from_list(rows)


def config(kind: str, out: str, per_device: int, accumulation: int, **options):
    """SGD in fp32 (see tests/trainer_runs.py's training_arguments), TRL's other defaults kept (gradient
    checkpointing on, as SFTConfig sets it); ``options`` override."""
    import trl

    common = dict(output_dir=out, per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
                  learning_rate=1e-2, max_grad_norm=0.5, logging_steps=1, report_to=[], optim="sgd", seed=3,
                  data_seed=4, dataloader_drop_last=True, use_cpu=True, disable_tqdm=True, max_steps=3,
                  save_strategy="no", **{"bf16": False, "max_length": None, **options})
    if kind == "sft":
        return trl.SFTConfig(**common)
    return trl.DPOConfig(**common, beta=0.5)


def check_reference_head_under_mixed_precision(trainer_class, policy, reference, out: str) -> None:
    """With bf16, accelerate wraps the reference model's forward while DPOTrainer is built: the forward it wraps
    must be nxdtp's vocab-parallel fused head, not TRL's (which would read this rank's vocabulary shard)."""
    built = trainer_class(model=copy.deepcopy(policy), ref_model=copy.deepcopy(reference),
                          args=config("dpo", out, 1, 1, bf16=True), train_dataset=dataset("dpo"),
                          processing_class=tokenizer())
    wrapped = built.ref_model.__dict__["_original_forward"]
    assert wrapped.__func__.__code__.co_filename.endswith("fused_head.py"), wrapped.__func__.__code__


def run(kind: str, out: str, tp: int, per_device: int, accumulation: int) -> None:
    import torch.distributed as dist
    import trl

    trainer_class = trl.SFTTrainer if kind == "sft" else trl.DPOTrainer
    policy = dense_model()
    reference = copy.deepcopy(policy) if kind == "dpo" else None
    if tp:
        from nxdtp import parallel_state
        from nxdtp.models import parallelize_model
        from nxdtp.models.hf_trainer import tensor_parallel_trainer

        dist.init_process_group("gloo")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        policy = parallelize_model(policy)
        reference = parallelize_model(reference) if reference is not None else None
        trainer_class = tensor_parallel_trainer(trainer_class)
    extra = {"ref_model": reference} if kind == "dpo" else {}
    if tp and kind == "dpo":
        check_reference_head_under_mixed_precision(trainer_class, policy, reference, os.path.join(out, "bf16"))
    trainer = trainer_class(model=policy, args=config(kind, out, per_device, accumulation),
                            train_dataset=dataset(kind), processing_class=tokenizer(), **extra)
    trainer.train()
    trainer.save_model(os.path.join(out, "final") if tp else out)
    if not tp or dist.get_rank() == 0:
        with open(os.path.join(out, "log.json"), "w") as f:
            json.dump([{key: float(value) for key, value in entry.items() if isinstance(value, (int, float))}
                       for entry in trainer.state.log_history if "loss" in entry], f)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["sft", "dpo"])
    parser.add_argument("layout", choices=["dense", "tp"])
    parser.add_argument("out")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--per_device", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=2)
    a = parser.parse_args()
    run(a.kind, a.out, a.tp if a.layout == "tp" else 0, a.per_device, a.accumulation)
