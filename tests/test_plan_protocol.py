"""The style protocol, the plans as data, the family registry and the one record of notes (issue 26, part 3).

* Each built-in style's declared ``records`` are the ParamSpec fields its converted parameters really carry.
* Every family's plan, with and without sequence parallelism, opens as many tensor-parallel regions as it closes in
  each layer, and as many sequence-parallel ones as it closes in the model; the check catches a plan that lost its
  block wrapper.
* The matching rules: a replacing style must name a leaf, an in-place one may name a parent (applied after it);
  ``Chain`` refuses a late replacing style; an object outside the protocol is refused as a style, naming where.
* The registry is the one list of families.
* After parallelizing, a forward, generation_mode and gradient checkpointing, no module of a model carries an nxdtp
  note outside its record.

The numerics of the plans (equal to dense) are the model tests' business (test_models_*.py); this file tests the
structure they rest on.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
import transformers
from torch import nn

from nxdtp import parallel_state as ps
from nxdtp.plan import (
    SEQUENCE_PARALLEL,
    TENSOR_PARALLEL,
    Chain,
    ColumnParallel,
    Effect,
    HeadPadded,
    KVReplicatedColumnParallel,
    Plan,
    Replicate,
    RowParallel,
    SetAttributes,
    Style,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    WrapForward,
    describe,
    parallelize,
)
from nxdtp.spec import ParamSpec, ShardedModule

# ParamSpec fields that say how a tensor is split, which every sharded spec sets; the records are the rest.
SPLIT_FIELDS = {"full_shape", "partition_dim", "num_partitions"}
DEFAULTS = {field.name: field.default for field in dataclasses.fields(ParamSpec) if field.name not in SPLIT_FIELDS}


def _randomised(module: nn.Module) -> nn.Module:
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return module


class RMSNorm(nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


# (style, the dense module it converts, the records the conversion must set: each case makes every declared field
# matter, e.g. a vocabulary TP does not divide, heads TP does not divide)
STYLE_CASES = [
    (ColumnParallel(stride=3), lambda: nn.Linear(8, 12), {"stride"}),
    (RowParallel(), lambda: nn.Linear(8, 6), set()),
    (VocabParallelEmbedding(pad_to_multiple_of=4), lambda: nn.Embedding(13, 8),
     {"real_shape", "pad_to_multiple_of", "vocabulary"}),
    (VocabParallelLMHead(pad_to_multiple_of=4), lambda: nn.Linear(8, 13), {"real_shape", "pad_to_multiple_of",
                                                                            "vocabulary"}),
    (Replicate(sequence_parallel=True), lambda: nn.LayerNorm(8), {"sequence_parallel"}),
    (Replicate(sequence_parallel=True), lambda: RMSNorm(8), {"sequence_parallel"}),
    (KVReplicatedColumnParallel(head_dim=4, replicas=2), lambda: nn.Linear(8, 4), {"real_shape", "replicas",
                                                                                    "replica_block"}),
    (HeadPadded(ColumnParallel(), head_dim=2, padded_heads=4, dim=0), lambda: nn.Linear(8, 6),
     {"real_shape", "pad_block"}),
    (HeadPadded(ColumnParallel(), head_dim=2, padded_heads=8, dim=0, groups=2), lambda: nn.Linear(8, 12),
     {"real_shape", "pad_block", "pad_groups"}),
    (HeadPadded(RowParallel(), head_dim=2, padded_heads=4, dim=1, groups=1), lambda: nn.Linear(6, 8),
     {"real_shape", "pad_block"}),
]


def _set_records(module: nn.Module) -> set:
    """The ParamSpec fields, beyond the split, that ``module``'s parameters carry with a non-default value."""
    if not isinstance(module, ShardedModule):
        return set()
    return {name for spec in module.param_specs().values() for name, default in DEFAULTS.items()
            if getattr(spec, name) != default and not (name == "real_shape" and spec.real_shape == spec.full_shape)}


@pytest.mark.parametrize("style,dense,expected", STYLE_CASES, ids=[f"{type(c[0]).__name__}-{i}"
                                                                    for i, c in enumerate(STYLE_CASES)])
