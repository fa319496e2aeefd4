"""Crash safety and resume, signals, locks and resource faults, with real processes and real filesystems."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from peft_shardmerge import InputError, merge_checkpoint
from peft_shardmerge.errors import OutputLockedError
from peft_shardmerge.output.staging import output_lock, partial_dir
from peft_shardmerge.testing import build_adapter, build_base
from tests.helpers import KILL_AFTER_SHARDS, seven_shard_merge

#: subprocesses, signals and kills: make test-all runs them
pytestmark = pytest.mark.slow

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
KILLS = 20


@pytest.fixture(scope="module")
def medium(tmp_path_factory):
    """A base big enough that writing takes a noticeable moment: ~120 MB of fp32, written as 4 MB bf16 shards."""
    root = tmp_path_factory.mktemp("medium")
    base = build_base(
        str(root / "base"),
        "llama",
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=4096,
        max_shard_size="20MB",
    )
    adapter = build_adapter(base, str(root / "adapter"), arch="llama")
    return base, adapter


def _cmd(base, adapter, out, *extra):
    return [
        sys.executable,
        "-m",
        "peft_shardmerge",
        "merge",
        base,
        adapter,
        out,
        "--dtype",
        "bfloat16",
        "--max-shard-size",
        "4MB",
        "-q",
        *extra,
    ]


def _tree_bytes(folder) -> dict[str, bytes]:
    return {f: open(os.path.join(folder, f), "rb").read() for f in sorted(os.listdir(folder))}


def _start_and_kill(cmd, out, rng, sig=signal.SIGKILL, window: float = 0.4) -> subprocess.Popen:
    """Start a merge, wait until it holds the output lock (planning is over and it is about to write), then
    signal it at a random moment within ``window`` seconds."""
    # a shell that starts jobs in the background (nohup, CI runners) ignores SIGINT, and children inherit that;
    # restore the default so that Ctrl-C reaches the merge as it does at a terminal
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lock = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.lock")
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline:
        try:
            if json.loads(open(lock).read() or "{}").get("pid") == proc.pid:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.002)
    time.sleep(rng.uniform(0, window))
    if proc.poll() is None:
        proc.send_signal(sig)
    proc.wait(timeout=120)
    proc.stderr_text = proc.stderr.read()
    return proc


def test_killed_at_random_points_then_resumed_byte_identical(medium, tmp_path):
    base, adapter = medium
    reference = str(tmp_path / "reference")
    report = merge_checkpoint(
        base, adapter, reference, dtype="bfloat16", max_shard_size="4MB", progress=False, resume=False
    )
    window = report.wall_time_s * 1.2  # signals land anywhere from the first shard to just after the commit
    out = str(tmp_path / "out")
    rng = random.Random(1234)
    killed, resumed_from, attempts = 0, [], 0
    while killed < KILLS and attempts < 6 * KILLS:
        attempts += 1
        proc = _start_and_kill(_cmd(base, adapter, out), out, rng, window=window)
        if os.path.exists(out):  # the kill came after the commit: OUT must then be the complete output
            assert _tree_bytes(out) == _tree_bytes(reference)
            shutil.rmtree(out)
            window *= 0.8  # the machine is faster than the reference run said: aim earlier
            continue
        if proc.returncode == -signal.SIGKILL:
            killed += 1
            manifest = os.path.join(partial_dir(out), "manifest.json")
            if os.path.exists(manifest):
                resumed_from.append(len(json.load(open(manifest))["shards"]))
        else:
            assert proc.returncode == 0, proc.stderr_text
            shutil.rmtree(out)  # finished before the signal: start over so that the next attempt is killed
            window *= 0.8
    assert killed >= KILLS, (killed, attempts)
    assert max(resumed_from) > 0, "no kill happened after a shard was finished"
    proc = subprocess.run(_cmd(base, adapter, out), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert _tree_bytes(out) == _tree_bytes(reference)
    assert sorted(os.listdir(tmp_path)) == ["out", "reference"]
    print(f"\nkills survived: {killed} of {attempts} attempts; finished shards found after each kill: {resumed_from}")


def test_kill_while_replacing_keeps_the_previous_output(medium, tmp_path):
    base, adapter = medium
    out = str(tmp_path / "out")
    merge_checkpoint(base, adapter, out, dtype="bfloat16", max_shard_size="4MB", progress=False)
    before = _tree_bytes(out)
    rng = random.Random(99)
    for _ in range(5):
        _start_and_kill(_cmd(base, adapter, out, "--overwrite", "--dtype", "float32"), out, rng)
        current = _tree_bytes(out)
        assert current == before or json.load(open(os.path.join(out, "config.json")))["dtype"] == "float32"
        if current != before:  # the new output landed whole; the next replacement starts from it
            before = current


@pytest.mark.parametrize("sig,code,word", [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")])
def test_sigterm_and_ctrl_c_clean_up(sig, code, word, medium, tmp_path):
    base, adapter = medium
    out = str(tmp_path / "out")
    for attempt in range(10):
        proc = _start_and_kill(_cmd(base, adapter, out), out, random.Random(attempt), sig=sig, window=0.05)
        if not os.path.exists(out):
            break
        shutil.rmtree(out)  # the signal came after the commit; try again
    else:
        pytest.fail("every attempt finished before the signal")
    assert proc.returncode == code, (proc.returncode, proc.stderr_text)
    assert proc.stderr_text.strip().splitlines() == [
        f"peft-shardmerge: {word}; the partial output was removed and OUT is unchanged"
    ]
    assert os.listdir(tmp_path) == []


#: where a Ctrl-C lands, made certain by the code run before the command: while Python imports the command line,
#: while it parses the arguments, while it sets up logging, and twice: once the staging folder is made, again as the
#: partial output is removed
_INTERRUPT_AT = {
    "import": """
        import importlib.abc
        class Interrupt(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "peft_shardmerge.api.cli":
                    os.kill(os.getpid(), signal.SIGINT)
        sys.meta_path.insert(0, Interrupt())
    """,
    "arguments": """
        import argparse
        parse = argparse.ArgumentParser.parse_args
        def interrupted(self, *a, **k):
            os.kill(os.getpid(), signal.SIGINT)
            return parse(self, *a, **k)
        argparse.ArgumentParser.parse_args = interrupted
    """,
    "logging": """
        import logging
        config = logging.basicConfig
        def interrupted(*a, **k):
            os.kill(os.getpid(), signal.SIGINT)
            return config(*a, **k)
        logging.basicConfig = interrupted
    """,
    "twice": """
        from peft_shardmerge.output import staging
        opened, discard = staging.Staging.open, staging.Staging.discard
        def first(self, *a, **k):
            done = opened(self, *a, **k)
            os.kill(os.getpid(), signal.SIGINT)
            return done
        def again(self, *a, **k):
            os.kill(os.getpid(), signal.SIGINT)
            return discard(self, *a, **k)
        staging.Staging.open, staging.Staging.discard = first, again
    """,
}


@pytest.mark.parametrize("when", list(_INTERRUPT_AT))
def test_ctrl_c_at_any_moment_of_the_command_is_one_line(when, tmp_path, make_base, make_adapter):
    """One line and status 130, never a traceback nor an 'Exception ignored', wherever the interrupt lands."""
    import textwrap

    out = tmp_path / "out"
    script = tmp_path / "run.py"
    script.write_text(
        "import os, signal, sys\n"
        + textwrap.dedent(_INTERRUPT_AT[when])
        + "\nfrom peft_shardmerge.api.entry import run\nrun()\n"
    )
    args = ["merge", make_base("llama_sharded"), make_adapter("llama_sharded", "default"), str(out)]
    r = subprocess.run(
        [sys.executable, str(script), *args, "--max-shard-size", "100KB", "-q"],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    state = "the partial output was removed" if when == "twice" else "nothing was written"
    assert (r.returncode, r.stderr) == (130, f"peft-shardmerge: interrupted; {state} and OUT is unchanged\n")
    assert os.listdir(tmp_path) == ["run.py"]


def test_changed_option_invalidates_the_manifest(medium, tmp_path):
    base, adapter = medium
    out = str(tmp_path / "out")
    staging = partial_dir(out)
    os.makedirs(staging)
    fake = "model-00001-of-00042.safetensors"
    open(os.path.join(staging, fake), "wb").write(b"not a shard")
    json.dump(
        {"fingerprint": "from another merge", "shards": {fake: {"size": 11, "digest": "x"}}},
        open(os.path.join(staging, "manifest.json"), "w"),
    )
    report = merge_checkpoint(base, adapter, out, dtype="bfloat16", max_shard_size="4MB", progress=False)
    assert not any("resumed" in n for n in report.notes)
    assert fake not in os.listdir(out) and not os.path.exists(staging)


def test_second_merge_into_the_same_output_is_refused(medium, tmp_path):
    base, adapter = medium
    out = str(tmp_path / "out")
    with output_lock(out):
        r = subprocess.run(_cmd(base, adapter, out), capture_output=True, text=True, timeout=300)
        with pytest.raises(OutputLockedError, match=rf"another merge is writing .*out: pid {os.getpid()}"):
            merge_checkpoint(base, adapter, out, progress=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"another merge is writing {out}: pid {os.getpid()}" in r.stderr
    assert not os.path.exists(out)


def test_stale_lock_from_a_dead_process_is_taken_over(medium, tmp_path):
    base, adapter = medium
    out = str(tmp_path / "out")
    lock = os.path.join(tmp_path, ".out.lock")
    json.dump({"pid": 999999, "host": "gone", "started": "yesterday"}, open(lock, "w"))
    merge_checkpoint(base, adapter, out, dtype="bfloat16", max_shard_size="4MB", progress=False)
    assert os.path.isdir(out) and not os.path.exists(lock)


def _tmpfs(mnt, options: str):
    """Mount a real tmpfs for one test (root only), or skip with the reason."""
    if not IS_ROOT:
        pytest.skip("mounting a filesystem needs root")
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@pytest.fixture()
def small_fs(tmp_path):
    """A real 1 MiB filesystem: smaller than any tiny merge."""
    yield from _tmpfs(tmp_path / "small", "size=1m")


@pytest.fixture()
def other_fs(tmp_path):
    """A real 8 MiB filesystem other than the one holding the inputs."""
    yield from _tmpfs(tmp_path / "other", "size=8m")


def test_disk_full_is_refused_up_front(small_fs, make_base, make_adapter):
    base, adapter = make_base("llama"), make_adapter("llama", "default")
    out = str(small_fs / "out")
    with pytest.raises(InputError, match=r"not enough free space for .*: the merge writes 0\.00[0-9] GB"):
        merge_checkpoint(base, adapter, out, dtype="float32", progress=False)
    r = subprocess.run(
        [sys.executable, "-m", "peft_shardmerge", "merge", base, adapter, out, "--dtype", "float32"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and "not enough free space" in r.stderr and "Traceback" not in r.stderr
    assert os.listdir(small_fs) == []


def test_resume_counts_the_space_its_staging_folder_holds(other_fs, tmp_path):
    """A merge killed on a nearly full disk is resumed although the disk has less free space than the whole output:
    the shards it finished are kept, not written again."""
    base, adapter = seven_shard_merge(tmp_path)
    opts = dict(dtype="bfloat16", max_shard_size="1MB", model_checks="first", progress=False)
    reference = str(tmp_path / "reference")
    merge_checkpoint(base, adapter, reference, **opts)
    whole = sum(os.path.getsize(os.path.join(reference, f)) for f in os.listdir(reference))
    out = str(other_fs / "out")
    killed = [sys.executable, "-c", KILL_AFTER_SHARDS, base, adapter, out]
    r = subprocess.run(killed, capture_output=True, timeout=300)
    assert r.returncode == 9, r.stderr
    staged = json.load(open(os.path.join(partial_dir(out), "manifest.json")))["shards"]
    staged_size = sum(meta["size"] for meta in staged.values())
    assert len(staged) == 3 and staged_size > 2 * (1 << 20)
    # fill the disk so that it has the output's size less what is staged, and a little more: not the whole output
    free = shutil.disk_usage(other_fs).free
    with open(other_fs / "ballast", "wb") as f:
        f.write(b"\0" * (free - (whole - staged_size + (3 << 20) // 2)))
    assert shutil.disk_usage(other_fs).free < whole
    report = merge_checkpoint(base, adapter, out, **opts)
    assert any("resumed" in n for n in report.notes), report.notes
    assert {f: b for f, b in _tree_bytes(out).items() if f != "merge_manifest.json"} == {
        f: b for f, b in _tree_bytes(reference).items() if f != "merge_manifest.json"
    }
    # what is staged counts only as much as the disk then lacks: with less room still, the rerun is refused up front
    shutil.rmtree(out)
    assert subprocess.run(killed, capture_output=True, timeout=300).returncode == 9
    free = shutil.disk_usage(other_fs).free
    with open(other_fs / "more ballast", "wb") as f:
        f.write(b"\0" * (free - (whole - staged_size - (1 << 20))))
    with pytest.raises(InputError, match=r"not enough free space .* \(counting the 0\.00[0-9]+ GB an interrupted run"):
        merge_checkpoint(base, adapter, out, **opts)
    assert len(json.load(open(os.path.join(partial_dir(out), "manifest.json")))["shards"]) == 3


def test_disk_full_mid_write_removes_everything(small_fs, make_base, make_adapter, monkeypatch):
    """The up-front check is told there is room; the kernel's real ENOSPC then hits the writer."""
    import peft_shardmerge.checkpoint.planner as planner

    base, adapter = make_base("llama"), make_adapter("llama", "default")
    previous = small_fs / "out"
    previous.mkdir()  # an earlier output of ours: its record lists its files
    (previous / "config.json").write_text("previous output")
    (previous / "merge_manifest.json").write_text(
        '{"format": "peft-shardmerge merge record", "shards": {}, "files": {"config.json": {}}}'
    )
    monkeypatch.setattr(planner, "check_space", lambda out_dir, nbytes: [])
    with pytest.raises(OSError) as e:
        merge_checkpoint(base, adapter, str(previous), dtype="float32", overwrite=True, progress=False)
    assert e.value.errno == errno.ENOSPC
    assert os.listdir(small_fs) == ["out"] and (previous / "config.json").read_text() == "previous output"


@pytest.fixture()
def read_only_fs(tmp_path):
    yield from _tmpfs(tmp_path / "ro", "ro,size=1m")


def test_read_only_parent_is_refused_up_front(read_only_fs, make_base, make_adapter):
    with pytest.raises(InputError, match=r"cannot write in .*ro \(read-only or no permission\)"):
        merge_checkpoint(
            make_base("llama"), make_adapter("llama", "default"), str(read_only_fs / "a" / "out"), progress=False
        )


def test_killed_run_is_not_resumed_with_another_option(medium, tmp_path):
    base, adapter = medium
    out = str(tmp_path / "out")
    rng = random.Random(7)
    for _ in range(30):
        _start_and_kill(_cmd(base, adapter, out), out, rng, window=0.3)
        if os.path.exists(out):
            shutil.rmtree(out)
            continue
        manifest = os.path.join(partial_dir(out), "manifest.json")
        if os.path.exists(manifest) and json.load(open(manifest))["shards"]:
            break
    else:
        pytest.fail("no kill left a finished shard behind")
    report = merge_checkpoint(base, adapter, out, dtype="float32", max_shard_size="4MB", progress=False)
    assert not any("resumed" in n for n in report.notes)
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "float32"
    again = str(tmp_path / "again")
    report = merge_checkpoint(base, adapter, again, dtype="float32", max_shard_size="4MB", progress=False)
    assert _tree_bytes(out) == _tree_bytes(again)


def test_missing_parents_are_created(make_base, make_adapter, tmp_path):
    out = tmp_path / "a" / "b" / "out"
    merge_checkpoint(make_base("llama"), make_adapter("llama", "default"), str(out), progress=False)
    assert (out / "model.safetensors").exists()


def test_output_on_another_filesystem_is_staged_there(other_fs, make_base, make_adapter):
    """The staging folder is always beside OUT, so the final rename never crosses filesystems."""
    small_fs = other_fs
    out = small_fs / "out"
    report = merge_checkpoint(
        make_base("llama"), make_adapter("llama", "default"), str(out), dtype="bfloat16", progress=False
    )
    assert os.stat(out).st_dev == os.stat(small_fs).st_dev != os.stat(make_base("llama")).st_dev
    assert sorted(os.listdir(small_fs)) == ["out"] and report.bytes_written < 2**20


def test_lock_holds_against_a_racing_opener(tmp_path, monkeypatch):
    """B opens the lock file while A holds it and locks it only after A released (and unlinked) it; a third
    merge C must still be refused while B holds the lock."""
    import fcntl
    import threading

    import peft_shardmerge.output.lock as outlock
    import peft_shardmerge.output.staging as staging

    out = str(tmp_path / "out")
    real = fcntl.flock
    go, b_has, release_b = threading.Event(), threading.Event(), threading.Event()

    class SlowFcntl:
        LOCK_EX, LOCK_NB = fcntl.LOCK_EX, fcntl.LOCK_NB

        @staticmethod
        def flock(fd, op):
            if threading.current_thread().name == "B":
                go.wait()
            return real(fd, op)

    monkeypatch.setattr(outlock, "fcntl", SlowFcntl)

    def b():
        with staging.output_lock(out):
            b_has.set()
            release_b.wait(10)

    with staging.output_lock(out):
        t = threading.Thread(target=b, name="B")
        t.start()
        time.sleep(0.2)
    go.set()
    assert b_has.wait(5)
    with pytest.raises(OutputLockedError):
        with staging.output_lock(out):
            pass
    release_b.set()
    t.join()


def test_interrupt_while_removing_the_old_output_keeps_the_new_one(make_base, make_adapter, tmp_path, monkeypatch):
    import peft_shardmerge.output.staging as staging

    out = tmp_path / "out"
    out.mkdir()  # an earlier output of ours: its record lists its files
    (out / "config.json").write_text("old")
    (out / "merge_manifest.json").write_text(
        '{"format": "peft-shardmerge merge record", "shards": {}, "files": {"config.json": {}}}'
    )
    real = shutil.rmtree

    def interrupted(path, *a, **k):
        if ".old-" in str(path):
            raise KeyboardInterrupt
        return real(path, *a, **k)

    monkeypatch.setattr(staging.shutil, "rmtree", interrupted)
    report = merge_checkpoint(
        make_base("llama"), make_adapter("llama", "default"), str(out), overwrite=True, progress=False
    )
    assert report.tensors_written and json.load(open(out / "config.json"))["model_type"] == "llama"


def test_mount_point_output_is_refused(other_fs, make_base, make_adapter):
    with pytest.raises(InputError, match="is a mount point"):
        merge_checkpoint(
            make_base("llama"), make_adapter("llama", "default"), str(other_fs), overwrite=True, progress=False
        )
