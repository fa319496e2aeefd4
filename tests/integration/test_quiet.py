"""A quiet first run: the demo, the command line, merge_checkpoint and merge_and_save print our own output only
(unless -v), DeepSpeed is imported only for a DeepSpeed engine, and the user's logging, warning and progress-bar
settings are as they were after a merge."""

from __future__ import annotations

import builtins
import logging
import os
import subprocess
import sys
import warnings

import pytest
import torch

from peft_shardmerge import merge_and_save, merge_checkpoint
from peft_shardmerge.api.quiet import DEEPSPEED_LOGGER, quiet_libraries
from tests.helpers import ROOT_DIR as ROOT

#: what the libraries printed on a first run before (DeepSpeed, bitsandbytes, transformers' warning and bars)
FOREIGN = (
    "Setting accelerator to CPU",
    "Failed to load CPU gemm_4bit_forward",
    "kernels-community",
    "is_gradient_checkpointing",
    "FutureWarning",
    "Loading weights",
    "[WARNING]",
)


@pytest.fixture
def deepspeed_imports(monkeypatch):
    """The ``deepspeed`` modules imported from now on (every import statement, whether loaded before or not)."""
    seen: list[str] = []
    real = builtins.__import__

    def recording(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and name.split(".")[0] == "deepspeed":
            seen.append(name)
        return real(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", recording)
    return seen


def _foreign(text: str) -> list[str]:
    return [s for s in FOREIGN if s in text]


def test_a_disk_merge_imports_no_deepspeed(make_base, make_adapter, tmp_path, deepspeed_imports):
    base, adapter = make_base("llama"), make_adapter("llama", "default")
    loaded_before = "deepspeed" in sys.modules  # building them took transformers' save_pretrained, which imports it
    deepspeed_imports.clear()
    report = merge_checkpoint(base, adapter, str(tmp_path / "m"), dtype="float32", progress=False)
    assert report.lora_modules_merged == 14
    assert deepspeed_imports == []
    assert loaded_before or "deepspeed" not in sys.modules


def test_merge_and_save_imports_no_deepspeed(make_base, make_adapter, tmp_path, deepspeed_imports):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, adapter = make_base("llama"), make_adapter("llama", "default")
    with quiet_libraries():
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    deepspeed_imports.clear()  # what loading the model did is transformers' and PEFT's, not ours
    report = merge_and_save(model, str(tmp_path / "m"), dtype="float32", base_precision="dequantized", progress=False)
    assert report.lora_modules_merged == 14
    assert deepspeed_imports == []


def _settings() -> tuple:
    """The global settings a merge must leave as it found them."""
    from huggingface_hub.utils import are_progress_bars_disabled
    from transformers.utils import logging as hf_logging

    levels = tuple(logging.getLogger(n).level for n in ("transformers", "bitsandbytes", "peft", DEEPSPEED_LOGGER))
    return (
        levels,
        tuple(logging.getLogger(DEEPSPEED_LOGGER).filters),
        hf_logging.is_progress_bar_enabled(),
        are_progress_bars_disabled(),
        list(warnings.filters),
    )


@pytest.mark.parametrize("bars", [True, False])
def test_the_libraries_are_held_back_for_the_call_and_restored_after(bars):
    from transformers.utils import logging as hf_logging

    (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()
    bnb_logger = logging.getLogger("bitsandbytes")
    bnb_level = bnb_logger.level
    bnb_logger.setLevel(logging.INFO)  # a user's own setting, kept
    try:
        before = _settings()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with quiet_libraries():
                assert not hf_logging.is_progress_bar_enabled()
                for name in (
                    "transformers.modeling_utils",
                    "bitsandbytes.backends.cpu.ops",
                    "kernels._internals.hf_hub",  # "Skipping publisher trust check" when bitsandbytes loads it offline
                    "accelerate.utils",
                ):
                    assert not logging.getLogger(name).isEnabledFor(logging.WARNING), name
                    assert logging.getLogger(name).isEnabledFor(logging.ERROR), name
                record = logging.LogRecord(
                    DEEPSPEED_LOGGER, logging.WARNING, "x.py", 1, "Setting accelerator", (), None
                )
                assert not logging.getLogger(DEEPSPEED_LOGGER).filter(record)
                warnings.warn_explicit(
                    "deprecated", FutureWarning, "modeling_utils.py", 1, module="transformers.modeling_utils"
                )
                warnings.warn_explicit("ours", UserWarning, "inprocess.py", 1, module="peft_shardmerge.api.inprocess")
                warnings.filterwarnings("ignore", message="a filter an import adds")  # numpy's, scipy's, ...
            assert [str(w.message) for w in caught] == ["ours"]
            assert warnings.filters[0][1].pattern == "a filter an import adds"  # kept
        assert _settings() == before
    finally:
        hf_logging.enable_progress_bar()
        bnb_logger.setLevel(bnb_level)


def test_transformers_imported_inside_a_block_that_left_it_unimported_is_held_back_then_as_it_set_itself():
    script = """
import logging, sys
from peft_shardmerge.api.quiet import quiet_libraries
with quiet_libraries(transformers=False):
    assert "transformers" not in sys.modules
    with quiet_libraries(transformers=False):
        import transformers  # its first import sets its logger's level and turns its bars on
    from transformers.utils import logging as hf
    inside = (logging.getLogger("transformers").level, hf.is_progress_bar_enabled())
print(inside, (logging.getLogger("transformers").level, hf.is_progress_bar_enabled()))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[-2] == "(40, False) (30, True)"  # held back inside; after: as its import set it


def test_blocks_of_two_threads_put_the_settings_back_when_the_last_closes():
    import threading

    logger = logging.getLogger("peft")
    before = logger.level
    opened, closing = threading.Event(), threading.Event()

    def other() -> None:
        with quiet_libraries():
            opened.set()
            closing.wait(30)

    with quiet_libraries():
        thread = threading.Thread(target=other)
        thread.start()
        assert opened.wait(30)
    assert logger.level == logging.ERROR  # the other thread's block is still open
    closing.set()
    thread.join(30)
    assert logger.level == before


def test_debug_logging_holds_nothing_back():
    ours = logging.getLogger("peft_shardmerge")
    level = ours.level
    ours.setLevel(logging.DEBUG)  # what peft-shardmerge -v amounts to
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with quiet_libraries():
                warnings.warn_explicit(
                    "deprecated", FutureWarning, "modeling_utils.py", 1, module="transformers.modeling_utils"
                )
    finally:
        ours.setLevel(level)
    assert [str(w.message) for w in caught] == ["deprecated"]


@pytest.mark.slow
def test_the_command_line_prints_only_our_output_and_imports_no_deepspeed(make_base, make_adapter, tmp_path):
    base, adapter = make_base("llama"), make_adapter("llama", "default")
    code = (
        "import sys; from peft_shardmerge.api.cli import main; code = main(sys.argv[1:]); "
        "print('deepspeed imported:', 'deepspeed' in sys.modules); sys.exit(code)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, "merge", base, adapter, str(tmp_path / "m"), "--dtype", "float32"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert "LoRA modules merged 14/14" in r.stdout and "deepspeed imported: False" in r.stdout
    assert _foreign(r.stdout + r.stderr) == [], r.stdout + r.stderr


def test_the_command_line_leaves_out_the_warnings_of_the_libraries_it_calls(make_base, make_adapter, tmp_path):
    """What the libraries log while the command plans (here the kernels package's offline notice, as bitsandbytes
    loading its CPU kernel makes it say) is left out; an error of theirs is not."""
    base, adapter = make_base("llama"), make_adapter("llama", "default")
    code = (
        "import logging, sys; from peft_shardmerge.checkpoint import planner; real = planner.build_plan\n"
        "def noisy(*a, **k):\n"
        "    logging.getLogger('kernels._internals.hf_hub').warning('Skipping publisher trust check')\n"
        "    logging.getLogger('DeepSpeed').warning('Setting accelerator to CPU')\n"
        "    logging.getLogger('accelerate.utils').error('an error of theirs')\n"
        "    return real(*a, **k)\n"
        "planner.build_plan = noisy\n"
        "from peft_shardmerge.api.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, "merge", base, adapter, str(tmp_path / "m"), "--model-checks", "first", "-q"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        check=False,
    )
    assert (r.returncode, r.stdout) == (0, ""), r.stderr
    assert r.stderr.splitlines() == ["peft-shardmerge: error (accelerate.utils): an error of theirs"], r.stderr


@pytest.mark.slow
def test_the_demo_prints_only_our_output(tmp_path):
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "demo.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip().endswith("->  MATCH")
    assert _foreign(r.stdout + r.stderr) == [], r.stdout + r.stderr
    assert all(line.startswith("merging") or not line.strip() for line in r.stderr.splitlines()), r.stderr
