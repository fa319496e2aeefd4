"""The checks of a merged row block: the self-check (the merged rows against the unmerged LoRA branch on probe
vectors), the output dtype's range, and the precision report's counts of updates the output dtype rounded away."""

from __future__ import annotations

import functools
import zlib
from typing import Sequence

import torch

from ..errors import MergeCheckError

#: probe vectors per merged weight, and the largest relative error the self-check accepts
PROBES = 2

PROBE_TOLERANCE = 1e-3


def probe_vectors(name: str, columns: int) -> torch.Tensor:
    """Reproducible random probe vectors for the self-check of one tensor (seeded by its name).

    Args:
        name: the tensor's name.
        columns: its number of columns (the length of each vector).

    Returns:
        A float32 tensor ``[columns, PROBES]``.

    Example:
        >>> probe_vectors("w", 3).shape
        torch.Size([3, 2])
    """
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    # held as [PROBES, columns]: a product with the transposed view is BLAS's fast case (a few columns held
    # row-major are its slow one)
    return torch.randn(PROBES, columns, generator=g).T


def check_probe_error(name: str, start: int, stop: int, err: float) -> None:
    """Fail the self-check of rows ``[start, stop)`` of tensor ``name`` when the probe error is over
    :data:`PROBE_TOLERANCE`.

    Args:
        name: the tensor.
        start: first row of the block.
        stop: one past the last row.
        err: the relative error from :func:`~peft_shardmerge.engine.maths.add_lora_checked_`.

    Returns:
        None.

    Raises:
        MergeCheckError: the error is over the tolerance, or not a number.

    Example:
        >>> check_probe_error("w", 0, 4, 1e-7)
        >>> check_probe_error("w", 0, 4, float("nan"))
        Traceback (most recent call last):
        peft_shardmerge.errors.MergeCheckError: self-check failed for 'w' rows 0-4: merged weight times probe vectors differs from base + LoRA by nan (relative) > 0.001
    """  # noqa: E501 - a doctest's expected exception is one line
    if not err <= PROBE_TOLERANCE:  # also a NaN error, which no comparison with ">" would catch
        raise MergeCheckError(
            f"self-check failed for {name!r} rows {start}-{stop}: merged weight times probe vectors differs from "
            f"base + LoRA by {err:.2e} (relative) > {PROBE_TOLERANCE:g}"
        )


def check_range(name: str, cast: torch.Tensor, dtype: torch.dtype) -> None:
    """float16 tops out at 65504: a larger value would be written as inf.

    Args:
        name: the tensor.
        cast: rows of it in the output dtype.
        dtype: the output dtype.

    Returns:
        None.

    Raises:
        MergeCheckError: a float16 output holds an infinity.

    Example:
        >>> check_range("w", torch.tensor([1.0]).half(), torch.float16)
    """
    if dtype == torch.float16 and bool(cast.isinf().any()):
        raise MergeCheckError(f"{name!r} has values beyond float16's range (65504); write bfloat16 or float32")


#: rows of a block checked by the self-check and counted by the precision report: at most PROBE_ROWS, and in wide
#: blocks as many as hold about PROBE_ELEMS elements (at least 2), so that the checks cost the same share of every
#: block (32 rows up to a width of 4096; 9 at an 8B MLP's 14336, whose blocks have 292 rows)
PROBE_ROWS, PROBE_ELEMS = 32, 1 << 17


