"""The user's files: where OUT may be, names beside it we did not make, files added while a merge runs, resume
keyed on input content, interrupts and kills at the moments that matter, and the messages about OUT's state.

Every test runs real merges of tiny models and compares the trees it must not touch, byte for byte, before and
after. Kills and interrupts are real signals sent to a real ``peft-shardmerge`` process; the moment is chosen by
a wrapper around one of this package's own functions in that process (never around a library's)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from peft_shardmerge import InputError, check_out_dir, merge_checkpoint, plan_checkpoint_merge
from peft_shardmerge.errors import FileSystemError, OutputChangedError
from peft_shardmerge.output.files import remove_checked, snapshot
from peft_shardmerge.output.staging import partial_dir
from tests.helpers import tree

#: subprocesses, signals and kills: make test-all runs them
pytestmark = pytest.mark.slow

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def user_folder(path: Path) -> Path:
    """A folder of the user's, with files and a subfolder."""
    (path / "sub").mkdir(parents=True)
    (path / "notes.txt").write_text("my notes")
    (path / "sub" / "data.bin").write_bytes(os.urandom(1000))
    return path


def run_cli(tmp_path, args, patch: str = "", cwd=None, timeout=300) -> subprocess.CompletedProcess:
    """``peft-shardmerge ARGS`` in a fresh process, after ``patch`` (Python run first, to pick a moment)."""
    script = tmp_path / f"run-{time.monotonic_ns()}.py"
    script.write_text(
        "import os, signal, sys\n"
        + textwrap.dedent(patch)
        + "\nfrom peft_shardmerge.api.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    )
    return subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


@pytest.fixture()
def tiny(make_base, make_adapter):
    return make_base("llama"), make_adapter("llama", "default")


@pytest.fixture()
def sharded(make_base, make_adapter):
    return make_base("llama_sharded"), make_adapter("llama_sharded", "default")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, make_base, make_adapter):
    """The sharded merge done once, uninterrupted."""
    out = tmp_path_factory.mktemp("ref") / "out"
    merge_checkpoint(
        make_base("llama_sharded"),
        make_adapter("llama_sharded", "default"),
        str(out),
        max_shard_size="100KB",
        progress=False,
        resume=False,
    )
    return tree(out)


# ---------------------------------------------------------------------------------------------------- where OUT is


def _dangerous(work: Path, home: Path) -> dict[str, str]:
    return {
        "empty": "",
        ".": ".",
        "./": "./",
        "root": "/",
        "cwd": str(work),
        "cwd/": str(work) + "/",
        "parent of cwd": str(work.parent),
        "..": "..",
        "home": str(home),
        "home/": str(home) + "/",
        "~ parent": str(home.parent),
        "cwd via symlink": str(work.parent / "link-to-work"),
    }


@pytest.mark.parametrize("overwrite", [False, True])
def test_dangerous_out_is_refused_and_nothing_changes(tiny, tmp_path, monkeypatch, overwrite):
    base, adapter = tiny
    work = user_folder(tmp_path / "user" / "work")
    home = user_folder(tmp_path / "user" / "work" / "home")  # a home inside the working folder
    (tmp_path / "user" / "link-to-work").symlink_to(work)
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(home))
    before = tree(tmp_path)
    for case, out in _dangerous(work, home).items():
        with pytest.raises(InputError) as e:
            merge_checkpoint(base, adapter, out, overwrite=overwrite, progress=False)
        assert type(e.value) is InputError, case
        assert any(
            w in str(e.value) for w in ("empty path", "filesystem root", "current working folder", "home folder")
        ), (case, str(e.value))
        assert tree(tmp_path) == before, case
    print(f"\n{len(_dangerous(work, home))} dangerous OUT values refused (overwrite={overwrite})")


