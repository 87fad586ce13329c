"""nxdtp's layering, as docs/index.md draws it, holds in the code.

The layers are read from the ```layers block of docs/index.md (top to bottom; each line names paths under nxdtp/, then
what they hold), so the diagram a reader sees is the one checked. The import graph is built from the source with
``ast`` (no module is imported), including imports inside functions, which hide no edge. Checked:

* every module of nxdtp/ is in a layer, and every path the block names exists;
* no module imports from a layer above its own, except the edges ``KNOWN_UPWARD_IMPORTS`` names with the reason;
* no import circle, within a layer either (a package and its modules included);
* only nxdtp/comm.py calls torch.distributed's collectives or group lifecycle, or imports torch_xla, except the uses
  ``KNOWN_BACKEND_USES`` names with the reason.

The checker itself is tested on small synthetic trees, so a check that cannot fail would be noticed.
"""

from __future__ import annotations

import ast
import os
import re
from typing import Dict, List, Set, Tuple

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INDEX_MD = os.path.join(REPO, "docs", "index.md")

# (importer, imported): why the edge goes up.
KNOWN_UPWARD_IMPORTS: Dict[Tuple[str, str], str] = {}

# torch.distributed functions that talk to a backend or make / break groups: comm's business.
BACKEND_CALLS = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier", "broadcast", "broadcast_object_list", "gather", "gather_object", "scatter",
    "scatter_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "send", "recv", "isend", "irecv",
    "new_group", "new_subgroups", "init_process_group", "destroy_process_group",
}

# (module, what it uses: "dist.<call>" or the torch_xla module it imports): why it is not in comm.
KNOWN_BACKEND_USES = {
    ("nxdtp.process_groups", "dist.new_group"):
        "initialize_model_parallel and zero1_groups create the topology's process groups through it",
    ("nxdtp.process_groups", "dist.barrier"):
        "the barrier after group creation (no rank leaves before every rank has made every group); comm sits above "
        "the topology core and cannot be used there",
    ("nxdtp.process_groups", "dist.init_process_group"):
        "initialize_single_process_world: the in-process world of 1 behind initialize_fallback_parallel_state; "
        "join_gloo_world: the worker processes of nxdtp verify join their CPU world",
    ("nxdtp.process_groups", "dist.destroy_process_group"):
        "destroy_model_parallel releases the groups made for the topology; leave_world ends nxdtp verify's worker "
        "world",
    ("nxdtp.process_groups", "torch_xla.distributed.xla_backend"):
        "registers torch.distributed's 'xla' backend before a single-process XLA world is made",
    ("nxdtp.agreement", "torch_xla.core.xla_model"):
        "the input check's XLA branch reads each result in a step closure (xm.add_step_closure), after its graph ran",
    ("nxdtp.random", "torch_xla.core.xla_model"): "the RNG tracker seeds and saves XLA's RNG state",
    ("nxdtp.xla_graphs", "torch_xla"): "trace_every_rank hashes the traced graphs (torch_xla._XLAC)",
    ("nxdtp.xla_graphs", "torch_xla.core.xla_model"): "trace_every_rank restores XLA's RNG state between ranks",
}


# ---- the import graph ----------------------------------------------------------------------------------------------

def module_files(root: str) -> Dict[str, str]:
    """Module name -> file, for every .py under ``root``/nxdtp (a package's ``__init__.py`` is the package)."""
    files = {}
    for directory, _, names in os.walk(os.path.join(root, "nxdtp")):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                module = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                files[module[:-len(".__init__")] if module.endswith(".__init__") else module] = path
    return files


