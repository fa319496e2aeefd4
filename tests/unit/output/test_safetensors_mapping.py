"""Inputs safetensors cannot map: a base shard larger than the process's address space. The free space for the
output is checked before anything maps an input, and a failed mapping is refused by name, never a traceback.

The large shard is a sparse file (a real safetensors header, then ``truncate`` to its size); the merges run in a
child process under ``RLIMIT_AS`` of 4 GiB."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap

import pytest
from safetensors import safe_open

BIG = 2**31 + 16  # elements of the one U8 tensor the adapter leaves alone
LIMIT = 4 << 30


@pytest.fixture()
def big_base(make_base, tmp_path):
    """The tiny llama base plus a second shard holding a ``[2**31 + 16]`` U8 tensor, sparse on disk."""
    base = tmp_path / "base"
    shutil.copytree(make_base("llama"), base)
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    os.rename(base / "model.safetensors", base / first)
    header = json.dumps(
        {"__metadata__": {"format": "pt"}, "big": {"dtype": "U8", "shape": [BIG], "data_offsets": [0, BIG]}}
    ).encode()
    header += b" " * (-len(header) % 8)
    with open(base / second, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
    os.truncate(base / second, 8 + len(header) + BIG)
    with safe_open(str(base / first), "pt") as f:
        weight_map = dict.fromkeys(f.keys(), first)
    weight_map["big"] = second
    (base / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
    )
    return base


def _merge_limited(tmp_path, args) -> subprocess.CompletedProcess:
    """``peft-shardmerge ARGS`` in a child whose address space is limited to 4 GiB."""
    script = tmp_path / "limited.py"
    script.write_text(
        textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, ({LIMIT}, {LIMIT}))
        from peft_shardmerge.api.cli import main
        sys.exit(main(sys.argv[1:]))
    """)
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, str(script), "merge", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )


@pytest.fixture()
def tiny_fs(tmp_path):
    """A real 3 MB tmpfs (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a filesystem needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True, text=True, check=False
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.slow
def test_free_space_is_checked_before_the_inputs_are_mapped(big_base, make_adapter, tiny_fs, tmp_path):
    r = _merge_limited(tmp_path, [big_base, make_adapter("llama", "default"), tiny_fs / "out"])
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "not enough free space for" in r.stderr, r.stderr
    assert f"{tiny_fs} has 0.003 GB free" in r.stderr
    assert os.listdir(tiny_fs) == []


@pytest.mark.slow
def test_a_shard_the_address_space_cannot_map_is_refused_by_name(big_base, make_adapter, tmp_path):
    out = tmp_path / "out"
    r = _merge_limited(tmp_path, [big_base, make_adapter("llama", "default"), out, "--dry-run"])
    assert r.returncode == 2, r.stderr
    size = os.path.getsize(big_base / "model-00002-of-00002.safetensors")
    assert "Traceback" not in r.stderr, r.stderr
    assert f"model-00002-of-00002.safetensors ({size} bytes) cannot be mapped into memory" in r.stderr
    assert "address space or memory is too small" in r.stderr
    assert not out.exists()
