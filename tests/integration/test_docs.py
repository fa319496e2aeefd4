"""The examples in the docs and examples/ run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from contextlib import ExitStack

import pytest

from tests.helpers import ROOT_DIR as ROOT

#: subprocesses, signals and kills: make test-all runs them
pytestmark = pytest.mark.slow

BLOCK = re.compile(r"^```(python|bash)\n(.*?)^```", re.DOTALL | re.MULTILINE)
#: the first line of an example that is not run, and why: ``# sketch: <why>``
SKETCH = re.compile(r"# sketch: \S.{10,}")
#: the pages whose examples the suite runs, each in a folder of its own; the others hold sketches only
RUN = [
    "README.md",
    "docs/guide.md",
    "docs/after-training.md",
    "docs/variants-dora.md",
    "docs/variants-several-adapters.md",
    "docs/variants-vocabulary.md",
    "docs/variants-layers.md",
    "docs/variants-other-peft.md",
    "docs/architectures.md",
    "docs/quantized-bases.md",
    "docs/distributed.md",
    "docs/choosing-the-base.md",
    "docs/gguf.md",
    "docs/hub.md",
    "docs/quantized.md",
]
#: pages whose pushes go to a local Hub (tests/hub_server.py), as the environment names it
AGAINST_A_LOCAL_HUB = {"docs/hub.md"}
#: pages whose commands run from the root of the clone, as they say
FROM_THE_ROOT = {"docs/choosing-the-base.md"}


def _blocks(path: str) -> list[tuple[str, str]]:
    with open(os.path.join(ROOT, path)) as f:
        return BLOCK.findall(f.read())


def _sketch(code: str) -> bool:
    return bool(SKETCH.fullmatch(code.split("\n", 1)[0].strip()))


@pytest.mark.parametrize("doc", RUN)
def test_doc_examples_run(doc, tmp_path, monkeypatch):
    blocks = [(lang, code) for lang, code in _blocks(doc) if not _sketch(code)]
    assert blocks
    monkeypatch.chdir(ROOT if doc in FROM_THE_ROOT else tmp_path)
    namespace: dict = {}
    bindir = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1"}
    with ExitStack() as stack:
        hub = _local_hub(stack, monkeypatch, env) if doc in AGAINST_A_LOCAL_HUB else None
        _run_blocks(doc, blocks, namespace, env)
        if hub is not None:  # the page's pushes reached the Hub, at most one commit each (the same files: none)
            calls = ("push_to_hub_merged(", "peft-shardmerge push ", 'push_to_hub="')
            pushes = sum(code.count(call) for _, code in blocks for call in calls)
            named = set(re.findall(r"\bme/[\w.-]+", "".join(code for _, code in blocks)))
            assert 0 < len(hub.commits) <= pushes and {c["repo"] for c in hub.commits} == named
            assert hub.unknown == [] and hub.errors == []


def _local_hub(stack: ExitStack, monkeypatch, env: dict):
    """A local Hub for the page's pushes: huggingface_hub pointed at it, in this process and in the commands."""
    import huggingface_hub.constants as hc
    from hub_server import FakeHub

    hub = stack.enter_context(FakeHub())
    local = {"HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_docs", "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1"}
    for name, value in local.items():
        monkeypatch.setenv(name, value)
    env.update(local)
    monkeypatch.setattr(hc, "ENDPOINT", hub.url)
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hc, "HF_HUB_DISABLE_XET", True)
    return hub


def _run_blocks(doc: str, blocks, namespace: dict, env: dict) -> None:
    for lang, code in blocks:
        if lang == "python":
            exec(compile(code, doc, "exec"), namespace)  # our own documentation
        else:
            r = subprocess.run(code, shell=True, capture_output=True, text=True, env=env, timeout=600)
            assert r.returncode == 0, f"{code}\n{r.stderr}"
            if doc == "docs/choosing-the-base.md":
                _agree_as_the_page_says(r.stdout)


def _agree_as_the_page_says(printed: str) -> None:
    """The comparison's own table (its figures depend on the CPU's kernels): the base alone is worse, and the
    trained model and both merges agree to about 1e-3, the dequantized merge closest to the trained model."""
    losses = [
        float(line.rsplit("|", 2)[1])
        for line in printed.splitlines()
        if line.startswith("| ") and not line.startswith("| model")
    ]
    base_alone, trained, original, dequantized = losses
    assert trained < base_alone and abs(original - trained) < 2e-3 and abs(dequantized - trained) < 2e-3, printed
    assert abs(dequantized - trained) <= abs(original - trained), printed


def test_every_example_in_the_docs_runs_or_says_why_not():
    """An allowlist of pages the suite runs; on every other page, and for the blocks a run page skips, the first line
    says why the example is not run (``# sketch: ...``)."""
    pages = ["README.md"] + [os.path.join("docs", n) for n in sorted(os.listdir(os.path.join(ROOT, "docs")))]
    silent = [
        f"{page}: {code.splitlines()[0] if code.strip() else '(empty)'}"
        for page in pages
        if page.endswith(".md")
        for _, code in _blocks(page)
        if page not in RUN and not _sketch(code)
    ]
    assert silent == []  # SKETCH asks for a reason after "# sketch: "


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