def test_a_style_records_what_it_declares(style, dense, expected):
    with ps.simulated_topology(world_size=2, rank=1, tensor_model_parallel_size=2):
        converted = style.convert(_randomised(dense()), "module", ps.tensor_parallel_group())
    declared = set(style.effect.records)
    carried = _set_records(converted)
    assert carried <= declared, f"{style} sets {carried - declared} without declaring them"
    assert carried == expected


# ---- regions balance in every family's plan --------------------------------------------------------------------------

def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))


def _qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=4))


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=4,
                                                                n_positions=32))


def _bert():
    return transformers.BertForPreTraining(transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=24,
        max_position_embeddings=32))


def _roberta():
    return transformers.RobertaForMaskedLM(transformers.RobertaConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=24,
        max_position_embeddings=40))


MODELS = {"llama": (_llama, "model.layers."), "qwen3": (_qwen3, "model.layers."), "gpt2": (_gpt2, "transformer.h."),
          "bert": (_bert, "bert.encoder.layer."), "roberta": (_roberta, "roberta.encoder.layer.")}


def _family_plan(model: nn.Module, sequence_parallel: bool) -> Plan:
    from nxdtp.models.registry import family_of

    return family_of(type(model).__name__).plan(sequence_parallel, 1, True)


def unbalanced_regions(rows, layer_prefix: str) -> list:
    """What is unbalanced in ``describe``'s rows: per layer (``<layer_prefix><n>.``), the tensor-parallel regions
    opened against those closed; over the model, the sequence-parallel ones."""
    tensor = collections.Counter()
    sequence = collections.Counter()
    for name, _, effect in rows:
        if name.startswith(layer_prefix):
            layer = name[:len(layer_prefix)] + name[len(layer_prefix):].split(".")[0]
            tensor[layer] += (effect.opens == TENSOR_PARALLEL) - (effect.closes == TENSOR_PARALLEL)
        sequence["model"] += (effect.opens == SEQUENCE_PARALLEL) - (effect.closes == SEQUENCE_PARALLEL)
    return [(where, count) for where, count in list(tensor.items()) + list(sequence.items()) if count]


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_every_family_plan_closes_the_regions_it_opens(family, sequence_parallel):
    build, layer_prefix = MODELS[family]
    with ps.simulated_topology(world_size=2, rank=0, tensor_model_parallel_size=2):
        model = build()
        rows = describe(model, _family_plan(model, sequence_parallel))
    layers = {name[len(layer_prefix):].split(".")[0] for name, _, _ in rows if name.startswith(layer_prefix)}
    assert layers == {"0", "1"}
    assert unbalanced_regions(rows, layer_prefix) == []
    opened = [effect.opens for _, _, effect in rows]
    assert opened.count(SEQUENCE_PARALLEL) == (1 if sequence_parallel else 0)


def test_the_region_check_catches_a_plan_without_its_block_wrapper():
    with ps.simulated_topology(world_size=2, rank=0, tensor_model_parallel_size=2):
        model = _llama()
        plan = _family_plan(model, False)
        rows = describe(model, plan)
        def prepare_without_mlp_block(model, group):
            return {p: s for p, s in plan.prepare(model, group).items() if p != "model.layers.*.mlp"}

        without_mlp_block = Plan(plan.styles, prepare_without_mlp_block)
        broken = describe(model, without_mlp_block)
    assert unbalanced_regions(rows, "model.layers.") == []
    assert unbalanced_regions(broken, "model.layers.") == [("model.layers.0", -1), ("model.layers.1", -1)]


# ---- matching rules --------------------------------------------------------------------------------------------------

@pytest.fixture
def world_of_one():
    with ps.simulated_topology(world_size=1, rank=0, tensor_model_parallel_size=1):
        yield

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.scale = 1.0

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) * self.scale


def _doubled(forward, x):
    return 2 * forward(x)


