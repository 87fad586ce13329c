"""from_pretrained_sharded: a sharded BERT built from an HF directory equals the dense model from_pretrained gives."""

from __future__ import annotations

import json
import os

import pytest

from tests.harness import WorkerGroup  # noqa: F401  (the worlds fixture lives in conftest)

VOCAB = 53  # odd: padded at tp=2 and tp=4


def _config():
    from transformers import BertConfig

    return BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, architectures=["BertForPreTraining"])


def _dense_randomised(seed=0):
    import torch
    from transformers import BertForPreTraining

    torch.manual_seed(seed)
    model = BertForPreTraining(_config())
    with torch.no_grad():
        for p in model.parameters():  # HF starts biases at 0 and LayerNorms at 1: that would hide bugs
            p.add_(torch.randn_like(p) * 0.2)
    return model


def _forms():
    """The checkpoint forms to read: what the installed transformers' ``save_pretrained`` writes (``model.safetensors``,
    and sharded with its index; transformers 4.26 writes ``pytorch_model.bin`` by default and cannot write BERT's tied
    weights as safetensors), then a ``pytorch_model.bin`` with the legacy names of early BERT checkpoints."""
    import inspect

    from transformers import PreTrainedModel

    option = inspect.signature(PreTrainedModel.save_pretrained).parameters.get("safe_serialization")
    if option is None or option.default is True:  # transformers 5 has no such option: it always writes safetensors
        return ["safetensors", "sharded-safetensors", "bin-legacy-names"]
    return ["bin", "bin-legacy-names"]


def _write_checkpoint(model, directory: str, form: str) -> None:
    """Write ``model`` in one of the forms from_pretrained_sharded reads."""
    import torch

    if form in ("safetensors", "bin"):
        model.save_pretrained(directory)
        assert os.path.isfile(os.path.join(directory, "model.safetensors" if form == "safetensors"
                                           else "pytorch_model.bin")), os.listdir(directory)
        return
    if form == "sharded-safetensors":
        model.save_pretrained(directory, max_shard_size="8KB")
        assert os.path.isfile(os.path.join(directory, "model.safetensors.index.json"))
        return
    # pytorch_model.bin with the legacy LayerNorm names of early BERT checkpoints, and the tied decoder weight absent
    model.config.save_pretrained(directory)
    state = {}
    for key, value in model.state_dict().items():
        if key == "cls.predictions.decoder.weight":
            continue
        key = key.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")
        state[key] = value.clone()
    torch.save(state, os.path.join(directory, "pytorch_model.bin"))