def test_dangerous_out_on_the_command_line(tiny, tmp_path):
    base, adapter = tiny
    work = user_folder(tmp_path / "work")
    before = tree(tmp_path)
    for out in ("", ".", "/"):
        r = run_cli(tmp_path, ["merge", base, adapter, out, "--overwrite", "-q"], cwd=work)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "empty path" in r.stderr or "working folder" in r.stderr or "filesystem root" in r.stderr
        assert r.stderr.startswith("peft-shardmerge: error: 1 problem found before writing anything")
    for f in tmp_path.glob("run-*.py"):
        f.unlink()
    assert tree(tmp_path) == before


def test_symlinked_out_is_refused_with_or_without_a_trailing_slash(tiny, tmp_path):
    base, adapter = tiny
    mine = user_folder(tmp_path / "mine")
    (tmp_path / "link").symlink_to(mine)
    before = tree(tmp_path)
    for out in (tmp_path / "link", str(tmp_path / "link") + "/", str(tmp_path / "link") + "//"):
        for overwrite in (False, True):
            with pytest.raises(InputError, match="is a symlink"):
                merge_checkpoint(base, adapter, out, overwrite=overwrite, progress=False)
            assert tree(tmp_path) == before


def test_trailing_slash_names_the_same_output(tiny, tmp_path):
    base, adapter = tiny
    merge_checkpoint(base, adapter, str(tmp_path / "out") + "/", progress=False)
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_parent_is_a_file_name_too_long_and_unwritable_parent_are_named_up_front(tiny, tmp_path):
    base, adapter = tiny
    (tmp_path / "afile").write_text("x")
    cases = {
        str(tmp_path / "afile" / "out"): r"afile is a file, not a folder",
        str(tmp_path / "afile" / "deeper" / "out"): r"afile is a file, not a folder",
        str(tmp_path / ("n" * 250)): r"staging folder and lock beside it .* need 264 bytes, more than",
        str(tmp_path / ("n" * 255)): r"need 269 bytes",
        str(tmp_path / "afile"): r"exists and is not a folder",
    }
    if not IS_ROOT:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        cases[str(ro / "out")] = r"cannot write in .*ro \(read-only or no permission\)"
    before = tree(tmp_path)
    for out, message in cases.items():
        for overwrite in (False, True):
            with pytest.raises(InputError, match=message) as e:
                merge_checkpoint(base, adapter, out, overwrite=overwrite, progress=False)
            assert type(e.value) is InputError and "Errno" not in str(e.value)
    assert tree(tmp_path) == before
    r = run_cli(tmp_path, ["merge", base, adapter, tmp_path / "afile" / "out", "-q"])
    assert r.returncode == 2 and "Traceback" not in r.stderr and "is a file, not a folder" in r.stderr


def test_path_arguments_accept_pathlike(tiny, tmp_path):
    base, adapter = tiny
    a = merge_checkpoint(Path(base), Path(adapter), tmp_path / "a", progress=False)
    merge_checkpoint(base, adapter, str(tmp_path / "b"), progress=False)
    assert tree(tmp_path / "a") == tree(tmp_path / "b") and a.tensors_written
    merge_checkpoint(Path(base), [Path(adapter)], tmp_path / "c", progress=False)
    assert tree(tmp_path / "c") == tree(tmp_path / "b")
    plan = plan_checkpoint_merge(Path(base), Path(adapter), tmp_path / "d")
    assert plan.tensors and not (tmp_path / "d").exists()
    assert check_out_dir(tmp_path / "a", inputs={"base": Path(base)}, overwrite=True) == []
    assert "is the base folder" in check_out_dir(Path(base), inputs={"base": Path(base)}, overwrite=True)[0]
    with pytest.raises(InputError, match=r"adapter must be a path \(str or os.PathLike\), got int"):
        merge_checkpoint(base, 3, tmp_path / "e", progress=False)
    with pytest.raises(InputError, match=r"output folder must be a path .*got NoneType"):
        merge_checkpoint(base, adapter, None, progress=False)


# ------------------------------------------------------------------------------------ names beside OUT we did not make


