"""Bad input is refused before anything is written, with a message naming what is wrong and the fix."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from peft_shardmerge import (
    CorruptFileError,
    InputError,
    NotFoundError,
    UnsupportedError,
    merge_checkpoint,
    parse_dtype,
    parse_size,
)
from peft_shardmerge.tiny import build_adapter, build_base


@pytest.fixture(scope="module")
def pair(make_base, make_adapter):
    return make_base("llama"), make_adapter("llama", "default")


def _edited_adapter(src: str, dst, **changes) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "adapter_config.json")
    config = json.load(open(path))
    for k, v in changes.items():
        if v is None:
            config.pop(k, None)
        else:
            config[k] = v
    json.dump(config, open(path, "w"))
    return str(dst)


def _nothing_written(tmp_path, out) -> None:
    assert not os.path.exists(out) or os.listdir(out) in ([], ["keep.txt"])
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")], "temporary folder left behind"


def test_adapter_for_another_architecture(pair, make_adapter, tmp_path):
    base, _ = pair
    gpt2_adapter = make_adapter("gpt2", "default", fan_in_fan_out=True)
    out = str(tmp_path / "out")
    with pytest.raises(InputError, match=r"LoRA target 'transformer\.h\.0\.attn\.c_attn' does not exist in the base"):
        merge_checkpoint(base, gpt2_adapter, out, progress=False)
    _nothing_written(tmp_path, out)


def test_adapter_for_another_hidden_size(pair, tmp_path):
    base, _ = pair
    other = build_base(str(tmp_path / "wide"), "llama", hidden_size=192, intermediate_size=256)
    adapter = build_adapter(other, str(tmp_path / "wide-adapter"), target_modules=["q_proj"])
    out = str(tmp_path / "out")
    with pytest.raises(InputError, match=r"gives a delta of shape \[192, 192\] but the base weight "
                                         r"'model\.layers\.0\.self_attn\.q_proj\.weight' is \[128, 128\]") as e:
        merge_checkpoint(base, adapter, out, progress=False)
    assert len(e.value.problems) == 2  # both layers named, at once
    assert not os.path.exists(out)


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
    assert "is not empty; pass --overwrite" in text
    assert (out / "keep.txt").read_text() == "mine"
    _nothing_written(tmp_path, str(out))


def test_overwrite_replaces_only_after_success(pair, tmp_path):
    base, adapter = pair
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    merge_checkpoint(base, adapter, str(out), overwrite=True, progress=False)
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]


@pytest.mark.parametrize("where", ["same", "inside_base", "inside_adapter", "base_inside_out"])
def test_output_must_not_touch_the_inputs(where, tmp_path, make_base, make_adapter):
    base = shutil.copytree(make_base("llama"), tmp_path / "base")
    adapter = shutil.copytree(make_adapter("llama", "default"), tmp_path / "adapter")
    out = {"same": base, "inside_base": base / "merged", "inside_adapter": adapter / "m",
           "base_inside_out": tmp_path}[where]
    before = sorted(os.listdir(base))
    with pytest.raises(InputError, match="choose a"):
        merge_checkpoint(str(base), str(adapter), str(out), overwrite=True, progress=False)
    assert sorted(os.listdir(base)) == before
    assert not os.path.exists(base / "merged")


def test_unknown_peft_type(pair, tmp_path):
    base, adapter = pair
    bad = _edited_adapter(adapter, tmp_path / "a", peft_type="LOHA")
    with pytest.raises(UnsupportedError, match=r"peft_type='LOHA'; only LoRA adapters"):
        merge_checkpoint(base, bad, str(tmp_path / "out"), progress=False)


def test_dora_config_without_magnitudes(pair, tmp_path):
    base, adapter = pair
    bad = _edited_adapter(adapter, tmp_path / "a", use_dora=True)
    with pytest.raises(InputError, match="use_dora=True in adapter_config.json but the weights lack"):
        merge_checkpoint(base, bad, str(tmp_path / "out"), progress=False)


def test_rank_in_config_disagrees_with_weights(pair, tmp_path):
    base, adapter = pair
    bad = _edited_adapter(adapter, tmp_path / "a", r=4)
    with pytest.raises(InputError, match=r"has rank 8 in its weights but adapter_config.json says r=4"):
        merge_checkpoint(base, bad, str(tmp_path / "out"), progress=False)


def test_config_missing_fields(pair, tmp_path):
    base, adapter = pair
    bad = _edited_adapter(adapter, tmp_path / "a", lora_alpha=None, r="8")
    with pytest.raises(InputError, match=r"(?s)'r' must be a positive number.*lacks 'lora_alpha'"):
        merge_checkpoint(base, bad, str(tmp_path / "out"), progress=False)


def test_missing_folders(pair, tmp_path):
    base, adapter = pair
    with pytest.raises(NotFoundError, match="not a folder, nor a Hub id in the local Hugging Face cache"):
        merge_checkpoint(str(tmp_path / "nope"), adapter, str(tmp_path / "out"), progress=False)
    with pytest.raises(NotFoundError, match="has none of adapter_config.json"):
        merge_checkpoint(base, str(tmp_path), str(tmp_path / "out"), progress=False)


def test_truncated_shard(pair, tmp_path):
    base, adapter = pair
    broken = shutil.copytree(base, tmp_path / "base")
    path = broken / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptFileError, match="ends beyond the file; the file is truncated"):
        merge_checkpoint(str(broken), adapter, str(tmp_path / "out"), progress=False)


def test_index_with_path_traversal(make_base, make_adapter, tmp_path):
    broken = shutil.copytree(make_base("llama_sharded"), tmp_path / "base")
    index_path = broken / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../elsewhere.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CorruptFileError, match=r"shard name '\.\./elsewhere\.safetensors' is not a plain"):
        merge_checkpoint(str(broken), make_adapter("llama_sharded", "default"), str(tmp_path / "out"),
                         progress=False)


def test_nan_in_adapter(pair, tmp_path):
    from safetensors.torch import load_file, save_file

    base, adapter = pair
    bad = shutil.copytree(adapter, tmp_path / "a")
    weights = load_file(str(bad / "adapter_model.safetensors"))
    key = next(k for k in weights if "lora_B" in k)
    weights[key][0, 0] = float("nan")
    save_file(weights, str(bad / "adapter_model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InputError, match=r"adapter weights contain NaN or Inf: .*lora_B"):
        merge_checkpoint(base, str(bad), str(tmp_path / "out"), progress=False)


@pytest.mark.parametrize("text,expected", [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("2GiB", 2 * 2**30),
                                           ("1.5GB", 1_500_000_000), (1234, 1234), ("100kb", 100_000)])
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
    return subprocess.run([sys.executable, "-m", "peft_shardmerge", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


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
