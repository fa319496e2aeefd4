"""Checking a merged checkpoint on disk: its bytes against the merge record, files, index, values, config, and,
with base + adapter, every tensor recomputed and the logits."""

from __future__ import annotations

import json
import logging
import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..checkpoint.base_folder import INDEX_FILE, SINGLE_FILE, safe_shard_name
from ..errors import NotFoundError, ShardMergeError
from ..io.safetensors_io import DTYPES, FLOAT_DTYPES, RowReader, read_header, row_blocks
from ..output.record import RECORD_FILE
from ..support.model_info import inspect_model
from .integrity import check_integrity, read_record
from .logits import check_logits
from .recompute import recompute_and_compare

log = logging.getLogger(__name__)

#: exit status of ``peft-shardmerge verify`` for each verdict
EXIT_CODES = {"OK": 0, "FAILED": 1, "UNCHECKED": 3}


@dataclass
class VerifyReport:
    """The outcome of :func:`verify_checkpoint`.

    Attributes:
        folder: the checked folder.
        status: ``"OK"`` (no problem, and the bytes were checked against the merge record or recomputed from
            base + adapter), ``"FAILED"`` (at least one problem) or ``"UNCHECKED"`` (no problem found, but
            nothing to check the bytes against: no merge record and no base + adapter, a file a loader reads
            was added after the merge, or base + adapter could not be run as the logits' reference).
        ok: True when ``status`` is ``"OK"``.
        problems: every problem found, each a sentence.
        checks: what was checked, one line each.
        notes: limits of the checks and files not covered, one line each.
        tensors: tensors found.
        integrity: True when every byte matched the merge record, False when it did not, None without a record.
        recomputed: True when every tensor was recomputed from base + adapter and matched, False when one did
            not, None when not recomputed.
        unchecked_files: files added after the merge that a loader reads and no record covers.
        unchecked: checks that could not be made because their reference could not be built, each with the reason
            (e.g. base + adapter that transformers cannot load); the verdict is then ``"UNCHECKED"``, not OK.
        logits_max_rel_err: max |logits(merged) - logits(base + adapter)| / max |logits(base + adapter)|,
            when base and adapter were given (of the hidden states, for a model without an LM head).
    """

    folder: str
    status: str = "OK"
    ok: bool = True
    problems: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    tensors: int = 0
    integrity: bool | None = None
    recomputed: bool | None = None
    logits_max_rel_err: float | None = None
    unchecked_files: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """The command's exit status: 0 OK, 1 FAILED, 3 UNCHECKED."""
        return EXIT_CODES[self.status]

    def summary(self) -> str:
        """The verdict and what was checked.

        Returns:
            Several lines of text; the first is ``OK: …``, ``FAILED: …`` or ``UNCHECKED: …``.

        Example:
            >>> print(VerifyReport("merged").summary())
            OK: merged
        """
        return "\n".join(
            [f"{self.status}: {self.folder}"]
            + [f"  checked: {c}" for c in self.checks]
            + [f"  note: {n}" for n in self.notes]
            + [f"  unchecked: {u}" for u in self.unchecked]
            + [f"  problem: {p}" for p in self.problems]
        )