def test_symlinked_staging_name_never_touches_its_target(tiny, tmp_path):
    base, adapter = tiny
    mine = user_folder(tmp_path / "mine")
    (tmp_path / ".out.partial").symlink_to(mine)
    before = tree(tmp_path)
    for overwrite in (False, True):
        with pytest.raises(InputError, match=r"\.out\.partial is a symlink .*never follows a link"):
            merge_checkpoint(base, adapter, tmp_path / "out", overwrite=overwrite, progress=False)
        assert tree(tmp_path) == before
    r = run_cli(tmp_path, ["merge", base, adapter, tmp_path / "out", "-q"])
    assert r.returncode == 2 and "Traceback" not in r.stderr and "never follows a link" in r.stderr
    assert tree(mine) == {k[len("mine/") :]: v for k, v in before.items() if k.startswith("mine/")}


def test_foreign_staging_folder_is_refused_and_an_empty_one_reused(tiny, tmp_path):
    base, adapter = tiny
    user_folder(tmp_path / ".out.partial")
    before = tree(tmp_path)
    with pytest.raises(InputError, match=r"was not made by peft-shardmerge .*never deletes what it did not make"):
        merge_checkpoint(base, adapter, tmp_path / "out", overwrite=True, progress=False)
    assert tree(tmp_path) == before
    forged = tmp_path / ".o2.partial"
    user_folder(forged)
    os.symlink(tmp_path / "elsewhere.json", forged / "manifest.json")  # a manifest that is a link proves nothing
    with pytest.raises(InputError, match="was not made by peft-shardmerge"):
        merge_checkpoint(base, adapter, tmp_path / "o2", progress=False)
    (tmp_path / ".o3.partial").mkdir()
    merge_checkpoint(base, adapter, tmp_path / "o3", progress=False)
    assert not (tmp_path / ".o3.partial").exists() and (tmp_path / "o3" / "model.safetensors").is_file()


@pytest.mark.parametrize("kind", ["symlink", "dangling symlink", "hard link", "foreign file", "fifo"])
def test_lock_name_taken_by_something_else_is_never_written(tiny, tmp_path, kind):
    base, adapter = tiny
    victim = tmp_path / "victim.txt"
    victim.write_text("precious content\n" * 100)
    lock = tmp_path / ".out.lock"
    if kind == "symlink":
        lock.symlink_to(victim)
    elif kind == "dangling symlink":
        lock.symlink_to(tmp_path / "would-be-created")
    elif kind == "hard link":
        os.link(victim, lock)
    elif kind == "foreign file":
        lock.write_text("my own lock file, not JSON")
    else:
        os.mkfifo(lock)
    before = tree(tmp_path)
    for overwrite in (False, True):
        with pytest.raises(InputError, match=r"\.out\.lock .*never writes into a file it did not make"):
            merge_checkpoint(base, adapter, tmp_path / "out", overwrite=overwrite, progress=False)
    assert tree(tmp_path) == before and victim.read_text() == "precious content\n" * 100
    assert not (tmp_path / "would-be-created").exists()


def test_old_output_name_we_cannot_prove_ours_is_never_touched(tiny, tmp_path):
    base, adapter = tiny
    user_folder(tmp_path / ".out.old-0123abcd")
    merge_checkpoint(base, adapter, tmp_path / "out", progress=False)
    before = tree(tmp_path / ".out.old-0123abcd")
    merge_checkpoint(base, adapter, tmp_path / "out", dtype="float16", overwrite=True, progress=False)
    assert tree(tmp_path / ".out.old-0123abcd") == before
    assert sorted(os.listdir(tmp_path)) == [".out.old-0123abcd", "out"]


# ------------------------------------------------------------------------------------ files added while a merge runs