def _imported_names(module: str, path: str, node: ast.AST) -> List[str]:
    """The absolute dotted names an import statement brings in (for ``from X import y``: X.y, which may be a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [f"{base}.{alias.name}" for alias in node.names]


def import_graph(root: str) -> Tuple[Dict[str, Set[str]], Dict[str, Set[str]]]:
    """(nxdtp module -> the nxdtp modules it imports, nxdtp module -> the outside modules and names it imports)."""
    files = module_files(root)
    inside: Dict[str, Set[str]] = {module: set() for module in files}
    outside: Dict[str, Set[str]] = {module: set() for module in files}
    for module, path in files.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _imported_names(module, path, node):
                if name == "nxdtp" or name.startswith("nxdtp."):
                    while name not in files:          # "nxdtp.comm.all_reduce" -> "nxdtp.comm"
                        name = name.rpartition(".")[0]
                    if name != module:
                        inside[module].add(name)
                else:
                    outside[module].add(name)
    return inside, outside


def import_circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (each an import circle), sorted; Tarjan's algorithm
    without recursion."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    circles: List[List[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    work.append((successor, iter(sorted(graph.get(successor, ())))))
                    break
                if successor in stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))
    return sorted(circles)


def backend_uses(root: str) -> Dict[str, Set[str]]:
    """Module -> its uses of a backend: "dist.<call>" for a call of torch.distributed's BACKEND_CALLS (however
    torch.distributed is bound: ``import torch.distributed as dist``, ``torch.distributed.x(...)``,
    ``from torch.distributed import x``), and every torch_xla module it imports."""
    uses: Dict[str, Set[str]] = {}
    for module, path in module_files(root).items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        dist_names, found = set(), set()
        call_names: Dict[str, str] = {}   # local name -> torch.distributed's name
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "torch.distributed" and alias.asname:
                        dist_names.add(alias.asname)
                    if alias.name.split(".")[0] == "torch_xla":
                        found.add(alias.name)
            elif isinstance(node, ast.ImportFrom) and not node.level:
                if node.module == "torch":
                    dist_names.update(a.asname or a.name for a in node.names if a.name == "distributed")
                elif node.module in ("torch.distributed", "torch.distributed.distributed_c10d"):
                    call_names.update((a.asname or a.name, a.name) for a in node.names if a.name in BACKEND_CALLS)
                if (node.module or "").split(".")[0] == "torch_xla":
                    found.add(node.module)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            function = node.func
            if isinstance(function, ast.Name) and function.id in call_names:
                found.add(f"dist.{call_names[function.id]}")
            elif isinstance(function, ast.Attribute) and function.attr in BACKEND_CALLS:
                owner = ast.unparse(function.value)
                if owner in dist_names or owner == "torch.distributed":
                    found.add(f"dist.{function.attr}")
        if found:
            uses[module] = found
    return uses


# ---- the layers docs/index.md draws -------------------------------------------------------------------------------

_LINE = re.compile(r"^(nxdtp/\S*(?:, nxdtp/\S*)*)\s{2,}\S")


def read_layers(markdown: str) -> List[List[str]]:
    """The paths of each layer, top layer first, from the first ```layers block of ``markdown``."""
    block = re.search(r"^```layers\n(.*?)^```", markdown, re.S | re.M)
    assert block, "docs/index.md has no ```layers block (the layering tests/test_layering.py checks)"
    layers = []
    for line in block.group(1).splitlines():
        match = _LINE.match(line)
        assert match, f"docs/index.md's layers block: {line!r} is not 'nxdtp/PATH[, nxdtp/PATH...]  description'"
        layers.append(match.group(1).split(", "))
    return layers


def layer_of(module: str, files: Dict[str, str], root: str, layers: List[List[str]]) -> int:
    """The index of the layer holding ``module``'s file (longest path wins); -1 if none does."""
    relative = os.path.relpath(files[module], root).replace(os.sep, "/")
    best, best_length = -1, -1
    for index, paths in enumerate(layers):
        for path in paths:
            holds = relative.startswith(path) if path.endswith("/") else relative == path
            if holds and len(path) > best_length:
                best, best_length = index, len(path)
    return best


