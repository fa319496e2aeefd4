"""The per-tensor merge of both paths: base rows in, adapter changes applied in fp32, checked, counted, cast."""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator, TypeVar

import torch

from ..errors import MergeCheckError
from ..io.safetensors_io import row_blocks
from ..options import DEFAULT_CHUNK_ELEMS
from .block_checks import check_probe_error, check_range, probe_rows, probe_vectors, update_counts
from .budget import MemoryBudget, free_accelerator_cache, is_out_of_memory
from .changes import Changes
from .maths import dora_rescale_, exact_factors, merge_block, replace_rows_, tile_rows
from .task_vectors import magnitude_thresholds

log = logging.getLogger(__name__)

T = TypeVar("T")


def choose_device(name: str, preferred: torch.device, nbytes: int, budget: MemoryBudget | None) -> torch.device:
    """Where to merge a tensor whose working set is ``nbytes``: ``preferred`` while it fits the memory budget
    (``maximum_memory_usage``), else the CPU; the CPU, the last resort, is used even over the budget.

    Args:
        name: the tensor (for the log).
        preferred: where its data lives or the merge was asked to run.
        nbytes: the working set.
        budget: the budget; None means no limit.

    Returns:
        The device.

    Example:
        >>> choose_device("w", torch.device("cpu"), 4, None)
        device(type='cpu')
    """
    if budget is None or budget.fits(nbytes, preferred):
        return preferred
    if preferred.type != "cpu":
        log.info("%s: over the memory budget on %s; merging it on the CPU", name, preferred)
        return torch.device("cpu")
    log.warning(
        "%s needs about %d MiB, which goes over maximum_memory_usage of host RAM; merging it anyway",
        name,
        nbytes >> 20,
    )
    return preferred


@dataclass
class MergeCounts:
    """What a source's merge counted: the figures of the count check and of the report.

    Attributes:
        applied: how often each change key was applied.
        fallbacks: out-of-memory failures redone on the CPU.
        probe_err: the largest self-check error seen.
        swallowed: per tensor, ``(sampled entries the adapter changed, of those rounded back to the base value)``.
        replaced: whole tensors taken from the adapter (``modules_to_save``, trained biases) where the source counts
            them as it writes (from disk; a loaded model's plan counts them).

    Example:
        >>> a, b = MergeCounts(Counter({"q": 1}), probe_err=0.1), MergeCounts(Counter({"v": 1}), fallbacks=1)
        >>> a.add(b); sorted(a.applied), a.fallbacks, a.probe_err
        (['q', 'v'], 1, 0.1)
    """

    applied: Counter = field(default_factory=Counter)
    fallbacks: int = 0
    probe_err: float = 0.0
    swallowed: dict = field(default_factory=dict)
    replaced: int = 0

    def add(self, other: "MergeCounts") -> None:
        """Add what another process of the job counted."""
        self.applied.update(other.applied)
        self.fallbacks += other.fallbacks
        self.probe_err = max(self.probe_err, other.probe_err)
        self.swallowed.update(other.swallowed)
        self.replaced += other.replaced