def test_file_added_to_a_new_out_during_the_merge_is_kept(sharded, reference, tmp_path):
    base, adapter = sharded
    out = tmp_path / "out"

    def user_meanwhile(staging_folder):
        out.mkdir()
        (out / "mine.txt").write_text("written by the user during the merge")

    with pytest.raises(
        OutputChangedError,
        match=r"changed while the merge ran \(it appeared\); it was left exactly "
        r"as it is and the new output is kept in .*\.out\.partial",
    ):
        merge_checkpoint(base, adapter, out, max_shard_size="100KB", progress=False, before_commit=user_meanwhile)
    assert tree(out) == {"mine.txt": hashlib.sha256(b"written by the user during the merge").hexdigest()}
    assert os.path.isdir(partial_dir(out))
    (out / "mine.txt").rename(tmp_path / "mine.txt")  # the user moves the file away and runs the command again
    report = merge_checkpoint(base, adapter, out, max_shard_size="100KB", progress=False, overwrite=True)
    assert any(n.startswith("resumed: ") for n in report.notes)
    assert tree(out) == reference and sorted(os.listdir(tmp_path)) == ["mine.txt", "out"]


def test_file_added_to_the_old_out_during_an_overwrite_is_kept(sharded, tmp_path):
    base, adapter = sharded
    out = tmp_path / "out"
    merge_checkpoint(base, adapter, out, max_shard_size="100KB", progress=False)
    previous = tree(out)
    for change in ("add", "modify", "remove"):

        def user_meanwhile(staging_folder):
            if change == "add":
                (out / "mine.txt").write_text("user's")
            elif change == "modify":
                with open(out / "config.json", "a") as f:
                    f.write(" ")
            else:
                os.unlink(out / "config.json")

        during = None
        with pytest.raises(
            OutputChangedError,
            match=r"changed while the merge ran \((added: mine.txt|modified: "
            r"config.json|removed: config.json)\)",
        ):

            def hook(folder):
                nonlocal during
                user_meanwhile(folder)
                during = tree(out)

            merge_checkpoint(
                base,
                adapter,
                out,
                max_shard_size="100KB",
                dtype="float16",
                progress=False,
                overwrite=True,
                before_commit=hook,
            )
        assert tree(out) == during != previous  # OUT exactly as the user left it
        if change == "add":  # the user moves their file out, as overwrite replaces only what our record lists
            (out / "mine.txt").unlink()
        if change == "modify":  # and their edited file, as overwrite replaces only what the merge wrote
            (out / "config.json").unlink()
        merge_checkpoint(base, adapter, out, max_shard_size="100KB", progress=False, overwrite=True)
        previous = tree(out)
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_removing_the_previous_output_deletes_only_what_was_checked(tmp_path):
    old = user_folder(tmp_path / "old")
    snap = snapshot(old)
    (old / "sub" / "late.txt").write_text("added after the check")
    (old / "late-link").symlink_to(tmp_path)
    left = remove_checked(str(old), snap)
    assert left == ["late-link", "sub", os.path.join("sub", "late.txt")]
    assert tree(old) == {
        "late-link": f"link -> {tmp_path}",
        "sub": "folder",
        "sub/late.txt": hashlib.sha256(b"added after the check").hexdigest(),
    }
    assert remove_checked(str(tmp_path / "gone"), snap) == []


# ------------------------------------------------------------------------------------ resume keyed on content

KILL_AFTER = """
import peft_shardmerge.output.staging as st
_record = st.Staging.record
def record(self, fname, digest, **kwargs):
    _record(self, fname, digest, **kwargs)
    if len(self.done) == {n}:
        os.kill(os.getpid(), signal.SIGKILL)
st.Staging.record = record
"""


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return str(dst)


def _rewrite_same_size(path: str, seed: int) -> None:
    """Other values, same names, shapes, dtypes and size; the modification time put back."""
    st = os.stat(path)
    tensors = load_file(path)
    g = torch.Generator().manual_seed(seed)
    save_file(
        {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in tensors.items()}, path, metadata={"format": "pt"}
    )
    assert os.path.getsize(path) == st.st_size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("what", ["base shard", "adapter"])