def verify_checkpoint(
    folder: str,
    *,
    base: str | None = None,
    adapter: str | list[str] | None = None,
    prompts: list[str] | None = None,
    tolerance: float | None = None,
    device: str = "cpu",
) -> VerifyReport:
    """Check a merged checkpoint.

    Without inputs: every byte against the SHA-256 digests of ``merge_manifest.json`` (written with the output:
    each tensor, each shard's header and size, ``config.json``, the index and every other file), shards or weight
    files missing or added; then every indexed tensor present once with a valid header, ``format`` metadata,
    no NaN/Inf, names and shapes the model class expects, and config consistency (dtype, vocabulary, tied
    embeddings). A folder without a record gets these structural checks only, and the verdict ``UNCHECKED``.

    With ``base`` and ``adapter``: every tensor is recomputed by the disk engine's own plan and merge code, one
    row block at a time, into the base precision the record names (original, nf4, or the dequantized 4-bit base
    of an in-process merge), and compared byte for byte, or within one rounding where the result can differ;
    then the logits of the merged model against base + adapter (loaded in 4-bit when the merge used a 4-bit base),
    or its hidden states for a model without an LM head (``BertModel``, sentence-transformers).

    Args:
        folder: the merged checkpoint.
        base: the base checkpoint the merge came from.
        adapter: the adapter that was merged, or the adapters of a combination in their order.
        prompts: texts to compare logits on (needs a tokenizer in ``folder`` or ``base``); random token ids
            when None.
        tolerance: largest accepted relative logits error; default 1e-4 for fp32 checkpoints, 3e-2 for 16-bit.
        device: where the recomputation runs (``"cpu"``, ``"cuda"`` or ``"auto"``).

    Returns:
        The :class:`VerifyReport`: ``status`` ``"OK"``, ``"FAILED"`` (each problem listed) or ``"UNCHECKED"``.

    Raises:
        NotFoundError: ``folder`` is not a folder or has no ``config.json``.
    """
    report = VerifyReport(os.path.abspath(folder))
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise NotFoundError(f"{folder} has no config.json; is it a checkpoint folder?")
    adapters = [adapter] if isinstance(adapter, str) else list(adapter or [])
    with _quiet():
        stage(report, "the merge record", _check_record, folder, report)
        config = stage(report, "config.json", _read_config, folder, report)
        tensors = stage(report, "the shards", _check_files, folder, report)
        if tensors and not report.integrity:  # with the record intact, its read found NaN/Inf already
            stage(report, "the values", _check_values, tensors, report)
        if tensors and config is not None:
            stage(report, "names and config", _check_names_and_config, folder, config, tensors, report)
        if base is not None and adapters and tensors:
            record = _record_merge(folder)
            done = stage(
                report, "the recomputation", _check_recompute, tensors, base, adapters, record, device, report
            )
            if done:
                stage(
                    report,
                    "the logits",
                    check_logits,
                    folder,
                    base,
                    adapters,
                    prompts,
                    tolerance,
                    config or {},
                    record,
                    report,
                )
    return settle(
        report,
        f"the bytes were not checked: there is no {RECORD_FILE} (the folder was not written "
        "by this version of peft-shardmerge); give --base and --adapter to recompute them",
    )


def settle(report: VerifyReport, unchecked: str) -> VerifyReport:
    """The verdict of the checks made: FAILED on any problem, OK where the bytes were checked against the record or
    recomputed, else UNCHECKED with ``unchecked`` as its note.

    Args:
        report: the report, its checks made.
        unchecked: why the bytes were not checked, for a report with neither record nor recomputation.

    Returns:
        ``report``, its ``status`` and ``ok`` set.

    Example:
        >>> settle(VerifyReport("x"), "no record").status
        'UNCHECKED'
    """
    if report.problems:
        report.status = "FAILED"
    elif report.unchecked_files or report.unchecked:
        report.status = "UNCHECKED"
    elif report.integrity or report.recomputed:
        report.status = "OK"
    else:
        report.status = "UNCHECKED"
        report.notes.append(unchecked)
    report.ok = report.status == "OK"
    return report


@contextmanager
def _quiet():
    """transformers, huggingface_hub and PEFT without progress bars, warnings or info logs, restored after."""
    import transformers
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    level = transformers.logging.get_verbosity()
    bars = transformers.utils.logging.is_progress_bar_enabled()
    hub_bars = are_progress_bars_disabled()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    disable_progress_bars()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.logging.set_verbosity(level)
        if bars:
            transformers.utils.logging.enable_progress_bar()
        if not hub_bars:
            enable_progress_bars()


def stage(report: VerifyReport, what: str, fn, *args):
    """Run one check; an error it did not foresee becomes a problem naming the check, never a traceback."""
    try:
        return fn(*args)
    except ShardMergeError as e:
        report.problems.append(f"{what}: {_first_line(e)}")
    except Exception as e:  # a verifier reports what it cannot check
        report.problems.append(f"{what} could not be checked: {type(e).__name__}: {_first_line(e)}")
    return None


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = lines[0] if lines else type(e).__name__
    if getattr(e, "problems", None) and len(e.problems) == 1:
        text = e.problems[0]
    return text if len(text) <= 300 else text[:297] + "..."


