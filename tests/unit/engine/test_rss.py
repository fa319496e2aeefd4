"""The merge's own peak resident memory (peft_shardmerge/engine/rss.py): memory held before the merge is not counted,
memory
used inside it is, and the report names how it was measured."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
import time

import pytest

from peft_shardmerge.api.disk import merge_checkpoint
from peft_shardmerge.engine import rss

MiB = 1 << 20


def _touch(mib: int) -> bytearray:
    """``mib`` MiB with every page written (resident, unlike a zeroed allocation)."""
    return bytearray(b"\x01") * (mib * MiB)


def _status_kib(field: str) -> int:
    """A field of /proc/self/status, read independently of the code under test."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def test_memory_held_inside_the_window_is_seen_and_memory_freed_before_is_not():
    block = _touch(200)
    del block
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the lifetime mark, 200 MiB above now
    meter = rss.PeakRss(interval=0.01).start()
    held = _touch(100)
    time.sleep(0.2)
    del held
    peak = meter.stop()
    assert meter.method == rss.SAMPLED and peak - meter.baseline >= 90 * MiB
    assert peak < before - 60 * MiB  # the 200 MiB freed before the window are not counted
    assert not meter._thread.is_alive()


def test_measuring_leaves_the_process_lifetime_peak_alone():
    block = _touch(200)
    del block
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss.PeakRss().start().stop()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >= before
    assert _status_kib("VmHWM") >= before - 1024  # a caller reading the kernel's mark still sees its own peak


def test_the_merge_report_counts_the_merge_only(make_base, make_adapter, tmp_path):
    base, adapter = make_base("llama"), make_adapter("llama", "default")
    block = _touch(400)
    del block
    lifetime = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report = merge_checkpoint(base, adapter, str(tmp_path / "out"), progress=False)
    assert report.peak_rss_bytes < lifetime - 250 * MiB  # the lifetime mark includes the 400 MiB, the merge does not
    assert 0 <= report.peak_rss_bytes - report.baseline_rss_bytes < 150 * MiB
    assert report.peak_rss_method == rss.SAMPLED
    assert "peak RSS during the merge" in report.summary() and "measured by sampling" in report.summary()


SCRIPT = textwrap.dedent("""
    import json, resource, sys
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from peft_shardmerge import merge_and_save

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(sys.argv[1]), sys.argv[2])
    block = bytearray(b"\\x01") * (500 << 20)   # 500 MiB, every page written, as a model's loading would
    del block
    lifetime = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report = merge_and_save(model, sys.argv[3], progress=False)
    print(json.dumps({"lifetime": lifetime, "peak": report.peak_rss_bytes, "baseline": report.baseline_rss_bytes,
                      "summary": report.summary()}))
""")


@pytest.mark.slow
def test_merge_and_save_in_a_fresh_process_does_not_report_earlier_memory(make_base, make_adapter, tmp_path):
    base, adapter = make_base("llama"), make_adapter("llama", "default")
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, base, adapter, str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["lifetime"] - got["baseline"] >= 450 * MiB  # the allocation happened
    assert got["peak"] - got["baseline"] < 150 * MiB  # the merge's own peak is well below it
    assert got["peak"] < got["lifetime"] - 300 * MiB
    assert "peak RSS during the merge" in got["summary"]