def test_resume_after_an_input_changed_with_the_same_size_and_time(sharded, tmp_path, what):
    base = _copy(sharded[0], tmp_path / "base")
    adapter = _copy(sharded[1], tmp_path / "adapter")
    out = tmp_path / "out"
    args = ["merge", base, adapter, out, "--max-shard-size", "100KB", "-q"]
    r = run_cli(tmp_path, args, patch=KILL_AFTER.format(n=2))
    assert r.returncode == -signal.SIGKILL and not out.exists()
    manifest = json.load(open(os.path.join(partial_dir(out), "manifest.json")))
    assert len(manifest["shards"]) == 2
    if what == "base shard":  # a base shard that a finished output shard was computed from
        index = json.load(open(os.path.join(base, "model.safetensors.index.json")))["weight_map"]
        changed = os.path.join(base, index["model.embed_tokens.weight"])
        plan = plan_checkpoint_merge(base, adapter, tmp_path / "unused", max_shard_size="100KB")
        assert any(t.source.path == changed for t in plan.tensors if plan.shard_names[t.shard] in manifest["shards"])
        _rewrite_same_size(changed, seed=5)
    else:
        _rewrite_same_size(os.path.join(adapter, "adapter_model.safetensors"), seed=6)
    report = merge_checkpoint(base, adapter, out, max_shard_size="100KB", progress=False)
    fresh = tmp_path / "fresh"
    merge_checkpoint(base, adapter, fresh, max_shard_size="100KB", progress=False, resume=False)
    assert tree(out) == tree(fresh)
    kept = [n for n in report.notes if n.startswith("resumed")]
    if what == "base shard":  # the shards whose inputs did not change may be kept; the changed one never
        assert len(manifest["shards"]) > (int(kept[0].split()[1]) if kept else 0)
    else:  # the adapter feeds every shard
        assert not kept


def test_resume_with_unchanged_inputs_keeps_the_finished_shards(sharded, reference, tmp_path):
    base, adapter = sharded
    out = tmp_path / "out"
    r = run_cli(
        tmp_path, ["merge", base, adapter, out, "--max-shard-size", "100KB", "-q"], patch=KILL_AFTER.format(n=3)
    )
    assert r.returncode == -signal.SIGKILL
    report = merge_checkpoint(base, adapter, out, max_shard_size="100KB", progress=False)
    assert "resumed: 3 shard(s) kept from an interrupted run" in report.notes
    assert tree(out) == reference


def test_a_dare_merge_killed_then_resumed_gives_the_bytes_of_one_run(sharded, make_adapter, tmp_path):
    base, adapter = sharded
    second = make_adapter("llama_sharded", "dare-second", r=2, seed=9, target_modules=["q_proj", "up_proj"])
    out = tmp_path / "out"
    options = ["--combination", "dare_ties", "--density", "0.3", "--seed", "7", "--max-shard-size", "100KB"]
    r = run_cli(
        tmp_path, ["merge", base, adapter, out, "--add-adapter", second, *options, "-q"], patch=KILL_AFTER.format(n=3)
    )
    assert r.returncode == -signal.SIGKILL
    kw = dict(combination="dare_ties", density=0.3, seed=7, max_shard_size="100KB", progress=False)
    report = merge_checkpoint(base, [adapter, second], out, **kw)
    assert "resumed: 3 shard(s) kept from an interrupted run" in report.notes
    fresh = merge_checkpoint(base, [adapter, second], tmp_path / "fresh", resume=False, **kw)
    assert tree(out) == tree(fresh.out_dir)


# ------------------------------------------------------------------------------------ interrupts and kills

SIGNAL_AFTER = """
import peft_shardmerge.output.staging as st
_orig = st.Staging.{method}
def wrapped(self, *a, **k):
    {before}
    result = _orig(self, *a, **k)
    {after}
    return result
st.Staging.{method} = wrapped
"""


