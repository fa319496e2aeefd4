"""GGUF from a loaded model: merge_and_save(model, "x.gguf") from a 4-bit QLoRA model equals the disk merge with
base_precision="nf4"; Unsloth's save_pretrained_gguf writes every type asked for from one pass, each file the one a
merge from disk writes; push_to_hub_gguf uploads them; what is refused is refused before anything is written."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("bitsandbytes")

from peft_shardmerge import InputError, merge_and_save, merge_checkpoint, patch_peft
from tests.integration.test_gguf import read
from tests.integration.test_inprocess import fake_hub, qlora  # noqa: F401 (a fixture)


def _files_equal(a: str, b: str) -> bool:
    with open(a, "rb") as f, open(b, "rb") as g:
        return f.read() == g.read()


def test_a_4bit_model_to_q8_0_is_the_disk_merge_from_nf4(gguf_case, tmp_path):
    base, _, _ = gguf_case("llama")
    model = qlora(base, "llama", "nf4", double_quant=True)
    model.save_pretrained(str(tmp_path / "adapter"))
    ours = tmp_path / "live" / "m.gguf"
    os.makedirs(ours.parent)
    merge_and_save(model, str(ours), tokenizer=base, outtype="q8_0", progress=False)
    disk = tmp_path / "disk" / "m.gguf"
    os.makedirs(disk.parent)
    merge_checkpoint(base, str(tmp_path / "adapter"), str(disk), outtype="q8_0", base_precision="nf4", progress=False)
    a, b = read(str(ours)), read(str(disk))
    assert list(a) == list(b) and [n for n in a if a[n][0] != b[n][0] or (a[n][1] != b[n][1]).any()] == []
    # the tokenizer passed in is saved by transformers (tokenizer.json, no tokenizer.model), which the converter
    # reads its other way; every other key is the disk merge's
    assert _keys(str(ours)) == _keys(str(disk))


def _keys(path: str) -> dict:
    """The metadata of a GGUF file but its tokenizer's and the key count."""
    import gguf

    fields = gguf.GGUFReader(path).fields
    return {k: (f.types, f.contents()) for k, f in fields.items() if not k.startswith(("tokenizer.", "GGUF.kv_count"))}


def test_save_pretrained_gguf_writes_each_type_from_one_pass(gguf_case, tmp_path, monkeypatch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from peft_shardmerge.api import job

    base, adapter, _ = gguf_case("llama")
    patch_peft()
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    runs = []
    real_run = job.run
    monkeypatch.setattr(job, "run", lambda *a, **k: runs.append(1) or real_run(*a, **k))
    folder = tmp_path / "m"
    report = model.save_pretrained_gguf(str(folder), quantization_method=["q8_0", "not_quantized", "q8_0"])
    written = ["Modelfile", "m.F16.gguf", "m.F16.merge_manifest.json", "m.Q8_0.gguf", "m.Q8_0.merge_manifest.json"]
    assert sorted(os.listdir(folder)) == written and len(runs) == 1
    assert report.shards == ["m.Q8_0.gguf", "m.F16.gguf"]
    assert (folder / "Modelfile").read_text() == "FROM ./m.Q8_0.gguf\n"
    from peft_shardmerge.verify.gguf_check import verify_gguf

    report = verify_gguf(str(folder / "m.F16.gguf"), base=base, adapter=adapter)  # named as the folder, recorded
    assert report.status == "OK" and report.recomputed, report.summary()
    for outtype, name in (("q8_0", "m.Q8_0.gguf"), ("f16", "m.F16.gguf")):
        alone = tmp_path / outtype / "m.gguf"
        os.makedirs(alone.parent)
        merge_checkpoint(base, adapter, str(alone), outtype=outtype, progress=False)
        assert _files_equal(str(alone), str(folder / name)), name
    with pytest.raises(InputError, match="exists; pass overwrite=True"):
        model.save_pretrained_gguf(str(folder), base, quantization_method="q8_0")
    with pytest.raises(InputError, match="quantization_method 'q3_k' is not a GGUF type"):
        model.save_pretrained_gguf(str(tmp_path / "n"), base, quantization_method=["q8_0", "q3_k"])
    with pytest.raises(InputError, match="call save_pretrained_gguf"):
        model.save_pretrained_merged(str(tmp_path / "n"), base, save_method="gguf")
    assert not os.path.exists(tmp_path / "n")


def test_push_to_hub_gguf_uploads_the_files(gguf_case, tmp_path, fake_hub):  # noqa: F811
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from peft_shardmerge import push_to_hub_gguf

    base, adapter, _ = gguf_case("llama")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    url = push_to_hub_gguf(model, "me/tiny-gguf", quantization_method="q8_0", token="hf_x", progress=False)
    assert len(fake_hub.commits) == 1 and "/me/tiny-gguf/commit/" in url
    files = fake_hub.files["me/tiny-gguf"]
    assert {"tiny-gguf.Q8_0.gguf", "Modelfile", "README.md"} <= set(files)
    local = tmp_path / "tiny-gguf.gguf"
    merge_checkpoint(base, adapter, str(local), outtype="q8_0", progress=False)
    assert files["tiny-gguf.Q8_0.gguf"] == local.read_bytes()
