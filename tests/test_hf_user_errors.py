"""What an HF user's usual mistakes on a parallelized model say: each error names the value and what to do instead."""

from __future__ import annotations

import pytest
import torch

from nxdtp.models import from_pretrained_sharded, parallelize_model

transformers = pytest.importorskip("transformers")


def _tiny_llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def case_sequence_length_under_sequence_parallelism():
    model = parallelize_model(_tiny_llama(), sequence_parallel=True)
    with pytest.raises(ValueError, match=r"this batch's sequence length is 7 .* pad sequences to a multiple of 2 "
                                         r"\(a tokenizer's or collator's pad_to_multiple_of=2"):
        model(torch.randint(0, 64, (2, 7)))
    return model(torch.randint(0, 64, (2, 8))).logits.shape[1]


def test_a_sequence_sp_cannot_split_says_to_pad_it(worlds):
    assert worlds(2).run(case_sequence_length_under_sequence_parallelism, tensor_model_parallel_size=2) == [8, 8]


def case_from_pretrained_sharded_on_an_nxdtp_checkpoint(directory: str):
    from nxdtp import checkpointing

    checkpointing.save({"model": parallelize_model(_tiny_llama())}, directory)
    tag = open(f"{directory}/newest").read().strip()
    for path in (directory, f"{directory}/{tag}"):
        with pytest.raises(ValueError, match=rf"{path} is an nxdtp sharded checkpoint, not a Hugging Face model "
                                             rf"directory: .*nxdtp-merge {path} OUT_DIR"):
            from_pretrained_sharded(path)
    return True


def test_from_pretrained_sharded_on_an_nxdtp_checkpoint_says_merge_it_first(worlds, tmp_path):
    assert worlds(2).run(case_from_pretrained_sharded_on_an_nxdtp_checkpoint, tensor_model_parallel_size=2,
                         directory=str(tmp_path / "ckpt")) == [True, True]


def test_missing_rng_states_say_to_load_without_them(tmp_path):
    from nxdtp.checkpointing import restore_rng

    with pytest.raises(FileNotFoundError, match=r"rng/rank_00003\.json is missing: .*a resharded checkpoint has "
                                                r"none.*restore_rng_states=False"):
        restore_rng(str(tmp_path), 3)


# ---- HF methods that would act on one rank's shards ------------------------------------------------------------------

def case_dense_only_methods_refuse():
    import transformers

    from nxdtp.models import parallelize_model

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = parallelize_model(transformers.LlamaForCausalLM(config))
    messages = []
    for call, expected in ((lambda: model.resize_token_embeddings(80), "resize the dense model"),
                           (lambda: model.push_to_hub("me/tiny-llama"), "upload dir from one rank")):
        with pytest.raises(NotImplementedError, match=expected) as error:
            call()
        messages.append(str(error.value))
    assert model.get_input_embeddings().weight.shape[0] == 32   # untouched: this rank's half of the vocabulary
    return messages


def test_resize_token_embeddings_and_push_to_hub_refuse_with_what_to_do(worlds):
    """HF's resize_token_embeddings raised a TypeError about nn.Embedding that said nothing of what to do; push_to_hub
    would upload from whichever rank calls it while its save (a collective) waits for the others."""
    results = worlds(2).run(case_dense_only_methods_refuse, tensor_model_parallel_size=2)
    assert results[0] == results[1]
