"""A merge's bytes do not depend on the row block, the memory budget or the path: the LoRA product is formed on a
tile grid fixed by the tensor's shape, never by the block being merged."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from peft_shardmerge import MergeOptions, merge_and_save, merge_checkpoint
from peft_shardmerge.engine import row_merge as row_merge_module
from peft_shardmerge.engine.maths import (
    NORM_TILE_ROWS,
    add_lora_,
    exact_factors,
    exact_prescale,
    merge_block,
    one_cpu_thread,
    row_norms,
    tile_rows,
)
from peft_shardmerge.testing import build_adapter, build_base
from tests.helpers import ROOT_DIR, folder_tensors

#: row blocks the same tensor is merged in; 1 and 7 rows take other BLAS kernels than a tile of 16 or more
STEPS = (1, 7, 64, 333, 10**9)


def _blocked(w: torch.Tensor, factors, step: int, transposed: bool) -> torch.Tensor:
    m = w.shape[0]
    return torch.cat(
        [
            merge_block(w[i : min(m, i + step)], factors, i, min(m, i + step), transposed=transposed)[0]
            for i in range(0, m, step)
        ]
    )


def check_blocks() -> list[str]:
    """Merge hand-made tensors in several row blocks; return what differed from the one-block merge."""
    torch.manual_seed(0)
    differ = []
    for m, n, r, transposed in [(1000, 4096, 16, False), (3000, 64, 8, False), (777, 300, 16, True)]:
        w = torch.randn(m, n)
        a, b = (torch.randn(r, m), torch.randn(n, r)) if transposed else (torch.randn(r, n), torch.randn(m, r))
        factors = [(a, b, 0.37), (a * 0.5, b, -1.25)]
        whole = merge_block(w, factors, 0, m, transposed=transposed)[0]
        differ += [f"{m}x{n} step {s}" for s in STEPS if not torch.equal(_blocked(w, factors, s, transposed), whole)]
    return differ


def test_the_tile_grid_follows_the_shape_alone():
    assert tile_rows(4096) == 64 and tile_rows(64) == 4096 and tile_rows(10**9) == 1


def test_row_blocks_give_the_same_bytes():
    assert check_blocks() == []


def test_the_lora_product_runs_on_one_cpu_thread_and_puts_the_pool_back():
    """The tile loop holds torch to one intra-op thread on the CPU (a tile's GEMM is too small to share) and puts the
    caller's count back, also when it fails; the bytes are those of a product computed with the caller's pool."""
    torch.manual_seed(0)
    w, a, b = torch.randn(300, 2048), torch.randn(16, 2048), torch.randn(300, 16)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        pooled = torch.mm(b[:32], a).mul_(0.5) + w[:32]
        merged = add_lora_(w.clone(), [(a, b, 0.5)], 0, 300, transposed=False)
        assert torch.get_num_threads() == 2
        assert torch.equal(merged[:32], pooled)  # the first tile, computed by the pool of two
        with pytest.raises(RuntimeError), one_cpu_thread(torch.device("cpu")):
            assert torch.get_num_threads() == 1
            torch.mm(a, a)  # shapes that do not fit
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_blocks_that_a_plain_matmul_would_round_differently_agree():
    """The construction matters: here a plain ``B @ A`` over the block differs from the whole, ours does not."""
    torch.manual_seed(0)
    b, a = torch.randn(1000, 16), torch.randn(16, 4096)
    plain = torch.cat([b[i : i + 7] @ a for i in range(0, 1000, 7)])
    if torch.equal(plain, b @ a):
        pytest.skip("this CPU's BLAS rounds a 7-row product as the 1000-row one: the test below cannot tell")
    w = torch.zeros(1000, 4096)
    assert torch.equal(
        _blocked(w, [(a, b, 1.0)], 7, False), merge_block(w, [(a, b, 1.0)], 0, 1000, transposed=False)[0]
    )


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal float32 bit for bit (``torch.equal`` takes ``-0.0`` for ``0.0``)."""
    return x.shape == y.shape and torch.equal(x.view(torch.int32), y.view(torch.int32))


def _peft_formula(w, factors, start, stop, transposed):
    """Rows ``[start, stop)`` of ``float32(W) + (B @ A) * scaling`` for each factor in turn, as PEFT writes it: the
    product on the tile grid, rounded, then scaled, then added (no moved scaling, no fused widening)."""
    out = w.to(torch.float32, copy=True)
    for a, b, scaling in factors:
        lhs, rhs = (a.T, b.T) if transposed else (b, a)
        rhs, step = rhs.contiguous(), tile_rows(rhs.shape[1])
        for t0 in range(start - start % step, stop, step):
            t1 = min(t0 + step, lhs.shape[0])
            delta = torch.mm(lhs[t0:t1].contiguous(), rhs) * scaling
            lo, hi = max(t0, start), min(t1, stop)
            out[lo - start : hi - start] += delta[lo - t0 : hi - t0]
    return out


@pytest.mark.parametrize("scaling", [1.0, 2.0, -4.0, 0.5, 2.0**-20, 0.37, -1.25])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_merged_rows_are_peft_formula_whatever_the_scaling_and_base_dtype(scaling, dtype):
    """Widening the base inside the tile loop and moving a power-of-two scaling onto A give the bytes of PEFT's
    formula, for whole tiles and for tiles cut by the block's edges, with two adapters on one weight."""
    g = torch.Generator().manual_seed(1)
    m, n = 700, 1024  # tiles of 256 rows: the blocks below start and stop inside tiles
    w = torch.randn(m, n, generator=g).to(dtype)
    f1 = (torch.randn(16, n, generator=g) * 0.02, torch.randn(m, 16, generator=g) * 0.02, scaling)
    f2 = (torch.randn(8, n, generator=g) * 0.05, torch.randn(m, 8, generator=g) * 0.05, 0.37)
    moved = scaling in (1.0, 2.0, 0.5, 2.0**-20)  # positive powers of two (negative ones stay: signed zeros)
    assert exact_prescale(f1[1], f1[0], scaling) is moved
    assert exact_factors([f1])[0][2] == (1.0 if moved else scaling)
    for start, stop in ((0, m), (100, 600), (300, 301)):
        want = _peft_formula(w[start:stop], [f1, f2], start, stop, False)
        got = merge_block(w[start:stop], exact_factors([f1, f2]), start, stop, transposed=False)[0]
        assert _same_bits(got, want), (start, stop)
        widened = add_lora_(
            w[start:stop].to(torch.float32, copy=True), exact_factors([f1]), start, stop, transposed=False
        )
        assert _same_bits(widened, _peft_formula(w[start:stop], [f1], start, stop, False))
    # Conv1D: the stored weight [300, 700] is (B @ A).T, its rows come from columns of A
    t = (torch.randn(16, 300, generator=g) * 0.02, torch.randn(700, 16, generator=g) * 0.02, scaling)
    wt = torch.randn(300, 700, generator=g).to(dtype)
    assert _same_bits(
        merge_block(wt[50:250], exact_factors([t]), 50, 250, transposed=True)[0],
        _peft_formula(wt[50:250], [t], 50, 250, True),
    )


def test_the_scaling_stays_on_the_product_where_moving_it_would_round_differently():
    """Products among float32's subnormals round on a coarser grid: scaling A by 4 first would change their bytes.
    Such factors keep the scaling on the product, as do an A whose scaled values would leave the normal range, sums
    that could overflow when scaled first, and every negative scaling (an exact zero delta is ``+0`` when A is scaled
    and ``-0`` when the product is, and ``-0.0 + -0`` keeps the sign ``-0.0 + +0`` loses)."""
    g = torch.Generator().manual_seed(2)
    a = torch.randn(16, 512, generator=g) * 2.0**-70
    b = torch.randn(64, 16, generator=g) * 2.0**-70  # products near 2**-140, among the subnormals
    assert not torch.equal(torch.mm(b, a * 4.0), torch.mm(b, a) * 4.0)  # what moving the scaling would do here
    assert not exact_prescale(b, a, 4.0)
    assert not exact_prescale(b * 2.0**140, a * 2.0**140, 4.0)  # sums near 2**142: beyond the upper bound
    w = torch.zeros(64, 512)
    assert _same_bits(
        merge_block(w, exact_factors([(a, b, 4.0)]), 0, 64, transposed=False)[0],
        _peft_formula(w, [(a, b, 4.0)], 0, 64, False),
    )
    ones = torch.ones(16, 512)
    assert not exact_prescale(torch.full((64, 16), 2.0**40), ones * 1.5 * 2.0**-120, 2.0**-10)  # A * s subnormal
    assert not exact_prescale(torch.full((64, 16), 2.0**-100), ones * 2.0**127, 4.0)  # A * s overflows

    a, b = torch.randn(16, 512, generator=g), torch.randn(64, 16, generator=g)
    b[2] = 0.0  # an exactly zero delta row
    w = torch.randn(64, 512, generator=g).to(torch.bfloat16)
    w[2] = -0.0
    moved = torch.mm(b, a * -2.0) + w.float()  # what moving a negative scaling would write
    want = _peft_formula(w, [(a, b, -2.0)], 0, 64, False)
    assert not _same_bits(moved, want) and torch.equal(moved, want)  # only the signs of the zeros differ
    assert not exact_prescale(b, a, -2.0) and exact_factors([(a, b, -2.0)])[0][2] == -2.0
    assert _same_bits(merge_block(w, exact_factors([(a, b, -2.0)]), 0, 64, transposed=False)[0], want)


@pytest.mark.slow
@pytest.mark.parametrize("capability", ["default", "avx2"])
def test_row_blocks_give_the_same_bytes_on_each_cpu_capability(capability):
    env = dict(os.environ)
    if capability != "default":
        env["ATEN_CPU_CAPABILITY"] = capability  # torch's own kernels
        env["MKL_ENABLE_INSTRUCTIONS"] = capability.upper()  # and the BLAS's
    code = (
        "import sys, torch; from tests.unit.engine.test_row_blocks import check_blocks; "
        "print(torch.backends.cpu.get_cpu_capability()); d = check_blocks(); print(d); sys.exit(1 if d else 0)"
    )
    root = ROOT_DIR
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    if capability != "default":
        assert done.stdout.splitlines()[0].lower() == capability, done.stdout


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A llama whose MLP and vocabulary span several tiles, and an adapter on every linear layer and the head."""
    root = tmp_path_factory.mktemp("wide")
    base = build_base(str(root / "base"), "llama", intermediate_size=1024, vocab_size=1024)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    adapter = build_adapter(base, str(root / "adapter"), target_modules=targets, r=16, lora_alpha=8)
    return base, adapter


def _loaded(base: str, adapter: str):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_disk_and_in_process_merges_agree_whatever_the_row_block(wide, tmp_path, dtype):
    base, adapter = wide
    outs = {}
    for chunk in (1000, 50_000, 1 << 22):
        opts = MergeOptions(dtype=dtype, chunk_elems=chunk, progress=False)
        merge_checkpoint(base, adapter, str(tmp_path / f"disk-{chunk}"), options=opts)
        outs[f"disk-{chunk}"] = folder_tensors(str(tmp_path / f"disk-{chunk}"))
    model = _loaded(base, adapter)
    for chunk, budget in ((1000, 0.5), (1 << 22, 0.9)):
        opts = MergeOptions(
            dtype=dtype, chunk_elems=chunk, maximum_memory_usage=budget, progress=False, base_precision="dequantized"
        )
        merge_and_save(model, str(tmp_path / f"live-{chunk}"), options=opts)
        outs[f"live-{chunk}"] = folder_tensors(str(tmp_path / f"live-{chunk}"))
    first, *others = outs
    ref = outs[first]
    assert any(v.numel() > 2 * 16 * 128 for v in ref.values())  # some tensor spans several tiles
    for other in others:
        assert outs[other].keys() == ref.keys()
        differ = [k for k in ref if not torch.equal(ref[k], outs[other][k])]
        assert differ == [], f"{other} differs from {first} in {differ}"


def test_dora_column_norms_do_not_follow_the_row_block(tmp_path, monkeypatch):
    """DoRA on GPT-2's Conv1D: the column norms of a tensor too big to merge whole are summed tile by tile."""
    base = build_base(str(tmp_path / "base"), "gpt2")
    adapter = build_adapter(base, str(tmp_path / "adapter"), use_dora=True, fan_in_fan_out=True)
    monkeypatch.setattr(row_merge_module, "WHOLE_NORM_ELEMS", 0)  # every tensor takes the tiled norm
    outs = []
    for chunk in (1000, 1 << 22):
        out = str(tmp_path / f"out-{chunk}")
        merge_checkpoint(base, adapter, out, options=MergeOptions(dtype="float32", chunk_elems=chunk, progress=False))
        outs.append(folder_tensors(out))
    assert [k for k in outs[0] if not torch.equal(outs[0][k], outs[1][k])] == []


@pytest.mark.parametrize("width", [3, 96, 4096, 14336, 1 << 15])
def test_row_norms_on_the_tile_grid_are_each_rows_norm(width):
    """The tiled norms (off the CPU) take each row in a zero-padded tile of the fixed grid: every row's own norm,
    wherever the block starts and ends (on the CPU torch's row norms do not depend on the block, so they must be
    equal here, bit for bit)."""
    step = max(NORM_TILE_ROWS, tile_rows(width))
    rows = 3 * step + 5
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(width))
    want = torch.linalg.norm(x, dim=1)
    for start, stop in [(0, rows), (1, step + 1), (step - 1, 2 * step + 3), (rows - 2, rows), (step, 2 * step)]:
        got = row_norms(x[start:stop], start, tiled=True)
        assert got.shape == (stop - start,) and torch.equal(got, want[start:stop]), (start, stop)


