"""The task-vector maths (engine/task_vectors.py) against MergeKit's own merge method on whole tensors, and the exact
top-k threshold and DARE's draw against their definitions."""

from __future__ import annotations

import math
import os

import pytest
import torch

from peft_shardmerge.checkpoint.combine import task_vector_method
from peft_shardmerge.engine.task_vectors import (
    TaskVectors,
    adapter_delta,
    dare_mask,
    kth_largest,
    magnitude_thresholds,
)
from peft_shardmerge.io.safetensors_io import row_blocks
from peft_shardmerge.support.combinations import task_vector_problems

CPU = torch.device("cpu")


def lora_factors(rows: int, cols: int, rank: int, seed: int, scaling: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rank, cols, generator=g) * 0.1, torch.randn(rows, rank, generator=g) * 0.1, scaling)]


def combined(method, adapters, shape, chunk_elems, name="w", transposed=False) -> torch.Tensor:
    """The combined delta of a whole tensor, merged into zeros in row blocks of ``chunk_elems``."""
    vectors = TaskVectors(method, adapters, name)
    blocks = row_blocks(shape, chunk_elems)
    vectors.thresholds = magnitude_thresholds(vectors, shape, CPU, transposed)
    out = torch.zeros(shape)
    for start, stop in blocks:
        vectors.add_(out[start:stop], start, stop, transposed=transposed)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_kth_largest_is_the_sorted_value_whatever_the_blocks(seed):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(3000, generator=g).abs()
    values[::7] = 0.0  # many zeros
    values[1::11] = values[5]  # many equal values
    values[2] = float("inf")
    ordered = values.sort(descending=True).values
    for cut in (7, 37, 3000):
        blocks = [values[i : i + cut] for i in range(0, values.numel(), cut)]
        for k in (1, 2, 500, 1501, 2999, 3000):
            assert kth_largest(lambda: iter(blocks), k) == ordered[k - 1].item()


def test_dare_draw_depends_on_seed_tensor_and_adapter_not_on_the_rows_asked():
    whole = dare_mask(11, "w", 0, 1000, 0, 700, 0.3)
    assert torch.equal(whole[123:456], dare_mask(11, "w", 0, 1000, 123, 456, 0.3))
    for other in (dare_mask(12, "w", 0, 1000, 0, 700, 0.3), dare_mask(11, "v", 0, 1000, 0, 700, 0.3)):
        assert not torch.equal(whole, other)
    assert not torch.equal(whole, dare_mask(11, "w", 1, 1000, 0, 700, 0.3))
    # the kept fraction is the density: 700,000 draws, within 6 standard deviations
    kept = whole.float().mean().item()
    assert abs(kept - 0.3) < 6 * math.sqrt(0.3 * 0.7 / whole.numel())


def test_dare_keeps_each_element_rescaled_and_its_expectation_is_the_plain_sum():
    shape = (600, 500)
    a, b = lora_factors(600, 500, 8, 1), lora_factors(600, 500, 4, 2)
    plain = adapter_delta(a, shape, CPU, 0, 600, False) * 0.6 + adapter_delta(b, shape, CPU, 0, 600, False) * 0.4
    method = task_vector_method("dare_linear", [0.6, 0.4], 0.25, seed=3)
    out = combined(method, [a, b], shape, 1 << 14)
    # each element is (mask_a * 0.6 * d_a + mask_b * 0.4 * d_b) / 0.25: check it against the draw itself
    ma = dare_mask(3, "w", 0, 500, 0, 600, 0.25)
    mb = dare_mask(3, "w", 1, 500, 0, 600, 0.25)
    da, db = adapter_delta(a, shape, CPU, 0, 600, False), adapter_delta(b, shape, CPU, 0, 600, False)
    assert torch.allclose(out, (da * ma / 0.25 * 0.6) + (db * mb / 0.25 * 0.4), rtol=1e-6, atol=1e-9)
    # unbiased: the mean of (out - plain) over 300,000 elements is within 6 standard errors of zero
    diff = (out - plain).flatten()
    assert abs(diff.mean().item()) < 6 * diff.std().item() / math.sqrt(diff.numel())
    assert out.abs().sum() > 0 and (out == 0).float().mean().item() > 0.4  # most elements dropped by both


@pytest.mark.parametrize("density", [0.01, 0.3, 0.999])
def test_magnitude_keeps_exactly_the_top_k_of_each_delta(density):
    shape = (100, 50)
    factors = lora_factors(100, 50, 8, 4)
    delta = adapter_delta(factors, shape, CPU, 0, 100, False)
    out = combined(task_vector_method("magnitude_prune", [1.0], density), [factors], shape, 700)
    k = max(1, int(density * delta.numel()))
    top = torch.zeros(delta.numel(), dtype=torch.bool)
    top[delta.abs().flatten().topk(k).indices] = True
    assert torch.equal(out.flatten() != 0, top)
    assert torch.equal(out.flatten()[top], delta.flatten()[top])


