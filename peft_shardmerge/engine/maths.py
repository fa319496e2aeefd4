"""The merge maths: pure functions from tensors to tensors (no I/O, no logging)."""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch

from .block_checks import lora_probe, probe_rows

#: one LoRA module's contribution: (A [r, n], B [m, r], scaling)
Factors = tuple[torch.Tensor, torch.Tensor, float]


def merge_block(
    base_rows: torch.Tensor,
    factors: Sequence[Factors],
    start: int,
    stop: int,
    *,
    transposed: bool,
    bias_deltas: Sequence[torch.Tensor] = (),
    probes: torch.Tensor | None = None,
    inplace: bool = False,
) -> tuple[torch.Tensor, float]:
    """Rows ``[start, stop)`` of ``W + sum(scaling * B @ A)`` in fp32, computed in place on a fp32 copy (or on
    ``base_rows`` itself, with ``inplace`` and float32 rows), and the self-check's error on them.

    For a weight stored ``[out, in]`` the rows come from rows of B; for one stored ``[in, out]`` (Conv1D with
    ``fan_in_fan_out``) or an embedding (``lora_embedding_A`` is ``[r, num_embeddings]``) they come from
    columns of A. Only one block's worth of memory is used, so a huge tensor can be merged in pieces.

    Args:
        base_rows: rows ``[start, stop)`` of the base weight, any float dtype (not modified unless ``inplace``).
        factors: ``(A, B, scaling)`` of each LoRA module adding to this weight.
        start: first row.
        stop: one past the last row.
        transposed: the stored weight is the transpose of ``B @ A``.
        bias_deltas: whole fp32 deltas to add to a 1-D tensor (``lora_B.bias * scaling``); rows are taken.
        probes: float32 vectors ``[columns, k]``; when given, the merged rows are checked against the unmerged
            computation, ``(W + dW) @ x`` vs ``W @ x + lora(x)``, on the evenly spaced rows of
            :func:`~peft_shardmerge.engine.block_checks.probe_rows` (enough to catch a wrong scaling, layout or
            factor; cheap next to the merge).
        inplace: float32 ``base_rows`` are a copy the merge may overwrite (no second copy is made).

    Returns:
        ``(rows, error)``: a new float32 tensor shaped like ``base_rows`` (``base_rows`` itself with ``inplace`` and
        float32 rows), and the relative error ``max |(W + dW) x - (W x + lora(x))| / max |W x + lora(x)|`` of the
        self-check (0.0 without ``probes``: nothing was checked).

    Raises:
        RuntimeError: from torch, when the shapes do not fit.

    Example:
        >>> w = torch.zeros(4, 3)
        >>> a, b = torch.ones(1, 3), torch.arange(4.0).reshape(4, 1)
        >>> merge_block(w[2:], [(a, b, 1.0)], 2, 4, transposed=False)
        (tensor([[2., 2., 2.],
                [3., 3., 3.]]), 0.0)
        >>> merge_block(w[2:], [(a, b, 1.0)], 2, 4, transposed=False, probes=torch.ones(3, 1))[1] < 1e-6
        True
    """
    if inplace and base_rows.dtype == torch.float32:
        out, base = base_rows, None
    else:  # widened tile by tile as the first delta is added (one pass over the block, not two)
        out, base = torch.empty(base_rows.shape, dtype=torch.float32, device=base_rows.device), base_rows
    err = add_lora_checked_(out, factors, start, stop, transposed=transposed, probes=probes, base=base)
    for d in bias_deltas:
        out += d[start:stop].to(out.device)
    return out, err