@pytest.mark.parametrize(
    "case,method,before,after,code,word",
    [
        (
            "SIGTERM right after the staging folder is made",
            "open",
            "",
            "os.kill(os.getpid(), signal.SIGTERM)",
            143,
            "terminated",
        ),
        (
            "Ctrl-C right after the staging folder is made",
            "open",
            "",
            "os.kill(os.getpid(), signal.SIGINT)",
            130,
            "interrupted",
        ),
        (
            "double Ctrl-C: the second one while the partial output is removed",
            "discard",
            "os.kill(os.getpid(), signal.SIGINT)",
            "",
            130,
            "interrupted",
        ),
        (
            "SIGTERM, then Ctrl-C while the partial output is removed",
            "discard",
            "os.kill(os.getpid(), signal.SIGINT)",
            "",
            130,
            "interrupted",
        ),
    ],
)
def test_signals_around_the_staging_folder_leave_nothing(sharded, tmp_path, case, method, before, after, code, word):
    base, adapter = sharded
    out = tmp_path / "work" / "out"
    out.parent.mkdir()
    patch = SIGNAL_AFTER.format(method=method, before=before, after=after)
    if case.startswith("SIGTERM, then"):  # the first signal: SIGTERM once the first shard is done
        patch += KILL_AFTER.format(n=1).replace("SIGKILL", "SIGTERM")
    elif method == "discard":  # the first Ctrl-C once the first shard is done
        patch += KILL_AFTER.format(n=1).replace("SIGKILL", "SIGINT")
    r = run_cli(tmp_path, ["merge", base, adapter, out, "--max-shard-size", "100KB", "-q"], patch=patch)
    assert r.returncode == code, (case, r.returncode, r.stderr)
    assert r.stderr.strip().splitlines() == [
        f"peft-shardmerge: {word}; the partial output was removed and OUT is unchanged"
    ], case
    assert os.listdir(out.parent) == [], case


def test_ctrl_c_during_start_up_prints_one_line(tiny, tmp_path):
    base, adapter = tiny
    out = tmp_path / "work" / "out"
    out.parent.mkdir()
    cmd = [sys.executable, "-m", "peft_shardmerge", "merge", base, adapter, str(out), "-q"]
    lines = set()
    for delay in (0.8, 1.5, 2.5):
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        if proc.returncode == 0:
            break  # the merge finished first: later delays would too
        # 130; now and then the process prints its one line and is then ended by the signal itself (-2): a known
        # wrong exit status, still one line and no traceback
        assert proc.returncode in (130, -signal.SIGINT) and "Traceback" not in err, (proc.returncode, err)
        assert len(err.strip().splitlines()) == 1, err
        lines.add(err.strip())
        assert os.listdir(out.parent) == []
    assert lines <= {
        "peft-shardmerge: interrupted; nothing was written and OUT is unchanged",
        "peft-shardmerge: interrupted; the partial output was removed and OUT is unchanged",
    }
    assert "peft-shardmerge: interrupted; nothing was written and OUT is unchanged" in lines


def test_interrupt_after_the_commit_says_the_output_is_complete(sharded, reference, tmp_path):
    base, adapter = sharded
    out = tmp_path / "out"
    patch = SIGNAL_AFTER.format(method="commit", before="", after="os.kill(os.getpid(), signal.SIGINT)")
    r = run_cli(tmp_path, ["merge", base, adapter, out, "--max-shard-size", "100KB", "-q"], patch=patch)
    assert r.returncode == 130
    assert r.stderr.strip() == (
        "peft-shardmerge: interrupted; the merge had finished: OUT holds the new, complete output"
    )
    assert tree(out) == reference


KILL_IN_COMMIT = """
import peft_shardmerge.output.staging as st
_rename, _remove = st.rename_noreplace, st.remove_checked
calls = []
def rename(src, dst):
    _rename(src, dst)
    calls.append(dst)
    if {when!r} == "after moving the old output aside" and ".old-" in dst:
        os.kill(os.getpid(), signal.SIGKILL)
def remove(folder, snap):
    if {when!r} == "after the new output landed":
        os.kill(os.getpid(), signal.SIGKILL)
    return _remove(folder, snap)
st.rename_noreplace, st.remove_checked = rename, remove
"""