def case_load_equals_dense(root: str, forms):
    import torch
    import torch.distributed as dist
    from transformers import BertForPreTraining, BertForSequenceClassification

    from nxdtp import comm, parallel_state
    from nxdtp.layers import shard_of
    from nxdtp.models import from_pretrained_sharded, gather_vocab_logits

    rank, tp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_size()
    dense = _dense_randomised()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(5))
    for form in forms:
        directory = os.path.join(root, form)
        if dist.get_rank() == 0:
            _write_checkpoint(dense, directory, form)
        comm.barrier()
        # The first form is save_pretrained's own, written before the others.
        reference = BertForPreTraining.from_pretrained(os.path.join(root, forms[0]))
        model = from_pretrained_sharded(directory)
        assert type(model).__name__ == "BertForPreTraining", form
        out, expected = model(ids), reference(ids)
        torch.testing.assert_close(gather_vocab_logits(out.prediction_logits, VOCAB), expected.prediction_logits,
                                   rtol=1e-5, atol=1e-5, msg=lambda m: f"{form}: {m}")
        torch.testing.assert_close(out.seq_relationship_logits, expected.seq_relationship_logits, rtol=1e-5,
                                   atol=1e-5)
        # Parameter by parameter: each rank holds exactly its slice of the dense tensor (padding rows zero).
        dense_params = dict(reference.named_parameters())
        for name, param in model.named_parameters():
            full = dense_params[name].detach()
            if getattr(param, "tensor_model_parallel", False):
                padded_rows = param.shape[0] * tp if param.partition_dim == 0 else full.shape[0]
                if padded_rows > full.shape[0]:
                    full = torch.cat([full, torch.zeros((padded_rows - full.shape[0],) + tuple(full.shape[1:]))])
                full = shard_of(full, param.partition_dim, rank, tp, param.partition_stride)
            assert torch.equal(param.detach(), full), f"{form}: {name}"
        assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight, form

    # Missing sharded tensors: a bias starts at zero as in HF (outputs still equal HF's from_pretrained of the same
    # directory); a weight cannot be reproduced and is refused by name.
    from safetensors.torch import save_file

    # As transformers 5 saves BERT: the tied decoder weight and bias only under their sources' names.
    full = {k: v.clone() for k, v in dense.state_dict().items()
            if k not in ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")}
    for form, drop in (("no-mlm-bias", ("cls.predictions.bias", "cls.predictions.decoder.bias")),
                       ("no-query-weight", ("bert.encoder.layer.0.attention.self.query.weight",))):
        directory = os.path.join(root, form)
        if dist.get_rank() == 0:
            os.makedirs(directory, exist_ok=True)
            dense.config.save_pretrained(directory)
            save_file({k: v for k, v in full.items() if k not in drop}, os.path.join(directory, "model.safetensors"),
                      metadata={"format": "pt"})
        comm.barrier()
        if form == "no-mlm-bias":
            model = from_pretrained_sharded(directory)
            assert torch.all(model.cls.predictions.bias == 0) and not model.training
            expected = BertForPreTraining.from_pretrained(directory)(ids)
            torch.testing.assert_close(gather_vocab_logits(model(ids).prediction_logits, VOCAB),
                                       expected.prediction_logits, rtol=1e-5, atol=1e-5)
        else:
            try:
                from_pretrained_sharded(directory)
            except ValueError as e:
                assert "lacks tensor-parallel parameters ['bert.encoder.layer.0.attention.self.query.weight']" in str(e)
            else:
                raise AssertionError("a checkpoint without a sharded weight was accepted")

    # A classifier the checkpoint lacks is initialised and made identical on every TP rank.
    classifier = from_pretrained_sharded(os.path.join(root, forms[0]),
                                         model_class=BertForSequenceClassification)
    tp_group = parallel_state.tensor_parallel_group()
    weights = [torch.empty_like(classifier.classifier.weight) for _ in range(tp_group.size)]
    dist.all_gather(weights, classifier.classifier.weight.detach().contiguous(),
                    group=tp_group.process_group_for("cpu"))
    assert all(torch.equal(w, weights[0]) for w in weights)
    return True


@pytest.mark.parametrize("world,tp", [(2, 2), (4, 4)])
def test_from_pretrained_sharded_equals_from_pretrained(worlds, tmp_path, world, tp):
    forms = _forms()
    assert all(worlds(world).run(case_load_equals_dense, tensor_model_parallel_size=tp, root=str(tmp_path),
                                 forms=forms))


def test_missing_checkpoint_is_named(tmp_path):
    from nxdtp.models import from_pretrained_sharded
    from nxdtp.parallel_state import simulated_topology

    _config().save_pretrained(tmp_path)
    with simulated_topology(world_size=2, rank=0, tensor_model_parallel_size=2):
        with pytest.raises(FileNotFoundError, match="has none of model.safetensors"):
            from_pretrained_sharded(str(tmp_path))


def test_shape_mismatch_is_named(tmp_path):
    import torch
    from safetensors.torch import save_file

    from nxdtp.models.hf_loading import CheckpointReader, read_shard
    from nxdtp.spec import ParamSpec

    save_file({"w": torch.zeros(10, 4)}, os.path.join(tmp_path, "model.safetensors"))
    reader = CheckpointReader(str(tmp_path))
    with pytest.raises(ValueError, match=r"'w' has shape \[10, 4\], but the model expects \[12, 4\]"):
        read_shard(reader, "w", ParamSpec(full_shape=(12, 4), partition_dim=0, num_partitions=2), rank=0)
    with open(os.path.join(tmp_path, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"w": "absent.safetensors"}}, f)
    os.remove(os.path.join(tmp_path, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="names absent.safetensors for 'w'"):
        CheckpointReader(str(tmp_path))