def add_lora_checked_(
    rows32: torch.Tensor,
    factors: Sequence[Factors],
    start: int,
    stop: int,
    *,
    transposed: bool,
    probes: torch.Tensor | None,
    base: torch.Tensor | None = None,
) -> float:
    """:func:`add_lora_` with the self-check: on the rows of :func:`~peft_shardmerge.engine.block_checks.probe_rows`,
    ``(W + dW) @ x`` is compared with ``W @ x + lora(x)`` computed from the factors without forming ``B @ A``.

    Args:
        rows32, factors, start, stop, transposed, base: as for :func:`add_lora_` (``rows32`` is written in place).
        probes: float32 probe vectors ``[columns, k]``, or None to skip the check.

    Returns:
        The relative error ``max |(W + dW) x - (W x + lora(x))| / max |W x + lora(x)|`` (0.0 without probes).

    Raises:
        RuntimeError: from torch, when the shapes do not fit.

    Example:
        >>> w = torch.eye(2)
        >>> add_lora_checked_(w, [(torch.ones(1, 2), torch.ones(2, 1), 1.0)], 0, 2, transposed=False,
        ...                   probes=torch.ones(2, 1)) < 1e-6
        True
    """
    if probes is None or not factors:
        add_lora_(rows32, factors, start, stop, transposed=transposed, base=base)
        return 0.0
    probes = probes.to(rows32.device, torch.float32)
    rows = probe_rows(rows32.shape[0], rows32.device, probes.shape[0])
    want = (rows32 if base is None else base).index_select(0, rows).to(torch.float32) @ probes
    want += lora_probe(probes, factors, start, stop, transposed=transposed, rows=rows)
    add_lora_(rows32, factors, start, stop, transposed=transposed, base=base)
    got = rows32.index_select(0, rows) @ probes
    return float(got.sub_(want).abs_().max() / want.abs_().max().clamp_min(1e-30))


#: rows of a LoRA product are computed in tiles of about this many elements, on a grid fixed by the tensor's shape
TILE_ELEMS = 1 << 18