def _check_record(folder: str, report: VerifyReport) -> None:
    result = check_integrity(folder)
    report.problems += result.problems
    report.checks += result.checks
    report.notes += result.notes
    report.unchecked_files += result.unchecked
    if result.record is not None:
        report.integrity = not result.problems
        if not report.integrity:
            return
        if result.nonfinite:
            report.problems.append(
                f"NaN or Inf in {len(result.nonfinite)} tensor(s): {', '.join(result.nonfinite[:5])}"
            )
        report.checks.append(
            "no NaN/Inf in any floating-point tensor"
            if not result.nonfinite
            else "NaN/Inf scan of every floating-point tensor"
        )
        merge = result.record.get("merge") or {}
        tool = result.record.get("tool") or {}
        report.checks.append(
            f"written by {tool.get('name')} {tool.get('version')}: {merge.get('path')} merge, base "
            f"precision {merge.get('base_precision')}, dtype {merge.get('dtype')}"
            + (", re-quantized to 4-bit" if merge.get("output_quantization") else "")  # an earlier version's
            + (f", quantized as {merge['quantize'].get('format')}" if merge.get("quantize") else "")
        )
    elif result.problems:
        report.integrity = False


def _record_merge(folder: str) -> dict | None:
    record, _ = read_record(folder)
    return None if record is None else record.get("merge")


def _read_config(folder: str, report: VerifyReport) -> dict | None:
    path = os.path.join(folder, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (ValueError, RecursionError) as e:
        report.problems.append(f"config.json is not valid JSON ({type(e).__name__}); from_pretrained cannot read it")
        return None
    if not isinstance(config, dict):
        report.problems.append("config.json is not a JSON object; from_pretrained cannot read it")
        return None
    return config


def _check_recompute(tensors, base, adapters, record, device, report) -> bool:
    result = recompute_and_compare(tensors, base, adapters, record, device=device)
    report.problems += result.problems
    report.checks += result.checks
    report.notes += result.notes
    report.unchecked += result.unchecked  # within the loss of bitsandbytes' CPU repacking: no verdict
    if result.checks:
        report.recomputed = result.complete
    return result.fits is not False  # the logits are compared unless base + adapter do not fit the checkpoint


def _check_files(folder, report):
    index_path = os.path.join(folder, INDEX_FILE)
    tensors = {}
    try:
        if os.path.exists(index_path):
            try:
                with open(index_path, encoding="utf-8") as f:
                    index = json.load(f)
            except (ValueError, RecursionError) as e:
                report.problems.append(
                    f"{INDEX_FILE} is not valid JSON ({type(e).__name__}); from_pretrained cannot read it"
                )
                return None
            wmap = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(wmap, dict) or not wmap:
                report.problems.append(f"{INDEX_FILE} has no weight_map object; from_pretrained cannot read it")
                return None
            if not isinstance(index.get("metadata"), dict) or "total_size" not in index["metadata"]:
                report.problems.append(f"{INDEX_FILE} has no metadata.total_size (from_pretrained needs it)")
            files = sorted({safe_shard_name(folder, f) for f in wmap.values()})
            present = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))
            for extra in sorted(set(present) - set(files)):
                report.problems.append(f"{os.path.basename(extra)} is not named by the index")
        elif os.path.exists(os.path.join(folder, SINGLE_FILE)):
            wmap, index, files = None, None, [os.path.join(folder, SINGLE_FILE)]
        else:
            raise NotFoundError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        for path in files:
            if not os.path.isfile(path):
                report.problems.append(f"shard {os.path.basename(path)} named by the index is missing")
                continue
            try:
                infos, meta = read_header(path)
            except ShardMergeError as e:
                report.problems.append(_first_line(e))
                continue
            if meta.get("format") != "pt":
                report.problems.append(f"{os.path.basename(path)} lacks {{'format': 'pt'}} metadata")
            for t in infos:
                if t.name in tensors:
                    report.problems.append(
                        f"tensor {t.name} is stored twice ({os.path.basename(path)} and "
                        f"{os.path.basename(tensors[t.name].path)})"
                    )
                tensors[t.name] = t
        if wmap is not None:
            for name, shard in wmap.items():
                if name not in tensors:
                    report.problems.append(f"tensor {name} is in the index but in no shard")
                elif os.path.basename(tensors[name].path) != shard:
                    report.problems.append(
                        f"tensor {name} is in {os.path.basename(tensors[name].path)}, the index says {shard}"
                    )
            for name in sorted(set(tensors) - set(wmap)):
                report.problems.append(f"tensor {name} is in a shard but not in the index")
            total = sum(t.nbytes for t in tensors.values())
            if isinstance(index.get("metadata"), dict) and index["metadata"].get("total_size") not in (None, total):
                report.problems.append(f"index total_size {index['metadata']['total_size']} != {total} tensor bytes")
    except ShardMergeError as e:
        report.problems.append(_first_line(e))
        return None
    report.tensors = len(tensors)
    report.checks.append(f"{len(tensors)} tensors in {len(files)} file(s): headers, offsets, index, format metadata")
    return tensors


