"""No function in nxdtp/ or tools/ is longer than MAX_LINES lines.

A function's length runs from its ``def`` line to its last line, decorators excluded, docstring and comments included:
what a reader has to hold in mind at once. Methods and nested functions are measured on their own as well as inside
the function that holds them. The source is parsed with ``ast``; nothing is imported.

The measure itself is tested on small synthetic sources, so a check that cannot fail would be noticed.
"""

from __future__ import annotations

import ast
import os
from typing import Iterator, List, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKED = [os.path.join(REPO, "nxdtp"), os.path.join(REPO, "tools")]
MAX_LINES = 60


def function_lengths(source: str) -> Iterator[Tuple[str, int, int]]:
    """``(qualified name, def line, length in lines)`` of every function of ``source``, nested ones included; the
    qualified name is the dotted path of classes and functions that hold it, as ``Class.method`` or ``outer.inner``."""

    def visit(node: ast.AST, prefix: str) -> Iterator[Tuple[str, int, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                # lineno is the def line (decorators have their own), end_lineno the function's last line.
                yield name, child.lineno, child.end_lineno - child.lineno + 1
                yield from visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, prefix + child.name + ".")
            else:
                yield from visit(child, prefix)  # functions defined under if / try / with blocks

    yield from visit(ast.parse(source), "")


def too_long(root: str, limit: int = MAX_LINES) -> List[str]:
    """One line per function under ``root`` longer than ``limit`` lines: file, function, length."""
    found = []
    for directory, subdirectories, files in os.walk(root):
        subdirectories.sort()
        for file in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(directory, file)
            with open(path, encoding="utf-8") as f:
                source = f.read()
            for name, line, length in function_lengths(source):
                if length > limit:
                    found.append(f"{os.path.relpath(path, REPO)}:{line}: {name} is {length} lines")
    return found


def test_no_function_in_nxdtp_or_tools_is_longer_than_the_limit():
    found = [line for root in CHECKED for line in too_long(root)]
    assert not found, (f"{len(found)} function(s) in nxdtp/ or tools/ longer than {MAX_LINES} lines (def line to last "
                       "line, "
                       "decorators excluded); split each into helpers that do one thing each:\n" + "\n".join(found))


# ---- the measure itself ----------------------------------------------------------------------------------------------

SYNTHETIC = '''
import functools


@functools.lru_cache()
def decorated(a):
    """Doc."""
    return a


class Outer:
    def method(self):
        x = 1

        def inner():
            return x

        return inner


if True:
    async def under_if():
        pass
'''


def test_lengths_count_from_def_to_last_line_without_decorators():
    lengths = {name: (line, length) for name, line, length in function_lengths(SYNTHETIC)}
    assert lengths == {
        "decorated": (6, 3),
        "Outer.method": (12, 7),
        "Outer.method.inner": (15, 2),
        "under_if": (22, 2),
    }


def test_a_long_function_is_reported_with_file_name_and_length(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    method_body = "".join(f"        x{i} = {i}\n" for i in range(MAX_LINES))
    (package / "sub" / "long.py").write_text("class C:\n    def m(self):\n" + method_body)  # one line too many
    (package / "short.py").write_text("def f():\n" + "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES - 1)))
    found = too_long(str(package))
    assert len(found) == 1
    assert found[0].endswith(f"long.py:2: C.m is {MAX_LINES + 1} lines"), found
    assert "short.py" not in found[0]
