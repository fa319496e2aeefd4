"""The loaded-model Source: a walked model's base tensors and the changes read off its live PEFT modules, handed to
the one row merge on a device chosen within the memory budget; re-quantization to 4-bit, side files and record."""

from __future__ import annotations

from typing import Callable

import torch

from ..engine.budget import MemoryBudget
from ..engine.changes import Changes, Scale, TokenRows, WholeDelta, peft_delta
from ..engine.maths import ia3_multiplier, linear_factors, lora_bias_delta
from ..engine.plan import Plan, PlannedTensor
from ..engine.row_merge import RowMerger, check_applied, choose_device
from ..engine.task_vectors import TaskVectorMethod, TaskVectors
from ..errors import MergeCheckError
from ..io.safetensors_io import DTYPES, row_blocks
from ..options import DEFAULT_CHUNK_ELEMS
from ..output.record import live_merge_info
from ..output.side_files import copy_base_side_files
from .host_slabs import HostSlabs
from .walk import (
    LiveEntry,
    LiveModel,
    change_key,
    materialized,
    offload_owner,
)
from .weights import entry_base


class LiveMerger(RowMerger):
    """Produces each output tensor of a walked model, within the memory budget.

    Attributes:
        live: the walked model.
        budget: the memory budget (``maximum_memory_usage``).
        out_dtype: the dtype the tensors will be written in (range check, rounding count).
        weights: per adapter, the weight its changes are multiplied by.
        combination: ``"cat"`` or ``"linear"`` (PEFT's ``add_weighted_adapter`` combinations), or a task-vector
            method's name.
        vectors: the task-vector method of such a combination (each adapter's factors are then kept apart, with their
            own scaling, and combined per tensor), else None.
        repacked: 4-bit weights bitsandbytes had repacked for its CPU kernel.
        chunk_elems: elements per row block.
    """

    def __init__(
        self,
        live: LiveModel,
        budget: MemoryBudget,
        out_dtype: torch.dtype = torch.float32,
        weights: dict[str, float] | None = None,
        combination: str = "cat",
        chunk_elems: int = DEFAULT_CHUNK_ELEMS,
        vectors: TaskVectorMethod | None = None,
    ):
        super().__init__(chunk_elems)
        self.live = live
        self.weights = weights or {}
        self.combination = combination
        self.vectors = vectors
        self.budget = budget
        self.out_dtype = out_dtype
        self.repacked: list[str] = []

    def compute_device(self, entry: LiveEntry) -> torch.device:
        """Where an entry is merged: where its weight lives (an offloaded one: its execution device) while its
        working set (an fp32 copy and one more) fits the budget, else the CPU.

        Args:
            entry: the entry.

        Returns:
            The device.
        """
        tensor = getattr(entry.holder, entry.attr, None)
        dev = (
            tensor.device
            if tensor is not None and entry.kind in ("lora", "quantized", "delta", "ia3")
            else torch.device("cpu")
        )
        if dev.type == "meta":
            hooks = (
                getattr(entry.holder, "_hf_hook", None),  # the layer's own hook first (a dispatched PeftModel)
                getattr(offload_owner(self.live.model, entry.name, entry.holder), "_hf_hook", None),
            )
            dev = torch.device(
                next((h.execution_device for h in hooks if getattr(h, "execution_device", None) is not None), "cpu")
            )
        return choose_device(entry.name, dev, entry.numel * 4 * 2, self.budget)

    def produce(self, entry: LiveEntry) -> torch.Tensor:
        """The tensor in the output layout (float32 for merged weights; as stored for plain tensors).

        Args:
            entry: the entry.

        Returns:
            The tensor, on the device it was merged on.

        Raises:
            MergeCheckError: the self-check failed, a NaN or Inf, or a value beyond float16's range.
        """
        with materialized(offload_owner(self.live.model, entry.name, entry.holder)):
            if entry.kind in ("plain", "saved"):
                return (
                    getattr(entry.holder, entry.attr)
                    if "." not in entry.attr
                    else entry.holder.state_dict(keep_vars=True)[entry.attr]
                )
            if entry.kind in ("tokens", "lora_bias"):  # merged where the tensor lives
                dev = getattr(entry.holder, entry.attr).device
            else:
                dev = self.compute_device(entry)
            return self.on_device(lambda d: self._merge_weight(entry, d), dev, entry.name)

    def _merge_weight(self, entry: LiveEntry, device: torch.device) -> torch.Tensor:
        """One entry merged whole on ``device``: its base (dequantized) and its changes through the row merge."""
        notes: list[str] = []
        w = entry_base(entry, device, notes)
        if notes:
            self.repacked.append(entry.name)
        changes = self.changes(entry)
        if not changes.empty:
            flat = w.reshape(w.shape[0], -1) if w.dim() > 1 else w
            for start, stop, merged, _ in self.merge_rows(
                entry.name, lambda a, b: flat[a:b], changes, tuple(w.shape), self.out_dtype, device, inplace=True
            ):
                if merged.data_ptr() != flat[start:stop].data_ptr():  # else merged in place already
                    flat[start:stop] = merged.reshape(flat[start:stop].shape)
        return w.T if entry.transpose_out else w

    def changes(self, entry: LiveEntry) -> Changes:
        """The changes of an entry, read off its live PEFT module (scaled by each adapter's weight).

        Args:
            entry: a ``"lora"``, ``"lora_bias"``, ``"tokens"``, ``"delta"``, ``"ia3"`` or ``"quantized"`` entry.

        Returns:
            The :class:`~peft_shardmerge.engine.changes.Changes` (none for a quantized base without adapter).

        Raises:
            RuntimeError: from torch, when the adapters' ranks differ in a ``"linear"`` combination.
        """
        m, adapters = entry.module, entry.adapters
        counted = (
            bool(adapters)
            and not (entry.kind == "ia3" and entry.attr == "bias")
            and not (entry.kind == "tokens" and m.tied_adapter is not None)
        )  # a tied head shares the embedding's rows
        keys = [change_key(entry)] if counted and entry.kind != "lora_bias" else []
        if entry.kind == "tokens":
            return Changes(
                tokens=[
                    TokenRows(torch.tensor(m.token_indices[a]), m.trainable_tokens_delta[a].detach().float())
                    for a in adapters
                ],
                keys=keys,
            )
        if entry.kind == "lora_bias":
            return Changes(
                bias_deltas=[lora_bias_delta(m.lora_B[a].bias.detach(), self._scaling(m, a)) for a in adapters]
            )
        if entry.kind in ("delta", "ia3"):
            return Changes(peft=[self._peft_change(entry, a) for a in adapters], keys=keys)
        if entry.kind != "lora":
            return Changes()
        return self._lora_changes(entry, keys)

    def _scaling(self, module, adapter: str) -> float:
        return module.scaling[adapter] * self.weights.get(adapter, 1.0)

    def _peft_change(self, entry: LiveEntry, adapter: str) -> WholeDelta | Scale:
        """PEFT's own delta of a LoHa/LoKr/VeRA layer or LoRA on a parameter, or IA3's scaling."""
        layer = entry.module
        shape = entry.shape[::-1] if entry.transpose_out else entry.shape  # as held (a 4-bit weight is packed)
        if entry.kind == "ia3":
            return Scale(
                *ia3_multiplier(
                    layer.ia3_l[adapter].detach(),
                    shape,
                    feedforward=layer.is_feedforward,
                    bias=entry.attr == "bias",
                    fan_in_fan_out=getattr(layer, "fan_in_fan_out", False),
                )
            )
        delta = peft_delta(layer, adapter) * self.weights.get(adapter, 1.0)
        return WholeDelta(delta.reshape(shape[0], -1) if len(shape) > 1 else delta)

    def _lora_changes(self, entry: LiveEntry, keys: list[str]) -> Changes:
        """LoRA factors (convolution factors flattened like the weight's rows) and DoRA magnitudes."""
        m = entry.module
        factors = []
        for a in entry.adapters:
            if a in m.lora_A:
                factors.append(
                    (
                        m.lora_A[a].weight.detach().flatten(1),
                        m.lora_B[a].weight.detach().flatten(1),
                        self._scaling(m, a),
                    )
                )
            else:
                factors.append((m.lora_embedding_A[a].detach(), m.lora_embedding_B[a].detach(), self._scaling(m, a)))
        if self.combination == "linear" and len(factors) > 1:
            factors = [linear_factors(factors)]
        embedding = bool(entry.adapters) and entry.adapters[0] in m.lora_embedding_A
        transposed = embedding or bool(getattr(m, "fan_in_fan_out", False))
        if self.vectors is not None and factors:  # each adapter's own factors (not weighted), in the method's order
            own = {a: (a_, b_, m.scaling[a]) for a, (a_, b_, _) in zip(entry.adapters, factors)}
            groups = [[own[a]] if a in own else [] for a in self.weights]
            return Changes(vectors=TaskVectors(self.vectors, groups, entry.name), transposed=transposed, keys=keys)
        magnitudes = [
            m.lora_magnitude_vector[a].weight.detach().reshape(-1)
            for a in entry.adapters
            if getattr(m, "use_dora", {}).get(a)
        ]
        return Changes(factors=factors, transposed=transposed, magnitudes=magnitudes, keys=keys)


