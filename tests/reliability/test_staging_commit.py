"""The commit of an output folder, killed at every step: after each SIGKILL, OUT is absent, the previous output or
the new complete output (file for file, byte for byte); the next run finishes or undoes the cut commit and ends with
the complete output and nothing of ours beside OUT.

The steps are this package's own kill points (``PEFT_SHARDMERGE_KILL_AT=<step>#<n>``: every unlink, rename, rmdir,
fsync and lock-record write of the commit and of the lock's release); they are listed by tracing an uninterrupted
commit (``PEFT_SHARDMERGE_STEPS``). The merges are :func:`~peft_shardmerge.output.staging.staged_output` writing a
small
output with a record of ours, each in a process forked from one child that imported the package once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from peft_shardmerge.output.out_dir import check_out_dir, settle_out_dir
from tests.helpers import tree

WRITER = textwrap.dedent("""
    import json, os, sys, traceback
    from peft_shardmerge.output.staging import file_digest, staged_output

    class Inputs:  # the inputs of every shard: one digest per version
        def __init__(self, version):
            self.version = version
        def common(self):
            return self.version
        def shard(self, name):
            return self.version

    def write(path, text):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    def merge(out, version, overwrite):
        shards = {f"model-0000{i}-of-00003.safetensors": f"{version} shard {i} " * 2000 for i in (1, 2, 3)}
        files = {"config.json": json.dumps({"version": version}), "tokenizer.json": "{}",
                 "1_Pooling/config.json": "{}"}
        with staged_output(out, overwrite=overwrite, fingerprint="fp-" + version, inputs=Inputs(version)) as st:
            for name, text in shards.items():
                if not st.is_done(name):
                    write(os.path.join(st.path, name), text)
                    st.record(name, file_digest(os.path.join(st.path, name)))
            for name, text in files.items():
                write(os.path.join(st.path, name), text)
            write(os.path.join(st.path, "merge_manifest.json"), json.dumps(
                {"format": "peft-shardmerge merge record", "shards": dict.fromkeys(shards, {}),
                 "files": dict.fromkeys(files, {})}))

    for line in sys.stdin:  # one merge per line, each in a child forked from this process (imported once)
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.environ.update(job["env"])
            try:
                merge(job["out"], job["version"], job["overwrite"])
            except BaseException:
                traceback.print_exc()
                os._exit(1)
            os._exit(0)
        status = os.waitpid(pid, 0)[1]
        print(-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status), flush=True)
""")


@pytest.fixture(scope="module")
def merger(tmp_path_factory):
    """A child process that runs one merge per request, each in a process forked from it: ``merger(out, version,
    overwrite, env)`` returns the exit status (``-9`` for SIGKILL)."""
    script = tmp_path_factory.mktemp("merger") / "merger.py"
    script.write_text(WRITER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEFT_SHARDMERGE_")}
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )

    def run(out, version: str, overwrite: bool, env: dict | None = None) -> int:
        proc.stdin.write(
            json.dumps({"out": str(out), "version": version, "overwrite": overwrite, "env": env or {}}) + "\n"
        )
        proc.stdin.flush()
        return int(proc.stdout.readline())

    yield run
    proc.stdin.close()
    proc.wait(timeout=60)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, merger):
    """The complete old and new outputs, and the steps of an uninterrupted commit over an old output (with
    ``--overwrite``) and into a new folder (without)."""
    root = tmp_path_factory.mktemp("commit")
    old, new = root / "old" / "out", root / "new" / "out"
    old.parent.mkdir()
    new.parent.mkdir()
    assert merger(old, "old", False) == 0
    assert merger(new, "new", False) == 0
    steps = {}
    for overwrite in (False, True):
        out = root / f"trace-{overwrite}" / "out"
        out.parent.mkdir()
        if overwrite:
            assert merger(out, "old", False) == 0
        trace = root / f"steps-{overwrite}.txt"
        assert merger(out, "new", overwrite, {"PEFT_SHARDMERGE_STEPS": str(trace)}) == 0
        assert tree(out) == tree(new)
        steps[overwrite] = [s for s in trace.read_text().split("\n") if s]
    return tree(old), tree(new), steps


def _beside(out) -> list[str]:
    return sorted(n for n in os.listdir(out.parent) if n != "out")


@pytest.mark.slow
@pytest.mark.parametrize("overwrite", [False, True], ids=["new folder", "overwrite"])
def test_a_kill_at_every_step_of_the_commit_is_recovered(outputs, merger, tmp_path, overwrite):
    old, new, traced = outputs
    steps = list(dict.fromkeys(s for s in traced[overwrite] if not s.startswith("recover:")))
    assert any(s.startswith("commit: rename new output into place") for s in steps)
    assert overwrite == any(s.startswith("remove old output:") for s in steps)
    for i, step in enumerate(steps):
        out = tmp_path / f"{i}" / "out"
        out.parent.mkdir()
        if overwrite:
            assert merger(out, "old", False) == 0
        assert merger(out, "new", overwrite, {"PEFT_SHARDMERGE_KILL_AT": step}) == -signal.SIGKILL, step
        now = tree(out) if out.exists() else None
        assert now in ((None, old) if overwrite else (None,)) or now == new, step
        # the up-front check of any next run finishes the cut commit and removes the dead merge's lock ...
        settle_out_dir(str(out), inputs={}, overwrite=overwrite)  # what a run about to merge does first
        problems = check_out_dir(str(out), inputs={}, overwrite=overwrite)
        assert problems == [] or (not overwrite and "pass overwrite=True" in problems[0]), (step, problems)
        assert tree(out) in (old, new) if out.exists() else not overwrite, step
        assert ".out.lock" not in _beside(out), step
        # ... and the same command again ends with the complete new output and nothing beside it
        if problems:
            assert tree(out) == new, step
        else:
            assert merger(out, "new", overwrite) == 0, step
        assert tree(out) == new and _beside(out) == [], (step, _beside(out))
