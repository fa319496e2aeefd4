"""The package's layering rules, read with ``ast`` from the source files so that they stay true: no import cycle
(imports inside functions counted), no private name or package root imported across modules, the test helpers
imported by no library module, and every exception class in ``errors.py``. Sizes are no rule: a module follows its
concern (which folder may import which is tests/unit/test_folder_imports.py's table)."""

from __future__ import annotations

import ast
import builtins
import os
import sys
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE_DIR = os.path.join(ROOT, "peft_shardmerge")
#: the module of test and demo helpers (tiny random models), which no library module may import
TEST_HELPERS = "testing"
#: the only module where exception classes may be defined
ERRORS = "errors"


@dataclass
class Module:
    name: str  # dotted, e.g. "peft_shardmerge.output.staging"; a package's __init__ is the package's name
    path: str
    source: str
    tree: ast.Module
    is_package: bool


def read_package(pkg_dir: str) -> dict[str, Module]:
    """Every ``.py`` file of the package and its subpackages, parsed."""
    root = os.path.dirname(os.path.normpath(pkg_dir))
    mods = {}
    for folder, _, files in os.walk(pkg_dir):
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(folder, f)
            name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
            is_package = name.endswith(".__init__")
            name = name[: -len(".__init__")] if is_package else name
            with open(path, encoding="utf-8") as fh:
                source = fh.read()
            mods[name] = Module(name, path, source, ast.parse(source, path), is_package)
    return mods