@pytest.mark.parametrize("chunk", [1 << 10, 5000, 1 << 22])
@pytest.mark.parametrize("shape", [(300, 64), (70, 9000)])  # one tile; tiles of 29 rows that the blocks cut
def test_the_combination_does_not_depend_on_the_row_block(chunk, shape):
    adapters = [lora_factors(*shape, 8, 1), lora_factors(*shape, 2, 2), []]
    for name in ("ties", "dare_ties", "magnitude_prune"):
        method = task_vector_method(name, [1.0, 0.5, 2.0], 0.3, seed=5)
        assert torch.equal(combined(method, adapters, shape, chunk), combined(method, adapters, shape, 1 << 30))


# MergeKit's own merge method, on whole tensors: the reference for the maths
mergekit = pytest.importorskip("mergekit")
from mergekit.merge_methods.base import TensorEntry, TensorGroup  # noqa: E402
from mergekit.merge_methods.generalized_task_arithmetic import (  # noqa: E402
    ConsensusMethod,
    GeneralizedTaskArithmeticMerge,
)
from mergekit.sparsify import SparsificationMethod  # noqa: E402


def mergekit_merge(base, models, weights, density, *, consensus, sparsify, normalize):
    """MergeKit's GeneralizedTaskArithmeticMerge on one tensor (fp32), with the given consensus and sparsification."""
    method = GeneralizedTaskArithmeticMerge(
        consensus_method=consensus,
        sparsification_method=sparsify,
        default_normalize=normalize,
        default_rescale=False,
        method_name="reference",
        method_pretty_name=None,
        method_reference_url=None,
    )
    ids = [f"m{i}" for i in range(len(models))]
    group = TensorGroup([TensorEntry("base", base, is_base=True)] + [TensorEntry(i, m) for i, m in zip(ids, models)])
    return method.merge_group(
        group,
        int8_mask=False,
        normalize=normalize,
        rescale=False,
        **{"lambda": 1.0},
        weight=dict(zip(ids, weights)),
        density=dict.fromkeys(ids, density),
    )


@pytest.mark.parametrize(
    "name,majority,normalize",
    [
        ("ties", "total", True),
        ("ties", "total", False),
        ("ties", "frequency", True),
        ("ties", "frequency", False),
        ("magnitude_prune", "total", False),
        ("magnitude_prune", "total", True),
    ],
)
@pytest.mark.parametrize("transposed", [False, True])
def test_equals_mergekit_on_whole_tensors(name, majority, normalize, transposed):
    rows, cols = 96, 80
    g = torch.Generator().manual_seed(0)
    base = torch.randn(rows, cols, generator=g) * 0.02
    # three adapters of different ranks; the third leaves this tensor alone (a zero delta in MergeKit)
    adapters = [
        lora_factors(cols if transposed else rows, rows if transposed else cols, r, s) for r, s in ((8, 1), (3, 2))
    ] + [[]]
    weights = [0.7, -0.4, 0.5]
    deltas = [adapter_delta(f, (rows, cols), CPU, 0, rows, transposed) for f in adapters]
    method = task_vector_method(name, weights, 0.4, majority_sign=majority, normalize=normalize)
    ours = base + combined(method, adapters, (rows, cols), 1 << 11, transposed=transposed)
    theirs = mergekit_merge(
        base,
        [base + d for d in deltas],
        weights,
        0.4,
        consensus={"ties": ConsensusMethod.sum if majority == "total" else ConsensusMethod.count}.get(name),
        sparsify=SparsificationMethod.magnitude,
        normalize=normalize,
    )
    # MergeKit takes each delta back as (base + delta) - base: a last-bit difference, which may move an element
    # across the top-k threshold; those are bounded, the rest agree to float32 rounding
    far = (ours - theirs).abs() > 1e-6
    assert far.sum().item() <= 4
    assert torch.allclose(ours[~far], theirs[~far], rtol=0, atol=1e-7)
    assert (ours != base).float().mean().item() > 0.2  # the adapters changed the tensor


