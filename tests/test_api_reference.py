"""docs/api.md against the code, so the hand-written reference cannot drift from it.

The reference documents a name in a heading (``### clip_grad_norm(parameters, max_norm, norm_type=2, ...) → Tensor``) or
in the first column of a table (```get_data_parallel_group(as_list=False)```), inside the section of its module
(``## nxdtp.grads``; ``## NxD's trainer API: `nxdtp.trainer```). Three checks:

* every name documented with a call form exists where the section says (a table may also name a method of one of the
  module's classes: ``process_group_for(device_type)`` of ``ParallelGroup``);
* where the reference spells out a parameter list, it is the code's: the same names in the same order, the same kinds
  (``*``, ``*args``, ``**kwargs``) and the same literal defaults (``inspect.signature``);
* every name in the ``__all__`` of a documented module appears in the reference.

Single process, no torch_xla or transformers needed beyond what importing nxdtp's modules pulls in.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
from pathlib import Path
from typing import Iterator, List, NamedTuple, Optional

import pytest

API_MD = Path(__file__).resolve().parents[1] / "docs" / "api.md"
DOTTED = re.compile(r"^nxdtp(\.\w+)*$")
CALL = re.compile(r"(?<![\w.])(\.?[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\(")
# Call forms in headings that are not nxdtp names: what a user calls on their own model.
NOT_NXDTP = {"model.generate"}


class Entry(NamedTuple):
    line: int
    module: Optional[str]  # the section's module
    name: str  # as written: relative to the module, or a full nxdtp.* path
    args: str  # the text between the parentheses
    in_table: bool


def _longest_module(path: str) -> Optional[str]:
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        try:
            importlib.import_module(candidate)
            return candidate
        except ImportError:
            continue
    return None


def _section_module(title: str) -> Optional[str]:
    """``nxdtp.grads`` -> itself; ``The nxdtp package`` -> nxdtp; ``ZeRO-1: `nxdtp.optimizer.X``` -> nxdtp.optimizer;
    prose titles -> None."""
    if title == "The nxdtp package":
        return "nxdtp"
    if DOTTED.match(title):
        return title
    quoted = re.findall(r"`(nxdtp(?:\.\w+)*)`", title)
    return _longest_module(quoted[0]) if quoted else None


def _calls(text: str) -> Iterator[tuple]:
    """(name, argument text) of each ``name(...)`` in ``text``, the parentheses balanced."""
    position = 0
    for match in CALL.finditer(text):
        if match.start() < position:
            continue
        depth, end = 1, match.end()
        while end < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            end += 1
        yield match.group(1), text[match.end():end - 1]
        position = end


def documented_entries() -> List[Entry]:
    entries, module, in_code = [], None, False
    for number, line in enumerate(API_MD.read_text().split("\n"), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif in_code:
            continue
        elif line.startswith("## "):
            module = _section_module(line[3:].strip())
        elif line.startswith(("### ", "#### ")):
            title = line.split(" ", 1)[1].strip()
            entries += [Entry(number, module, name, args, False) for name, args in _calls(title)]
        elif line.startswith("| ") and not line.startswith("| ---"):
            for code in re.findall(r"`([^`]+)`", line.split("|")[1]):
                entries += [Entry(number, module, name, args, True) for name, args in _calls(code)]
    return entries


def _resolve(entry: Entry):
    """The documented object, or None. A table entry may name a method of one of the module's classes."""
    if entry.name.startswith("nxdtp."):
        owner_name = _longest_module(entry.name)
        owner, rest = importlib.import_module(owner_name), entry.name[len(owner_name) + 1:].split(".")
    elif entry.module is None:
        return None
    else:
        owner, rest = importlib.import_module(entry.module), entry.name.split(".")
    value = owner
    for part in rest:
        value = getattr(value, part, None)
        if value is None:
            break
    if value is not None or not entry.in_table or entry.module is None:
        return value
    classes = [c for _, c in inspect.getmembers(owner, inspect.isclass) if c.__module__.startswith("nxdtp")]
    # Through an instance-less class lookup a method keeps ``self``: bind it to None so signatures leave it out.
    owner_class = next((c for c in classes if hasattr(c, entry.name)), None)
    if owner_class is None:
        return None
    value = inspect.getattr_static(owner_class, entry.name)
    if isinstance(value, (staticmethod, classmethod)):
        return getattr(owner_class, entry.name)
    return functools.partial(value, None) if inspect.isfunction(value) else getattr(owner_class, entry.name)


ENTRIES = documented_entries()
CHECKED = [e for e in ENTRIES if not e.name.startswith(".") and e.name not in NOT_NXDTP]


def test_the_reference_is_parsed():
    """The parser finds the reference's entries (a format change would otherwise make every check pass vacuously)."""
    assert len(CHECKED) > 150, len(CHECKED)
    assert any(e.name == "initialize_model_parallel" and e.module == "nxdtp.parallel_state" for e in CHECKED)
    assert any(e.name == "neuronx_distributed_config" and e.module == "nxdtp.trainer" for e in CHECKED)


def test_every_documented_name_exists_where_documented():
    missing = [f"api.md:{e.line}: `{e.name}` in {e.module or 'a section with no module'}" for e in CHECKED
               if _resolve(e) is None]
    assert not missing, "documented but not in the code:\n" + "\n".join(missing)