def tile_rows(width: int) -> int:
    """Rows per tile of a tensor whose rows hold ``width`` elements: a function of the shape alone.

    BLAS picks its kernel, and with it the order of each sum, by the matrix's shape: a row of ``B @ A`` computed in
    a 7-row call can differ by an ulp from the same row computed in a 1000-row call. Computing every product on
    the same grid of tiles, whatever the row block, makes the merged bytes independent of ``chunk_elems``, the
    memory budget and the rank count.

    Args:
        width: elements per row.

    Returns:
        The tile height (at least 1).

    Example:
        >>> tile_rows(4096), tile_rows(1 << 20)
        (64, 1)
    """
    return max(1, TILE_ELEMS // max(1, width))


def add_lora_(
    rows32: torch.Tensor,
    factors: Sequence[Factors],
    start: int,
    stop: int,
    *,
    transposed: bool,
    base: torch.Tensor | None = None,
) -> torch.Tensor:
    """Add the LoRA deltas of rows ``[start, stop)`` to a float32 tensor in place, as PEFT does:
    ``W + (B @ A) * scaling``, the product rounded to fp32, then scaled, then added.

    Each product is formed on the fixed tile grid of :func:`tile_rows` from fresh contiguous operands; a tile
    cut by the block's edge is computed whole and the needed rows kept. Only one tile's delta is allocated.
    Factors from :func:`exact_factors` carry a scaling of 1 where it could be moved onto ``A``: one pass less.

    Args:
        rows32: float32 rows ``[start, stop)`` of the weight; modified in place.
        factors: ``(A, B, scaling)`` of each LoRA module.
        start: first row.
        stop: one past the last row.
        transposed: the stored weight is the transpose of ``B @ A``.
        base: the weight's rows in any float dtype, when ``rows32`` does not hold them yet: ``rows32`` is then
            written as ``base`` widened to float32 plus the first delta, tile by tile (the same values as
            widening first and adding after, in one pass), or as ``base`` widened where there is no factor.

    Returns:
        ``rows32``.

    Example:
        >>> add_lora_(torch.zeros(2, 3), [(torch.ones(1, 3), torch.ones(2, 1), 2.0)], 0, 2, transposed=False)
        tensor([[2., 2., 2.],
                [2., 2., 2.]])
        >>> add_lora_(torch.empty(1, 2), [(torch.ones(1, 2), torch.ones(1, 1), 0.5)], 0, 1, transposed=False,
        ...           base=torch.ones(1, 2, dtype=torch.bfloat16))
        tensor([[1.5000, 1.5000]])
    """
    if stop <= start:
        return rows32
    if not factors:
        if base is not None:
            rows32.copy_(base)
        return rows32
    with one_cpu_thread(rows32.device):
        return _add_tiles_(rows32, factors, start, stop, transposed, base)


@contextmanager
def one_cpu_thread(device: torch.device) -> Iterator[None]:
    """On the CPU, torch's intra-op threads (a setting of the whole process) held to one while the block runs, then
    put back.

    Where it is used: the LoRA tile products (a tile's GEMM is a few rows by a rank of 16, each thread of a pool
    would get a sliver of it; the bytes are the pool's, tests/unit/engine/test_row_blocks.py); the reductions of a
    4-bit round trip and PEFT's layer deltas (a long sum split over a pool rounds by the pool's size: one thread makes
    the bytes the same whatever the workers); and the whole run of a merge's worker threads
    (:func:`~peft_shardmerge.engine.pipeline.worker_pool`), where each op runs in its worker's thread.

    Args:
        device: where the block runs; on an accelerator nothing changes.

    Example:
        >>> with one_cpu_thread(torch.device("cpu")):
        ...     torch.get_num_threads()
        1
    """
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _add_tiles_(rows32: torch.Tensor, factors: Sequence[Factors], start: int, stop: int, transposed: bool, base):
    # a fresh tensor's alignment (torch's CPU allocator: 64 bytes; CUDA's caching allocator: 512): a tile's product
    # is written in place only where its rows start on it, since BLAS may pick its kernel, and so its rounding, by it
    align = 64 if rows32.device.type == "cpu" else 512
    for a, b, scaling in factors:
        a32 = a.to(device=rows32.device, dtype=torch.float32)
        b32 = b.to(device=rows32.device, dtype=torch.float32)
        # lhs: one row per output row ([rows, r]); rhs: [r, columns], the same for every tile
        lhs, rhs = (a32.T, b32.T) if transposed else (b32, a32)
        rhs = rhs.clone(memory_format=torch.contiguous_format)
        total, step = lhs.shape[0], tile_rows(rhs.shape[1])
        for t0 in range(start - start % step, stop, step):
            t1 = min(t0 + step, total)
            lo, hi = max(t0, start), min(t1, stop)
            part = rows32[lo - start : hi - start]
            tile = lhs[t0:t1].clone(memory_format=torch.contiguous_format)
            if base is not None and (lo, hi) == (t0, t1) and part.data_ptr() % align == 0:
                torch.mm(tile, rhs, out=part)  # a whole tile: its product written straight into the rows
                if scaling != 1.0:
                    part.mul_(scaling)
                part += base[lo - start : hi - start]  # d + float32(w): the same sum as w + d
                continue
            delta = torch.mm(tile, rhs)
            if scaling != 1.0:
                delta.mul_(scaling)
            if base is None:
                part += delta[lo - t0 : hi - t0]
            else:
                torch.add(base[lo - start : hi - start], delta[lo - t0 : hi - t0], out=part)
        base = None
    return rows32


#: a product of two nonzero operands at least this large (in magnitude) has its exact value on float32's finest
#: grid, so no rounding happens among the subnormals; sums at most this large (the other bound) never overflow
_PRESCALE_LOW, _PRESCALE_HIGH = 2.0**-100, 2.0**100


def exact_factors(factors: Sequence[Factors]) -> list[Factors]:
    """The factors with each scaling moved onto ``A`` (as float32) where :func:`exact_prescale` shows that this gives
    the same bytes: the tile loop then adds each product as it comes, without a pass to scale it.

    Args:
        factors: ``(A, B, scaling)`` of each LoRA module.

    Returns:
        ``(A * scaling, B, 1.0)`` where exact, the factor itself elsewhere.

    Example:
        >>> a, b = torch.ones(1, 2), torch.ones(2, 1)
        >>> [s for _, _, s in exact_factors([(a, b, 2.0), (a, b, 0.3)])]
        [1.0, 0.3]
    """
    out = []
    for a, b, scaling in factors:
        if scaling != 1.0 and exact_prescale(b, a, scaling):
            out.append((a.to(torch.float32) * scaling, b, 1.0))
        else:
            out.append((a, b, scaling))
    return out


def exact_prescale(lhs: torch.Tensor, rhs: torch.Tensor, scaling: float) -> bool:
    """Whether ``lhs @ (rhs * scaling)`` has the same float32 bytes as ``(lhs @ rhs) * scaling`` for these operands.

    Scaling by a positive power of two is exact in float32 unless a value leaves the normal range, and then it
    commutes with every rounding of the product's sums. The operands are checked for that: ``rhs * scaling`` itself
    exact (its nonzero entries stay at least ``2**-126`` and below ``2**127``); every product of a nonzero ``lhs`` and
    ``rhs`` entry, scaled or not, at least ``2**-100`` (the exact values of products and partial sums then lie on a
    grid of ``2**-148``, which float32's subnormals hold without rounding); and every sum, scaled or not, at most
    ``2**100`` (no overflow, even partway). A negative scaling is never moved: a sum that is exactly zero is ``+0``
    either way, which a negative scaling applied after turns into ``-0``, and ``-0.0 + -0`` keeps the sign a
    ``+0`` would lose. (Subnormals are assumed kept, as torch does by default; with ``torch.set_flush_denormal(True)``
    a sum cancelling into them could be flushed in one order and not the other.)

    Args:
        lhs: ``[rows, r]``, any float dtype (the product is taken in float32).
        rhs: ``[r, columns]``, likewise.
        scaling: the factor.

    Returns:
        True when the scaling may be moved onto ``rhs``.

    Example:
        >>> a, b = torch.ones(2, 3), torch.ones(4, 2)
        >>> exact_prescale(b, a, 2.0), exact_prescale(b, a, 0.3), exact_prescale(b, a, -2.0)
        (True, False, False)
        >>> exact_prescale(b * 1e-30, a * 1e-30, 2.0)
        False
    """
    if scaling == 1.0:
        return True
    if not (math.isfinite(scaling) and scaling > 0.0 and math.frexp(scaling)[0] == 0.5):
        return False
    if lhs.numel() == 0 or rhs.numel() == 0:
        return True  # no product to round
    ends = []  # largest and smallest nonzero magnitude of each, read back at once (one wait on an accelerator)
    for t in (lhs, rhs):
        mags = t.abs().float()
        ends += [mags.amax(), torch.where(mags > 0, mags, torch.inf).amin()]
    high_l, low_l, high_r, low_r = torch.stack(ends).tolist()
    if low_r * min(1.0, scaling) < 2.0**-126 or high_r * max(1.0, scaling) >= 2.0**127:
        return False  # rhs * scaling would round (among the subnormals) or overflow
    lowest = low_l * low_r * min(1.0, scaling)
    highest = high_l * high_r * lhs.shape[1] * max(1.0, scaling)
    return lowest >= _PRESCALE_LOW and highest <= _PRESCALE_HIGH


def lora_bias_delta(bias_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """The change a ``lora_bias=True`` adapter makes to the base bias: ``lora_B.bias * scaling`` in fp32.

    Args:
        bias_b: the ``lora_B.bias`` tensor.
        scaling: the module's LoRA scaling.

    Returns:
        The fp32 bias delta.

    Raises:
        RuntimeError: from torch, when the shapes do not fit.

    Example:
        >>> lora_bias_delta(torch.ones(2), 2.0)
        tensor([2., 2.])
    """
    return bias_b.to(torch.float32) * scaling


def dora_rescale_(merged_rows: torch.Tensor, magnitude: torch.Tensor, start: int = 0) -> torch.Tensor:
    """DoRA's merge of full rows of a Linear weight, in place: ``m * (W + dW) / ||W + dW||`` with the L2 norm of
    each output row, as PEFT's ``DoraLinearLayer`` computes it (the norms by :func:`row_norms`).

    Args:
        merged_rows: float32 rows ``[start, start + n)`` of ``W + dW`` (whole rows: the norm is per row); modified
            in place.
        magnitude: the matching entries of ``lora_magnitude_vector``.
        start: the first row's index in the weight.

    Returns:
        ``merged_rows``.

    Raises:
        RuntimeError: from torch, when the shapes do not fit.

    Example:
        >>> dora_rescale_(torch.tensor([[3.0, 4.0]]), torch.tensor([10.0]))
        tensor([[6., 8.]])
    """
    norm = row_norms(merged_rows, start)
    merged_rows *= (magnitude.to(merged_rows.device, torch.float32) / norm).unsqueeze(1)
    return merged_rows


#: rows of a tile of row norms at least: torch's CUDA reduction sizes its thread blocks by the number of rows while
#: there are few (Reduce.cuh), so a tile of a very wide tensor is not left at a handful of rows, laid out unlike the
#: whole weight PEFT takes DoRA's norms of
NORM_TILE_ROWS = 16


def row_norms(rows: torch.Tensor, start: int = 0, *, tiled: bool | None = None) -> torch.Tensor:
    """The L2 norm of each row of a 2-D block whose first row is row ``start`` of its tensor, the same whatever the
    block. On the CPU torch reduces each row alike however many rows it is given; on an accelerator the reduction's
    layout (threads per row, blocks per row) follows the number of rows, so there each norm is taken in a fresh,
    zero-padded tile of :func:`tile_rows` rows (at least :data:`NORM_TILE_ROWS`) on a grid fixed by the tensor's
    shape: always the same shape.

    Args:
        rows: float32 ``[n, width]``.
        start: the first row's index in the tensor.
        tiled: take the norms tile by tile (default: off the CPU).

    Returns:
        float32 ``[n]`` on ``rows``' device.

    Example:
        >>> x = torch.arange(12.0).reshape(6, 2)
        >>> torch.equal(row_norms(x[1:], 1, tiled=True), torch.linalg.norm(x[1:], dim=1))
        True
    """
    if not (rows.device.type != "cpu" if tiled is None else tiled):
        return torch.linalg.norm(rows, dim=1)
    n, width = rows.shape
    step = max(NORM_TILE_ROWS, tile_rows(width))
    out = torch.empty(n, dtype=torch.float32, device=rows.device)
    tile = torch.empty(step, width, dtype=torch.float32, device=rows.device)  # zeroed for each tile
    for t0 in range(start - start % step, start + n, step):
        lo, hi = max(t0, start), min(t0 + step, start + n)
        tile.zero_()
        tile[lo - t0 : hi - t0] = rows[lo - start : hi - start]
        out[lo - start : hi - start] = torch.linalg.norm(tile, dim=1)[lo - t0 : hi - t0]
    return out


def linear_factors(factors: Sequence[Factors]) -> Factors:
    """PEFT's ``add_weighted_adapter(combination_type="linear")`` factors: ``A = sum_i sign_i sqrt(|s_i|) A_i``,
    ``B = sum_i sqrt(|s_i|) B_i`` with scaling 1, where ``s_i`` is each adapter's weight times its scaling. The
    product includes the cross terms ``B_i @ A_j``; the ranks must be equal.

    Args:
        factors: ``(A, B, weight * scaling)`` of each adapter on one module.

    Returns:
        ``(A, B, 1.0)`` in float32.

    Raises:
        RuntimeError: from torch, when the ranks or shapes differ.

    Example:
        >>> a, b, s = linear_factors([(torch.ones(1, 2), torch.ones(2, 1), 4.0)])
        >>> (b @ a * s).tolist()
        [[4.0, 4.0], [4.0, 4.0]]
    """
    import math

    a_sum = b_sum = None
    for a, b, s in factors:
        root = math.sqrt(abs(s))
        a32, b32 = a.to(torch.float32) * math.copysign(root, s), b.to(torch.float32) * root
        a_sum, b_sum = (a32, b32) if a_sum is None else (a_sum + a32, b_sum + b32)
    return a_sum, b_sum, 1.0


def replace_rows_(
    rows: torch.Tensor, index: torch.Tensor, new_rows: torch.Tensor, start: int, stop: int
) -> torch.Tensor:
    """Trainable tokens' merge on rows ``[start, stop)`` of a weight, in place: row ``index[j]`` becomes
    ``new_rows[j]`` (PEFT's ``TrainableTokensLayer.merge``, an ``index_copy``).

    Args:
        rows: rows ``[start, stop)`` of the weight; modified in place.
        index: token ids (int64), one per row of ``new_rows``.
        new_rows: the trained rows.
        start: first row of the block.
        stop: one past the last row.

    Returns:
        ``rows``.

    Raises:
        RuntimeError: from torch, when the widths differ.

    Example:
        >>> replace_rows_(torch.zeros(2, 2), torch.tensor([3, 0]), torch.ones(2, 2), 0, 2)
        tensor([[1., 1.],
                [0., 0.]])
    """
    inside = (index >= start) & (index < stop)
    if bool(inside.any()):
        rows[(index[inside] - start).to(rows.device)] = new_rows[inside].to(rows.device, rows.dtype)
    return rows


def ia3_multiplier(
    vec: torch.Tensor, shape: tuple[int, ...], *, feedforward: bool, fan_in_fan_out: bool = False, bias: bool = False
) -> tuple[torch.Tensor, bool]:
    """IA3's merge as a multiplier of the weight's rows (flattened to ``[rows, -1]``), as PEFT's ``merge`` scales
    it: a non-feedforward layer scales its outputs (and its bias), a feedforward one its inputs.

    Args:
        vec: ``ia3_l`` (any shape holding one value per output or input).
        shape: the stored tensor's shape (``[out, in]``; ``[in, out]`` with ``fan_in_fan_out``;
            ``[out, in, *kernel]`` for a convolution; ``[out]`` for a bias).
        feedforward: the layer is one of the config's ``feedforward_modules``.
        fan_in_fan_out: the weight is stored ``[in, out]`` (GPT-2 Conv1D).
        bias: ``shape`` is the bias.

    Returns:
        ``(multiplier, per_row)``: when ``per_row`` the multiplier is ``[rows, 1]`` (or ``[rows]`` for a bias) and
        is sliced with the row block; otherwise it is ``[1, columns]`` and applies to every block whole.

    Raises:
        RuntimeError: from torch, when the sizes do not fit.

    Example:
        >>> ia3_multiplier(torch.tensor([[2.0], [3.0]]), (2, 4), feedforward=False)[0].tolist()
        [[2.0], [3.0]]
    """
    v = vec.reshape(-1).to(torch.float32)
    if bias:
        return v, True
    if len(shape) > 2:  # a convolution: rows are output channels, columns in-channel major then kernel
        kernel = math.prod(shape[2:])
        return (v.reshape(-1, 1), True) if not feedforward else (v.repeat_interleave(kernel).reshape(1, -1), False)
    along_rows = (not feedforward) != fan_in_fan_out
    return (v.reshape(-1, 1), True) if along_rows else (v.reshape(1, -1), False)
