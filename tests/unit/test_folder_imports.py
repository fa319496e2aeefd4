"""Which folder of the package may import which: the layers as a table, checked against every import (those
inside functions included). A new arrow fails here until the table says it is meant."""

from __future__ import annotations

import ast
import os

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "peft_shardmerge")
TOP = "(top)"  # the package's own modules: errors, options, version, testing, __init__, __main__

#: folder -> the folders it may import: the layers, top-down. The engine reaches the two sources and the ranks only
#: through the Source protocol and the coordinator's hooks; only api/ reaches distributed/.
ALLOWED = {
    TOP: {"api", "quant", "support", "verify"},  # __init__'s lazy public names, options' 4-bit settings, testing
    "api": {TOP, "checkpoint", "distributed", "engine", "io", "model", "output", "quant", "support", "verify"},
    "verify": {TOP, "checkpoint", "engine", "io", "output", "quant", "support"},
    "model": {TOP, "engine", "io", "output", "quant", "support"},  # the two sources never import each other
    "checkpoint": {TOP, "engine", "io", "output", "quant", "support"},
    "distributed": {TOP, "engine", "output", "quant"},
    "engine": {TOP, "io"},
    "support": {TOP, "io"},
    "output": {TOP, "engine", "io", "quant", "support"},  # support: the GGUF types by name (support/outtypes.py)
    "quant": {TOP, "io"},
    "io": {TOP},
}


def folder_imports() -> dict[str, set[str]]:
    """folder -> the other folders its modules import (relative imports, anywhere in the module)."""
    edges: dict[str, set[str]] = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, PACKAGE).split(os.sep)
            here = rel[0] if len(rel) > 1 else TOP
            package = rel[:-1]  # the module's package, under peft_shardmerge
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if not isinstance(node, ast.ImportFrom) or not node.level:
                    continue
                target = package[: len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
                names = [a.name for a in node.names]
                first = target[0] if target else None
                if first is None:  # from . import x, at the top: x is a folder or a top-level module
                    hits = {n if os.path.isdir(os.path.join(PACKAGE, n)) else TOP for n in names}
                else:
                    hits = {first if os.path.isdir(os.path.join(PACKAGE, first)) else TOP}
                edges.setdefault(here, set()).update(h for h in hits if h != here)
    return edges


def test_every_folder_is_in_the_table():
    folders = {d for d in os.listdir(PACKAGE) if os.path.isfile(os.path.join(PACKAGE, d, "__init__.py"))}
    assert set(ALLOWED) == folders | {TOP}


def test_folders_import_only_what_the_table_allows():
    extra = {k: sorted(v - ALLOWED.get(k, set())) for k, v in folder_imports().items() if v - ALLOWED.get(k, set())}
    assert extra == {}, "imports the table does not allow (folder: folders)"


def test_the_table_holds_no_arrow_the_code_does_not_draw():
    drawn = folder_imports()
    unused = {k: sorted(v - drawn.get(k, set())) for k, v in ALLOWED.items() if v - drawn.get(k, set())}
    assert unused == {}, "arrows the table allows that no import uses any more: remove them from ALLOWED"


def test_the_folders_have_no_cycle():
    """Below the package's own top-level modules (the shared vocabulary: errors, options), no folder reaches back to
    one that imports it."""
    edges = {k: v - {TOP} for k, v in folder_imports().items() if k != TOP}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in edges.get(start, ()))

    assert [f for f in edges if reaches(f, f, {f})] == []