class RowMerger:
    """The per-tensor merge both paths run, and what it counted.

    Attributes:
        chunk_elems: elements per row block.
        counts: what it counted (:class:`MergeCounts`).

    Example:
        >>> from peft_shardmerge.engine.changes import Changes
        >>> m = RowMerger()
        >>> changes = Changes(factors=[(torch.ones(1, 2), torch.ones(2, 1), 1.0)], keys=["q"])
        >>> [c.tolist() for *_, c in m.merge_rows("w", lambda a, b: torch.zeros(b - a, 2), changes, (2, 2),
        ...                                           torch.float32, torch.device("cpu"))]
        [[[1.0, 1.0], [1.0, 1.0]]]
        >>> m.counts.applied
        Counter({'q': 1})
    """

    def __init__(self, chunk_elems: int = DEFAULT_CHUNK_ELEMS):
        self.chunk_elems = chunk_elems
        self.counts = MergeCounts()
        self.lock = threading.Lock()  # the counts, updated from several worker threads

    def on_device(self, step: Callable[[torch.device], T], device: torch.device, what: str) -> T:
        """Run ``step(device)``; when it runs out of memory, free the accelerator's cache, count it, and run
        ``step`` again on the CPU.

        Args:
            step: the work, given the device to run on.
            device: where to try first.
            what: what is computed (for the log).

        Returns:
            What ``step`` returned.

        Raises:
            Exception: whatever ``step`` raised other than an out-of-memory, or on its CPU retry.

        Example:
            >>> RowMerger().on_device(lambda device: device.type, torch.device("cpu"), "w")
            'cpu'
        """
        try:
            return step(device)
        except Exception as e:  # only out-of-memory is retried
            if not is_out_of_memory(e):
                raise
        free_accelerator_cache()
        with self.lock:
            self.counts.fallbacks += 1
        log.warning("out of memory on %s for %s; redoing it on the CPU", device, what)
        return step(torch.device("cpu"))

    def merge_rows(
        self,
        name: str,
        rows: Callable[[int, int], torch.Tensor],
        changes: Changes,
        shape: tuple[int, ...],
        out_dtype: torch.dtype,
        device: torch.device,
        *,
        inplace: bool = False,
    ) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor | None]]:
        """Merge one tensor block by block: rows ``[start, stop)`` of the base, the changes added in fp32 on
        ``device`` (an out-of-memory block redone on the CPU), the self-check, DoRA's rescale, the finite and
        range checks and the rounding count (taken on the output values, after DoRA), then the cast. The changes'
        keys are counted once the last block is out.

        Args:
            name: the tensor's name (probe seed, messages, rounding count).
            rows: ``rows(start, stop)`` gives those base rows (any float dtype, any device; not modified unless
                ``inplace``).
            changes: what the adapter changes.
            shape: the stored tensor's shape.
            out_dtype: the dtype written.
            device: where the LoRA product is computed.
            inplace: ``rows`` gives float32 blocks of a copy the merge may overwrite, and only the merged float32
                rows are wanted (no cast beyond what the checks need); the caller retries an out-of-memory.

        Yields:
            ``(start, stop, merged float32 rows, the same cast to out_dtype or None with inplace)``, shaped
            ``[stop - start, *shape[1:]]``, on the device they were merged on (the CPU for a block redone there):
            the checks and the cast run there, and only the output's bytes need to leave an accelerator.

        Raises:
            MergeCheckError: the self-check failed, a NaN or Inf, or a value beyond float16's range.
        """
        blocks = row_blocks(shape, self.chunk_elems)
        width = math.prod(shape[1:]) if shape else 1
        if changes.factors:  # scalings moved onto A where that gives the same bytes: once per tensor, not per block
            changes = dataclasses.replace(changes, factors=exact_factors(changes.factors))
        if changes.vectors is not None:  # magnitudes kept per adapter: a pass over the deltas, first
            self._prepare_vectors(name, changes, shape, device)
        probes = probe_vectors(name, width) if changes.factors and len(shape) >= 2 else None
        columns, first = (
            self._column_scale(name, rows, changes, shape, device, probes)
            if changes.magnitudes and changes.transposed
            else (None, None)
        )
        if first is not None:  # merged whole for PEFT's own norm: one block
            blocks = [(0, shape[0])]
        changed = lost = 0
        count = bool(changes.factors or changes.vectors) and out_dtype != torch.float32  # on sample rows
        given = first[1] if first is not None else None  # rows merged whole for the column norms: used once
        for start, stop in blocks:
            base = first[0] if first is not None else _base_rows(rows(start, stop), changes, start, stop)
            # the sampled base rows: a copy, kept when rows change in place
            before = base.index_select(0, probe_rows(stop - start, base.device, width)) if count else None

            def block(dev: torch.device, base=base, before=before, start=start, stop=stop):
                nonlocal given  # a retry starts again from the base rows: the first try may have rescaled them
                merged, given = given, None
                if merged is None:
                    merged = self._changed_rows(name, base, changes, start, stop, dev, probes, inplace)
                return self._finish(name, merged, before, changes, columns, start, stop, shape, out_dtype, inplace)

            # an out-of-memory anywhere in the block redoes it on the CPU; in place, the caller redoes the tensor
            what = f"{name} rows {start}-{stop}"
            merged, cast, counts = block(device) if inplace else self.on_device(block, device, what)
            if counts is not None:
                changed, lost = changed + counts[0], lost + counts[1]
            yield start, stop, merged, cast
            del merged, cast  # not held on the device while the next block is merged
        with self.lock:
            if changed:
                self.counts.swallowed[name] = (changed, lost)
            self.counts.applied.update(changes.keys)

    @staticmethod
    def _finish(name, merged, before, changes: Changes, columns, start, stop, shape, out_dtype, inplace):
        """A block's rows after the adapter's changes, where they are: DoRA's rescale, the finite check, the cast and
        its range check, the precision report's counts (``before``: the sampled base rows, None for no counts).
        Returns ``(merged rows, cast or None, (changed, lost) or None)``."""
        if columns is not None:
            merged *= columns.to(merged.device).unsqueeze(0)
        else:
            for magnitude in changes.magnitudes:  # m * (W + dW) / ||W + dW||, norms per output row, as PEFT
                dora_rescale_(merged, magnitude[start:stop], start)
        if not torch.isfinite(merged.sum()):  # one cheap pass; finite sums mean finite values here
            raise MergeCheckError(f"merged tensor {name!r} has NaN or Inf in rows {start}-{stop}")
        merged = merged.reshape(stop - start, *shape[1:])
        cast = merged.to(out_dtype) if not inplace or out_dtype == torch.float16 else None
        if cast is not None:
            check_range(name, cast, out_dtype)
        if before is None:
            return merged, cast, None
        sample = probe_rows(stop - start, merged.device, math.prod(shape[1:]) if shape else 1)
        sampled = merged.index_select(0, sample)
        counts = update_counts(
            before.to(sampled.device).reshape(sampled.shape),
            sampled,
            cast.index_select(0, sample) if cast is not None else sampled.to(out_dtype),
        )
        return merged, cast, counts

    def _prepare_vectors(self, name: str, changes: Changes, shape, device: torch.device) -> None:
        """Move a combination's factors to ``device`` once and set its magnitude thresholds (a pass that runs out of
        memory is redone on the CPU; a block redone there later compares its CPU deltas with them, where an element
        at a threshold may round to the other side)."""
        vectors = changes.vectors

        def thresholds(dev: torch.device):
            vectors.adapters = [[(a.to(dev), b.to(dev), s) for a, b, s in group] for group in vectors.adapters]
            return magnitude_thresholds(vectors, shape, dev, changes.transposed)

        vectors.thresholds = self.on_device(thresholds, device, f"{name} (task-vector thresholds)")

    def _column_scale(self, name, rows, changes: Changes, shape, device, probes):
        """DoRA on a Conv1D or an embedding: PEFT's norms run over the stored rows (one per column). A tensor of at
        most :data:`WHOLE_NORM_ELEMS` is merged whole and takes PEFT's own float32 norm, bit for bit (its merged
        rows are kept for the second pass); a larger one accumulates the squares in float64 tile by tile, on the
        grid of :func:`~peft_shardmerge.engine.maths.tile_rows`, so the scale does not depend on the row block.

        Returns ``(column scale, (base rows, merged rows) of a tensor merged whole or None)``."""
        total, width = shape[0], math.prod(shape[1:])
        magnitude = changes.magnitudes[0]
        if total * width <= WHOLE_NORM_ELEMS:
            base = _base_rows(rows(0, total), changes, 0, total)

            def whole(dev: torch.device):
                merged = self._changed_rows(name, base, changes, 0, total, dev, probes, False)
                return magnitude.to(merged.device, torch.float32) / torch.linalg.norm(merged, dim=0), merged

            scale, merged = self.on_device(whole, device, f"{name} (DoRA's column norms)")
            return scale, (base, merged)
        step = tile_rows(width)
        per_block = max(step, (self.chunk_elems // max(1, width)) // step * step)
        sumsq = None
        for start in range(0, total, per_block):
            stop = min(total, start + per_block)
            base = _base_rows(rows(start, stop), changes, start, stop)

            def squares(dev: torch.device, base=base, start=start, stop=stop) -> list[torch.Tensor]:
                merged = self._changed_rows(name, base, changes, start, stop, dev, None, False)
                return [merged[t : t + step].double().pow(2).sum(0) for t in range(0, stop - start, step)]

            for part in self.on_device(squares, device, f"{name} rows {start}-{stop} (DoRA's column norms)"):
                sumsq = part if sumsq is None else sumsq + part.to(sumsq.device)  # a block redone on the CPU
        return magnitude.to(sumsq.device, torch.float32) / sumsq.sqrt().float(), None

    def _changed_rows(self, name, base, changes: Changes, start, stop, device, probes, inplace) -> torch.Tensor:
        """Rows of the base with LoRA (self-checked), ``lora_bias`` and PEFT's own changes, before DoRA, merged on
        ``device``; an out-of-memory is the caller's to retry (in place, a failure may leave the rows half-changed:
        the caller redoes the whole tensor)."""
        merged, err = self._lora_rows(base, changes, start, stop, device, probes, inplace)
        if probes is not None:
            with self.lock:
                self.counts.probe_err = max(self.counts.probe_err, err)
            check_probe_error(name, start, stop, err)
        for change in changes.peft:
            change.apply_(merged, start, stop)
        return merged

    @staticmethod
    def _lora_rows(base, changes: Changes, start, stop, device, probes, inplace=False) -> tuple[torch.Tensor, float]:
        """The step run on the accelerator: fp32 rows plus the LoRA products and bias deltas, and the self-check
        error (0.0 without probes)."""
        factors = changes.factors
        if device.type != "cpu":  # LoRA factors are small next to a row block: move them with it
            factors = [(a.to(device), b.to(device), s) for a, b, s in factors]
        merged, err = merge_block(
            base.to(device),
            factors,
            start,
            stop,
            transposed=changes.transposed,
            bias_deltas=changes.bias_deltas,
            probes=probes,
            inplace=inplace,
        )
        if changes.vectors is not None:
            changes.vectors.add_(merged.reshape(stop - start, -1), start, stop, transposed=changes.transposed)
        return merged, err


def _base_rows(rows: torch.Tensor, changes: Changes, start: int, stop: int) -> torch.Tensor:
    """Base rows as the merge works on them: convolutions flattened to ``[out, in * kernel]``, trainable-token
    rows put in place (in fp32, on a copy)."""
    if rows.dim() > 2:
        rows = rows.reshape(rows.shape[0], -1)
    if changes.tokens:
        rows = rows.to(torch.float32, copy=True)
    for t in changes.tokens:
        replace_rows_(rows, t.index, t.rows, start, stop)
    return rows


#: DoRA on a Conv1D or an embedding: a tensor up to this size is merged whole for PEFT's float32 column norm
WHOLE_NORM_ELEMS = 1 << 22

#: above this fraction of swallowed updates a tensor is named in a warning
SWALLOWED_WARNING = 0.5
#: below this share of the update kept, the report notes it (else it is logged at DEBUG, ``-v``): the merges seen
#: kept 98.6-99.4% of their sampled entries in bf16 (99.4% for the guide's tiny Llama, 98.6% in a user's trial); 95%
#: loses more than three times that, where writing float32 or float16 is worth deciding on
KEPT_NOTE = 0.95


def precision_notes(counts: dict[str, tuple[int, int]], dtype: torch.dtype) -> list[str]:
    """A note on how much of the LoRA update the output dtype kept (where it kept less than :data:`KEPT_NOTE`; else
    logged at DEBUG), and a warning (also logged) naming the tensors where it swallowed more than
    :data:`SWALLOWED_WARNING` of it.

    Args:
        counts: per tensor, ``(sampled entries, entries rounded back to the base value)``.
        dtype: the output dtype.

    Returns:
        Notes for the report (none when nothing was sampled).

    Example:
        >>> precision_notes({"w": (100, 1)}, torch.bfloat16), precision_notes({"w": (100, 10)}, torch.bfloat16)[0][:40]
        ([], 'bfloat16 kept the LoRA update in 90.0% o')
    """
    if not counts:
        return []
    changed = sum(c for c, _ in counts.values())
    lost = sum(s for _, s in counts.values())
    name = str(dtype).removeprefix("torch.")
    kept = (
        f"{name} kept the LoRA update in {100 * (1 - lost / changed):.1f}% of the merged entries "
        f"({lost} of {changed} sampled entries rounded back to the base value)"
    )
    notes = []
    if 1 - lost / changed < KEPT_NOTE:
        notes.append(kept)
    else:
        log.debug("%s", kept)  # the usual share: worth a look with -v only
    worst = sorted((s / c, k) for k, (c, s) in counts.items() if s / c > SWALLOWED_WARNING)
    if worst:
        names = ", ".join(k for _, k in worst[-5:][::-1])
        message = (
            f"{name} swallowed more than {SWALLOWED_WARNING:.0%} of the LoRA update in {len(worst)} tensor(s) "
            f"(worst: {names}); write float32 or float16 to keep it (dtype='float32' in Python, "
            "--dtype float32 on the command line)"
        )
        log.warning("%s", message)
        notes.append(message)
    return notes


def check_applied(expected: list[str], applied: Counter) -> None:
    """The count check of every merge: each adapter change (LoRA module, ``lora_bias``, token rows, PEFT layer)
    applied exactly once.

    Args:
        expected: the keys of every change that must be applied.
        applied: how often each key was applied.

    Returns:
        None.

    Raises:
        MergeCheckError: naming what was never applied and what was applied more than once.

    Example:
        >>> check_applied(["a"], Counter({"a": 1}))
    """
    if applied != Counter(expected):
        missing = sorted(set(expected) - set(applied))
        twice = sorted(k for k, v in applied.items() if v > 1)
        raise MergeCheckError(
            f"adapter changes not applied exactly once: never applied {missing[:10]}, applied twice {twice[:10]}"
        )
