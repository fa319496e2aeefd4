"""What ``overwrite`` may replace: an empty folder or an earlier output of peft-shardmerge holding only what its
merge record lists; a folder with anything else is refused before anything is written, naming what is there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from peft_shardmerge import InputError, merge_checkpoint
from tests.helpers import tree


@pytest.fixture()
def tiny(make_base, make_adapter):
    return make_base("llama"), make_adapter("llama", "default")


def _user_folder(out):
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("my notes")
    (out / "README.md").write_text("my readme")
    (out / "sub" / "data.bin").write_bytes(b"1234")
    return tree(out)


def test_overwrite_refuses_a_folder_of_the_users_and_names_what_is_there(tiny, tmp_path):
    out = tmp_path / "out"
    before = _user_folder(out)
    with pytest.raises(InputError) as e:
        merge_checkpoint(*tiny, str(out), overwrite=True, progress=False)
    text = str(e.value)
    assert "holds files peft-shardmerge did not write (README.md, notes.txt, sub, sub/data.bin)" in text
    assert "no merge_manifest.json of ours" in text and "choose another output folder" in text
    assert tree(out) == before and sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.slow
def test_overwrite_on_the_command_line_refuses_it_too(tiny, tmp_path):
    out = tmp_path / "out"
    before = _user_folder(out)
    r = subprocess.run(
        [sys.executable, "-m", "peft_shardmerge", "merge", *tiny, str(out), "--overwrite", "-q"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        check=False,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "did not write (README.md, notes.txt, sub, sub/data.bin)" in r.stderr
    assert tree(out) == before and sorted(os.listdir(tmp_path)) == ["out"]


def test_a_file_added_to_an_earlier_output_is_never_deleted(tiny, tmp_path):
    out = tmp_path / "out"
    merge_checkpoint(*tiny, str(out), progress=False)
    (out / "notes.txt").write_text("added after the merge")
    before = tree(out)
    with pytest.raises(InputError, match=r"did not write \(notes\.txt\).*does not list, added after the merge"):
        merge_checkpoint(*tiny, str(out), overwrite=True, dtype="float16", progress=False)
    assert tree(out) == before


def test_merge_and_save_with_overwrite_refuses_a_folder_of_the_users(tiny, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from peft_shardmerge import merge_and_save

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny[0], dtype=torch.float32), tiny[1])
    out = tmp_path / "out"
    before = _user_folder(out)
    with pytest.raises(InputError, match=r"did not write \(README\.md, notes\.txt, sub, sub/data\.bin\)"):
        merge_and_save(model, str(out), overwrite=True, progress=False)
    assert tree(out) == before and sorted(os.listdir(tmp_path)) == ["out"]


def test_a_plan_or_dry_run_touches_nothing_a_killed_merge_left_and_the_merge_itself_clears_it(tiny, tmp_path):
    """A dead merge's lock beside a finished output: planning and --dry-run leave every file as it is (they write
    nothing); the merge that runs removes the stale lock."""
    import json

    from peft_shardmerge import plan_checkpoint_merge
    from peft_shardmerge.output.files import MADE_BY, sidecar

    out = tmp_path / "out"
    merge_checkpoint(*tiny, str(out), progress=False)
    lock = sidecar(str(out), "lock")
    with open(lock, "w") as f:  # what a merge killed after its commit leaves: its record, no process holding it
        json.dump({"made_by": MADE_BY, "pid": 2**22 + 7, "host": "gone", "started": "then"}, f)
    before = tree(tmp_path)
    plan_checkpoint_merge(*tiny, str(out), overwrite=True)
    merge_checkpoint(*tiny, str(out), overwrite=True, dry_run=True, progress=False)
    assert tree(tmp_path) == before
    merge_checkpoint(*tiny, str(out), overwrite=True, progress=False)
    assert not os.path.lexists(lock) and sorted(os.listdir(tmp_path)) == ["out"]


def test_overwrite_refuses_an_earlier_output_whose_files_the_user_edited(tiny, tmp_path):
    out = tmp_path / "out"
    merge_checkpoint(*tiny, str(out), progress=False)
    with open(out / "config.json", "a") as f:
        f.write("\n")  # an edit after the merge: still a file the record lists, no longer the bytes it wrote
    before = tree(out)
    with pytest.raises(InputError, match=r"holds files changed since peft-shardmerge wrote them \(config\.json\)"):
        merge_checkpoint(*tiny, str(out), overwrite=True, progress=False)
    assert tree(out) == before
    (out / "config.json").write_bytes(b"")  # replaced by the user: refused too
    with pytest.raises(InputError, match="changed since"):
        merge_checkpoint(*tiny, str(out), overwrite=True, progress=False)


def _our_staging(tmp_path, name: str, nbytes: int):
    """``tmp_path/.out.partial`` with a manifest of ours and ``name`` holding ``nbytes`` random bytes; ``OUT``."""
    staging = tmp_path / ".out.partial"
    staging.mkdir()
    (staging / "manifest.json").write_text('{"made_by": "peft-shardmerge", "shards": {}}')
    (staging / name).write_bytes(os.urandom(nbytes))
    return tmp_path / "out", staging


def test_only_a_staging_folder_of_ours_counts_as_space_for_the_next_run(tmp_path):
    from peft_shardmerge.output.checks import staged_bytes
    from peft_shardmerge.output.files import sidecar

    out = tmp_path / "out"
    staging = tmp_path / ".out.partial"
    assert sidecar(str(out), "partial") == str(staging)
    staging.mkdir()
    shard = staging / "model-00001-of-00002.safetensors"
    with open(shard, "wb") as f:
        f.write(os.urandom(3 << 20))
        os.fsync(f.fileno())  # blocks counted once written (some filesystems allocate late)
    assert staged_bytes(str(out)) == 0  # no manifest: not ours, never counted (the merge refuses to touch it)
    (staging / "manifest.json").write_text('{"made_by": "peft-shardmerge", "shards": {}}')
    (staging / "sub").mkdir()  # not a file of a merge: not counted
    (staging / "sub" / "x").write_bytes(os.urandom(1 << 20))
    (staging / "link").symlink_to("x" * 200)  # a link long enough to take a block of its own: not counted either
    counted = staged_bytes(str(out))
    disk = sum(os.stat(staging / f).st_blocks * 512 for f in ("model-00001-of-00002.safetensors", "manifest.json"))
    assert counted == disk and counted >= 3 << 20
    link = tmp_path / ".linked.partial"
    link.symlink_to(staging)
    assert staged_bytes(str(tmp_path / "linked")) == 0
    os.link(shard, tmp_path / "kept-elsewhere")  # a second name: removing the staged one frees nothing
    assert staged_bytes(str(out)) == counted - os.stat(shard).st_blocks * 512


def test_an_unreadable_staging_folder_counts_for_nothing_and_breaks_no_check(tmp_path, monkeypatch):
    import errno

    from peft_shardmerge.output.checks import check_space, staged_bytes

    out, staging = _our_staging(tmp_path, "model-00001-of-00001.safetensors", 1 << 20)
    assert staged_bytes(str(out)) > 1 << 20
    if os.geteuid() == 0:  # root lists any folder: the listing fails as it does for a user on a 0o300 folder
        real = os.scandir

        def denied(path):
            if os.fspath(path) == str(staging):
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real(path)

        monkeypatch.setattr(os, "scandir", denied)
    staging.chmod(0o300)  # can enter and write, cannot list
    try:
        assert staged_bytes(str(out)) == 0
        assert check_space(str(out), 1000) == []
        free = shutil.disk_usage(tmp_path).free
        (problem,) = check_space(str(out), free + (1 << 30))
        assert "not enough free space" in problem and "interrupted run" not in problem
    finally:
        staging.chmod(0o700)


def test_a_staged_file_removed_while_it_is_counted_is_skipped(tmp_path, monkeypatch):
    from contextlib import contextmanager

    from peft_shardmerge.output.checks import staged_bytes

    out, staging = _our_staging(tmp_path, "manifest.json.tmp", 1 << 20)
    real = os.scandir

    @contextmanager
    def listed_then_renamed(path):  # another merge of ours renames its manifest between the listing and the stat
        with real(path) as entries:
            listed = sorted(entries, key=lambda e: e.name != "manifest.json.tmp")  # the vanishing one first
        os.replace(staging / "manifest.json.tmp", staging / "manifest.json")
        yield iter(listed)

    monkeypatch.setattr(os, "scandir", listed_then_renamed)
    assert staged_bytes(str(out)) == os.stat(staging / "manifest.json").st_blocks * 512
