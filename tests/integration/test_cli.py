"""The command line end to end: merge, --dry-run, Hub ids resolved from the local cache, verbosity."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from peft_shardmerge.testing import compare_logits


def _cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "peft_shardmerge", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=600,
    )


def test_cli_merge_and_summary(make_base, make_adapter, tmp_path):
    base, adapter = make_base("llama_sharded"), make_adapter("llama_sharded", "default")
    out = str(tmp_path / "merged")
    r = _cli("merge", base, adapter, out, "--dtype", "float32", "--max-shard-size", "200KB")
    assert r.returncode == 0, r.stderr
    assert "LoRA modules merged 14/14" in r.stdout
    shards = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    assert len(shards) > 1 and f"shards {len(shards)}," in r.stdout and "peak RSS" in r.stdout
    assert "merging" not in r.stderr and r.stderr == "", r.stderr  # no bar in a pipe (a log file, CI)
    assert compare_logits(base, adapter, out) < 1e-4


def test_the_progress_bar_is_shown_on_a_terminal_only(make_base, make_adapter, tmp_path):
    from tests.helpers import run_on_a_terminal

    base, adapter = make_base("llama"), make_adapter("llama", "default")
    command = [sys.executable, "-m", "peft_shardmerge", "merge", base, adapter]
    code, shown = run_on_a_terminal([*command, str(tmp_path / "t")], env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert code == 0 and "merging: 100%" in shown, shown
    code, shown = run_on_a_terminal([*command, str(tmp_path / "q"), "-q"], env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert code == 0 and shown == "", shown  # -q: nothing at all


@pytest.mark.slow
def test_cli_dry_run_prints_plan_and_writes_nothing(make_base, make_adapter, tmp_path):
    base, adapter = make_base("llama"), make_adapter("llama", "default")
    out = tmp_path / "merged"
    r = _cli("merge", base, adapter, str(out), "--dry-run", "--max-shard-size", "100KB", "-q")
    assert r.returncode == 0, r.stderr
    assert not out.exists() and os.listdir(tmp_path) == []
    lines = r.stdout.splitlines()
    assert any("model.layers.0.self_attn.q_proj.weight" in ln and "merge +lora(r=8)" in ln for ln in lines)
    assert any("model.norm.weight" in ln and "copy" in ln for ln in lines)
    assert "model-00001-of-" in r.stdout and "estimated peak working memory" in r.stdout
    assert r.stderr == ""  # -q: no progress bar, no info logging


@pytest.mark.slow
def test_cli_resolves_hub_ids_from_the_local_cache_offline(make_base, make_adapter, tmp_path):
    cache = tmp_path / "hub"
    for repo, src in (
        ("tiny-org/tiny-llama", make_base("llama")),
        ("tiny-org/tiny-adapter", make_adapter("llama", "default")),
    ):
        root = cache / f"models--{repo.replace('/', '--')}"
        shutil.copytree(src, root / "snapshots" / "0123abcd")
        (root / "refs").mkdir()
        (root / "refs" / "main").write_text("0123abcd")
    out = tmp_path / "merged"
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    r = _cli("merge", "tiny-org/tiny-llama", "tiny-org/tiny-adapter", str(out), "--dtype", "float32", env=env)
    assert r.returncode == 0, r.stderr
    assert compare_logits(make_base("llama"), make_adapter("llama", "default"), str(out)) < 1e-4
    r = _cli("merge", "tiny-org/not-cached", "tiny-org/tiny-adapter", str(tmp_path / "o2"), env=env)
    assert r.returncode == 2 and "not a folder, nor a Hub id in the local Hugging Face cache" in r.stderr


@pytest.mark.slow
def test_tokenizer_files_travel(make_base, make_adapter, tmp_path):
    base = shutil.copytree(make_base("llama"), tmp_path / "base")
    adapter = shutil.copytree(make_adapter("llama", "default"), tmp_path / "adapter")
    (base / "tokenizer_config.json").write_text('{"from": "base"}')
    (base / "special_tokens_map.json").write_text("{}")
    (adapter / "tokenizer_config.json").write_text('{"from": "adapter"}')
    out = tmp_path / "merged"
    r = _cli("merge", str(base), str(adapter), str(out))
    assert r.returncode == 0, r.stderr
    assert (out / "tokenizer_config.json").read_text() == '{"from": "adapter"}'
    assert not (out / "special_tokens_map.json").exists()  # the adapter's tokenizer replaces the base's wholly
    assert "tokenizer files taken from the adapter folder" in r.stdout