@pytest.mark.parametrize("when", ["after moving the old output aside", "after the new output landed"])
def test_kill_during_an_overwrite_commit_is_finished_by_the_next_run(sharded, reference, tmp_path, when):
    base, adapter = sharded
    out = tmp_path / "out"
    merge_checkpoint(base, adapter, out, max_shard_size="100KB", dtype="float16", progress=False)
    previous = tree(out)
    args = ["merge", base, adapter, out, "--max-shard-size", "100KB", "--overwrite", "-q"]
    r = run_cli(tmp_path, args, patch=KILL_IN_COMMIT.format(when=when))
    assert r.returncode == -signal.SIGKILL
    olds = [n for n in os.listdir(tmp_path) if n.startswith(".out.old-")]
    assert len(olds) == 1  # what the kill left
    if when == "after moving the old output aside":
        assert not out.exists() and tree(tmp_path / olds[0]) == previous
        # the next run puts the previous output back before anything else (then, without --overwrite, refuses)
        with pytest.raises(InputError, match="holds an earlier output of peft-shardmerge; pass overwrite=True"):
            merge_checkpoint(base, adapter, out, max_shard_size="100KB", progress=False)
        assert tree(out) == previous
    else:
        assert tree(out) == reference
    merge_checkpoint(base, adapter, out, max_shard_size="100KB", progress=False, overwrite=True)
    assert tree(out) == reference
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith("run-")) == ["out"]


def test_filesystem_error_mid_merge_is_in_the_family_and_says_what_happened(sharded, tmp_path, monkeypatch):
    import errno

    import peft_shardmerge.output.staging as st

    base, adapter = sharded
    out = tmp_path / "out"
    real = st.Staging.record

    def full(self, fname, digest, **kwargs):
        real(self, fname, digest, **kwargs)
        raise OSError(errno.EIO, "Input/output error", os.path.join(self.path, fname))

    monkeypatch.setattr(st.Staging, "record", full)
    with pytest.raises(FileSystemError) as e:
        merge_checkpoint(base, adapter, out, max_shard_size="100KB", progress=False)
    assert isinstance(e.value, OSError) and e.value.errno == errno.EIO
    assert str(e.value).startswith("Input/output error (") and str(e.value).endswith(
        "; the partial output was removed and OUT is unchanged"
    )
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------------ in process: never over an input


def test_merge_and_save_never_writes_over_the_folder_the_model_came_from(sharded, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from peft_shardmerge import merge_and_save

    base = _copy(sharded[0], tmp_path / "base")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), sharded[1])
    before = tree(tmp_path)
    cases = [
        (base, "is the model folder"),
        (Path(base) / "merged", "is inside the model folder"),
        (tmp_path, "is inside the output folder"),
    ]
    for out, message in cases:
        for precision in ("dequantized", "auto"):
            with pytest.raises(InputError, match=message):
                merge_and_save(model, out, base_precision=precision, overwrite=True, progress=False)
            assert tree(tmp_path) == before
    report = merge_and_save(model, tmp_path / "merged", base_precision="dequantized", progress=False)
    assert report.tensors_written and (tmp_path / "merged" / "config.json").is_file()


# --- inputs reached another way: links into a store, relative names after a chdir, '..' after a link -------------


