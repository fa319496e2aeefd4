"""Task-vector combinations of several adapters' deltas of one tensor (TIES, DARE, magnitude pruning), block by block.

Each adapter's delta is sparsified, a sign is elected per element and the disjoint (weighted) mean is added to the
base, as MergeKit defines the methods; the top-k threshold is found without holding a whole delta.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from .maths import Factors, add_lora_, tile_rows

#: a normalized combination whose weights can scale a delta up this many times is named in a warning: weights of
#: one sign never scale it past 1 (a weighted mean), and 10 is reached only where opposite weights are within 20% of
#: cancelling (1 and -0.82), which no intended task negation needs
SCALE_WARNING = 10.0


@dataclass(frozen=True)
class TaskVectorMethod:
    """How several adapters' deltas are combined, per tensor (the methods and their defaults:
    :data:`~peft_shardmerge.support.combinations.TASK_VECTOR_METHODS`).

    Attributes:
        name: the method's name (``"ties"``, ``"dare_ties"``, ``"dare_linear"``, ``"magnitude_prune"``).
        weights: one weight per adapter, in order.
        density: the fraction of each delta kept: its largest magnitudes (``sparsification="magnitude"``) or a
            random draw rescaled by ``1 / density`` (``"random"``, DARE).
        sparsification: ``"magnitude"`` or ``"random"``.
        elects_sign: whether a sign is elected per element and only the deltas of that sign are kept.
        normalized: whether the sum is divided by the weights of the deltas kept at each element.
        majority_sign: how the sign is elected: ``"total"``, the sign of the weighted sum (TIES' rule, MergeKit's
            ``sum``), or ``"frequency"``, the sign most deltas have (MergeKit's ``count``).
        seed: DARE's seed; each tensor's draw depends on it, the tensor's name and the adapter alone.

    Example:
        >>> TaskVectorMethod("ties", (0.7, 0.3), 0.5, "magnitude", True, True).describe()
        'ties (weights 0.7, 0.3; density 0.5; majority sign total; normalized)'
    """

    name: str
    weights: tuple[float, ...]
    density: float
    sparsification: str
    elects_sign: bool
    normalized: bool
    majority_sign: str = "total"
    seed: int = 0

    def describe(self) -> str:
        """The method and its parameters in words, for the report, the record and the model card."""
        parts = [f"weights {', '.join(f'{w:g}' for w in self.weights)}", f"density {self.density:g}"]
        if self.elects_sign:
            parts.append(f"majority sign {self.majority_sign}")
        if self.sparsification == "random":
            parts.append(f"seed {self.seed}")
        parts.append("normalized" if self.normalized else "not normalized")
        return f"{self.name} ({'; '.join(parts)})"

    def scale_bound(self) -> float:
        """How many times the largest of the adapters' own deltas at an element the combined delta can reach.
        Normalized: at most 1 where the weights share a sign (a weighted mean), more where weights of opposite signs
        nearly cancel in the divisor (the sum of the weights kept at the element, MergeKit's maths); not
        normalized: the sum of the weights' magnitudes.

        Returns:
            The largest ``sum |w_i| / |sum w_i|`` over the sets of adapters an element may keep (a sum of 0, which
            the divisor replaces by 1, counts as 1); ``sum |w_i|`` when not normalized.

        Example:
            >>> round(TaskVectorMethod("ties", (1.0, -0.99), 0.5, "magnitude", True, True).scale_bound(), 1)
            199.0
        """
        if not self.normalized:
            return sum(abs(w) for w in self.weights)
        n = len(self.weights)
        subsets = range(1, 1 << n) if (self.elects_sign and n <= 12) else [(1 << n) - 1]
        worst = 1.0
        for bits in subsets:
            kept = [w for i, w in enumerate(self.weights) if bits >> i & 1]
            total = float(torch.tensor(kept, dtype=torch.float32).sum())  # the divisor, summed as the merge does
            worst = max(worst, sum(abs(w) for w in kept) / (abs(total) if abs(total) >= 1e-8 else 1.0))
        return worst

    def notes(self) -> list[str]:
        """What this combination does that a user may not expect, in words: one adapter is only sparsified (there
        is nothing to combine), and weights that nearly cancel scale the normalized deltas up (a warning above
        :data:`SCALE_WARNING` times).

        Returns:
            The notes, each a sentence with what to do instead; empty when there is nothing to say.

        Example:
            >>> TaskVectorMethod("ties", (1.0,), 0.5, "magnitude", True, True).notes()[0][:60]
            "combination 'ties' of one adapter combines nothing: it keeps"
        """
        notes = []
        if len(self.weights) == 1:
            kept = (
                f"the {self.density:.0%} largest values of its delta"
                if self.sparsification == "magnitude"
                else f"a random {self.density:.0%} of its delta (seed {self.seed}) divided by {self.density:g}"
            )
            notes.append(
                f"combination {self.name!r} of one adapter combines nothing: it keeps {kept} (density "
                f"{self.density:g}) and drops the rest; to merge the whole delta, merge the adapter without a "
                "combination (cat, the default)"
            )
        bound = self.scale_bound()
        if self.normalized and bound >= SCALE_WARNING:
            notes.append(
                f"weights {', '.join(f'{w:g}' for w in self.weights)} nearly cancel: normalized, an element kept "
                f"by adapters of opposite weights is divided by the sum of their weights, which scales its delta "
                f"up to {bound:.3g} times (MergeKit's maths does the same); pass normalize=False, or weights that "
                "do not cancel"
            )
        return notes

    def record(self) -> dict:
        """The parameters as JSON-ready values, for the merge record."""
        return {
            "method": self.name,
            "weights": [float(w) for w in self.weights],
            "density": float(self.density),
            "majority_sign": self.majority_sign if self.elects_sign else None,
            "normalize": self.normalized,
            "seed": self.seed if self.sparsification == "random" else None,
        }


@dataclass
class TaskVectors:
    """Several adapters' changes to one tensor, combined by a :class:`TaskVectorMethod`.

    Attributes:
        method: the combination.
        adapters: each adapter's LoRA factors on this tensor, in the method's order (empty: it leaves the tensor
            alone, a zero delta, as in MergeKit).
        name: the tensor's name (DARE's draw).
        thresholds: per adapter, the smallest magnitude kept, set by :func:`magnitude_thresholds` before the first
            block (an entry None keeps all of that delta); None until then.
    """

    method: TaskVectorMethod
    adapters: list[list[Factors]]
    name: str
    thresholds: list[float | None] | None = None

    def add_(self, rows32: torch.Tensor, start: int, stop: int, *, transposed: bool) -> torch.Tensor:
        """Add the combined delta of rows ``[start, stop)`` to float32 rows in place.

        Args:
            rows32: float32 rows ``[stop - start, columns]``.
            start: first row.
            stop: one past the last row.
            transposed: the stored weight is the transpose of ``B @ A``.

        Returns:
            ``rows32``.

        Example:
            >>> one = [(torch.ones(1, 2), torch.ones(2, 1), 1.0)]
            >>> minus = [(torch.ones(1, 2), -torch.ones(2, 1), 0.5)]
            >>> ties = TaskVectorMethod("ties", (1.0, 1.0), 1.0, "magnitude", True, True)
            >>> tv = TaskVectors(ties, [one, minus], "w", [None, None])
            >>> tv.add_(torch.zeros(2, 2), 0, 2, transposed=False).tolist()  # the sign of the sum wins
            [[1.0, 1.0], [1.0, 1.0]]
        """
        step = tile_rows(rows32.shape[1])
        for t0 in range(start - start % step, stop, step):  # one tile at a time: a few tile-sized temporaries
            lo, hi = max(t0, start), min(t0 + step, stop)
            self._add_tile_(rows32[lo - start : hi - start], lo, hi, transposed)
        return rows32

    def _add_tile_(self, rows32: torch.Tensor, start: int, stop: int, transposed: bool) -> None:
        """:meth:`add_` on rows of at most one tile."""
        m = self.method
        deltas = []
        for i, factors in enumerate(self.adapters):
            d = adapter_delta(factors, rows32.shape, rows32.device, start, stop, transposed)
            if m.sparsification == "magnitude":
                if self.thresholds is None:
                    raise RuntimeError(f"{self.name}: magnitude thresholds not computed before the merge")
                if self.thresholds[i] is not None:
                    d.mul_(d.abs() >= self.thresholds[i])
            elif m.density < 1:
                d.mul_(dare_mask(m.seed, self.name, i, rows32.shape[1], start, stop, m.density).to(d.device))
                d.div_(m.density)
            deltas.append(d.mul_(m.weights[i]))
        if m.elects_sign:
            if m.majority_sign == "total":
                vote = _sum(deltas)
            else:
                vote = _sum([d.sign() for d in deltas])
            majority = torch.where(vote >= 0, 1.0, -1.0)
            keep = [d.sign() == majority for d in deltas]
            mixed = _sum([d * k for d, k in zip(deltas, keep)])
            divisor = _sum([k * w for k, w in zip(keep, m.weights)])
            divisor[divisor == 0] = 1
        else:
            mixed = _sum(deltas)
            divisor = float(torch.tensor(m.weights, dtype=torch.float32).sum())  # MergeKit's float32 sum
            divisor = divisor if abs(divisor) >= 1e-8 else 1.0
        if m.normalized:
            mixed /= divisor
        rows32 += mixed


def _sum(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The element-wise sum of tensors, in order, in float32 (a new tensor)."""
    out = tensors[0].to(torch.float32, copy=True)
    for t in tensors[1:]:
        out += t
    return out


def adapter_delta(
    factors: Sequence[Factors], shape, device: torch.device, start: int, stop: int, transposed: bool
) -> torch.Tensor:
    """One adapter's delta of rows ``[start, stop)`` in float32, on the fixed tile grid of
    :func:`~peft_shardmerge.engine.maths.add_lora_` (the same values whatever the row block).

    Args:
        factors: the adapter's ``(A, B, scaling)`` on this tensor (none: zeros).
        shape: ``(stop - start, columns)``.
        device: where it is computed.
        start: first row.
        stop: one past the last row.
        transposed: the stored weight is the transpose of ``B @ A``.

    Returns:
        The delta rows.

    Example:
        >>> adapter_delta([(torch.ones(1, 2), torch.ones(3, 1), 2.0)], (2, 2), torch.device("cpu"), 1, 3, False)
        tensor([[2., 2.],
                [2., 2.]])
    """
    return add_lora_(torch.zeros(tuple(shape), device=device), factors, start, stop, transposed=transposed)


def dare_mask(seed: int, name: str, adapter: int, width: int, start: int, stop: int, density: float) -> torch.Tensor:
    """DARE's draw for rows ``[start, stop)`` of one adapter's delta of one tensor: True where an element is kept
    (probability ``density``). Each tile of :func:`~peft_shardmerge.engine.maths.tile_rows` rows is drawn from its
    own generator seeded by ``(seed, name, adapter, tile)``, so the draw does not depend on the row block, the
    rank count, the device or a resume.

    Args:
        seed: the user's seed.
        name: the tensor's name.
        adapter: the adapter's index in the combination.
        width: elements per row.
        start: first row.
        stop: one past the last row.
        density: the probability of keeping an element.

    Returns:
        A bool tensor ``[stop - start, width]`` on the CPU.

    Example:
        >>> a = dare_mask(11, "w", 0, 3, 0, 4, 0.5)
        >>> torch.equal(a[1:3], dare_mask(11, "w", 0, 3, 1, 3, 0.5)), a.shape
        (True, torch.Size([4, 3]))
    """
    step = tile_rows(width)
    parts = []
    for t0 in range(start - start % step, stop, step):
        digest = hashlib.sha256(f"{seed}\0{name}\0{adapter}\0{t0 // step}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        tile = torch.rand((step, width), generator=gen) < density
        lo, hi = max(t0, start), min(t0 + step, stop)
        parts.append(tile[lo - t0 : hi - t0])
    return torch.cat(parts) if parts else torch.zeros((0, width), dtype=torch.bool)


def kth_largest(blocks: Callable[[], Iterator[torch.Tensor]], k: int) -> float:
    """The ``k``-th largest value of a non-negative float32 tensor given block by block, exactly, without holding it:
    a radix selection on the bit patterns (whose order is the values' order for non-negative floats), counting the
    high 16 bits over one pass of the blocks, then the low 16 bits of the one bucket that holds the answer.

    Args:
        blocks: called twice; each call yields the tensor's blocks (float32, non-negative, any shapes).
        k: 1 for the largest; at most the number of elements.

    Returns:
        The value.

    Example:
        >>> values = torch.tensor([0.5, 3.0, 2.0, 2.0, 1.0])
        >>> [kth_largest(lambda: iter([values[:2], values[2:]]), k) for k in (1, 2, 3, 4, 5)]
        [3.0, 2.0, 2.0, 1.0, 0.5]
    """
    high = None
    assert k >= 1, k
    for block in blocks():
        bits = block.contiguous().view(torch.int32).reshape(-1)
        counts = torch.bincount(bits >> 16, minlength=1 << 15).cpu()
        high = counts if high is None else high + counts
    if high is None or k > int(high.sum()):
        raise ValueError(f"k={k} is beyond the {0 if high is None else int(high.sum())} elements given")
    bucket, rank = _bucket(high, k)
    low = None
    for block in blocks():
        bits = block.contiguous().view(torch.int32).reshape(-1)
        counts = torch.bincount(bits[(bits >> 16) == bucket] & 0xFFFF, minlength=1 << 16).cpu()
        low = counts if low is None else low + counts
    lo, _ = _bucket(low, rank)
    return torch.tensor([(bucket << 16) | lo], dtype=torch.int32).view(torch.float32).item()


def _bucket(counts: torch.Tensor, k: int) -> tuple[int, int]:
    """The bucket holding the ``k``-th largest element, counting from the top, and its rank inside that bucket."""
    from_top = counts.flip(0).cumsum(0)
    index = int(torch.searchsorted(from_top, torch.tensor(k)).item())
    above = int(from_top[index - 1].item()) if index else 0
    return counts.numel() - 1 - index, k - above


def magnitude_thresholds(
    vectors: TaskVectors, shape: tuple[int, ...], device: torch.device, transposed: bool
) -> list[float | None]:
    """Per adapter, the magnitude of its ``k``-th largest delta element over the whole tensor, ``k = max(1,
    int(density * elements))`` as in MergeKit; elements at least that large are kept. Each adapter's delta is
    computed twice, one tile of rows at a time (:func:`kth_largest`); the whole delta is never held.

    Args:
        vectors: the tensor's task vectors.
        shape: the tensor's shape.
        device: where the deltas are computed.
        transposed: the stored weight is the transpose of ``B @ A``.

    Returns:
        One threshold per adapter; None where nothing is dropped (density 1, or an adapter without a change here).
    """
    method = vectors.method
    width = math.prod(shape[1:]) if len(shape) > 1 else 1
    total = shape[0] * width if shape else 1
    if method.sparsification != "magnitude" or method.density >= 1 or total == 0:
        return [None] * len(vectors.adapters)
    k = max(1, int(method.density * total))
    step = tile_rows(width)
    out: list[float | None] = []
    for factors in vectors.adapters:
        if not factors:
            out.append(None)
            continue

        def deltas(factors=factors) -> Iterator[torch.Tensor]:
            for start in range(0, shape[0], step):
                stop = min(start + step, shape[0])
                yield adapter_delta(factors, (stop - start, width), device, start, stop, transposed).abs_()

        out.append(kth_largest(deltas, k))
    return out
