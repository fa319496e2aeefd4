"""The disk engine's per-tensor merge: base rows read in blocks, LoRA and PEFT changes added in fp32, checked and cast."""

from __future__ import annotations

import logging
from collections import Counter

import torch

from .budget import free_accelerator_cache, is_out_of_memory
from .errors import MergeCheckError
from .maths import (
    dora_rescale_,
    lora_bias_delta,
    merge_block,
    probe_rows,
    replace_rows_,
    update_counts,
)
from .plan_types import Plan, PlannedTensor
from .quant import quantize_roundtrip
from .safetensors_io import DTYPES, RowReader, row_blocks
from .writer import ShardWriter

log = logging.getLogger(__name__)


def _check_range(t: PlannedTensor, cast: torch.Tensor, dtype: torch.dtype) -> None:
    """float16 tops out at 65504: a larger value would be written as inf."""
    if dtype == torch.float16 and bool(cast.isinf().any()):
        raise MergeCheckError(f"{t.name!r} has values beyond float16's range (65504); write bfloat16 or float32")


def probe_vectors(name: str, columns: int) -> torch.Tensor:
    """Reproducible random probe vectors for the self-check of one tensor (seeded by its name).

    Args:
        name: the tensor's name.
        columns: its number of columns (the length of each vector).

    Returns:
        A float32 tensor ``[columns, PROBES]``.

    Raises:
        Nothing.

    Example:
        >>> probe_vectors("w", 3).shape
        torch.Size([3, 2])
    """
    import zlib

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(columns, PROBES, generator=g)


def _flat(factor: torch.Tensor) -> torch.Tensor:
    """A LoRA factor as a float32 matrix (convolution factors ``[r, in, *kernel]`` become ``[r, in * kernel]``)."""
    return factor.float().reshape(factor.shape[0], -1)


