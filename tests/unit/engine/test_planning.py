"""The planning rules shared by both paths: which adapters combine (combinations.py) and the tie policy (ties.py)."""

from __future__ import annotations

import json
import os

import pytest
from peft import IA3Config, LoraConfig
from transformers import AutoConfig

from peft_shardmerge import InputError, merge_checkpoint
from peft_shardmerge.support.combinations import combination_problems
from peft_shardmerge.support.model_info import inspect_model
from peft_shardmerge.support.ties import tie_enabled, untie_note, untied_names
from peft_shardmerge.testing import build_adapter


def _both_forms(config):
    """A PEFT config object and the dict its adapter_config.json holds."""
    return [config, config.to_dict()]


@pytest.mark.parametrize("form", [0, 1], ids=["peft-object", "json-dict"])
def test_combination_rules_on_real_configs(form):
    lora8, lora8b = LoraConfig(r=8), LoraConfig(r=8, lora_alpha=4)
    lora4, dora = LoraConfig(r=4), LoraConfig(r=8, use_dora=True)
    ia3 = IA3Config(target_modules=["k_proj"])
    pick = [_both_forms(c)[form] for c in (lora8, lora8b, lora4, dora, ia3)]
    a, b, c, d, e = pick
    assert combination_problems([a, b], ["a", "b"], [0.5, 0.5], "linear") == ([0.5, 0.5], [])
    assert combination_problems([a, c], ["a", "c"], None, "cat")[1] == []
    assert combination_problems([d], ["d"], None, "cat")[1] == []  # one adapter with weight 1: no combination
    assert combination_problems([e], ["e"], [1.0], "linear")[1] == []
    linear = combination_problems([a, c], ["a", "c"], None, "linear", option="combination_type")[1]
    assert linear == [
        "combination_type 'linear' needs adapters of equal rank: every adapter must have the same "
        "rank, got [4, 8]; use 'cat'"
    ]
    problems = combination_problems([d, e], ["d", "e"], [1.0, 2.0], "cat")[1]
    assert problems == [
        "DoRA adapters cannot be weighted or combined (their magnitudes do not add): ['d']",
        "IA3 adapters cannot be weighted or combined (their scalings multiply): ['e']",
    ]
    assert combination_problems([d], ["d"], [0.5], "cat")[1][0].startswith("DoRA adapters cannot be weighted")
    pattern = _both_forms(LoraConfig(r=8, rank_pattern={"q_proj": 2}))[form]
    assert "got [2, 8]" in combination_problems([a, pattern], ["a", "p"], None, "linear")[1][0]


def test_combination_rules_refuse_bad_weights_first():
    weights, problems = combination_problems([LoraConfig(r=8)] * 2, ["a", "b"], [1.0, float("inf")], "sum")
    assert problems == [
        "adapter weights must be finite numbers, got [1.0, inf]",
        "combination must be one of cat, linear, ties, dare_ties, dare_linear, magnitude_prune, got 'sum'",
    ]
    assert combination_problems([{}] * 2, ["a", "b"], [1.0], "cat")[1] == [
        "1 weight(s) given for 2 adapter(s); give one weight per adapter"
    ]


def test_dora_combination_refused_on_disk_with_the_shared_message(make_base, tmp_path):
    base = make_base("llama")
    plain = build_adapter(base, str(tmp_path / "plain"), seed=1, r=8)
    dora = build_adapter(base, str(tmp_path / "dora"), seed=2, r=8, use_dora=True)
    with pytest.raises(InputError, match=r"DoRA adapters cannot be weighted or combined .*dora'\]"):
        merge_checkpoint(base, [plain, dora], str(tmp_path / "m"), progress=False)
    with pytest.raises(InputError, match=r"DoRA adapters cannot be weighted or combined"):
        merge_checkpoint(base, dora, str(tmp_path / "m"), weights=[0.5], progress=False)
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("name,expected", [("qwen2", True), ("llama", False)])
def test_tie_policy_agrees_for_dict_and_config_object(make_base, name, expected):
    base = make_base(name)
    with open(os.path.join(base, "config.json")) as f:
        raw = json.load(f)
    config = AutoConfig.from_pretrained(base)
    assert tie_enabled(raw) is expected and tie_enabled(config) is expected
    info = inspect_model(base)
    assert info.tie_enabled is expected  # the model-structure flag follows the same policy
    assert bool(info.tied) is expected


def test_tie_policy_nested_and_default():
    assert tie_enabled({"text_config": {"tie_word_embeddings": False}}) is False
    assert tie_enabled({"tie_word_embeddings": True, "text_config": {"tie_word_embeddings": False}}) is True
    assert tie_enabled({}) is True


def test_untied_names_on_a_real_tied_model(make_base):
    info = inspect_model(make_base("qwen2"))
    ((target, source),) = info.tied.items()
    present = [target, source]
    assert untied_names(info.tied, [], present) == []
    assert untied_names(info.tied, [source], present) == sorted([target, source])
    assert untied_names(info.tied, [target], [source]) == []  # the target cannot be written: nothing to untie
    assert untie_note([target, source]).endswith("both are written and tie_word_embeddings is set to false")


def test_the_adapters_finite_check_runs_on_one_torch_thread(make_base, make_adapter, tmp_path, monkeypatch):
    """Planning reads every adapter weight to check it is finite: hundreds of tiny tensors, each checked with torch
    held to one thread (not a pool woken per op), and the setting put back after."""
    import torch

    from peft_shardmerge.io.safetensors_io import RowReader

    base, adapter = make_base("llama"), make_adapter("llama", "default")
    seen, real = [], RowReader.read_rows

    def read_rows(self, info, start, stop):
        seen.append(torch.get_num_threads())
        return real(self, info, start, stop)

    monkeypatch.setattr(RowReader, "read_rows", read_rows)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        merge_checkpoint(base, adapter, str(tmp_path / "dry"), dry_run=True, progress=False)
        assert seen and set(seen) == {1} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