def test_an_in_place_style_on_a_parent_runs_after_its_children_are_converted(world_of_one):
    torch.manual_seed(0)
    dense = Block()
    model = Block()
    model.load_state_dict(dense.state_dict())
    # A plan never names the root module (it has no name), so the parent is put in a wrapper.
    outer_dense, outer = nn.Sequential(dense), nn.Sequential(model)
    plan = Plan({"0": Chain((SetAttributes((("scale", 0.5),)), WrapForward("test_doubled", _doubled))),
                 "0.up": ColumnParallel(), "0.down": RowParallel()})
    order = [name for name, _, _ in describe(outer, plan)]
    assert order == ["0.up", "0.down", "0"]
    parallelize(outer, plan)
    x = torch.randn(3, 8)
    torch.testing.assert_close(outer(x), outer_dense(x), atol=1e-6, rtol=1e-6)   # 2 * 0.5 = 1
    assert outer[0].scale == 0.5 and isinstance(outer[0], Block)


@dataclasses.dataclass(frozen=True)
class _ToIdentity(Style):
    """A replacing style of the test's own."""

    effect = Effect(replaces=True)

    def convert(self, module, name, group):
        return nn.Identity()


class _OldStyle:
    """An object with a two-argument ``convert`` and no declared effect, as styles were before the protocol."""

    def convert(self, module, name):
        return nn.Identity()


def test_a_replacing_style_on_a_parent_of_another_match_is_refused(world_of_one):
    outer = nn.Sequential(nn.Sequential(nn.Linear(4, 4)))
    plan = Plan({"0": _ToIdentity(), "0.0": ColumnParallel()})
    with pytest.raises(ValueError, match=r"plan matches nested modules \('0', '0.0'\), and the style on '0' "
                                         r"replaces it: name leaf modules"):
        parallelize(outer, plan)


def test_parallelizing_a_model_twice_is_refused_naming_the_sharded_layer(world_of_one):
    model = parallelize(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), Plan({"0": ColumnParallel()}))
    with pytest.raises(TypeError, match=r"ColumnParallel applies to Linear, but '0' is ColumnParallelLinear: it is "
                                        r"sharded already \(was the model parallelized before\?"):
        parallelize(model, Plan({"0": ColumnParallel()}))


def test_an_optimizer_built_before_parallelizing_is_refused_at_its_first_step(world_of_one):
    """It holds the dense weights the plan replaced, which get no gradient: without the refusal only the kept
    parameters (here the ReLU-free second Linear) would train. An optimizer built after steps as usual."""
    model = _randomised(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    parallelize(model, Plan({"0": ColumnParallel()}))
    model(torch.randn(2, 4)).sum().backward()
    kept = model[1].weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"SGD holds 2 parameters that parallelizing replaced .*build the optimizer "
                                           r"after parallelize_model / parallelize"):
        early.step()
    assert torch.equal(model[1].weight, kept)
    late = torch.optim.SGD(model.parameters(), lr=0.1)
    late.step()
    assert not torch.equal(model[1].weight, kept)


def test_chain_refuses_a_replacing_style_after_the_first():
    with pytest.raises(ValueError, match=r"Chain: only the first style may replace the module, but "
                                         r"\['ColumnParallel'\] would replace"):
        Chain((WrapForward("test_doubled", _doubled), ColumnParallel()))


def test_set_attributes_refuses_an_attribute_the_module_lacks_before_anything_changes(world_of_one):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    before = model[0].weight
    plan = Plan({"0": ColumnParallel(), "1": SetAttributes((("num_heads", 2),))})
    with pytest.raises(TypeError, match=r"SetAttributes sets \['num_heads'\] on '1', but Linear has no such "
                                        r"attribute"):
        parallelize(model, plan)
    assert model[0].weight is before and type(model[0]) is nn.Linear


def test_an_object_outside_the_style_protocol_is_refused_naming_where_it_stands(world_of_one):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(TypeError, match=r"the plan's style for '0' is _OldStyle, not an nxdtp.plan.Style: a style "
                                        r"subclasses Style, with convert\(module, name, group\)"):
        parallelize(model, Plan({"0": _OldStyle()}))
    assert type(model[0]) is nn.Linear
    with pytest.raises(TypeError, match=r"Chain's style 1 is _OldStyle, not an nxdtp.plan.Style"):
        Chain((ColumnParallel(), _OldStyle()))
    assert isinstance(parallelize(model, Plan({"0": _ToIdentity()}))[0], nn.Identity)


