"""Problems reported together, option parsing, and the real command line's exit codes (the catalogue of bad
inputs is tests/integration/test_bad_inputs.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from peft_shardmerge import (
    InputError,
    merge_checkpoint,
    parse_dtype,
    parse_size,
)


@pytest.fixture(scope="module")
def pair(make_base, make_adapter):
    return make_base("llama"), make_adapter("llama", "default")


def _nothing_written(tmp_path, out) -> None:
    assert not os.path.exists(out) or os.listdir(out) in ([], ["keep.txt"])
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")], "temporary folder left behind"


def test_every_problem_is_reported_at_once(pair, tmp_path):
    base, adapter = pair
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(InputError) as e:
        merge_checkpoint(base, adapter, str(out), dtype="int4", max_shard_size="lots", progress=False)
    text = str(e.value)
    assert text.startswith("3 problems found before writing anything:")
    assert "dtype 'int4' is not supported" in text
    assert "max_shard_size 'lots' is not a size" in text
    assert "holds files peft-shardmerge did not write (keep.txt)" in text and "overwrite=True" not in text
    assert (out / "keep.txt").read_text() == "mine"
    _nothing_written(tmp_path, str(out))


def test_overwrite_replaces_only_after_success(pair, tmp_path):
    base, adapter = pair
    out = tmp_path / "out"
    merge_checkpoint(base, adapter, str(out), dtype="float16", progress=False)  # an earlier output of ours
    merge_checkpoint(base, adapter, str(out), overwrite=True, progress=False)
    assert sorted(os.listdir(out)) == [
        "config.json",
        "generation_config.json",
        "merge_manifest.json",
        "model.safetensors",
    ]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]


@pytest.mark.parametrize(
    "text,expected",
    [
        ("5GB", 5 * 10**9),
        ("500MB", 5 * 10**8),
        ("2GiB", 2 * 2**30),
        ("1.5GB", 1_500_000_000),
        (1234, 1234),
        ("100kb", 100_000),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "5 XB", "-1GB", 0, "0MB", True])
def test_parse_size_rejects(text):
    with pytest.raises(InputError, match="max_shard_size"):
        parse_size(text)


def test_parse_dtype():
    import torch

    assert parse_dtype(None) is None
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype(torch.float16) is torch.float16
    assert parse_dtype("torch.float32") is torch.float32
    with pytest.raises(InputError, match="dtype 'int8' is not supported; use one of float32, float16, bfloat16"):
        parse_dtype("int8")


def _cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "peft_shardmerge", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


@pytest.mark.slow
def test_cli_user_error_exits_2_without_traceback(pair, tmp_path):
    base, adapter = pair
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    r = _cli("merge", base, adapter, str(out), "--max-shard-size", "huge")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "peft-shardmerge: error: 2 problems found before writing anything" in r.stderr
    assert (out / "keep.txt").read_text() == "mine"


def test_cli_bad_choice_exits_2(pair, tmp_path):
    base, adapter = pair
    r = _cli("merge", base, adapter, str(tmp_path / "o"), "--dtype", "int4")
    assert r.returncode == 2 and "invalid choice: 'int4'" in r.stderr and "Traceback" not in r.stderr