def _documented_parameters(args: str) -> Optional[ast.arguments]:
    """The parameter list as Python parses it; None where the reference abbreviates (``...``) or writes prose."""
    if "..." in args or "…" in args:
        return None
    try:
        return ast.parse(f"def f({args}): pass").body[0].args
    except SyntaxError:
        return None


_MISSING = object()


def _literal(node: ast.expr):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return _MISSING


def _compare(documented: ast.arguments, signature: inspect.Signature) -> List[str]:
    kinds = inspect.Parameter
    doc = ([(a.arg, kinds.POSITIONAL_OR_KEYWORD) for a in documented.posonlyargs + documented.args]
           + ([(documented.vararg.arg, kinds.VAR_POSITIONAL)] if documented.vararg else [])
           + [(a.arg, kinds.KEYWORD_ONLY) for a in documented.kwonlyargs]
           + ([(documented.kwarg.arg, kinds.VAR_KEYWORD)] if documented.kwarg else []))
    positional_defaults = dict(zip([a.arg for a in documented.args][::-1], documented.defaults[::-1]))
    keyword_defaults = {a.arg: d for a, d in zip(documented.kwonlyargs, documented.kw_defaults) if d is not None}
    defaults = {**positional_defaults, **keyword_defaults}
    # ``**unsupported`` only collects keywords to reject them with a message naming them (nxdtp's layers): not API.
    parameters = {n: p for n, p in signature.parameters.items()
                  if not (n == "unsupported" and p.kind == kinds.VAR_KEYWORD)}
    code = [(p.name, kinds.POSITIONAL_OR_KEYWORD if p.kind == kinds.POSITIONAL_ONLY else p.kind)
            for p in parameters.values()]
    if doc != code:
        return [f"parameters {[n for n, _ in doc]} (kinds {[k.name for _, k in doc]}) but the code has "
                f"{[n for n, _ in code]} (kinds {[k.name for _, k in code]})"]
    problems = []
    for name, parameter in parameters.items():
        has_default = parameter.default is not inspect.Parameter.empty
        if (name in defaults) != has_default:
            problems.append(f"{name}: documented {'with' if name in defaults else 'without'} a default, the code "
                            f"{'has ' + repr(parameter.default) if has_default else 'has none'}")
        elif has_default:
            documented_value = _literal(defaults[name])
            text = ast.unparse(defaults[name])
            if documented_value is not _MISSING:
                if documented_value != parameter.default or type(documented_value) is not type(parameter.default):
                    problems.append(f"{name}={text} documented, the code's default is {parameter.default!r}")
            elif text != str(parameter.default):  # torch.float32 and the like
                problems.append(f"{name}={text} documented, the code's default is {parameter.default!r}")
    return problems


def _signature(value) -> Optional[inspect.Signature]:
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):
        return None
    kinds = [p.kind for p in signature.parameters.values()]
    if kinds == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]:
        return None  # a wrapper that forwards everything (autograd Function.apply): nothing to compare
    return signature


def test_documented_signatures_match_the_code():
    problems = []
    for entry in CHECKED:
        documented = _documented_parameters(entry.args)
        value = _resolve(entry)
        signature = _signature(value) if documented is not None and value is not None else None
        if signature is not None:
            problems += [f"api.md:{entry.line}: {entry.name}: {p}" for p in _compare(documented, signature)]
    assert not problems, "signatures in docs/api.md that differ from the code:\n" + "\n".join(problems)


def _public_modules() -> List[str]:
    """The modules whose sections the reference has, plus the package itself."""
    return sorted({e.module for e in ENTRIES if e.module} | {"nxdtp"})


def test_every_public_name_of_a_documented_module_is_documented():
    prose = re.sub(r"^\s*```.*?^\s*```", "", API_MD.read_text(), flags=re.S | re.M)  # examples do not document
    spans = re.findall(r"`([^`]+)`", prose) + [line for line in prose.split("\n") if line.startswith("#")]
    words = set(re.findall(r"[A-Za-z_]\w*", " ".join(spans)))
    undocumented = []
    for name in _public_modules():
        module = importlib.import_module(name)
        for public in getattr(module, "__all__", ()):
            if public not in words:
                undocumented.append(f"{name}.{public}")
    assert not undocumented, "in __all__ but not in docs/api.md:\n" + "\n".join(undocumented)


@pytest.mark.parametrize("args,ok", [("a, b=1, *, c=None", True), ("a, b=2, *, c=None", False),
                                      ("a, c=None", False), ("a, b=1, c=None", False)])
def test_the_signature_check_can_fail(args, ok):
    """The comparison itself: a changed default, a dropped parameter or a lost ``*`` is reported."""
    def function(a, b=1, *, c=None):
        pass

    assert (_compare(_documented_parameters(args), inspect.signature(function)) == []) is ok


def test_the_existence_check_can_fail():
    """A name the module lacks is not resolved, in a heading or a table; a table may name a method of the module's
    classes, a heading may not."""
    assert _resolve(Entry(0, "nxdtp.grads", "clip_grad_norm", "", False)) is not None
    assert _resolve(Entry(0, "nxdtp.grads", "clip_grad_norms", "", False)) is None
    assert _resolve(Entry(0, "nxdtp.parallel_state", "process_group_for", "device_type", True)) is not None
    assert _resolve(Entry(0, "nxdtp.parallel_state", "process_group_for", "device_type", False)) is None
    assert _resolve(Entry(0, None, "nxdtp.models.generation_mode", "model", False)) is not None