REPACKED_NOTE = (
    "{} 4-bit weight(s) were repacked by bitsandbytes for its CPU kernel, which rounds their block scales to bf16: "
    "they are merged within that loss (verify names it where it shows). For the exact merge, reload the model with "
    "support_avx512bf16_for_cpu = False on every Linear4bit, load the adapter and merge again "
    '(docs/after-training.md, "bitsandbytes\' CPU repacking")'
)


def _rows(data: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of a tensor; a 0-dim tensor (a scalar parameter) is its one row."""
    return data[start:stop] if data.dim() else data.reshape(1)


class ModelReader:
    """The loaded-model :class:`~peft_shardmerge.engine.source.Source`: each planned tensor produced whole, in plan
    order on the executor's thread, on the device the budget allows (retried on the CPU on out-of-memory); then
    written in row blocks, by worker threads when there are several (the module copied out first, block by block in
    the output dtype into reused host buffers, so that the workers only hash and write it while the next module is
    merged).

    Args:
        plan: a loaded model's plan (from :func:`~peft_shardmerge.model.planner.plan_live`).
        budget: the memory budget (``maximum_memory_usage``).
        merge_info: the record's ``merge`` part when the caller took it already (an FSDP1 model holds no whole
            parameter outside its planning view); default: taken from the model when the output is complete.
        copy: always copy what is written (a gathered FSDP unit's storage must be free of the writer's views when
            it is released).
        workers: threads that write (1: the executor's thread merges and writes, one module after the other).

    Attributes:
        merger: the :class:`LiveMerger` that produces each module's tensors.
        counts: what it counted (:class:`~peft_shardmerge.engine.row_merge.MergeCounts`).
        ahead: one module per worker, and the next one, prepared and not yet written (each held in the output dtype
            on the CPU until written)...
        held_limit: ...and at most the largest planned tensor's bytes of them at once (one module waiting for its
            write, or several small ones; None with one worker, which writes each module as it is merged).
    """

    one_torch_thread = False  # the workers only hash and write: the merge keeps torch's threads

    def __init__(
        self, plan: Plan, budget: MemoryBudget, merge_info: dict | None = None, copy: bool = False, workers: int = 1
    ):
        src = plan.inputs
        self.merger = LiveMerger(
            src.live, budget, plan.dtype, src.weights, src.combination, plan.chunk_elems, src.vectors
        )
        self.live, self.counts, self.chunk_elems = src.live, self.merger.counts, plan.chunk_elems
        self.plan, self.src, self.info, self.copy = plan, src, merge_info, copy
        self.workers, self.ahead = workers, workers + 1
        self.held_limit = max((t.nbytes for t in plan.tensors), default=0) if workers > 1 else None
        # host buffers for blocks copied out, by whether they are page-locked (for a GPU's blocks)
        block_bytes = self.chunk_elems * self.plan.dtype.itemsize
        self._slabs = {pinned: HostSlabs(block_bytes, pinned) for pinned in (False, True)}
        self._narrow_on_device = True

    def prepare(self, t: PlannedTensor) -> Callable[[object], None]:
        """Produce one planned tensor (an entry merged whole), in plan order: the
        walk, the memory budget and a job's gathers follow it.

        Args:
            t: the planned tensor.

        Returns:
            ``write(sink)``, which writes it in row blocks.

        Raises:
            MergeCheckError: the self-check failed, a NaN or Inf, a value beyond float16's range, or a shape or dtype
                other than planned.
        """
        e = t.recipe.entry
        data = self.merger.produce(e)
        if tuple(data.shape) != e.shape:
            raise MergeCheckError(f"{e.name}: produced shape {list(data.shape)}, expected {list(e.shape)}")
        if e.kind != "plain" and not e.adapters and data.is_floating_point() and not torch.isfinite(data.sum()):
            raise MergeCheckError(f"tensor {e.name!r} has NaN or Inf")  # the row merge checked every changed one
        target, blocks = DTYPES[t.out_dtype][0], row_blocks(e.shape, self.chunk_elems)
        if self.workers > 1:  # written later, by a worker: off the device and out of the model's storage now
            parts = self._copied_out(data.detach(), blocks, target, checked=e.kind != "plain")
            return lambda w: self._write_parts(parts, w)
        return lambda w: self._write_blocks(data, blocks, target, self.copy, w)

    def _copied_out(
        self, data: torch.Tensor, blocks, target: torch.dtype, checked: bool
    ) -> list[tuple[torch.Tensor, HostSlabs | None]]:
        """The tensor's row blocks off the device (and out of the model's or a gathered unit's storage) in the output
        dtype, each in a reused host buffer (:class:`~peft_shardmerge.model.host_slabs.HostSlabs`, page-locked for
        a GPU's) and paired with the pool it goes back to: no temporary larger than a block, no page faulted in
        afresh per module. ``checked``: its values are known finite (merged or checked), so narrowing it on the GPU
        gives the host's bytes."""
        if data.device.type == "cpu" and data.dtype == target and not self.copy:
            return [(_rows(data, a, b), None) for a, b in blocks]  # a plain tensor as held: written from where it is
        slabs = self._slabs[data.device.type == "cuda"]
        parts = []
        for start, stop in blocks:
            rows = self._narrowed(_rows(data, start, stop), target) if checked else _rows(data, start, stop)
            part = slabs.take(tuple(rows.shape), target)
            part.copy_(rows)  # from a GPU: waits for the copy, so the buffer is complete when handed on
            parts.append((part, slabs))
        return parts

    def _narrowed(self, rows: torch.Tensor, target: torch.dtype) -> torch.Tensor:
        """Finite rows on an accelerator narrowed to ``target`` where they are (round to nearest even, as on the
        host), so that only the output's bytes cross: torch's copy into a host tensor of a narrower dtype first
        brings the wider rows over into a fresh pageable host tensor, then narrows them there. Left as they are
        where the cast would widen, and for the rest of the merge once the device had no room for it."""
        if rows.device.type == "cpu" or target.itemsize >= rows.element_size() or not self._narrow_on_device:
            return rows
        try:
            return rows.to(target)
        except torch.OutOfMemoryError:
            self._narrow_on_device = False
            return rows

    def _write_parts(self, parts: list[tuple[torch.Tensor, HostSlabs | None]], w) -> None:
        """Write the blocks of :meth:`_copied_out`, each buffer handed back to its pool as soon as it is written."""
        for part, slabs in parts:
            w.write(part)
            if slabs is not None:
                slabs.give(part)

    @staticmethod
    def _write_blocks(data: torch.Tensor, blocks, target: torch.dtype, copy: bool, w) -> None:
        for start, stop in blocks:
            w.write(_rows(data, start, stop).detach().to(device="cpu", dtype=target, copy=copy))

    def skip(self, tensors: list[PlannedTensor]) -> None:
        """Never called: a loaded model's merge keeps no shard of an earlier run."""

    def resume_keys(self) -> None:
        """None: what is in memory has no files to fingerprint, so a rerun starts afresh."""
        return None

    def side_files(self, folder: str) -> None:
        """The base's tokenizer and pipeline files (when it was loaded from a folder), and the generation config."""
        copy_base_side_files(getattr(self.live.model.config, "_name_or_path", "") or "", folder)
        if self.src.generation_config is not None:
            self.src.generation_config.save_pretrained(folder)

    def merge_info(self) -> dict:
        """The record's ``merge`` part, naming the weights read from bitsandbytes' lossy CPU repacking (``verify``
        then knows which tensors cannot equal a recomputation from the original base byte for byte)."""
        src = self.src
        info = self.info or live_merge_info(
            self.live.model, self.plan.dtype, src.adapter_names, src.weights, src.combination, src.vectors
        )
        return {**info, "cpu_repacked": sorted(self.merger.repacked)} if self.merger.repacked else info

    def check(self) -> None:
        """Every LoRA layer of the walked model applied exactly once."""
        check_applied(self.live.lora_layers, self.counts.applied)

    def close(self) -> None:
        """Release the host buffers of the blocks copied out (the model stays the caller's)."""
        for slabs in self._slabs.values():
            slabs.release()

    def report_fields(self) -> dict:
        """The report's fields of a loaded model's merge."""
        live, plan, vectors, repacked = self.live, self.plan, self.merger.vectors, self.merger.repacked
        return dict(
            base=self.src.origin,
            adapter=plan.adapter_text or "(in memory)" + (f" ({vectors.describe()})" if vectors else ""),
            base_precision="dequantized",
            combination=vectors.describe() if vectors else "",
            lora_modules_merged=sum(not k.startswith("tokens:") for k in self.counts.applied),
            replacements_applied=sum(1 for e in live.entries if e.kind == "saved"),
            device=str(next((p.device for p in live.model.parameters()), "cpu")),
            untied=list(live.untied),
            notes=list(plan.notes) + ([REPACKED_NOTE.format(len(repacked))] if repacked else []),
        )