def probe_rows(n: int, device: torch.device | None = None, width: int = 1) -> torch.Tensor:
    """Evenly spaced row indices of an ``n``-row block, first and last included: :data:`PROBE_ROWS` of them, fewer
    in wide blocks (see :data:`PROBE_ELEMS`), all of a smaller block (one tensor per height, width and device,
    shared: not to be modified).

    Args:
        n: rows in the block.
        device: where the index tensor goes.
        width: elements per row.

    Returns:
        An int64 tensor of distinct indices.

    Example:
        >>> probe_rows(5).tolist(), len(probe_rows(292, width=14336))
        ([0, 1, 2, 3, 4], 9)
    """
    k = max(2, min(PROBE_ROWS, PROBE_ELEMS // max(1, width)))
    return _probe_rows(n, k, torch.device("cpu") if device is None else torch.device(device))


@functools.lru_cache(maxsize=256)
def _probe_rows(n: int, k: int, device: torch.device) -> torch.Tensor:
    """:func:`probe_rows`, made once per block height, count and device (blocks of a tensor share their height): a
    handful of small torch calls less per block, each a wait for the interpreter lock when several workers merge."""
    rows = torch.arange(n) if n <= k else torch.linspace(0, n - 1, k).round().long().unique()
    rows = rows.to(device)
    if rows.device.type == "cuda":  # copied on this thread's stream, read on others'
        torch.cuda.current_stream(rows.device).synchronize()
    return rows


def update_counts(base_rows: torch.Tensor, merged: torch.Tensor, cast: torch.Tensor) -> tuple[int, int]:
    """How many entries of a merged block the adapter changed, and how many of those the output dtype rounded back
    to the base value (so that the update is lost there). Entries the adapter left as they were count in neither:
    an adapter with no update has nothing to lose.

    Args:
        base_rows: the base rows as read (any dtype).
        merged: the merged rows in fp32, before casting.
        cast: the merged rows cast to the output dtype.

    Returns:
        ``(changed, lost)``.

    Raises:
        RuntimeError: from torch, when the shapes differ.

    Example:
        >>> base = torch.tensor([1.0, 1.0, 1.0])
        >>> merged = torch.tensor([1.0, 1.0001, 1.5])
        >>> update_counts(base, merged, merged.to(torch.bfloat16))
        (2, 1)
    """
    # an entry the adapter left as it was also casts to the base's value: those that moved in the output dtype are a
    # subset of those the adapter changed, and the lost ones are the difference. Each count is a sum of |sign| of a
    # difference (no comparison masks: those are the slow kernels here)
    exact = torch.float32 if merged.numel() <= 1 << 24 else torch.float64  # sums of ones, exact below 2**24
    changed = (merged - base_rows.to(merged.dtype)).sign_().abs_().sum(dtype=exact)
    moved = (cast.to(torch.float32) - base_rows.to(cast.dtype).to(torch.float32)).sign_().abs_().sum(dtype=exact)
    changed, moved = (int(v) for v in torch.stack((changed, moved)).tolist())
    return changed, changed - moved


def lora_probe(
    x: torch.Tensor,
    factors: Sequence[tuple[torch.Tensor, torch.Tensor, float]],
    start: int,
    stop: int,
    *,
    transposed: bool,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sum(scaling * B @ (A @ x))`` restricted to rows ``[start, stop)`` of the stored weight, without forming
    ``B @ A``: the LoRA branch applied to probe vectors, for checking a merged block.

    Args:
        x: probe vectors ``[columns of the stored weight, k]`` in float32.
        factors: ``(A, B, scaling)`` of each LoRA module.
        start: first row.
        stop: one past the last row.
        transposed: the stored weight is the transpose of ``B @ A``.
        rows: only these rows of the block (indices from ``start``).

    Returns:
        A float32 tensor ``[stop - start, k]`` (``[len(rows), k]`` with ``rows``).

    Raises:
        RuntimeError: from torch, when the shapes do not fit.

    Example:
        >>> a, b = torch.ones(1, 3), torch.ones(2, 1)
        >>> lora_probe(torch.ones(3, 1), [(a, b, 0.5)], 0, 2, transposed=False)
        tensor([[1.5000],
                [1.5000]])
    """
    index = torch.arange(start, stop, device=x.device) if rows is None else rows.to(x.device) + start
    out = torch.zeros(len(index), x.shape[1], device=x.device)
    for a, b, scaling in factors:
        a32 = a.to(device=x.device, dtype=torch.float32)
        b32 = b.to(device=x.device, dtype=torch.float32)
        if transposed:
            out += (a32[:, index].T @ (b32.T @ x)) * scaling
        else:
            out += (b32[index] @ (a32 @ x)) * scaling
    return out
