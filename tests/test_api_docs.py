"""docs/api.md is checked against the code: every signature it documents is the function's own, and every public name
of the package's modules is documented (in api.md, or for checkpoint files in checkpoints.md).

A heading of api.md that reads like a call (``### name(a, b=1, *, c=None) → T``, several joined by commas) names an
object, resolved in the module of its section (``## nxdtp.grads``) or by its full dotted path. Its parameters, in
order, with their kinds (``*args``, ``*``, ``**kwargs``) and defaults, must be what ``inspect.signature`` reports; a
trailing ``...`` elides the rest. So a renamed parameter, a changed default or a function that no longer exists fails
here rather than misleading a reader. The checker itself is tested on small synthetic documents.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_MD = os.path.join(REPO, "docs", "api.md")

# Public modules whose __all__ the reference must cover: each name in backticks or in a heading of api.md or
# checkpoints.md.
COVERED_MODULES = ("nxdtp", "nxdtp.parallel_state", "nxdtp.layers", "nxdtp.mappings", "nxdtp.grads",
                   "nxdtp.loss_functions", "nxdtp.random", "nxdtp.utils", "nxdtp.models", "nxdtp.checkpointing",
                   "nxdtp.optimizer", "nxdtp.trainer")

_NAME = re.compile(r"[A-Za-z_][\w.]*")
_MISSING = object()


@dataclass
class DocumentedCall:
    line: int
    module: str
    name: str
    params: List[str]


def _closing_paren(text: str, start: int) -> int:
    """Index of the parenthesis closing the one at ``start``, skipping quoted strings."""
    depth, quote = 0, None
    for i in range(start, len(text)):
        c = text[i]
        if quote:
            quote = None if c == quote else quote
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced parentheses in {text!r}")


def calls_in_heading(text: str) -> Iterator[Tuple[str, str]]:
    """(dotted name, parameter text) of each call form at the top level of a heading's text; code in backticks (a
    user's call such as `model.generate(...)`) names no nxdtp object."""
    text = re.sub(r"`[^`]*`", "", text)
    i = 0
    while i < len(text):
        match = _NAME.match(text, i)
        if match and match.end() < len(text) and text[match.end()] == "(" and (i == 0 or not text[i - 1].isalnum()):
            end = _closing_paren(text, match.end())
            yield match.group(), text[match.end() + 1:end]
            i = end + 1
        elif text[i] in "([{":
            i = _closing_paren(text, i) + 1
        else:
            i = match.end() if match else i + 1


def split_params(text: str) -> List[str]:
    """Top-level comma-separated items of a parameter list."""
    items, depth, quote, current = [], 0, None, ""
    for c in text:
        if quote:
            quote = None if c == quote else quote
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            items.append(current.strip())
            current = ""
            continue
        current += c
    if current.strip():
        items.append(current.strip())
    return items


def section_module(heading: str) -> Optional[str]:
    """The module a ``##`` heading documents: its first ``nxdtp...`` path that imports (a class path gives its
    module); "The nxdtp package" is nxdtp; any other heading documents no module."""
    if heading.strip() == "The nxdtp package":
        return "nxdtp"
    for path in re.findall(r"nxdtp(?:\.\w+)*", heading):
        parts = path.split(".")
        for end in range(len(parts), 0, -1):
            try:
                importlib.import_module(".".join(parts[:end]))
            except ImportError:
                continue
            return ".".join(parts[:end])
    return None


def documented_calls(markdown: str) -> Iterator[DocumentedCall]:
    module, fenced = None, False
    for number, line in enumerate(markdown.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        if line.startswith("## "):
            module = section_module(line[3:])
        elif line.startswith(("### ", "#### ")) and (module or "nxdtp." in line):
            for name, params in calls_in_heading(line.lstrip("#").strip()):
                yield DocumentedCall(number, module or "", name, split_params(params))


def resolve(call: DocumentedCall):
    """The object a documented call names, or raise LookupError saying what is missing."""
    if call.name.startswith("nxdtp."):
        parts = call.name.split(".")
        for end in range(len(parts) - 1, 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:end]))
            except ImportError:
                continue
            rest = parts[end:]
            break
    else:
        obj, rest = importlib.import_module(call.module), call.name.split(".")
    owner = None
    for attribute in rest:
        if not hasattr(obj, attribute):
            raise LookupError(f"api.md:{call.line} documents {call.name} in {call.module or 'nxdtp'}, which has no "
                              f"attribute {attribute!r}")
        owner, obj = obj, getattr(obj, attribute)
    if rest[-1] == "apply" and isinstance(owner, type) and issubclass(owner, torch.autograd.Function):
        return owner.forward  # Function.apply takes what forward takes after ctx
    return obj


