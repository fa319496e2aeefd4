"""The disk Source: a planned tensor's base rows and adapter changes read from the checkpoint and adapter files,
handed to the one row merge; the side files, record and count check of a merge from disk."""

from __future__ import annotations

import functools
import logging
import os
import shutil
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from ..engine.block_checks import check_range
from ..engine.changes import ChangeKey, Changes, Scale, TokenRows, WholeDelta
from ..engine.maths import lora_bias_delta, one_cpu_thread
from ..engine.plan import Op, Plan, PlannedTensor
from ..engine.row_merge import MergeCounts, RowMerger, check_applied
from ..engine.task_vectors import TaskVectors
from ..io.safetensors_io import DTYPES, RowReader, row_blocks
from ..output.record import disk_merge_info
from ..output.resume import InputDigests
from ..output.side_files import copy_side_files
from ..output.writer import ShardWriter
from ..quant.nf4 import quantize_roundtrip
from .base_folder import TOKENIZER_FILES

log = logging.getLogger(__name__)

__all__ = ["CheckpointReader", "check_counts", "planned_keys"]


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
    """
    keys = [ChangeKey("lora", m.key) for m in t.recipe.loras]
    keys += [ChangeKey("lora_bias", m.key) for m in t.recipe.bias_loras]
    keys += [ChangeKey("tokens", r.key, t.name) for r in t.recipe.token_rows]
    return keys + [ChangeKey("peft", o.key) for o in t.recipe.peft_ops]


class CheckpointReader:
    """The disk :class:`~peft_shardmerge.engine.source.Source`: each planned tensor copied, cast or merged from the
    checkpoint's and adapter's files, one row block at a time.

    Args:
        plan: the plan carried out.
        device: where LoRA products are computed.
        resume: offer the executor the plan's fingerprint and input digests, so that a rerun keeps finished shards.
        workers: tensors produced at once, on as many threads (:mod:`~peft_shardmerge.engine.pipeline`).

    Attributes:
        merger: the :class:`~peft_shardmerge.engine.row_merge.RowMerger` every merged tensor goes through.
        counts: what it counted (:class:`~peft_shardmerge.engine.row_merge.MergeCounts`; ``replaced``: tensors taken
            from the adapter, ``modules_to_save``).
        ahead: twice the workers (a tensor in flight holds a row block: one being merged, one handed out beside it).
    """

    one_torch_thread = True  # each worker merges with torch ops of its own
    held_limit = None  # a tensor in flight holds a row block

    def __init__(self, plan: Plan, device: torch.device = torch.device("cpu"), resume: bool = False, workers: int = 1):
        self.merger = RowMerger(plan.chunk_elems)
        self.counts, self.lock = self.merger.counts, self.merger.lock
        if device.type == "cuda" and device.index is None:  # worker threads start on GPU 0: name the caller's GPU
            device = torch.device("cuda", torch.cuda.current_device())
        self.plan = plan
        self.workers = workers
        self.ahead = 2 * workers
        self._local = threading.local()
        self.device = device
        self.resume = resume
        self.reader = RowReader()
        self.parts: dict[str, tuple[dict[str, torch.Tensor], int]] = {}

    def close(self) -> None:
        """Close the files read."""
        self.reader.close()

    def skip(self, tensors: list[PlannedTensor]) -> None:
        """Count the changes of tensors of a shard kept from an interrupted run (already merged and verified)."""
        with self.lock:
            for t in tensors:
                self.counts.replaced += t.recipe.from_adapter
                self.counts.applied.update(str(k) for k in planned_keys(t))

    def resume_keys(self) -> tuple[str, InputDigests] | None:
        """The plan's fingerprint and its inputs' digests (None without ``resume``)."""
        return (self.plan.fingerprint(), InputDigests(self.plan)) if self.resume else None

    def side_files(self, folder: str) -> None:
        """Every non-weight file of the base the allowlist carries (tokenizer, sentence-transformers pipeline,
        README...), then the adapter's tokenizer files, which replace the base's tokenizer as a whole."""
        base, adapter = self.plan.inputs.base, self.plan.inputs.adapter
        skip = TOKENIZER_FILES if adapter.tokenizer_files else ()
        written = set(self.plan.shard_names) | {"model.safetensors.index.json"}
        copy_side_files(base.folder, folder, [n for n in base.extra_files if n not in written], skip=skip)
        for fname in adapter.tokenizer_files:
            shutil.copyfile(os.path.join(adapter.folder, fname), os.path.join(folder, fname))

    def merge_info(self) -> dict:
        """The record's ``merge`` part: inputs, options and the adapter's files."""
        return disk_merge_info(self.plan)

    def check(self) -> None:
        """Every LoRA module, ``lora_bias``, token row and PEFT change of the plan applied exactly once."""
        check_counts(self.plan, self.counts)

    def report_fields(self) -> dict:
        """The report's fields of a merge from disk."""
        plan = self.plan
        return dict(
            base=plan.inputs.base.folder,
            adapter=plan.adapter_text  # a loaded model's adapters, their combination included
            or ", ".join(plan.inputs.adapter.folders)
            + (f" ({plan.inputs.adapter.combination})" if plan.inputs.adapter.combination else ""),
            base_precision=plan.base_precision,
            lora_modules_merged=len(
                {
                    k.split("@")[0]
                    for k in self.counts.applied
                    if not k.endswith((".bias", "::bias")) and not k.startswith("tokens:")
                }
            ),
            replacements_applied=self.counts.replaced,
            combination=plan.inputs.adapter.combination,
            device=str(self.device),
            untied=list(plan.untied),
            notes=list(plan.notes),
        )

    def prepare(self, t: PlannedTensor) -> Callable[[ShardWriter], None]:
        """Nothing to do in plan order: the whole of ``t``'s work is :meth:`write_tensor`, on a worker.

        Args:
            t: the planned tensor.

        Returns:
            ``write(sink)``.
        """
        return functools.partial(self.write_tensor, t)

    def write_tensor(self, t: PlannedTensor, w: ShardWriter) -> None:
        """Write one planned tensor: its bytes copied, cast, or merged block by block (with several workers on a
        GPU, each worker thread on its own CUDA stream, so that one's copies overlap another's kernels).

        Args:
            t: the planned tensor.
            w: the shard writer (or any sink with ``write`` and ``copy_from``).

        Returns:
            None.

        Raises:
            MergeCheckError: the self-check failed, a NaN or Inf, or a value beyond float16's range.
        """
        with self._stream():
            self._write_tensor(t, w)

    @contextmanager
    def _stream(self) -> Iterator[None]:
        """This worker thread's own CUDA stream, where several workers share a GPU."""
        if self.device.type != "cuda" or self.workers == 1:
            yield
            return
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            yield

    def _write_tensor(self, t: PlannedTensor, w: ShardWriter) -> None:
        src = t.source
        if t.recipe.from_adapter:
            with self.lock:
                self.counts.replaced += 1
        if t.op is Op.COPY:
            w.copy_from(self.reader.fd(src.path), src.offset, src.nbytes)
            return
        out_dtype = DTYPES[t.out_dtype][0]
        if t.op in (Op.CAST, Op.DEQUANTIZE):
            for start, stop in row_blocks(t.shape, self.plan.chunk_elems):
                cast = self.reader.read_rows(src, start, stop).to(out_dtype)
                check_range(t.name, cast, out_dtype)
                w.write(cast)
            return
        blocks = self.merger.merge_rows(t.name, self._base(t), self.changes(t), t.shape, out_dtype, self.device)
        for *_, merged, cast in blocks:
            w.write(cast)  # copied to the host there
            del merged, cast  # not held on the device while the next block is merged

    def _base(self, t: PlannedTensor):
        """``rows(start, stop)`` of the base as read, or of dequant(quantize(base)) for a 4-bit base."""
        src = t.source
        if not t.recipe.quantize:
            return lambda start, stop: self.reader.read_rows(src, start, stop)
        # bitsandbytes quantizes Conv1D weights as [out, in]: quantize the same layout
        weight = self.reader.read(src)
        with one_cpu_thread(torch.device("cpu")):  # bitsandbytes' reductions: the same sums whatever the workers
            whole = quantize_roundtrip(weight.T if t.recipe.transposed else weight, self.plan.inputs.nf4)
        whole = whole.T.contiguous() if t.recipe.transposed else whole
        return lambda start, stop: whole[start:stop]

    def changes(self, t: PlannedTensor) -> Changes:
        """The changes of a planned tensor, read from the adapter's files.

        Args:
            t: the planned tensor.

        Returns:
            The :class:`~peft_shardmerge.engine.changes.Changes`.

        Raises:
            OSError: an adapter file cannot be read.
        """
        load = self.reader
        factors = [(_flat(m.a.load(load)), _flat(m.b.load(load)), m.scaling) for m in t.recipe.loras]
        method = self.plan.inputs.adapter.vectors
        vectors = None
        if method is not None and factors:  # each adapter's factors apart, combined by the method
            groups = [[f for f, m in zip(factors, t.recipe.loras) if m.index == i] for i in range(len(method.weights))]
            factors, vectors = [], TaskVectors(method, groups, t.name)
        return Changes(
            factors=factors,
            vectors=vectors,
            transposed=t.recipe.transposed,
            bias_deltas=[lora_bias_delta(m.bias.load(load), m.scaling) for m in t.recipe.bias_loras if m.bias],
            magnitudes=[m.magnitude.load(load).float().reshape(-1) for m in t.recipe.loras if m.magnitude is not None],
            tokens=[TokenRows(torch.tensor(r.indices), r.rows.load(load).float()) for r in t.recipe.token_rows],
            peft=[self._peft_change(o, t) for o in t.recipe.peft_ops],
            keys=[str(k) for k in planned_keys(t)],
        )

    def _peft_change(self, o, t: PlannedTensor) -> WholeDelta | Scale:
        """LoHa/LoKr/VeRA/LoRA-on-parameter changes as the whole tensor's delta (``[rows, -1]``, once), IA3 as its
        multiplier."""
        # PEFT's layers build these deltas one at a time, on one intra-op thread whatever the workers (same sums)
        with self.lock, one_cpu_thread(torch.device("cpu")):
            if o.kind == "scale":
                return Scale(*o.scale(t.shape))
            delta = self._part(o) if o.kind == "part" else o.delta()
        return WholeDelta(delta.reshape(t.shape[0], -1))

    def _part(self, part) -> torch.Tensor:
        """One checkpoint key's slice of a delta the checkpoint stores in parts: from that expert's factors alone
        when the layout allows, else the whole delta is computed and cut once, and dropped when its last part is
        written."""
        own = self.plan.inputs.adapter.layers.part_delta(part.op, part.memory_name, part.file_name)
        if own is not None:
            return own
        if part.memory_name not in self.parts:
            delta = part.op.delta()
            self.parts[part.memory_name] = (self.plan.inputs.adapter.layers.split(part.memory_name, delta), part.count)
        pieces, left = self.parts[part.memory_name]
        if left == 1:
            del self.parts[part.memory_name]
        else:
            self.parts[part.memory_name] = (pieces, left - 1)
        return pieces[part.file_name].float()


def check_counts(plan: Plan, counts: MergeCounts) -> None:
    """The count check of a checkpoint merge: every LoRA module of the adapter (and its ``lora_bias``), every
    token-row and PEFT change of the plan applied exactly once.

    Args:
        plan: the plan executed.
        counts: what its source counted.

    Returns:
        None.

    Raises:
        MergeCheckError: naming what was never applied and what was applied more than once.
    """
    modules = plan.inputs.adapter.modules.values()
    expected = [ChangeKey("lora", m.key) for m in modules]
    expected += [ChangeKey("lora_bias", m.key) for m in modules if m.bias is not None]
    expected += [k for t in plan.tensors for k in planned_keys(t) if k.kind in ("tokens", "peft")]
    check_applied([str(k) for k in expected], counts.applied)
