"""Our merge against MergeKit's: a ``BASE+ADAPTER`` model reference merged by MergeKit (passthrough) is the same
checkpoint, byte for byte, as ours."""

from __future__ import annotations

import os

import pytest
import torch

mergekit = pytest.importorskip("mergekit")

from mergekit.config import MergeConfiguration  # noqa: E402
from mergekit.merge import run_merge  # noqa: E402
from mergekit.options import MergeOptions  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from peft_shardmerge import merge_checkpoint  # noqa: E402
from peft_shardmerge.testing import build_adapter, build_base  # noqa: E402
from tests.helpers import folder_tensors  # noqa: E402


def mergekit_passthrough(base: str, adapter: str, out: str, cache: str, dtype: str) -> str:
    """MergeKit's merge of ``base+adapter`` (it merges the adapter with PEFT into its cache, then copies)."""
    config = {"merge_method": "passthrough", "dtype": dtype, "models": [{"model": f"{base}+{adapter}"}]}
    options = MergeOptions(lora_merge_cache=cache, copy_tokenizer=False, write_model_card=False, quiet=True)
    run_merge(MergeConfiguration.model_validate(config), out, options)
    return out


@pytest.mark.parametrize(
    "arch,dtype,lora",
    [
        ("llama", torch.bfloat16, dict(r=8, lora_alpha=16)),
        ("qwen2", torch.bfloat16, dict(r=4, lora_alpha=8, use_rslora=True)),  # tied embeddings
        ("gpt2", torch.float16, dict(r=8, lora_alpha=32, fan_in_fan_out=True)),  # Conv1D, stored [in, out]
    ],
)
def test_same_bytes_as_mergekit_passthrough(tmp_path, arch, dtype, lora):
    base = build_base(str(tmp_path / "base"), arch, dtype=dtype)
    adapter = build_adapter(base, str(tmp_path / "adapter"), **lora)
    theirs = mergekit_passthrough(
        base, adapter, str(tmp_path / "mergekit"), str(tmp_path / "cache"), str(dtype).removeprefix("torch.")
    )
    ours = merge_checkpoint(base, adapter, str(tmp_path / "ours"), progress=False)
    a, b = folder_tensors(theirs), folder_tensors(ours.out_dir)
    assert sorted(a) == sorted(b)
    differing = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert differing == []
    base_tensors = folder_tensors(base)
    changed = [k for k in a if not torch.equal(a[k], base_tensors[k])]
    assert len(changed) >= 4  # the adapter changed the projections: the comparison is not of two copies of the base


def assert_close_but_at_thresholds(a: dict, b: dict, bound: int) -> None:
    """Two checkpoints' tensors agree to float32 rounding, but for at most ``bound`` elements: MergeKit reads each
    delta back as (base + delta) - base, which may move an element at a top-k threshold across it."""
    far = 0
    for k in a:
        diff = (a[k] - b[k]).abs()
        far += int((diff > 1e-6).sum())
        assert torch.allclose(a[k][diff <= 1e-6], b[k][diff <= 1e-6], rtol=0, atol=2e-7), k
    assert far <= bound


@pytest.fixture(scope="module")
def three_adapters(tmp_path_factory):
    """An fp32 base and three adapters of different ranks and target sets."""
    tmp = tmp_path_factory.mktemp("task-vectors")
    base = build_base(str(tmp / "base"), "llama", dtype=torch.float32)
    adapters = [
        build_adapter(base, str(tmp / "a"), r=8, lora_alpha=16, seed=1),
        build_adapter(base, str(tmp / "b"), r=4, lora_alpha=8, seed=2, target_modules=["q_proj", "v_proj", "up_proj"]),
        build_adapter(
            base, str(tmp / "c"), r=2, lora_alpha=4, seed=3, use_rslora=True, target_modules=["q_proj", "down_proj"]
        ),
    ]
    return base, adapters