@pytest.mark.parametrize(
    ("base_dtype", "out_dtype"),
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)],
)
def test_update_counts_equal_the_definition_with_masks(base_dtype, out_dtype):
    """The precision report's counts, taken from sums of |sign| of differences, equal the definition written with
    comparisons: changed = merged != base, lost = changed and cast(merged) == cast(base); signed zeros, updates far
    below and far above the output dtype's step, and untouched entries included."""
    from peft_shardmerge.engine.block_checks import update_counts

    g = torch.Generator().manual_seed(0)
    base = (torch.randn(32, 512, generator=g) * 4).to(base_dtype)
    base[0, :4] = torch.tensor([0.0, -0.0, 0.0, -0.0], dtype=base_dtype)
    scale = torch.logspace(-9, 0, 512).repeat(32, 1)  # tiny updates vanish in 16 bits, large ones do not
    merged = base.float() + torch.randn(32, 512, generator=g) * scale
    merged[1] = base[1].float()  # a row the adapter left as it was
    merged[0, :4] = torch.tensor([-0.0, 0.0, 0.0, 1e-30])  # signed zeros are equal; 1e-30 is a change
    cast = merged.to(out_dtype)
    changed = merged != base.float()
    lost = changed & (cast == base.to(out_dtype))
    assert update_counts(base, merged, cast) == (int(changed.sum()), int(lost.sum()))
    assert 0 < int(lost.sum()) < int(changed.sum())


