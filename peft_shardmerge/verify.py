"""Checking a merged checkpoint on disk: files, index, values, config, and logits against base + adapter."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

import torch

from .errors import NotFoundError, ShardMergeError
from .model_info import inspect_model
from .safetensors_io import DTYPES, FLOAT_DTYPES, RowReader, read_header, row_blocks
from .sources import INDEX_FILE, SINGLE_FILE, safe_shard_name

log = logging.getLogger(__name__)


@dataclass
class VerifyReport:
    """The outcome of :func:`verify_checkpoint`.

    Attributes:
        folder: the checked folder.
        ok: True when no problem was found.
        problems: every problem found, each a sentence.
        checks: what was checked, one line each.
        tensors: tensors found.
        logits_max_rel_err: max |logits(merged) - logits(base + adapter)| / max |logits(base + adapter)|,
            when base and adapter were given.
    """

    folder: str
    ok: bool = True
    problems: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    tensors: int = 0
    logits_max_rel_err: float | None = None

    def summary(self) -> str:
        """The verdict and what was checked.

        Args:
            None.

        Returns:
            Several lines of text; the first is ``OK: …`` or ``FAILED: …``.

        Raises:
            Nothing.

        Example:
            >>> print(VerifyReport("merged").summary())
            OK: merged
        """
        head = f"{'OK' if self.ok else 'FAILED'}: {self.folder}"
        return "\n".join([head] + [f"  checked: {c}" for c in self.checks] + [f"  problem: {p}" for p in self.problems])


def verify_checkpoint(
    folder: str,
    *,
    base: str | None = None,
    adapter: str | None = None,
    prompts: list[str] | None = None,
    tolerance: float | None = None,
) -> VerifyReport:
    """Check a merged checkpoint: every indexed tensor present once with a valid header, sizes, ``format``
    metadata, no NaN/Inf, names and shapes the model class expects, config consistency (dtype, vocabulary,
    tied embeddings), and, with ``base`` and ``adapter``, logits against base + adapter.

    Tensor values are read in row blocks, so the file checks need little memory; the logits check loads the
    merged model and base + adapter in fp32 (models that fit the machine).

    Args:
        folder: the merged checkpoint.
        base: the base checkpoint the merge came from.
        adapter: the adapter that was merged.
        prompts: texts to compare logits on (needs a tokenizer in ``folder`` or ``base``); random token ids
            when None.
        tolerance: largest accepted relative logits error; default 1e-4 for fp32 checkpoints, 3e-2 for 16-bit.

    Returns:
        The :class:`VerifyReport` (``ok`` is False when anything is wrong).

    Raises:
        NotFoundError: ``folder`` has no ``config.json`` or no weights.

    Example:
        >>> print(verify_checkpoint("merged", base="base", adapter="adapter").summary())   # doctest: +SKIP
        OK: merged
    """
    report = VerifyReport(os.path.abspath(folder))
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise NotFoundError(f"{folder} has no config.json; is it a checkpoint folder?")
    config = json.load(open(config_path))
    tensors = _check_files(folder, report)
    if tensors is None:
        report.ok = False
        return report
    _check_values(tensors, report)
    _check_names_and_config(folder, config, tensors, report)
    if base is not None and adapter is not None:
        _check_logits(folder, base, adapter, prompts, tolerance, config, report)
    report.ok = not report.problems
    return report


def _check_files(folder, report):
    index_path = os.path.join(folder, INDEX_FILE)
    tensors = {}
    try:
        if os.path.exists(index_path):
            index = json.load(open(index_path))
            wmap = index.get("weight_map")
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
            infos, meta = read_header(path)
            if meta.get("format") != "pt":
                report.problems.append(f"{os.path.basename(path)} lacks {{'format': 'pt'}} metadata")
            for t in infos:
                if t.name in tensors:
                    report.problems.append(f"tensor {t.name} is stored twice ({os.path.basename(path)} and "
                                           f"{os.path.basename(tensors[t.name].path)})")
                tensors[t.name] = t
        if wmap is not None:
            for name, shard in wmap.items():
                if name not in tensors:
                    report.problems.append(f"tensor {name} is in the index but in no shard")
                elif os.path.basename(tensors[name].path) != shard:
                    report.problems.append(f"tensor {name} is in {os.path.basename(tensors[name].path)}, the index "
                                           f"says {shard}")
            for name in sorted(set(tensors) - set(wmap)):
                report.problems.append(f"tensor {name} is in a shard but not in the index")
            total = sum(t.nbytes for t in tensors.values())
            if isinstance(index.get("metadata"), dict) and index["metadata"].get("total_size") not in (None, total):
                report.problems.append(f"index total_size {index['metadata']['total_size']} != {total} tensor bytes")
    except ShardMergeError as e:
        report.problems.append(str(e))
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


def _check_names_and_config(folder, config, tensors, report):
    info = inspect_model(folder)
    dtypes = {t.dtype for t in tensors.values() if t.dtype in FLOAT_DTYPES}
    written = str(DTYPES[next(iter(dtypes))][0]).removeprefix("torch.") if len(dtypes) == 1 else None
    declared = config.get("dtype") or config.get("torch_dtype")
    if written and declared and declared != written:
        report.problems.append(f"config.json says dtype {declared} but the tensors are {written}")
    if "quantization_config" in config and not any(n.endswith(".absmax") for n in tensors):
        report.problems.append("config.json has a quantization_config but the weights are not quantized")
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
    quantized = {m for m in present if any(m.startswith(w + ".") for w in info.linear_weights)}
    missing = sorted(expected - set(present) - built)
    unexpected = sorted(present[m] for m in set(present) - info.state_names - quantized)
    if missing:
        report.problems.append(f"{len(missing)} tensor(s) the model expects are missing: {', '.join(missing[:5])}")
    if unexpected:
        report.problems.append(f"{len(unexpected)} tensor(s) the model does not know: {', '.join(unexpected[:5])}")
    for name in sorted(set(present) & info.state_names):
        if name in info.linear_weights and quantized:
            continue
        shape = tuple(tensors[present[name]].shape)
        if shape != tuple(info.shapes.get(name, shape)):
            report.problems.append(f"{present[name]} has shape {list(shape)}, the config implies "
                                   f"{list(info.shapes[name])}")
    if info.tie_enabled and info.tied and any(t in present for t in info.tied):
        report.problems.append("tie_word_embeddings is true but the tied output weights are stored separately; "
                               "transformers would overwrite them with the input embeddings on load")
    report.checks.append(f"names and shapes match {info.architecture}; config dtype, vocabulary and tying")


def _check_logits(folder, base, adapter, prompts, tolerance, config, report):
    from peft import PeftModel
    from transformers import AutoConfig

    from .tiny import model_class, model_inputs

    cls = model_class(AutoConfig.from_pretrained(folder))
    merged = cls.from_pretrained(folder, dtype=torch.float32).eval()
    ref = PeftModel.from_pretrained(cls.from_pretrained(base, dtype=torch.float32), adapter).eval()
    if prompts:
        from transformers import AutoTokenizer

        tok_dir = folder if os.path.exists(os.path.join(folder, "tokenizer_config.json")) else base
        tok = AutoTokenizer.from_pretrained(tok_dir)
        batches = []
        for p in prompts:
            ids = tok(p, return_tensors="pt")["input_ids"]
            extra = model_inputs(merged.config, images=False)  # decoder ids of an encoder-decoder
            extra["input_ids"] = ids
            batches.append(extra)
        what = f"{len(prompts)} prompt(s)"
    else:
        batches = [model_inputs(merged.config, seed=s) for s in range(2)]
        what = "2 random inputs" + (" (with an image)" if "pixel_values" in batches[0] else "")
    worst = 0.0
    with torch.no_grad():
        for inputs in batches:
            want = ref(**inputs).logits
            got = merged(**inputs).logits
            worst = max(worst, float((got - want).abs().max() / want.abs().max().clamp_min(1e-12)))
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    tol = tolerance if tolerance is not None else (1e-4 if dtype == "float32" else 3e-2)
    report.logits_max_rel_err = worst
    report.checks.append(f"logits vs base + adapter on {what}: max relative error {worst:.2e} (tolerance {tol:g})")
    if worst > tol:
        report.problems.append(f"logits differ from base + adapter: max relative error {worst:.2e} > {tol:g}")