# ---- the registry ----------------------------------------------------------------------------------------------------

def test_the_registry_is_the_one_list_of_families():
    from nxdtp.models import bert, gpt2, llama, moe, roberta, supported_models
    from nxdtp.models.common import supported_transformers
    from nxdtp.models.registry import FAMILIES, family_of

    assert FAMILIES == (bert.FAMILY, roberta.FAMILY, gpt2.FAMILY, llama.FAMILY, moe.FAMILY)
    assert supported_models() == sorted(name for family in FAMILIES for name in family.classes)
    assert family_of("Qwen3ForCausalLM") is llama.FAMILY and family_of("GPTNeoForCausalLM") is None
    assert family_of("Qwen3MoeForCausalLM") is moe.FAMILY
    assert [supported_transformers(family.name) for family in FAMILIES] == [">=4.26,<6"] + [">=4.48,<6"] * 3 + [
        ">=5.0,<6"]


# ---- one record of notes ---------------------------------------------------------------------------------------------

def _stray_notes(model: nn.Module) -> list:
    from nxdtp.record import _KEY

    # ``_nxdtp_specs`` is ShardedModule's own storage of its parameters' specs, declared by the class every module
    # holding one is (parallel layers, and norms given sequence-parallel specs).
    return [(name, key) for name, module in model.named_modules() for key in vars(module)
            if "nxdtp" in key and key not in (_KEY, "_nxdtp_specs")]


def case_notes_live_in_records(family: str):
    from nxdtp.models import generation_mode, parallelize_model
    from nxdtp.random import model_parallel_xla_manual_seed

    build, _ = MODELS[family]
    torch.manual_seed(0)
    model_parallel_xla_manual_seed(0)   # dropout inside TP regions draws from the TP RNG tracker
    model = parallelize_model(build(), sequence_parallel=True)
    ids = torch.randint(0, 50, (2, 8))
    model.train()
    model.gradient_checkpointing_enable()
    model(input_ids=ids, labels=ids if family != "bert" else None)
    if family in ("llama", "qwen3", "gpt2"):
        with torch.no_grad(), generation_mode(model):
            model(input_ids=ids[:, :3])
    return _stray_notes(model)


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_no_module_carries_an_nxdtp_note_outside_its_record(worlds, family):
    assert worlds(2).run(case_notes_live_in_records, tensor_model_parallel_size=2, family=family) == [[], []]


# ---- the guide's examples --------------------------------------------------------------------------------------------

def test_the_guides_family_file_is_robertas_code():
    import ast
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1]
    guide = (root / "docs" / "wrapping_hf_models.md").read_text()
    section = guide[guide.index("## Adding a family"):guide.index("## Limits")]
    shown = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    source = (root / "nxdtp" / "models" / "roberta.py").read_text()
    tree = ast.parse(source)
    body = tree.body[1:]   # the module docstring
    code = "".join(ast.get_source_segment(source, node, padded=True) + "\n" for node in body
                   if not (isinstance(node, ast.ImportFrom) and node.module == "__future__"))
    assert ast.dump(ast.parse(shown)) == ast.dump(ast.parse(code))
    assert "FAMILIES = (bert.FAMILY, roberta.FAMILY, gpt2.FAMILY, llama.FAMILY, moe.FAMILY)" in section
    assert "FAMILIES: Tuple[Family, ...] = (bert.FAMILY, roberta.FAMILY, gpt2.FAMILY, llama.FAMILY, moe.FAMILY)" in (
        root / "nxdtp" / "models" / "registry.py").read_text()


def test_the_guides_tiny_gpt_plan_equals_dense(tmp_path):
    import re

    from tests.test_models_decoders import _run_guide_example

    stdout = _run_guide_example("tiny_gpt.py", tmp_path)
    assert sorted(re.findall(r"rank (\d): loss [0-9.]+ equals dense", stdout)) == ["0", "1"], stdout
