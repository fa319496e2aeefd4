"""``peft-shardmerge verify OUT`` on a finished output to which files were added after the merge.

The merge record (``merge_manifest.json``) lists every file the merge wrote. A file added later that a loader reads
(``tokenizer_config.json``, a chat template, remote code) was checked by nothing, so the verdict cannot be OK: it is
UNCHECKED (exit 3), with the file named. A weight file added is FAILED (a loader may take weights from it);
documentation added (a README) is named in a note and leaves the verdict as it was."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from peft_shardmerge import merge_checkpoint


@pytest.fixture(scope="module")
def merged(tmp_path_factory, make_base, make_adapter):
    out = str(tmp_path_factory.mktemp("verify-extra") / "merged")
    merge_checkpoint(make_base("llama"), make_adapter("llama", "default"), out, progress=False)
    return out


def verify(*args) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [sys.executable, "-m", "peft_shardmerge", "verify", *args], capture_output=True, text=True, timeout=600
    )
    assert "Traceback" not in r.stdout + r.stderr, r.stderr
    return r


def test_the_record_lists_every_file_the_merge_wrote(merged):
    record = json.load(open(os.path.join(merged, "merge_manifest.json")))
    listed = set(record["shards"]) | set(record["files"])
    written = {os.path.relpath(os.path.join(root, f), merged) for root, _, files in os.walk(merged) for f in files}
    assert listed == written - {"merge_manifest.json"}
    r = verify(merged)
    assert r.returncode == 0 and r.stdout.startswith("OK: "), r.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json", "modeling_custom.py"]
)
def test_a_file_a_loader_reads_added_after_the_merge_is_unchecked_and_named(merged, tmp_path, name):
    folder = shutil.copytree(merged, tmp_path / "copy")
    (folder / name).write_text('{"chat_template": "{{ messages }}"}\n')
    r = verify(str(folder))
    assert r.returncode == 3 and r.stdout.startswith("UNCHECKED: "), r.stdout
    assert name in r.stdout and "was not checked" in r.stdout, r.stdout


@pytest.mark.slow
def test_documentation_added_is_a_note_and_weights_added_fail(merged, tmp_path):
    folder = shutil.copytree(merged, tmp_path / "copy")
    (folder / "README.md").write_text("# my model\n")
    r = verify(str(folder))
    assert r.returncode == 0 and "README.md was added after the merge" in r.stdout, r.stdout
    shutil.copyfile(folder / "model.safetensors", folder / "extra.safetensors")
    r = verify(str(folder))
    assert r.returncode == 1 and "extra.safetensors was not written by the merge" in r.stdout, r.stdout
