"""The disk engine's side of the per-tensor merge: a planned tensor's base rows and adapter changes, read from the
checkpoint and adapter files, handed to the one row merge; and the checks every merge ends with."""

from __future__ import annotations

import logging

import torch

from ..engine.changes import ChangeKey, Changes, Scale, TokenRows, WholeDelta
from ..engine.maths import lora_bias_delta
from ..engine.plan import Plan, PlannedTensor
from ..engine.row_merge import RowMerger, check_applied, check_range
from ..io.safetensors_io import DTYPES, RowReader, row_blocks
from ..output.writer import ShardWriter
from ..quant.nf4 import quantize_roundtrip

log = logging.getLogger(__name__)

__all__ = ["PlanMerger", "check_counts", "planned_keys"]


def _flat(factor: torch.Tensor) -> torch.Tensor:
    """A LoRA factor as a float32 matrix (convolution factors ``[r, in, *kernel]`` become ``[r, in * kernel]``)."""
    return factor.float().reshape(factor.shape[0], -1)


def planned_keys(t: PlannedTensor) -> list[ChangeKey]:
    """The count-check keys of the changes a planned tensor receives (LoRA modules, ``lora_bias`` terms, token
    rows, PEFT layers).

    Args:
        t: the planned tensor.

    Returns:
        One key per change.

    Example:
        >>> planned_keys(plan.tensors[0])   # doctest: +SKIP
        [ChangeKey(kind='lora', name='model.layers.0.self_attn.q_proj', tensor='')]
    """
    keys = [ChangeKey("lora", m.key) for m in t.loras]
    keys += [ChangeKey("lora_bias", m.key) for m in t.bias_loras]
    keys += [ChangeKey("tokens", r.key, t.name) for r in t.token_rows]
    return keys + [ChangeKey("peft", o.key) for o in t.peft_ops]


class PlanMerger(RowMerger):
    """State of one execution: reader, device, counters, progress bar.

    Attributes:
        plan: the plan executed.
        device: where LoRA products are computed.
        replacements: tensors taken from the adapter (``modules_to_save``).

    Example:
        >>> merger = PlanMerger(plan, torch.device("cpu"), progress=False)   # doctest: +SKIP
    """

    def __init__(self, plan: Plan, device: torch.device, progress: bool):
        from tqdm.auto import tqdm

        super().__init__(plan.chunk_elems)
        self.plan = plan
        self.device = device
        self.reader = RowReader()
        self.replacements = 0
        self.parts: dict[str, tuple[dict[str, torch.Tensor], int]] = {}
        self.bar = tqdm(total=plan.total_size, unit="B", unit_scale=True, desc="merging", disable=not progress)

    def close(self) -> None:
        """Close the progress bar and the files read."""
        self.bar.close()
        self.reader.close()

    def skip(self, tensors: list[PlannedTensor]) -> None:
        """Account for tensors of a shard kept from an interrupted run (already merged and verified)."""
        for t in tensors:
            self.replacements += t.from_adapter
            self.applied.update(str(k) for k in planned_keys(t))
            self.bar.update(t.nbytes)

    def write_tensor(self, t: PlannedTensor, w: ShardWriter) -> None:
        """Write one planned tensor: its bytes copied, cast, or merged block by block.

        Args:
            t: the planned tensor.
            w: the shard writer (or any sink with ``write`` and ``copy_from``).

        Returns:
            None.

        Raises:
            MergeCheckError: the self-check failed, a NaN or Inf, or a value beyond float16's range.

        Example:
            >>> merger.write_tensor(plan.tensors[0], writer)   # doctest: +SKIP
        """
        src = t.source
        if t.from_adapter:
            self.replacements += 1
        if t.op == "copy":
            w.copy_from(self.reader.fd(src.path), src.offset, src.nbytes)
            self.bar.update(t.nbytes)
            return
        out_dtype = DTYPES[t.out_dtype][0]
        row_bytes = t.nbytes // max(1, t.shape[0] if t.shape else 1)
        if t.op in ("cast", "dequantize"):
            for start, stop in row_blocks(t.shape, self.plan.chunk_elems):
                cast = self.reader.read_rows(src, start, stop).to(out_dtype)
                check_range(t.name, cast, out_dtype)
                w.write(cast)
                self.bar.update((stop - start) * row_bytes)
            return
        for start, stop, _, cast in self.merge_rows(t.name, self._base(t), self.changes(t), t.shape, out_dtype,
                                                    self.device):
            w.write(cast)
            self.bar.update((stop - start) * row_bytes)

    def _base(self, t: PlannedTensor):
        """``rows(start, stop)`` of the base as read, or of dequant(quantize(base)) for a 4-bit base."""
        src = t.source
        if not t.quantize:
            return lambda start, stop: self.reader.read_rows(src, start, stop)
        # bitsandbytes quantizes Conv1D weights as [out, in]: quantize the same layout
        weight = self.reader.read(src)
        whole = quantize_roundtrip(weight.T if t.transposed else weight, self.plan.nf4)
        whole = whole.T.contiguous() if t.transposed else whole
        return lambda start, stop: whole[start:stop]

    def changes(self, t: PlannedTensor) -> Changes:
        """The changes of a planned tensor, read from the adapter's files.

        Args:
            t: the planned tensor.

        Returns:
            The :class:`~peft_shardmerge.engine.changes.Changes`.

        Raises:
            OSError: an adapter file cannot be read.

        Example:
            >>> merger.changes(plan.tensors[1]).keys   # doctest: +SKIP
            ['model.layers.0.self_attn.q_proj']
        """
        load = self.reader
        return Changes(
            factors=[(_flat(m.a.load(load)), _flat(m.b.load(load)), m.scaling) for m in t.loras],
            transposed=t.transposed,
            bias_deltas=[lora_bias_delta(m.bias.load(load), m.scaling) for m in t.bias_loras if m.bias],
            magnitudes=[m.magnitude.load(load).float().reshape(-1) for m in t.loras if m.magnitude is not None],
            tokens=[TokenRows(torch.tensor(r.indices), r.rows.load(load).float()) for r in t.token_rows],
            peft=[self._peft_change(o, t) for o in t.peft_ops],
            keys=[str(k) for k in planned_keys(t)])

    def _peft_change(self, o, t: PlannedTensor) -> WholeDelta | Scale:
        """LoHa/LoKr/VeRA/LoRA-on-parameter changes as the whole tensor's delta (``[rows, -1]``, once), IA3 as its
        multiplier."""
        if o.kind == "scale":
            return Scale(*o.scale(t.shape))
        delta = self._part(o) if o.kind == "part" else o.delta()
        return WholeDelta(delta.reshape(t.shape[0], -1))

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


def check_counts(plan: Plan, merger: PlanMerger) -> None:
    """The count check of a checkpoint merge: every LoRA module of the adapter (and its ``lora_bias``), every
    token-row and PEFT change of the plan applied exactly once.

    Args:
        plan: the plan executed.
        merger: its merger.

    Returns:
        None.

    Raises:
        MergeCheckError: naming what was never applied and what was applied more than once.

    Example:
        >>> check_counts(plan, merger)   # doctest: +SKIP
    """
    modules = plan.adapter.modules.values()
    expected = [ChangeKey("lora", m.key) for m in modules]
    expected += [ChangeKey("lora_bias", m.key) for m in modules if m.bias is not None]
    expected += [k for t in plan.tensors for k in planned_keys(t) if k.kind in ("tokens", "peft")]
    check_applied([str(k) for k in expected], merger.applied)


