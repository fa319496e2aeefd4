"""peft-shardmerge verify: a clean merge passes; each kind of damage is named; a wrong adapter fails the logits."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from peft_shardmerge import merge_checkpoint
from peft_shardmerge.verify import verify_checkpoint


@pytest.fixture(scope="module")
def merged(tmp_path_factory, make_base, make_adapter):
    base, adapter = make_base("llama_sharded"), make_adapter("llama_sharded", "default")
    out = str(tmp_path_factory.mktemp("verify") / "merged")
    merge_checkpoint(base, adapter, out, dtype="float32", max_shard_size="300KB", progress=False)
    return base, adapter, out


def _copy(out, tmp_path):
    return shutil.copytree(out, tmp_path / "copy")


def test_clean_merge_passes_with_logits(merged):
    base, adapter, out = merged
    report = verify_checkpoint(out, base=base, adapter=adapter)
    assert report.ok, report.summary()
    assert report.logits_max_rel_err < 1e-5 and report.tensors == 21
    r = subprocess.run([sys.executable, "-m", "peft_shardmerge", "verify", out, "--base", base, "--adapter", adapter],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("OK: ")


def test_wrong_adapter_fails_the_logits(merged, make_adapter):
    base, _, out = merged
    other = make_adapter("llama_sharded", "patterns", r=8, lora_alpha=16, use_rslora=True,
                         rank_pattern={"q_proj": 4, "down_proj": 2}, alpha_pattern={"v_proj": 3})
    r = subprocess.run([sys.executable, "-m", "peft_shardmerge", "verify", out, "--base", base, "--adapter", other],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stdout.startswith("FAILED: ") and "logits differ from base + adapter" in r.stdout


def _first_shard(folder):
    return sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))[0]


def test_missing_tensor_and_index_disagreement(merged, tmp_path):
    out = _copy(merged[2], tmp_path)
    shard = os.path.join(out, _first_shard(out))
    tensors = load_file(shard)
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    save_file(tensors, shard, metadata={"format": "pt"})
    report = verify_checkpoint(str(out))
    assert not report.ok
    assert f"tensor {dropped} is in the index but in no shard" in report.problems
    assert any(p.startswith("index total_size") for p in report.problems)
    assert any("the model expects are missing" in p for p in report.problems)


def test_nan_and_format_metadata(merged, tmp_path):
    out = _copy(merged[2], tmp_path)
    shard = os.path.join(out, _first_shard(out))
    tensors = load_file(shard)
    name = sorted(n for n in tensors if tensors[n].is_floating_point())[0]
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, shard)  # and no {"format": "pt"}
    report = verify_checkpoint(str(out))
    assert any(p.startswith("NaN or Inf in 1 tensor(s): " + name) for p in report.problems)
    assert any("lacks {'format': 'pt'} metadata" in p for p in report.problems)


def test_config_inconsistencies(merged, tmp_path):
    out = _copy(merged[2], tmp_path)
    config = json.load(open(out / "config.json"))
    config.update(dtype="bfloat16", tie_word_embeddings=True, vocab_size=1000)
    json.dump(config, open(out / "config.json", "w"))
    report = verify_checkpoint(str(out))
    text = "\n".join(report.problems)
    assert "config.json says dtype bfloat16 but the tensors are float32" in text
    assert "tie_word_embeddings is true but the tied output weights are stored separately" in text
    assert "model.embed_tokens.weight has shape [512, 128], the config implies [1000, 128]" in text


def test_not_a_checkpoint(tmp_path):
    r = subprocess.run([sys.executable, "-m", "peft_shardmerge", "verify", str(tmp_path)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and "has no config.json" in r.stderr and "Traceback" not in r.stderr