def _documented_default(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return eval(text, {"torch": torch, "math": __import__("math")})  # documented defaults like torch.float32


def signature_mismatches(call: DocumentedCall, obj) -> List[str]:
    """What differs between the documented parameters and ``obj``'s signature (empty when they agree)."""
    if call.params == ["..."]:
        return []
    try:
        actual = [p for p in inspect.signature(obj).parameters.values() if p.name not in ("self", "cls", "ctx")]
    except (TypeError, ValueError):
        return []  # builtins without a signature: nothing to check
    where = f"api.md:{call.line} {call.name}"
    problems, index = [], 0
    for item in call.params:
        if item == "...":
            return problems
        if item == "*":
            if index < len(actual) and actual[index].kind is inspect.Parameter.KEYWORD_ONLY and \
                    (index == 0 or actual[index - 1].kind is not inspect.Parameter.KEYWORD_ONLY):
                continue
            problems.append(f"{where}: '*' where the code has no keyword-only parameters from here")
            continue
        if index >= len(actual):
            problems.append(f"{where}: documents {item!r}, which the code does not have")
            continue
        param = actual[index]
        index += 1
        stars = "**" if param.kind is inspect.Parameter.VAR_KEYWORD else \
            "*" if param.kind is inspect.Parameter.VAR_POSITIONAL else ""
        name, _, default_text = item.partition("=")
        if name.strip() != stars + param.name:
            problems.append(f"{where}: documents {name.strip()!r} where the code has {stars + param.name!r}")
            continue
        expected = _MISSING if not default_text else _documented_default(default_text.strip())
        actual_default = _MISSING if param.default is inspect.Parameter.empty else param.default
        if stars:
            continue
        if (expected is _MISSING) != (actual_default is _MISSING) or (expected is not _MISSING and
                                                                     expected != actual_default):
            problems.append(f"{where}: {param.name} documented as {default_text.strip() or 'required'}, the code "
                            f"has {'required' if actual_default is _MISSING else repr(actual_default)}")
    if index < len(actual):
        problems.append(f"{where}: the code also has {[p.name for p in actual[index:]]}, which api.md leaves out "
                        f"(end the list with '...' to elide them on purpose)")
    return problems


# ---- the checker on synthetic documents -----------------------------------------------------------------------------

def _sample(a, b=1, *args, c=None, **kwargs):
    return a


def test_heading_parser_finds_every_call_form():
    heading = "clip_grads_with_norm(p, total_norm, max_norm) → Tensor, param_is_not_shared(param) → bool (see f(x))"
    assert list(calls_in_heading(heading)) == [("clip_grads_with_norm", "p, total_norm, max_norm"),
                                               ("param_is_not_shared", "param")]
    assert split_params('a, b=(1, 2), c="x,y", *, d=None') == ["a", "b=(1, 2)", 'c="x,y"', "*", "d=None"]


@pytest.mark.parametrize("params,problem", [
    (["a", "b=1", "*args", "c=None", "**kwargs"], None),
    (["a", "..."], None),
    (["a", "b=2", "*args", "c=None", "**kwargs"], "b documented as 2, the code has 1"),
    (["a", "bb=1", "*args", "c=None", "**kwargs"], "documents 'bb' where the code has 'b'"),
    (["a", "b=1"], "the code also has ['args', 'c', 'kwargs']"),
    (["a", "b=1", "*args", "c", "**kwargs"], "c documented as required, the code has None"),
])
def test_signature_check_can_fail(params, problem):
    problems = signature_mismatches(DocumentedCall(1, "m", "_sample", params), _sample)
    assert (problems == []) if problem is None else any(problem in p for p in problems), problems


def test_a_documented_name_that_does_not_exist_is_named():
    with pytest.raises(LookupError, match=r"api.md:7 documents no_such_function in nxdtp.grads"):
        resolve(DocumentedCall(7, "nxdtp.grads", "no_such_function", []))


# ---- the real document ----------------------------------------------------------------------------------------------

def _api_md() -> str:
    with open(API_MD, encoding="utf-8") as f:
        return f.read()


def test_every_documented_signature_is_the_codes():
    problems = []
    for call in documented_calls(_api_md()):
        try:
            problems += signature_mismatches(call, resolve(call))
        except LookupError as e:
            problems.append(str(e))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("module", COVERED_MODULES)
def test_every_public_name_is_documented(module):
    # The checkpoint functions' reference is docs/checkpoints.md, which api.md links to.
    with open(os.path.join(REPO, "docs", "checkpoints.md"), encoding="utf-8") as f:
        text = _api_md() + f.read()
    names = getattr(importlib.import_module(module), "__all__", [])
    def mentioned(name: str) -> bool:
        word = rf"\b{re.escape(name)}\b"
        return re.search(rf"`[^`\n]*{word}[^`\n]*`|#.*{word}", text) is not None

    missing = [name for name in names if not mentioned(name)]
    assert not missing, f"docs/api.md does not mention these names of {module}.__all__: {missing}"