def _imports(mod: Module, mods: dict[str, Module], pkg: str):
    """``(line, target module, imported name or None)`` for every import of a package module, at any depth (imports
    inside functions included); the target is the submodule when the name imported is one."""
    package = mod.name if mod.is_package else mod.name.rpartition(".")[0]
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target != pkg and not target.startswith(pkg + "."):
                continue
            for alias in node.names:
                full = f"{target}.{alias.name}"
                yield node.lineno, (full if full in mods else target), (None if full in mods else alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == pkg or alias.name.startswith(pkg + "."):
                    yield node.lineno, alias.name, None


def import_graph(mods: dict[str, Module], pkg: str) -> dict[str, set[str]]:
    """Module -> the package modules it imports, anywhere in its code."""
    graph = {name: set() for name in mods}
    for m in mods.values():
        for _, target, _ in _imports(m, mods, pkg):
            if target in mods and target != m.name:
                graph[m.name].add(target)
    return graph


def import_cycles(mods: dict[str, Module], pkg: str) -> list[str]:
    """Every group of modules that import each other, directly or through others (strongly connected components
    of more than one module, Tarjan)."""
    graph = import_graph(mods, pkg)
    index, low, stack, on, comps = {}, {}, [], set(), []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(" <-> ".join(sorted(comp)))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(mods) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                strong(v)
    finally:
        sys.setrecursionlimit(limit)
    return comps


def private_import_problems(mods: dict[str, Module], pkg: str) -> list[str]:
    """``from .x import _name`` where ``_name`` is not a module: a private name used outside its module."""
    out = []
    for m in mods.values():
        for line, target, name in _imports(m, mods, pkg):
            if name and name.startswith("_") and not name.startswith("__"):
                out.append(f"{m.name} (line {line}) imports {target}.{name}")
    return out


def importers_of(mods: dict[str, Module], pkg: str, target: str) -> list[str]:
    """Library modules (other than ``target`` itself) that import module ``target``, with the line."""
    out = []
    for m in mods.values():
        if m.name == target:
            continue
        for line, imported, name in _imports(m, mods, pkg):
            if imported == target:
                out.append(f"{m.name} (line {line}) imports {target}{'.' + name if name and target == pkg else ''}")
    return out


def root_import_problems(mods: dict[str, Module], pkg: str) -> list[str]:
    """Library modules that import the package root (``from . import __version__``): the root imports the
    library, so that is a cycle waiting to happen."""
    return importers_of(mods, pkg, pkg)


def helper_import_problems(mods: dict[str, Module], pkg: str) -> list[str]:
    """Library modules that import the test helpers."""
    return importers_of(mods, pkg, f"{pkg}.{TEST_HELPERS}")


def _base_name(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Call):
        return _base_name(node.func)
    return ""


def exception_classes(mods: dict[str, Module]) -> dict[str, list[tuple[str, int]]]:
    """Class name -> ``[(module, line)]`` of every class that derives from ``Exception``: through a built-in
    exception, a base whose name ends in ``Error`` or ``Exception`` (another library's), or a class of the package
    that does (by name, followed to a fixed point)."""
    classes = [(m.name, node) for m in mods.values() for node in ast.walk(m.tree) if isinstance(node, ast.ClassDef)]
    known = {
        n
        for n in dir(builtins)
        if isinstance(getattr(builtins, n), type) and issubclass(getattr(builtins, n), Exception)
    }
    found: dict[str, list[tuple[str, int]]] = {}
    changed = True
    while changed:
        changed = False
        for module, node in classes:
            if (module, node.lineno) in found.get(node.name, []):
                continue
            if any(
                _base_name(b) in known
                or (not hasattr(builtins, _base_name(b)) and _base_name(b).endswith(("Error", "Exception")))
                for b in node.bases
            ):
                found.setdefault(node.name, []).append((module, node.lineno))
                known.add(node.name)
                changed = True
    return found


def exception_location_problems(mods: dict[str, Module], pkg: str) -> list[str]:
    """Exception classes defined outside ``errors.py``."""
    home = f"{pkg}.{ERRORS}"
    return [
        f"{name} is defined in {module} (line {line})"
        for name, where in sorted(exception_classes(mods).items())
        for module, line in where
        if module != home
    ]


@pytest.fixture(scope="module")
def package():
    return read_package(PACKAGE_DIR), os.path.basename(PACKAGE_DIR)


def test_no_import_cycle_counting_imports_inside_functions(package):
    assert import_cycles(*package) == []


def test_no_private_name_imported_across_modules(package):
    assert private_import_problems(*package) == []


def test_no_library_module_imports_the_package_root(package):
    assert root_import_problems(*package) == []


def test_no_library_module_imports_the_test_helpers(package):
    mods, pkg = package
    assert f"{pkg}.{TEST_HELPERS}" in mods, "the test helpers module was renamed: update TEST_HELPERS"
    assert helper_import_problems(mods, pkg) == []


def test_every_exception_class_is_defined_in_errors(package):
    mods, pkg = package
    assert [m for m, _ in exception_classes(mods)["ShardMergeError"]] == [f"{pkg}.{ERRORS}"]
    assert exception_location_problems(mods, pkg) == []


def _write(folder, name: str, text: str) -> None:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_each_rule_catches_what_it_forbids(tmp_path):
    """The checkers above, on a made-up package that breaks each rule once (and keeps to it once nearby)."""
    pkg = tmp_path / "fakepkg"
    _write(pkg, "__init__.py", "from .version import VERSION\n")
    _write(pkg, "version.py", 'VERSION = "1"\n')
    _write(pkg, "errors.py", "class BaseErr(Exception):\n    pass\n\n\nclass Sub(BaseErr, ValueError):\n    pass\n")
    _write(pkg, "testing.py", "from .a import helper\n")
    code = "\n".join(f"    x{i} = {i}" for i in range(61))
    fits = "\n".join(f"    y{i} = {i}  # a trailing comment" for i in range(59))  # 60 with the def line
    _write(
        pkg,
        "a.py",
        "from .b import _hidden, shown\nfrom . import VERSION\nfrom .testing import helper\n"
        "from .errors import BaseErr\n\n\nclass Local(BaseErr):\n    pass\n\n\n"
        "class Wrapped(json.JSONDecodeError):\n    pass\n\n\nclass Plain(dict):\n    pass\n\n\n"
        f"def long():\n{code}\n\n\n"
        f'def fits():\n    """A docstring\n\n    of several lines."""\n    # a comment\n\n{fits}\n\n\n'
        "def helper():\n    pass\n" + "\n" * 400,
    )
    _write(pkg, "b.py", "def shown():\n    from .c import later\n\n\ndef _hidden():\n    pass\n")
    _write(pkg, "c.py", "def later():\n    from .a import helper\n")
    _write(pkg, "sub/__init__.py", "")
    _write(pkg, "sub/d.py", "from .. import b\nfrom ..b import _hidden as h\n")
    mods = read_package(str(pkg))
    assert "fakepkg.sub.d" in mods and "fakepkg" in mods
    assert import_cycles(mods, "fakepkg") == ["fakepkg.a <-> fakepkg.b <-> fakepkg.c <-> fakepkg.testing"]
    assert private_import_problems(mods, "fakepkg") == [
        "fakepkg.a (line 1) imports fakepkg.b._hidden",
        "fakepkg.sub.d (line 2) imports fakepkg.b._hidden",
    ]
    assert root_import_problems(mods, "fakepkg") == ["fakepkg.a (line 2) imports fakepkg.VERSION"]
    assert helper_import_problems(mods, "fakepkg") == ["fakepkg.a (line 3) imports fakepkg.testing"]
    assert exception_location_problems(mods, "fakepkg") == [
        "Local is defined in fakepkg.a (line 7)",
        "Wrapped is defined in fakepkg.a (line 11)",
    ]
    assert import_cycles({k: v for k, v in mods.items() if k != "fakepkg.c"}, "fakepkg") == [
        "fakepkg.a <-> fakepkg.testing"
    ]


def test_planning_writes_nothing():
    """Planning and checking are pure: no function of the planners (the sources' folders) takes ``recover``, nor does
    the output folder's check, and the one step that writes before a plan (finishing a killed merge's commit,
    ``settle_out_dir``) is called from the entries in ``api/`` alone."""
    import inspect

    from peft_shardmerge.output.out_dir import check_out_dir

    recovers, settles = [], []
    for mod in read_package(PACKAGE_DIR).values():
        folder = mod.name.split(".")[1] if mod.name.count(".") else ""
        for node in ast.walk(mod.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and folder in ("checkpoint", "model"):
                if any(a.arg == "recover" for a in node.args.args + node.args.kwonlyargs):
                    recovers.append(f"{mod.name}.{node.name}")
            if isinstance(node, ast.Call) and folder not in ("api", "output"):
                name = getattr(node.func, "id", getattr(node.func, "attr", ""))
                if name in ("settle_out_dir", "finish_killed_commit"):
                    settles.append(f"{mod.name}: {name}")
    assert recovers == [] and settles == []
    assert "recover" not in inspect.signature(check_out_dir).parameters


def test_a_planned_tensor_is_neutral_and_only_its_source_reads_its_recipe(package):
    """PlannedTensor holds what every destination reads (name, dtype, its stored tensor, shard) and a recipe; a
    field only one source uses lives in that source's recipe, which only that source's folder (and, for a loaded
    model's sharded units, the ranks that gather them) reads beyond the Recipe protocol's methods."""
    import dataclasses

    from peft_shardmerge.engine.plan import PlannedTensor

    assert [f.name for f in dataclasses.fields(PlannedTensor)] == ["name", "out_dtype", "source", "recipe", "shard"]
    protocol = {"op", "stored", "change_keys"}
    readers = {"checkpoint", "model", "distributed", "support", "api"}
    read: dict[str, set[str]] = {}
    for mod in package[0].values():
        folder = mod.name.split(".")[1] if mod.name.count(".") >= 2 else "(top)"
        for node in ast.walk(mod.tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "recipe"
            ):
                if node.attr not in protocol:
                    read.setdefault(folder, set()).add(node.attr)
    assert read and set(read) <= readers, read  # engine/, output/ and verify/ never look inside a recipe
    assert not read.get("model", set()) & {"loras", "token_rows", "peft_ops", "quantize", "from_adapter"}
    assert not read.get("checkpoint", set()) & {"entry", "part", "kind"}
