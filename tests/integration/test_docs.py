"""The examples in the docs and examples/ run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT_DIR as ROOT

#: subprocesses, signals and kills: make test-all runs them
pytestmark = pytest.mark.slow

BLOCK = re.compile(r"^```(python|bash)\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _blocks(path: str) -> list[tuple[str, str]]:
    with open(os.path.join(ROOT, path)) as f:
        return BLOCK.findall(f.read())


@pytest.mark.parametrize(
    "doc",
    [
        "docs/guide.md",
        "docs/after-training.md",
        "docs/variants-dora.md",
        "docs/variants-several-adapters.md",
        "docs/variants-vocabulary.md",
        "docs/variants-layers.md",
        "docs/variants-other-peft.md",
        "docs/architectures.md",
        "docs/quantized-bases.md",
    ],
)
def test_doc_examples_run(doc, tmp_path, monkeypatch):
    blocks = _blocks(doc)
    assert blocks
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    bindir = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}
    for lang, code in blocks:
        if lang == "python":
            exec(compile(code, doc, "exec"), namespace)  # our own documentation
        else:
            r = subprocess.run(code, shell=True, capture_output=True, text=True, env=env, timeout=600)
            assert r.returncode == 0, f"{code}\n{r.stderr}"


def test_readme_commands_exist():
    text = open(os.path.join(ROOT, "README.md")).read()
    assert "make demo" in text and "make test" in text
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)


def test_demo_example_runs(tmp_path):
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "demo.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip().endswith("->  MATCH")
    assert "LoRA modules merged 14/14" in r.stdout


def test_qlora_example_runs(tmp_path):
    pytest.importorskip("bitsandbytes")
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "qlora_train_and_merge.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip().endswith("->  MATCH")
    assert "LoRA modules merged 14/14" in r.stdout and "base precision dequantized" in r.stdout


def test_compare_bases_example_runs(tmp_path):
    pytest.importorskip("bitsandbytes")
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "compare_bases.py"), str(tmp_path), "--steps", "30"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    losses = [
        float(line.rsplit("|", 2)[1])
        for line in r.stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| model")
    ]
    base_alone, trained, original, dequantized = losses
    assert trained < base_alone
    assert abs(dequantized - trained) < 0.05 and abs(original - trained) < 0.05