def mergekit_task_vectors(base, adapters, weights, out, cache, method, **parameters) -> str:
    """MergeKit's ``method`` over ``base+adapter`` references, in float32."""
    per_model = {"density": parameters.pop("density")} if "density" in parameters else {}
    config = {
        "merge_method": method,
        "base_model": base,
        "dtype": "float32",
        "parameters": parameters,
        "models": [
            {"model": f"{base}+{a}", "parameters": {"weight": w, **per_model}} for a, w in zip(adapters, weights)
        ],
    }
    options = MergeOptions(lora_merge_cache=cache, copy_tokenizer=False, write_model_card=False, quiet=True)
    run_merge(MergeConfiguration.model_validate(config), out, options)
    return out


@pytest.mark.parametrize(
    "count,normalize,density",
    [(2, True, 0.5), (2, False, 0.5), (3, True, 0.3), (3, None, 1.0)],
)
def test_ties_equals_mergekit(tmp_path, three_adapters, count, normalize, density):
    base, adapters = three_adapters
    adapters, weights = adapters[:count], [0.7, 0.3, 0.5][:count]
    params = {"density": density, **({"normalize": normalize} if normalize is not None else {})}
    theirs = mergekit_task_vectors(
        base, adapters, weights, str(tmp_path / "mk"), str(tmp_path / "cache"), "ties", **params
    )
    ours = merge_checkpoint(
        base,
        adapters,
        str(tmp_path / "ours"),
        weights=weights,
        combination="ties",
        density=density,
        normalize=normalize,
        progress=False,
    )
    assert ours.combination.startswith("ties (weights")
    a, b, base_tensors = folder_tensors(theirs), folder_tensors(ours.out_dir), folder_tensors(base)
    assert sorted(a) == sorted(b)
    assert_close_but_at_thresholds(a, b, bound=8)
    assert sum(not torch.equal(a[k], base_tensors[k]) for k in a) == 14  # every targeted projection changed


def test_cat_with_weights_equals_mergekit_task_arithmetic(tmp_path, three_adapters):
    base, adapters = three_adapters
    weights = [0.7, -0.3, 1.5]
    theirs = mergekit_task_vectors(
        base, adapters, weights, str(tmp_path / "mk"), str(tmp_path / "cache"), "task_arithmetic"
    )
    ours = merge_checkpoint(base, adapters, str(tmp_path / "ours"), weights=weights, progress=False)
    a, b = folder_tensors(theirs), folder_tensors(ours.out_dir)
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=2e-7) for k in a)
    assert sum(not torch.equal(a[k], folder_tensors(base)[k]) for k in a) == 14


@pytest.mark.parametrize("arch,targets", [("gpt2", ["c_attn", "c_fc"]), ("llama", ["q_proj", "embed_tokens"])])
def test_ties_on_conv1d_and_embedding_layers_equals_mergekit(tmp_path, arch, targets):
    """Layers whose stored weight is the transpose of B @ A: GPT-2's Conv1D, and embeddings."""
    base = build_base(str(tmp_path / "base"), arch, dtype=torch.float32)
    extra = dict(fan_in_fan_out=True) if arch == "gpt2" else {}
    adapters = [
        build_adapter(base, str(tmp_path / "a"), r=8, lora_alpha=16, seed=1, target_modules=targets, **extra),
        build_adapter(base, str(tmp_path / "b"), r=4, lora_alpha=8, seed=2, target_modules=targets[:1], **extra),
    ]
    for folder in adapters:  # as save_embedding_layers=False saves them: the LoRA factors alone
        path = os.path.join(folder, "adapter_model.safetensors")
        kept = {k: v for k, v in load_file(path).items() if ".lora_" in k}
        save_file(kept, path, metadata={"format": "pt"})
    theirs = mergekit_task_vectors(
        base, adapters, [0.6, 0.4], str(tmp_path / "mk"), str(tmp_path / "cache"), "ties", density=0.4
    )
    ours = merge_checkpoint(
        base, adapters, str(tmp_path / "ours"), weights=[0.6, 0.4], combination="ties", density=0.4, progress=False
    )
    a, b, base_tensors = folder_tensors(theirs), folder_tensors(ours.out_dir), folder_tensors(base)
    assert sorted(a) == sorted(b)
    assert_close_but_at_thresholds(a, b, bound=4)
    changed = {k for k in a if not torch.equal(a[k], base_tensors[k])}
    targeted = {k for k in a if k.endswith(tuple(f"{t}.weight" for t in targets))}
    assert targeted and targeted <= changed, targeted - changed