@pytest.mark.parametrize(
    "weights,normalize,warned",
    [((1.0, -0.99), True, True), ((1.0, -0.5), True, False), ((0.7, 0.3), True, False), ((1.0, -0.99), False, False)],
)
def test_weights_that_nearly_cancel_scale_the_deltas_as_far_as_the_warning_says(weights, normalize, warned):
    """The bound the warning quotes is what the maths (ours and MergeKit's) does: elements kept by both adapters
    reach it within a factor of 2, none exceeds it."""
    rows, cols = 64, 48
    adapters = [lora_factors(rows, cols, 4, s) for s in (1, 2)]
    deltas = [adapter_delta(f, (rows, cols), CPU, 0, rows, False) for f in adapters]
    method = task_vector_method("ties", list(weights), 1.0, normalize=normalize)
    out = combined(method, adapters, (rows, cols), 1 << 10)
    theirs = mergekit_merge(
        torch.zeros(rows, cols),
        deltas,
        list(weights),
        1.0,
        consensus=ConsensusMethod.sum,
        sparsify=SparsificationMethod.magnitude,
        normalize=normalize,
    )
    assert torch.allclose(out, theirs, rtol=1e-5, atol=1e-7)
    ratio = (out.abs() / torch.maximum(deltas[0].abs(), deltas[1].abs())).max().item()
    bound = method.scale_bound()
    assert ratio <= bound * (1 + 1e-4) and ratio >= bound / 2, (ratio, bound)
    notes = method.notes()
    assert bool(notes) == warned, notes
    if warned:
        assert notes == [
            f"weights 1, -0.99 nearly cancel: normalized, an element kept by adapters of opposite weights is divided "
            f"by the sum of their weights, which scales its delta up to {bound:.3g} times (MergeKit's maths does the "
            "same); pass normalize=False, or weights that do not cancel"
        ]


@pytest.mark.parametrize("name,kept", [("ties", "the 30% largest values"), ("dare_linear", "a random 30%")])
def test_one_adapter_under_a_task_vector_method_is_named_as_pruned(
    name, kept, tmp_path, make_base, make_adapter, caplog
):
    """One adapter: nothing to combine, only pruning; the plan warns and the report says so, and the output is
    the pruned delta indeed (fewer elements changed than by a plain merge)."""
    import logging

    from safetensors.torch import load_file

    from peft_shardmerge import merge_checkpoint

    base, adapter = make_base("llama"), make_adapter("llama", "default")
    with caplog.at_level(logging.WARNING, logger="peft_shardmerge"):
        report = merge_checkpoint(base, adapter, str(tmp_path / "v"), combination=name, density=0.3, progress=False)
    warned = [r.getMessage() for r in caplog.records if "of one adapter combines nothing" in r.getMessage()]
    assert len(warned) == 1 and kept in warned[0] and warned[0] not in report.notes, warned  # shown once
    merge_checkpoint(base, adapter, str(tmp_path / "plain"), progress=False)
    key = "model.layers.0.self_attn.q_proj.weight"
    before = load_file(os.path.join(base, "model.safetensors"))[key]
    pruned = (load_file(str(tmp_path / "v" / "model.safetensors"))[key] != before).float().mean().item()
    whole = (load_file(str(tmp_path / "plain" / "model.safetensors"))[key] != before).float().mean().item()
    assert pruned < 0.45 < whole, (pruned, whole)


@pytest.mark.parametrize(
    "config,named",
    [
        ({"lora_bias": True}, "lora_bias"),
        ({"trainable_token_indices": [1, 2]}, "trainable_token_indices"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"target_parameters": ["experts.w"]}, "target_parameters"),
        ({"peft_type": "LOHA"}, "peft_type LOHA"),
    ],
)
def test_a_task_vector_method_takes_plain_lora_deltas_only(config, named):
    from peft_shardmerge.support.combinations import combination_problems

    plain = {"peft_type": "LORA", "r": 8}
    for method in ("ties", "dare_linear"):
        _, problems = combination_problems([plain, {**plain, **config}], ["a", "b"], None, method)
        assert len(problems) == 1 and "the adapter b " in problems[0] and named in problems[0], problems
    _, dora = combination_problems([plain, {**plain, "use_dora": True}], ["a", "b"], None, "ties")
    assert "DoRA adapters cannot be weighted or combined" in dora[0]


def test_task_vector_parameters_are_checked_by_name():
    assert task_vector_problems("ties", 0.5, "total", None, 0) == []
    assert "needs a density" in task_vector_problems("dare_ties", None, "total", None, 0)[0]
    assert "(0, 1]" in task_vector_problems("ties", 1.5, "total", None, 0)[0]
    assert "too small for DARE" in task_vector_problems("dare_ties", 1e-300, "total", None, 0)[0]
    assert task_vector_problems("ties", 1e-300, "total", None, 0) == []  # k = 1: the largest element alone
    assert (
        "applies to the methods that elect a sign" in task_vector_problems("dare_linear", 0.5, "frequency", None, 0)[0]
    )
    assert "applies to DARE's random draw" in task_vector_problems("ties", 0.5, "total", None, 3)[0]
    problems = task_vector_problems("linear", 0.5, "frequency", True, 2)
    assert len(problems) == 4 and all("applies to the task-vector combinations" in p for p in problems)
    assert "must be one of total, frequency" in task_vector_problems("ties", 0.5, "sum", None, 0)[0]