def test_a_base_of_links_protects_the_files_they_point_to(tiny, tmp_path):
    base, adapter = tiny
    store, snap = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snap"
    store.mkdir(parents=True)
    snap.mkdir()
    for name in os.listdir(base):  # the Hub cache's layout: a snapshot of links into blobs/
        (store / (name + ".blob")).write_bytes((Path(base) / name).read_bytes())
        (snap / name).symlink_to(Path("..") / "blobs" / (name + ".blob"))
    before = tree(tmp_path / "hub")
    for out in (store, tmp_path / "hub", store / "merged"):
        with pytest.raises(InputError, match="the files its links point to"):
            merge_checkpoint(str(snap), adapter, str(out), overwrite=True, progress=False)
    r = subprocess.run(
        [sys.executable, "-m", "peft_shardmerge", "merge", str(snap), adapter, str(store), "--overwrite"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert tree(tmp_path / "hub") == before


def test_dot_dot_after_a_link_is_refused(tiny, tmp_path, monkeypatch):
    base, adapter = tiny
    (tmp_path / "outs").mkdir()
    (tmp_path / "outs" / "L").symlink_to(Path(base))
    monkeypatch.chdir(tmp_path / "outs")
    for raw in ("L/../x", "L/../out/"):  # the system reads L/.. as base's parent, not as outs/
        with pytest.raises(InputError, match=r"has '\.\.' after a symbolic link"):
            merge_checkpoint(base, adapter, raw, overwrite=True, progress=False)
    assert sorted(os.listdir(tmp_path / "outs")) == ["L"]


def test_in_process_relative_sources_after_a_chdir_are_protected(tiny, tmp_path, monkeypatch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from peft_shardmerge import merge_and_save

    base, adapter = tiny
    work = tmp_path / "work"
    work.mkdir()
    for name, src in (("base", base), ("ad", adapter)):
        (work / name).mkdir()
        for f in os.listdir(src):
            (work / name / f).write_bytes((Path(src) / f).read_bytes())
    monkeypatch.chdir(work)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("base"), "ad")
    monkeypatch.chdir(tmp_path)  # the notebook moved on: "base" and "ad" no longer resolve
    before = tree(work)
    for target in (work / "base", work / "base" / "sub"):
        with pytest.raises(InputError, match="recorded as the relative path"):
            merge_and_save(model, str(target), overwrite=True, progress=False)
    with pytest.raises(InputError, match="holds a model or adapter that peft-shardmerge did not write"):
        merge_and_save(model, str(work / "ad"), overwrite=True, progress=False)  # PEFT does not record this folder
    assert tree(work) == before
    merge_and_save(model, str(tmp_path / "merged"), progress=False)  # elsewhere it works
    merge_and_save(model, str(tmp_path / "merged"), overwrite=True, progress=False)  # and replaces its own output
    assert (tmp_path / "merged" / "config.json").exists()


def test_verify_piped_into_head_prints_no_traceback(tiny, tmp_path):
    base, adapter = tiny
    out = tmp_path / "out"
    merge_checkpoint(base, adapter, str(out), progress=False)
    r = subprocess.run(
        f"{sys.executable} -m peft_shardmerge verify {out} | head -c 1", shell=True, capture_output=True, text=True
    )
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr


@pytest.mark.parametrize(
    "tmp_content,ours",
    [
        ('{"made_by": "peft-shardmerge", "fingerprint": null, "inputs": null, "shards": {}}', True),
        ('{"note": "not ours"}', False),
    ],
)
def test_a_kill_before_the_first_manifest_was_renamed_into_place(make_base, make_adapter, tmp_path, tmp_content, ours):
    """A merge killed between fsyncing a new staging folder's first manifest and renaming it leaves the folder
    holding only manifest.json.tmp. Ours (it names peft-shardmerge): the next run takes the folder over. Anything
    else under that name is not provably ours and stays."""
    base, adapter = make_base("llama"), make_adapter("llama", "default")
    out = str(tmp_path / "out")
    os.mkdir(partial_dir(out))
    with open(os.path.join(partial_dir(out), "manifest.json.tmp"), "w") as f:
        f.write(tmp_content)
    if ours:
        merge_checkpoint(base, adapter, out, progress=False)
        assert os.path.isfile(os.path.join(out, "model.safetensors")) and not os.path.exists(partial_dir(out))
    else:
        with pytest.raises(InputError, match="was not made by peft-shardmerge"):
            merge_checkpoint(base, adapter, out, progress=False)
        assert os.listdir(partial_dir(out)) == ["manifest.json.tmp"] and not os.path.exists(out)