def _check_values(tensors, report):
    bad = []
    with RowReader() as reader:
        for t in tensors.values():
            if t.dtype not in FLOAT_DTYPES:
                continue
            for start, stop in row_blocks(t.shape, 1 << 22):
                if not torch.isfinite(reader.read_rows(t, start, stop)).all():
                    bad.append(t.name)
                    break
    if bad:
        report.problems.append(f"NaN or Inf in {len(bad)} tensor(s): {', '.join(bad[:5])}")
    report.checks.append("no NaN/Inf in any floating-point tensor")


def _module_of(name: str, modules) -> str | None:
    """The longest module name among ``modules`` that ``name`` lies under, or None."""
    parts = name.split(".")
    for k in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:k]) in modules:
            return ".".join(parts[:k])
    return None


def _check_names_and_config(folder, config, tensors, report):
    info = inspect_model(folder)
    dtypes = {t.dtype for t in tensors.values() if t.dtype in FLOAT_DTYPES}
    written = str(DTYPES[next(iter(dtypes))][0]).removeprefix("torch.") if len(dtypes) == 1 else None
    declared = config.get("dtype") or config.get("torch_dtype")
    if written and declared and declared != written:
        report.problems.append(f"config.json says dtype {declared} but the tensors are {written}")
    if not info.available:
        report.checks.append("names not checked: the model class could not be built from config.json")
        return
    expected = set(info.state_names)
    if info.tie_enabled:
        expected -= set(info.tied)
    # names as transformers loads them (e.g. LLaVA's language_model.model.* -> model.language_model.*)
    memory = info.memory_names(list(tensors))
    present = {m: n for n, (m, converted) in memory.items() if not converted}
    built = {m for m, converted in memory.values() if converted}  # e.g. fused experts built from per-expert keys
    # a quantized weight's stored parts (bitsandbytes' X.weight.absmax, X.SCB; FP8's X.weight_scale_inv;
    # compressed-tensors' X.weight_packed, X.weight_scale): tensors of a linear module that the class does not hold
    modules = {w.rsplit(".", 1)[0]: w for w in info.linear_weights}
    owner = {m: _module_of(m, modules) for m in present if m not in info.state_names}
    quantized = {m for m, module in owner.items() if module is not None}
    if "quantization_config" in config and not quantized:
        report.problems.append("config.json has a quantization_config but the weights are not quantized")
    packed = {modules[owner[m]] for m in quantized}  # weights stored in another form
    missing = set(expected - set(present) - built - packed)
    missing = sorted(missing - info.load_ignores(sorted(missing), missing=True))
    # what from_pretrained drops without a word (old position_ids, ...) is no problem; nor is a buffer the class
    # computes itself, which it reports and ignores
    unknown = set(present) - info.state_names - quantized
    unknown -= info.load_ignores(sorted(unknown))
    buffers = sorted(present[m] for m in unknown & info.buffers)
    unexpected = sorted(present[m] for m in unknown - info.buffers)
    if buffers:
        report.notes.append(
            f"{len(buffers)} stored tensor(s) are buffers {info.architecture} computes itself; "
            f"from_pretrained ignores them: {', '.join(buffers[:5])}"
        )
    if missing:
        report.problems.append(f"{len(missing)} tensor(s) the model expects are missing: {', '.join(missing[:5])}")
    if unexpected:
        report.problems.append(f"{len(unexpected)} tensor(s) the model does not know: {', '.join(unexpected[:5])}")
    for name in sorted(set(present) & info.state_names):
        if name in info.linear_weights and quantized:
            continue
        shape = tuple(tensors[present[name]].shape)
        if shape != tuple(info.shapes.get(name, shape)):
            report.problems.append(
                f"{present[name]} has shape {list(shape)}, the config implies {list(info.shapes[name])}"
            )
    if info.tie_enabled and info.tied and any(t in present for t in info.tied):
        report.problems.append(
            "tie_word_embeddings is true but the tied output weights are stored separately; "
            "transformers would overwrite them with the input embeddings on load"
        )
    report.checks.append(f"names and shapes match {info.architecture}; config dtype, vocabulary and tying")
