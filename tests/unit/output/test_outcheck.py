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
    (out / "training_args.bin").write_bytes(b"trainer state")
    before = tree(out)
    for overwrite in (False, True):  # the hint without overwrite is the refusal overwrite would give
        with pytest.raises(InputError) as e:
            merge_checkpoint(*tiny, str(out), overwrite=overwrite, dtype="float16", progress=False)
        assert str(e.value) == (
            f"1 problem found before writing anything:\n  - output folder {out} holds an earlier output of "
            "peft-shardmerge and 1 entry added after the merge that its merge record (merge_manifest.json) does not "
            "list (training_args.bin); overwrite replaces that output and its model card (README.md), nothing "
            "else: move the others out, or choose another output folder"
        )
        assert tree(out) == before


@pytest.mark.parametrize("card", ["added", "edited"])
def test_overwrite_replaces_an_earlier_output_with_its_model_card_and_says_so(tiny, tmp_path, card, caplog):
    """The model card is the most common edit after a merge: the hint names it, overwrite replaces it with the
    rest of the earlier output (here with the base's own README.md, carried into the new output)."""
    import logging

    base = tmp_path / "base"
    shutil.copytree(tiny[0], base)
    if card == "edited":
        (base / "README.md").write_text("the base's card")
    out = tmp_path / "out"
    merge_checkpoint(str(base), tiny[1], str(out), progress=False, max_shard_size="300KB")
    (out / "README.md").write_text("my own card")
    with pytest.raises(InputError) as e:
        merge_checkpoint(str(base), tiny[1], str(out), progress=False, max_shard_size="300KB")
    shards = len([f for f in os.listdir(out) if f.endswith(".safetensors")])
    assert shards > 1
    assert str(e.value).endswith(
        f"output folder {out} holds an earlier output of peft-shardmerge; pass overwrite=True to replace it "
        f"({shards} shards, {4 + (card == 'edited')} other files of the merge and README.md, {card} after it)"
    )
    with caplog.at_level(logging.INFO, logger="peft_shardmerge.output.out_dir"):
        merge_checkpoint(str(base), tiny[1], str(out), overwrite=True, dtype="float16", progress=False)
    assert any(
        "README.md, " + card + " after it) is replaced once the new one is complete" in r.getMessage()
        for r in caplog.records
    )
    if card == "edited":
        assert (out / "README.md").read_text() == "the base's card"
    else:
        assert not (out / "README.md").exists()


def test_a_folder_that_overwrite_would_not_replace_is_never_offered_overwrite(tiny, tmp_path):
    from peft_shardmerge.api.cli import main

    for name in ("notes.txt", ".gitkeep"):
        out = tmp_path / name.strip(".")
        out.mkdir()
        (out / name).write_text("")
        with pytest.raises(InputError) as e:
            merge_checkpoint(*tiny, str(out), progress=False)
        assert "overwrite=True" not in str(e.value) and f"did not write ({name})" in str(e.value)
        assert "choose another output folder, or move them out" in str(e.value)
    for overwrite in ([], ["--overwrite"]):  # OUT is the base: one problem, no flag offered
        with pytest.raises(InputError) as e:
            merge_checkpoint(*tiny, tiny[0], progress=False, overwrite=bool(overwrite))
        assert str(e.value) == (
            f"1 problem found before writing anything:\n  - output folder {tiny[0]} is the base folder {tiny[0]}; "
            "choose a folder outside it"
        )
    assert main(["merge", *tiny, tiny[0], "-q"]) == 2


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
    from peft_shardmerge.output.files import sidecar
    from peft_shardmerge.output.out_dir import staged_bytes

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

    from peft_shardmerge.output.out_dir import check_space, staged_bytes

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

    from peft_shardmerge.output.out_dir import staged_bytes

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


def test_a_stale_lock_taken_over_is_one_plain_line(tiny, tmp_path, caplog):
    import json
    import logging

    from peft_shardmerge.output.files import MADE_BY, sidecar

    out = tmp_path / "out"
    with open(sidecar(str(out), "lock"), "w") as f:  # a merge killed outright: its record, no process holding it
        json.dump({"made_by": MADE_BY, "pid": 2**22 + 7, "host": "gone", "started": "2026-12-01 10:00:00"}, f)
    with caplog.at_level(logging.INFO, logger="peft_shardmerge.output.lock"):
        merge_checkpoint(*tiny, str(out), progress=False)
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and r.name.endswith(".lock")]
    assert said == [
        f"{out}: the lock of a merge that stopped (pid {2**22 + 7}, started 2026-12-01 10:00:00) is taken over"
    ]
