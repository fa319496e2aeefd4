"""What the command line says: each note once (summary, not a log line too, under --dry-run too), and BASE and ADAPTER
given the wrong way round named as such."""

from __future__ import annotations

import logging
import os

import pytest

from peft_shardmerge.api.cli import main
from peft_shardmerge.api.disk import plan_checkpoint_merge


def test_each_note_is_printed_once(make_base, make_adapter, tmp_path, capsys, caplog):
    base = make_base("qwen2")  # tied embeddings: a LoRA on the head unties them, which the plan notes
    adapter = make_adapter("qwen2", "head", target_modules=["q_proj", "lm_head"])
    notes = plan_checkpoint_merge(base, adapter, str(tmp_path / "plan")).notes
    assert notes
    for args in (["--dry-run"], []):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            assert main(["merge", base, adapter, str(tmp_path / f"o{len(args)}"), *args]) == 0
        shown = capsys.readouterr().out + "\n".join(
            r.getMessage() for r in caplog.records if r.levelno >= logging.INFO
        )
        for note in notes:
            assert shown.count(note) == 1, (args, note)


@pytest.mark.parametrize("which", ["merge", "dry-run"])
def test_base_and_adapter_swapped_are_named(which, make_base, make_adapter, tmp_path, capsys):
    base, adapter = make_base("llama"), make_adapter("llama")
    out = str(tmp_path / "o")
    assert main(["merge", adapter, base, out, *(["--dry-run"] if which == "dry-run" else [])]) == 2
    err = capsys.readouterr().err
    assert "BASE and ADAPTER look swapped" in err and "adapter_config.json" in err and not os.path.exists(out)