class PlanMerger:
    """State of one execution: reader, device, counters, progress bar."""

    def __init__(self, plan: Plan, device: torch.device, progress: bool):
        from tqdm.auto import tqdm

        self.plan = plan
        self.device = device
        self.reader = RowReader()
        self.applied: Counter[str] = Counter()
        self.replacements = 0
        self.fallbacks = 0
        self.probe_err = 0.0
        self.swallowed: dict[str, tuple[int, int]] = {}
        self.parts: dict[str, tuple[dict[str, torch.Tensor], int]] = {}
        self.bar = tqdm(total=plan.total_size, unit="B", unit_scale=True, desc="merging", disable=not progress)

    def close(self) -> None:
        self.bar.close()
        self.reader.close()

    def skip(self, tensors: list[PlannedTensor]) -> None:
        """Account for tensors of a shard kept from an interrupted run (already merged and verified)."""
        for t in tensors:
            self.replacements += t.from_adapter
            self._count(t)
            self.bar.update(t.nbytes)

    def _count(self, t: PlannedTensor) -> None:
        """Record that the changes of ``t`` (LoRA modules, ``lora_bias`` terms, token rows, PEFT layers) were
        applied."""
        for m in t.loras:
            self.applied[m.key] += 1
        for m in t.bias_loras:
            self.applied[m.key + ".bias"] += 1
        for r in t.token_rows:
            self.applied[f"{r.key}@{t.name}"] += 1
        for o in t.peft_ops:
            self.applied[o.key] += 1

    def write_tensor(self, t: PlannedTensor, w: ShardWriter) -> None:
        src = t.source
        if t.from_adapter:
            self.replacements += 1
        if t.op == "copy":
            w.copy_from(self.reader.fd(src.path), src.offset, src.nbytes)
            self.bar.update(t.nbytes)
            return
        out_dtype = DTYPES[t.out_dtype][0]
        blocks = row_blocks(t.shape, self.plan.chunk_elems)
        row_bytes = t.nbytes // max(1, t.shape[0] if t.shape else 1)
        if t.op == "cast":
            for start, stop in blocks:
                cast = self.reader.read_rows(src, start, stop).to(out_dtype)
                _check_range(t, cast, out_dtype)
                w.write(cast)
                self.bar.update((stop - start) * row_bytes)
            return
        factors = [(_flat(m.a.load(self.reader)), _flat(m.b.load(self.reader)), m.scaling) for m in t.loras]
        bias_deltas = [lora_bias_delta(m.bias.load(self.reader), m.scaling) for m in t.bias_loras if m.bias]
        magnitudes = [m.magnitude.load(self.reader).float().reshape(-1) for m in t.loras if m.magnitude is not None]
        tokens = [(torch.tensor(r.indices), r.rows.load(self.reader).float()) for r in t.token_rows]
        peft_ops = [self._peft_change(o, t) for o in t.peft_ops]
        whole = None
        if t.quantize:
            # bitsandbytes quantizes Conv1D weights as [out, in]: quantize the same layout
            weight = self.reader.read(src)
            whole = quantize_roundtrip(weight.T if t.transposed else weight, self.plan.nf4)
            whole = whole.T.contiguous() if t.transposed else whole
        probes = probe_vectors(t.name, src.numel // t.shape[0]) if factors and len(t.shape) >= 2 else None

        def base_rows(start: int, stop: int) -> torch.Tensor:
            rows = whole[start:stop] if whole is not None else self.reader.read_rows(src, start, stop)
            if rows.dim() > 2:  # a convolution: rows of the weight flattened to [out, in * kernel]
                rows = rows.reshape(rows.shape[0], -1)
            if tokens:  # trainable tokens replace base rows (in fp32); LoRA (outside them) adds on top
                rows = rows.float()
            for index, new_rows in tokens:
                replace_rows_(rows, index, new_rows, start, stop)
            return rows

        columns = None
        if magnitudes and t.transposed:
            # DoRA on a Conv1D or an embedding: PEFT's norms run over the stored rows (one per column), so a
            # first pass accumulates them block by block, and the second pass scales each column
            sumsq = torch.zeros(src.numel // t.shape[0], dtype=torch.float64)
            for start, stop in blocks:
                merged = self._merge_block(t, base_rows(start, stop), factors, bias_deltas, start, stop)
                sumsq += merged.double().pow(2).sum(0)
            columns = magnitudes[0] / sumsq.sqrt().float()
        changed = lost = 0
        for start, stop in blocks:
            rows = base_rows(start, stop)
            merged = self._merge_block(t, rows, factors, bias_deltas, start, stop, probes)
            if probes is not None:
                merged, err = merged
                self.probe_err = max(self.probe_err, err)
                check_probe_error(t.name, start, stop, err)
            for delta, (mult, per_row) in peft_ops:
                if delta is not None:
                    merged += delta[start:stop]
                else:  # IA3's multiplier: per row (sliced with the block) or per column (whole)
                    merged *= mult[start:stop] if per_row else mult
            if columns is not None:
                merged *= columns.unsqueeze(0)
            else:
                for magnitude in magnitudes:  # DoRA: m * (W + dW) / ||W + dW||, norms per output row, as PEFT merges
                    dora_rescale_(merged, magnitude[start:stop])
            if not torch.isfinite(merged.sum()):  # one cheap pass; finite sums mean finite values here
                raise MergeCheckError(f"merged tensor {t.name!r} has NaN or Inf in rows {start}-{stop}")
            cast = merged.to(out_dtype).reshape(stop - start, *t.shape[1:])
            rows = rows.reshape(stop - start, *t.shape[1:])
            _check_range(t, cast, out_dtype)
            if factors and out_dtype != torch.float32:  # estimated on the rows the self-check samples
                sample = probe_rows(cast.shape[0])
                c, lo = update_counts(rows[sample], merged.reshape(cast.shape)[sample], cast[sample])
                changed, lost = changed + c, lost + lo
            w.write(cast)
            self.bar.update((stop - start) * row_bytes)
        if changed:
            self.swallowed[t.name] = (changed, lost)
        self._count(t)

    def _peft_change(self, o, t: PlannedTensor) -> tuple[torch.Tensor | None, tuple]:
        """``(delta as [rows, -1], (None, False))`` for LoHa/LoKr/VeRA/LoRA-on-parameter changes (the whole tensor's
        delta, once), or ``(None, (multiplier, per_row))`` for IA3."""
        if o.kind == "scale":
            return None, o.scale(t.shape)
        delta = self._part(o) if o.kind == "part" else o.delta()
        return delta.reshape(t.shape[0], -1), (None, False)

    def _part(self, part) -> torch.Tensor:
        """One checkpoint key's slice of a delta the checkpoint stores in parts: from that expert's factors alone
        when the layout allows, else the whole delta is computed and cut once, and dropped when its last part is
        written."""
        own = self.plan.adapter.layers.part_delta(part.op, part.memory_name, part.file_name)
        if own is not None:
            return own
        if part.memory_name not in self.parts:
            delta = part.op.delta()
            self.parts[part.memory_name] = (self.plan.adapter.layers.split(part.memory_name, delta), part.count)
        pieces, left = self.parts[part.memory_name]
        if left == 1:
            del self.parts[part.memory_name]
        else:
            self.parts[part.memory_name] = (pieces, left - 1)
        return pieces[part.file_name].float()

    def _merge_block(self, t, rows, factors, bias_deltas, start, stop, probes=None):
        if self.device.type != "cpu":
            try:
                got = self._compute(t, rows, factors, bias_deltas, start, stop, self.device, probes)
                return (got[0].cpu(), got[1]) if probes is not None else got.cpu()
            except Exception as e:  # noqa: BLE001 - only out-of-memory is retried
                if not is_out_of_memory(e):
                    raise
                free_accelerator_cache()
                self.fallbacks += 1
                log.warning("out of memory on %s for %s rows %d-%d; redoing them on the CPU",
                            self.device, t.name, start, stop)
        return self._compute(t, rows, factors, bias_deltas, start, stop, torch.device("cpu"), probes)

    @staticmethod
    def _compute(t, rows, factors, bias_deltas, start, stop, device, probes=None):
        if device.type != "cpu":  # LoRA factors are small next to a row block: move them with it
            factors = [(a.to(device), b.to(device), s) for a, b, s in factors]
        return merge_block(rows.to(device), factors, start, stop, transposed=t.transposed, bias_deltas=bias_deltas,
                           probes=probes)


#: probe vectors per merged weight, and the largest relative error the self-check accepts
PROBES = 2


PROBE_TOLERANCE = 1e-3


def check_probe_error(name: str, start: int, stop: int, err: float) -> None:
    """Fail the self-check of rows ``[start, stop)`` of tensor ``name`` when the probe error is over
    :data:`PROBE_TOLERANCE`.

    Args:
        name: the tensor.
        start: first row of the block.
        stop: one past the last row.
        err: the relative error from :func:`~peft_shardmerge.maths.add_lora_checked_`.

    Returns:
        None.

    Raises:
        MergeCheckError: the error is over the tolerance, or not a number.

    Example:
        >>> check_probe_error("w", 0, 4, 1e-7)
        >>> check_probe_error("w", 0, 4, float("nan"))
        Traceback (most recent call last):
        peft_shardmerge.errors.MergeCheckError: self-check failed for 'w' rows 0-4: merged weight times probe vectors differs from base + LoRA by nan (relative) > 0.001
    """
    if not err <= PROBE_TOLERANCE:  # also a NaN error, which no comparison with ">" would catch
        raise MergeCheckError(
            f"self-check failed for {name!r} rows {start}-{stop}: merged weight times probe vectors differs from "
            f"base + LoRA by {err:.2e} (relative) > {PROBE_TOLERANCE:g}")


#: above this fraction of swallowed updates a tensor is named in a warning
SWALLOWED_WARNING = 0.5


def precision_notes(counts: dict[str, tuple[int, int]], dtype: torch.dtype) -> list[str]:
    """A note on how much of the LoRA update the output dtype kept, and a warning (also logged) naming the
    tensors where it swallowed more than :data:`SWALLOWED_WARNING` of it.

    Args:
        counts: per tensor, ``(sampled entries, entries rounded back to the base value)``.
        dtype: the output dtype.

    Returns:
        Notes for the report (none when nothing was sampled).

    Raises:
        Nothing.

    Example:
        >>> precision_notes({"w": (100, 1)}, torch.bfloat16)[0][:40]
        'bfloat16 kept the LoRA update in 99.0% o'
    """
    if not counts:
        return []
    changed = sum(c for c, _ in counts.values())
    lost = sum(s for _, s in counts.values())
    name = str(dtype).removeprefix("torch.")
    notes = [f"{name} kept the LoRA update in {100 * (1 - lost / changed):.1f}% of the merged entries "
             f"({lost} of {changed} sampled entries rounded back to the base value)"]
    worst = sorted((s / c, k) for k, (c, s) in counts.items() if s / c > SWALLOWED_WARNING)
    if worst:
        names = ", ".join(k for _, k in worst[-5:][::-1])
        message = (f"{name} swallowed more than {SWALLOWED_WARNING:.0%} of the LoRA update in {len(worst)} tensor(s) "
                   f"(worst: {names}); write float32 or float16 to keep it (dtype='float32' in Python, --dtype float32 "
                   "on the command line)")
        log.warning("%s", message)
        notes.append(message)
    return notes


def check_counts(plan: Plan, merger: PlanMerger) -> None:
    expected = [m.key for m in plan.adapter.modules.values()]
    expected += [m.key + ".bias" for m in plan.adapter.modules.values() if m.bias is not None]
    expected += [f"{r.key}@{t.name}" for t in plan.tensors for r in t.token_rows]
    expected += [o.key for t in plan.tensors for o in t.peft_ops]
    check_applied(expected, merger.applied)


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
            f"adapter changes not applied exactly once: never applied {missing[:10]}, applied twice {twice[:10]}")
