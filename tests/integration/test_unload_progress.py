"""merge_and_unload(progressbar=True), PEFT's call site (peft_shardmerge/api/dropins.py): a tqdm bar over the
modules."""

from __future__ import annotations

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from peft_shardmerge import merge_and_unload


def _model(base: str, adapter: str):
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)


def test_progressbar_shows_a_bar_over_the_modules_on_a_terminal_and_none_without_it(make_base, make_adapter, capsys):
    import os
    import sys

    from tests.helpers import run_on_a_terminal

    base, adapter = make_base("llama"), make_adapter("llama")
    script = (
        "import sys, torch; from peft import PeftModel; from transformers import AutoModelForCausalLM; "
        "from peft_shardmerge import merge_and_unload; "
        "m = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(sys.argv[1]), sys.argv[2]); "
        "merge_and_unload(m, progressbar=True)"
    )
    code, shown = run_on_a_terminal([sys.executable, "-c", script, base, adapter], env=dict(os.environ))
    assert code == 0 and "Unloading and merging model" in shown and "14/14" in shown, shown  # 2 layers x 7 each
    merge_and_unload(_model(base, adapter), progressbar=True)  # stderr is no terminal here (a log, CI): no bar
    merge_and_unload(_model(base, adapter))
    assert "Unloading and merging model" not in capsys.readouterr().err