def layering_violations(root: str, layers: List[List[str]], known=()) -> List[str]:
    files = module_files(root)
    problems = [f"{path} (docs/index.md's layers) does not exist" for paths in layers for path in paths
                if not os.path.exists(os.path.join(root, path))]
    level = {module: layer_of(module, files, root, layers) for module in files}
    problems += [f"{module} ({os.path.relpath(files[module], root)}) is in no layer of docs/index.md: add it"
                 for module, index in sorted(level.items()) if index < 0]
    inside, _ = import_graph(root)
    for module, imported in sorted(inside.items()):
        for target in sorted(imported):
            if 0 <= level[target] < level[module] and (module, target) not in known:
                problems.append(f"{module} (layer {level[module]}: {', '.join(layers[level[module]])}) imports "
                                f"{target}, which is above it (layer {level[target]}: "
                                f"{', '.join(layers[level[target]])})")
    return problems


# ---- nxdtp -----------------------------------------------------------------------------------------------------------

def test_no_module_imports_from_a_layer_above_its_own():
    with open(INDEX_MD, encoding="utf-8") as f:
        layers = read_layers(f.read())
    problems = layering_violations(REPO, layers, KNOWN_UPWARD_IMPORTS)
    assert not problems, "\n".join(problems)


def test_no_import_circle():
    inside, _ = import_graph(REPO)
    circles = import_circles(inside)
    assert not circles, f"import circles (each a set of modules that import one another): {circles}"


def test_the_known_upward_imports_still_exist():
    """A named exception that the code no longer needs is removed from the list, so the list stays the truth."""
    inside, _ = import_graph(REPO)
    gone = [edge for edge in KNOWN_UPWARD_IMPORTS if edge[1] not in inside.get(edge[0], ())]
    assert not gone, f"these edges are gone: drop them from KNOWN_UPWARD_IMPORTS: {gone}"


def test_nothing_imports_nxdtp_init_from_inside_the_library():
    """The package's __init__ is the top: a module below it that imported it (``from .. import __version__``) would
    make every layer depend on everything."""
    inside, _ = import_graph(REPO)
    importers = sorted(module for module, imported in inside.items() if "nxdtp" in imported)
    assert not importers, f"{importers} import nxdtp/__init__.py; import the module that defines the name instead"


def test_no_importlib_hides_an_edge():
    """Imports by name (importlib.import_module, __import__) would hide an edge from the graph above."""
    hiding = []
    for module, path in module_files(REPO).items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("importlib.import_module", "__import__",
                                                                          "import_module"):
                hiding.append(f"{module}:{node.lineno}")
    assert not hiding, f"imports by name: {hiding}"


