"""The README's layout table is generated from the package tree (each folder's and module's first docstring line)
and compared here; ``python tests/unit/test_readme_layout.py --write`` rewrites it."""

from __future__ import annotations

import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "peft_shardmerge")
README = os.path.join(ROOT, "README.md")
BEGIN, END = "<!-- layout: generated from the package by tests/unit/test_readme_layout.py -->", "<!-- layout end -->"
#: the folders top-down, from what a user calls to the bytes on disk (the package's top-level modules last)
ORDER = ["api", "checkpoint", "model", "engine", "quant", "io", "output", "distributed", "verify", "support", ""]


def _first_line(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    return " ".join(doc.split("\n\n")[0].split())


def layout_table() -> str:
    """The markdown table of every folder and module of the package, with what each owns."""
    rows = ["| folder | module | owns |", "|---|---|---|"]
    folders = sorted(d for d in os.listdir(PACKAGE) if os.path.isfile(os.path.join(PACKAGE, d, "__init__.py")))
    assert sorted(ORDER[:-1]) == folders, f"ORDER must list every folder of the package: {folders}"
    for folder in ORDER:
        where = os.path.join(PACKAGE, folder)
        shown = f"`peft_shardmerge/{folder}/`" if folder else "`peft_shardmerge/`"
        rows.append(f"| {shown} | | {_first_line(os.path.join(where, '__init__.py'))} |")
        for name in sorted(f for f in os.listdir(where) if f.endswith(".py") and f != "__init__.py"):
            rows.append(f"| | `{name}` | {_first_line(os.path.join(where, name))} |")
    return "\n".join(rows)


def _readme_block() -> str:
    with open(README, encoding="utf-8") as f:
        text = f.read()
    return text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip("\n")


def test_the_readme_layout_table_is_the_package_tree():
    assert _readme_block() == layout_table(), "run: python tests/unit/test_readme_layout.py --write"


def test_every_module_says_what_it_owns():
    silent = [
        os.path.relpath(os.path.join(d, f), PACKAGE)
        for d, _, files in os.walk(PACKAGE)
        for f in files
        if f.endswith(".py") and not _first_line(os.path.join(d, f))
    ]
    assert silent == []


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    with open(README, encoding="utf-8") as f:
        text = f.read()
    head, tail = text[: text.index(BEGIN) + len(BEGIN)], text[text.index(END) :]
    with open(README, "w", encoding="utf-8") as f:
        f.write(f"{head}\n{layout_table()}\n{tail}")