def test_a_wide_block_samples_fewer_rows_and_its_self_check_still_catches_a_wrong_merge(monkeypatch):
    """The checks look at about PROBE_ELEMS elements of a block (32 rows up to a width of 4096, 9 rows of a
    292-row block at an 8B MLP's width 14336): a doubled scaling is still caught there."""
    from peft_shardmerge.engine import maths
    from peft_shardmerge.engine.block_checks import PROBE_TOLERANCE, probe_rows, probe_vectors

    assert len(probe_rows(292, width=14336)) == 9 and len(probe_rows(292, width=4096)) == 32
    assert len(probe_rows(292, width=10**7)) == 2 and len(probe_rows(5, width=14336)) == 5
    g = torch.Generator().manual_seed(3)
    w = torch.randn(292, 14336, generator=g)
    a, b = torch.randn(16, 14336, generator=g) * 0.02, torch.randn(292, 16, generator=g) * 0.02
    probes = probe_vectors("w", 14336)
    assert maths.add_lora_checked_(w.clone(), [(a, b, 2.0)], 0, 292, transposed=False, probes=probes) < 1e-5
    real = maths.add_lora_

    def doubled(rows32, factors, start, stop, *, transposed, base=None):
        return real(rows32, [(x, y, 2 * s) for x, y, s in factors], start, stop, transposed=transposed, base=base)

    from peft_shardmerge.engine.changes import Changes
    from peft_shardmerge.engine.row_merge import RowMerger

    merger = RowMerger(chunk_elems=292 * 14336)  # one block of 292 rows, as an 8B down_proj's
    base = w.to(torch.bfloat16)
    changes = Changes(factors=[(a, b, 2.0)], keys=["q"])
    for _ in merger.merge_rows("w", lambda i, j: base[i:j], changes, (292, 14336), torch.bfloat16, w.device):
        pass
    assert 0 < merger.counts.swallowed["w"][0] <= 9 * 14336  # the precision report counted 9 rows of it, not 32
    monkeypatch.setattr(maths, "add_lora_", doubled)
    wrong = maths.add_lora_checked_(w.clone(), [(a, b, 2.0)], 0, 292, transposed=False, probes=probes)
    assert wrong > PROBE_TOLERANCE