def test_no_import_machinery_or_generated_globals():
    """Names a reader can grep and imports the graph above sees: no module of nxdtp imports importlib, calls
    __import__, touches sys.meta_path (an import hook), or writes names through globals()[...]."""
    found = []
    for module, path in module_files(REPO).items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            imported = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                        [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(name.split(".")[0] == "importlib" for name in imported):
                found.append(f"{module}:{node.lineno}: imports importlib")
            elif isinstance(node, ast.Name) and node.id == "__import__":
                found.append(f"{module}:{node.lineno}: __import__")
            elif isinstance(node, ast.Attribute) and node.attr == "meta_path":
                found.append(f"{module}:{node.lineno}: sys.meta_path")
            elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "globals()":
                found.append(f"{module}:{node.lineno}: globals()[...]")
    assert not found, "\n".join(found)


def test_only_comm_talks_to_a_backend():
    found = {(module, use) for module, uses in backend_uses(REPO).items() for use in uses if module != "nxdtp.comm"}
    unexpected = sorted(found - set(KNOWN_BACKEND_USES))
    assert not unexpected, ("backend calls or torch_xla imports outside nxdtp/comm.py (move them into comm, or name "
                            f"them in KNOWN_BACKEND_USES with the reason): {unexpected}")
    stale = sorted(set(KNOWN_BACKEND_USES) - found)
    assert not stale, f"KNOWN_BACKEND_USES names uses the code no longer has: drop them: {stale}"


# ---- the checker on synthetic trees --------------------------------------------------------------------------------

def _tree(root, sources: Dict[str, str]) -> str:
    for relative, text in sources.items():
        path = os.path.join(str(root), relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return str(root)


LAYERS = [["nxdtp/__init__.py", "nxdtp/top.py"], ["nxdtp/pkg/"], ["nxdtp/low.py"]]


@pytest.mark.parametrize("importer,source,upward", [
    ("nxdtp/low.py", "from . import top\n", "nxdtp.low"),
    ("nxdtp/low.py", "def f():\n    from .pkg import a\n", "nxdtp.low"),          # inside a function
    ("nxdtp/pkg/a.py", "from ..top import x\n", "nxdtp.pkg.a"),                    # a name of a module
    ("nxdtp/pkg/a.py", "import nxdtp.top\n", "nxdtp.pkg.a"),
    ("nxdtp/pkg/a.py", "from .. import low\nfrom . import b\n", None),            # down, and within the layer
    ("nxdtp/top.py", "from .pkg.a import y\nfrom .low import z\n", None),
])
def test_the_checker_finds_upward_imports(tmp_path, importer, source, upward):
    sources = {"nxdtp/__init__.py": "", "nxdtp/top.py": "", "nxdtp/low.py": "", "nxdtp/pkg/__init__.py": "",
               "nxdtp/pkg/a.py": "", "nxdtp/pkg/b.py": ""}
    sources[importer] = source
    problems = layering_violations(_tree(tmp_path, sources), LAYERS)
    assert [p.split(" ")[0] for p in problems] == ([upward] if upward else []), problems


def test_the_checker_finds_unplaced_modules_and_missing_paths(tmp_path):
    root = _tree(tmp_path, {"nxdtp/__init__.py": "", "nxdtp/top.py": "", "nxdtp/low.py": "", "nxdtp/stray.py": ""})
    problems = layering_violations(root, LAYERS)
    assert any(p.startswith("nxdtp/pkg/ (docs/index.md's layers) does not exist") for p in problems), problems
    assert any(p.startswith("nxdtp.stray (") and "is in no layer" in p for p in problems), problems


def test_the_circle_check_finds_circles_through_packages_and_functions(tmp_path):
    root = _tree(tmp_path, {
        "nxdtp/__init__.py": "", "nxdtp/low.py": "def f():\n    from .pkg import x\n",
        "nxdtp/pkg/__init__.py": "from .a import x\n", "nxdtp/pkg/a.py": "from ..low import f\n",
        "nxdtp/pkg/b.py": "", "nxdtp/top.py": "from .pkg import a\nfrom . import low\n",
    })
    assert import_circles(import_graph(root)[0]) == [["nxdtp.low", "nxdtp.pkg", "nxdtp.pkg.a"]]
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_backend_check_sees_every_spelling(tmp_path):
    root = _tree(tmp_path, {
        "nxdtp/__init__.py": "",
        "nxdtp/a.py": "import torch.distributed as dist\ndef f():\n    dist.all_reduce(x)\n    dist.get_rank()\n",
        "nxdtp/b.py": "import torch\ndef f():\n    torch.distributed.new_group([0])\n",
        "nxdtp/c.py": "from torch.distributed import barrier as wait\nwait()\n",
        "nxdtp/d.py": "def f():\n    import torch_xla.core.xla_model as xm\n",
        "nxdtp/e.py": "from torch import distributed\ndistributed.is_initialized()\n",
    })
    assert backend_uses(root) == {"nxdtp.a": {"dist.all_reduce"}, "nxdtp.b": {"dist.new_group"},
                                  "nxdtp.c": {"dist.barrier"}, "nxdtp.d": {"torch_xla.core.xla_model"}}


def test_the_layers_block_is_parsed_top_first():
    text = "x\n```layers\nnxdtp/a.py, nxdtp/b/  top things\nnxdtp/c.py         low things\n```\n"
    assert read_layers(text) == [["nxdtp/a.py", "nxdtp/b/"], ["nxdtp/c.py"]]
