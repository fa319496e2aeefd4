"""The MergeReport: what a merge did, in numbers, and its one-screen summary."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

#: what a merge from disk reproduces, by base precision (in process, the merge says it itself)
_FROM_DISK = {
    "original": "the original base + adapter (for a QLoRA adapter, not the 4-bit model it was trained on: "
    "base precision nf4 reproduces that)",
    "nf4": "the QLoRA-trained model (dequant(nf4(W)) + adapter)",
}


@dataclass
class MergeReport:
    """What a merge wrote and how it went.

    Attributes:
        out_dir: the output folder (not written for a dry run).
        base: the base checkpoint folder.
        adapter: the adapter folder.
        dtype: the floating-point dtype written, e.g. ``"bfloat16"``.
        base_precision: ``"original"`` or ``"nf4"`` (what the deltas were added to).
        tensors_written: output tensors.
        lora_modules_merged: LoRA modules applied (equals ``lora_modules_total`` after a successful merge).
        lora_modules_total: LoRA modules in the adapter.
        replacements_applied: whole tensors taken from the adapter (``modules_to_save``, trained biases).
        shards: output safetensors file names.
        bytes_written: tensor bytes written (the index's ``total_size``).
        wall_time_s: seconds from planning to commit.
        peak_rss_bytes: the process's peak resident memory during the merge (not before it: a model's loading is
            not counted), measured as ``peak_rss_method`` says.
        baseline_rss_bytes: resident memory when the merge started.
        peak_rss_method: how ``peak_rss_bytes`` was measured (sampling while the merge runs;
            :mod:`peft_shardmerge.engine.rss`).
        cpu_fallbacks: row blocks recomputed on the CPU after an accelerator out-of-memory.
        device: where the merge maths ran.
        untied: tied weights written separately.
        notes: things worth knowing about this merge.
        self_check_max_rel_err: the worst relative error of the per-block self-check, (W + dW) x against
            W x + lora(x) for random probe vectors x, in fp32 before casting.
        swallowed: per merged tensor, the fraction of its entries that the output dtype rounded back to the base
            value, so that the LoRA update is lost there (16-bit outputs; estimated on the self-check's rows).
        dry_run: True when nothing was written.
        plan_text: the printed plan, for dry runs.
        reproduces: what the written model reproduces (the trained model, or the original base + adapter).
        combination: how several adapters were combined, with the method's parameters (e.g. ``"ties (weights 0.7,
            0.3; density 0.5; majority sign total; normalized)"``), or "" for one adapter.
    """

    out_dir: str
    base: str
    adapter: str
    dtype: str
    base_precision: str
    tensors_written: int = 0
    lora_modules_merged: int = 0
    lora_modules_total: int = 0
    replacements_applied: int = 0
    shards: list[str] = field(default_factory=list)
    bytes_written: int = 0
    wall_time_s: float = 0.0
    peak_rss_bytes: int = 0
    baseline_rss_bytes: int = 0
    peak_rss_method: str = ""
    cpu_fallbacks: int = 0
    device: str = "cpu"
    untied: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    self_check_max_rel_err: float = 0.0
    swallowed: dict[str, float] = field(default_factory=dict)
    dry_run: bool = False
    plan_text: str = ""
    reproduces: str = ""
    combination: str = ""

    def __repr__(self) -> str:
        """A one-line repr (a notebook cell that ends with a save shows this, not every field).

        Example:
            >>> MergeReport("out", "base", "adapter", "bfloat16", "original", shards=["model.safetensors"])
            MergeReport(out_dir='out', dtype='bfloat16', base_precision='original', LoRA modules 0/0, 1 shard(s), 0 bytes)
        """  # noqa: E501 - a doctest's expected output is one line
        if self.dry_run:
            return f"MergeReport(dry run, out_dir={self.out_dir!r})"
        return (
            f"MergeReport(out_dir={self.out_dir!r}, dtype={self.dtype!r}, base_precision={self.base_precision!r}, "
            f"LoRA modules {self.lora_modules_merged}/{self.lora_modules_total}, {len(self.shards)} shard(s), "
            f"{self.bytes_written} bytes)"
        )

    def summary(self) -> str:
        """A one-screen summary of the merge.

        Returns:
            Several lines of text.

        Example:
            >>> print(MergeReport("out", "base", "adapter", "bfloat16", "original").summary())  # doctest: +ELLIPSIS
            merged base + adapter -> out...
        """
        if self.dry_run:
            return self.plan_text
        gb = self.bytes_written / 1e9
        lines = [
            f"merged {self.base} + {self.adapter} -> {self.out_dir}",
            f"  dtype {self.dtype}, base precision {self.base_precision}, device {self.device}",
            *(
                [f"  reproduces {self.reproduces or _FROM_DISK.get(self.base_precision)}"]
                if self.reproduces or self.base_precision in _FROM_DISK
                else []
            ),
            f"  tensors {self.tensors_written}, LoRA modules merged {self.lora_modules_merged}/"
            f"{self.lora_modules_total}, tensors from adapter {self.replacements_applied}",
            f"  shards {len(self.shards)}, {self.bytes_written} bytes ({gb:.3f} GB)",
            (
                f"  wall time {self.wall_time_s:.2f} s, "
                f"peak RSS during the merge {self.peak_rss_bytes / 2**20:.0f} MiB "
                f"(+{max(0, self.peak_rss_bytes - self.baseline_rss_bytes) / 2**20:.0f} MiB over the "
                f"{self.baseline_rss_bytes / 2**20:.0f} MiB at its start)"
                + (f", measured by {self.peak_rss_method}" if self.peak_rss_method else "")
            ),
        ]
        if self.self_check_max_rel_err:
            lines.append(
                f"  self-check: (W + dW) x vs W x + lora(x) on random probes, max relative error "
                f"{self.self_check_max_rel_err:.1e}"
            )
        if self.cpu_fallbacks:
            lines.append(f"  {self.cpu_fallbacks} block(s) redone on the CPU after out-of-memory")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def bar_disabled(progress: bool) -> bool | None:
    """tqdm's ``disable`` for a progress bar the caller asked for or not: off when not asked; shown in a notebook
    (its output is no terminal, but bars are what it shows); else None, which tqdm takes as "only on a terminal", so a
    log file or CI output gets no bar.

    Args:
        progress: whether the caller wants a bar.

    Returns:
        True, False or None.

    Example:
        >>> bar_disabled(False), bar_disabled(True) in (None, False)
        (True, True)
    """
    if not progress:
        return True
    return False if "ipykernel" in sys.modules else None
