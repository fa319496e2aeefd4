"""Unsloth's GGUF drop-ins: a trained model written as one GGUF file per type asked for, from one pass over the
merge, into a folder or up to the Hub."""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from ..engine.plan import Plan
from ..engine.report import MergeReport
from ..engine.sink import Sink
from ..engine.source import Source
from ..errors import InputError
from ..options import MODEL, MergeOptions
from ..output.gguf_sink import GGUFSink
from ..output.gguf_types import OutType
from ..output.out_dir import check_out_dir, path_argument, source_folders
from ..support.outtypes import gguf_types, outtype_problems
from .inprocess import ModelJob
from .quiet import quiet_libraries

#: Unsloth's options that change nothing here (its llama.cpp build, its buffers, its saving of a 16-bit copy)
IGNORED = (
    "first_conversion",
    "is_main_process",
    "state_dict",
    "save_function",
    "max_shard_size",
    "safe_serialization",
    "variant",
    "save_peft_format",
    "tags",
    "temporary_location",
    "use_temp_dir",
    "commit_message",
    "commit_description",
    "create_pr",
    "revision",
)


def gguf_file_names(save_directory: str, quantization_method: Any) -> list[tuple[str, str]]:
    """The files :func:`save_pretrained_gguf` writes: ``(path, type)``, each named after the folder and its type.

    Args:
        save_directory: the folder.
        quantization_method: a type (Unsloth's names too) or a list of them.

    Returns:
        ``[(path, type), ...]``, one per type, in the order asked (each once).

    Example:
        >>> gguf_file_names("out/model", ["q4_k_m", "fast_quantized"])
        [('out/model/model.Q4_K_M.gguf', 'q4_k_m'), ('out/model/model.Q8_0.gguf', 'q8_0')]
    """
    name = os.path.basename(os.path.abspath(os.fspath(save_directory))) or "model"
    types = list(dict.fromkeys(gguf_types(quantization_method)))
    return [(os.path.join(os.fspath(save_directory), f"{name}.{t.upper()}.gguf"), t) for t in types]


def save_pretrained_gguf(
    model: nn.Module,
    save_directory: str,
    tokenizer: Any = None,
    quantization_method: Any = "fast_quantized",
    maximum_memory_usage: float = 0.9,
    *,
    base_precision: str = "auto",
    overwrite: bool = False,
    progress: bool = True,
    **unsloth,
) -> MergeReport:
    """Unsloth's ``save_pretrained_gguf``: the trained model merged and written as GGUF files for llama.cpp and
    Ollama, one per type asked for, all from one pass over the merge (no llama.cpp build, no 16-bit copy on disk).
    Each file is what llama.cpp's converter and quantizer write from the merge (``docs/gguf.md``).

    Args:
        model: the trained ``PeftModel`` (a 4-bit or 16-bit base).
        save_directory: the folder the files go in (created), each named ``<folder>.<TYPE>.gguf``; a
            ``Modelfile`` for ``ollama create`` is written beside them.
        tokenizer: the tokenizer (an object, a folder or a Hub id); None: the base checkpoint's, where it is on disk.
        quantization_method: a type or a list of them: Unsloth's names (``"not_quantized"`` is f16,
            ``"fast_quantized"`` q8_0, ``"quantized"`` q4_k_m) or ``f32``, ``f16``, ``bf16``, ``q8_0``, ``q4_0``,
            ``q4_1``, ``q5_0``, ``q5_1``, ``q4_k_s``, ``q4_k_m``, ``q5_k_s``, ``q5_k_m``, ``q6_k``.
        maximum_memory_usage: fraction (0, 0.95] of accelerator memory the merge may occupy.
        base_precision: ``"auto"``, ``"original"`` or ``"dequantized"`` (see :func:`merge_and_save`).
        overwrite: replace files of the same names.
        progress: show a progress bar.
        **unsloth: Unsloth's other options, accepted and unused (:data:`IGNORED`); ``push_to_hub=True`` with
            ``token`` and ``private`` pushes the folder to the Hub repository named by ``save_directory``.

    Returns:
        The :class:`~peft_shardmerge.engine.report.MergeReport` (``report.shards``: the files written).

    Raises:
        InputError: an unknown type or option, a file in the way; all before anything is merged.
        UnsupportedError: an architecture or tokenizer llama.cpp's converter does not take.

    Example:
        >>> save_pretrained_gguf(None, "out", quantization_method="q3_k_m")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        peft_shardmerge.errors.InputError: 1 problem found before writing anything:
          - quantization_method 'q3_k_m' is not a GGUF type written here; choose one of auto, f32, ...
    """
    push = unsloth.pop("push_to_hub", False)
    token, private = unsloth.pop("token", None), unsloth.pop("private", None)
    problems = _method_problems(quantization_method)
    problems += [f"{k}={v!r} is not an option of save_pretrained_gguf" for k, v in unsloth.items() if k not in IGNORED]
    raw, path_problems = path_argument(save_directory, "save_directory")
    problems += path_problems
    if problems:
        raise InputError(problems)
    if push:
        hub = {k: v for k, v in unsloth.items() if k in ("commit_message", "revision", "create_pr")}
        return push_to_hub_gguf(
            model,
            raw,
            tokenizer,
            quantization_method,
            token=token,
            private=private,
            maximum_memory_usage=maximum_memory_usage,
            base_precision=base_precision,
            progress=progress,
            **hub,
        )
    return _write(
        model, raw, tokenizer, quantization_method, maximum_memory_usage, base_precision, overwrite, progress
    )


def _method_problems(quantization_method: Any) -> list[str]:
    """What is wrong with the types asked for, under Unsloth's name for them."""
    methods = quantization_method if isinstance(quantization_method, (list, tuple)) else [quantization_method]
    return [p for t in methods for p in outtype_problems(t, what="quantization_method")]


def _write(model, folder, tokenizer, methods, maximum_memory_usage, base_precision, overwrite, progress):
    """The GGUF files of ``methods`` written into ``folder`` from one merge, and a Modelfile beside them."""
    targets = gguf_file_names(folder, methods)
    problems = []
    for path, _ in targets:
        problems += check_out_dir(path, inputs=source_folders(model), overwrite=overwrite)
    opts, more = MergeOptions.merged(
        None,
        path=MODEL,
        maximum_memory_usage=maximum_memory_usage,
        base_precision=base_precision,
        overwrite=overwrite,
        progress=progress,
    )
    if problems + more:
        raise InputError(problems + more)
    name = os.path.basename(os.path.abspath(folder))
    with quiet_libraries():
        report = _GGUFFiles(model, targets, opts, tokenizer, name).run()  # the folder made once the merge is planned
    modelfile = os.path.join(folder, "Modelfile")
    if overwrite or not os.path.exists(modelfile):  # ollama create NAME -f Modelfile (the template is in the file)
        with open(modelfile, "w", encoding="utf-8") as f:
            f.write(f"FROM ./{os.path.basename(targets[0][0])}\n")
    return report


class _GGUFFiles(ModelJob):
    """A loaded model's merge into several GGUF files at once (one sink, one pass)."""

    def __init__(self, model, targets: list[tuple[str, str]], opts: MergeOptions, tokenizer, name: str):
        super().__init__(model, targets[0][0], opts, [], tokenizer=tokenizer)
        self.targets, self.name = targets, name

    def sink(self, plan: Plan, source: Source) -> Sink:
        dtype = self.base_dtype(plan)
        files = [(path, OutType.parse(t, dtype)) for path, t in self.targets]
        return GGUFSink(
            files,
            plan.config,
            source.side_files,
            self.before_commit(),
            self.opts.overwrite,
            self.name,
            quiet=quiet_libraries,
        )

    def carry_out(self, plan: Plan) -> MergeReport:
        report = super().carry_out(plan)
        report.shards = [os.path.basename(p) for p, _ in self.targets]
        report.bytes_written = sum(os.path.getsize(p) for p, _ in self.targets)
        report.dtype = ", ".join(t for _, t in self.targets)
        return report


def push_to_hub_gguf(
    model: nn.Module,
    repo_id: str,
    tokenizer: Any = None,
    quantization_method: Any = "fast_quantized",
    token: str | None = None,
    private: bool | None = None,
    maximum_memory_usage: float = 0.9,
    *,
    base_precision: str = "auto",
    progress: bool = True,
    **unsloth,
) -> str:
    """Unsloth's ``push_to_hub_gguf``: the Hub access checked first, the GGUF files written (one pass, as
    :func:`save_pretrained_gguf`) into a staging folder (Unsloth's ``temporary_location``, else the system's temporary
    folder) with a model card and a Modelfile, then pushed in one commit, each file uploaded by its SHA-256 taken
    while it was written.

    Args:
        model: the trained ``PeftModel``.
        repo_id: ``"user/name"`` (or ``"name"`` in the token owner's namespace).
        tokenizer: the tokenizer; None: the base checkpoint's.
        quantization_method: a type or a list of them (as :func:`save_pretrained_gguf`).
        token: Hub token (never logged).
        private: create the repository private.
        maximum_memory_usage: fraction (0, 0.95] of accelerator memory the merge may occupy.
        base_precision: ``"auto"``, ``"original"`` or ``"dequantized"``.
        progress: show progress bars.
        **unsloth: Unsloth's other options, accepted and unused (:data:`IGNORED`).

    Returns:
        The URL of the commit.

    Raises:
        InputError: bad options or offline mode, before anything is merged.
        HubUploadError: the Hub cannot be reached, refuses the repository, or the upload failed (token masked).

    Example:
        >>> push_to_hub_gguf(None, "me/model-gguf", quantization_method="q2_k")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        peft_shardmerge.errors.InputError: 1 problem found before writing anything:
          - quantization_method 'q2_k' is not a GGUF type written here; choose one of auto, f32, ...
    """
    from ..output.hub_push import HubTarget
    from ..output.hub_staging import staged_push
    from .hub import Push, model_names, prepare_repo, push_gguf_folder

    problems = _method_problems(quantization_method)
    problems += [f"{k}={v!r} is not an option of push_to_hub_gguf" for k, v in unsloth.items() if k not in IGNORED]
    if problems:
        raise InputError(problems)
    revision = unsloth.get("revision")
    create_pr = bool(unsloth.get("create_pr", False))
    repo_id = prepare_repo(repo_id, token=token, private=private, revision=revision, create_pr=create_pr)
    target = HubTarget(
        repo_id,
        token=token,
        revision=revision,
        private=private,
        commit_message=unsloth.get("commit_message") or "Upload GGUF",
        commit_description=unsloth.get("commit_description"),
        create_pr=create_pr,
        progress=progress,
    )
    push = Push(target, unsloth.get("temporary_location"), save_method="gguf", tags=["gguf", "llama.cpp"])
    name = repo_id.split("/")[-1]
    with staged_push(push.folder()) as folder:
        out = os.path.join(folder, name)
        report = _write(
            model, out, tokenizer, quantization_method, maximum_memory_usage, base_precision, True, progress
        )
        report.out_dir = target.url
        return push_gguf_folder(out, push, report, *model_names(model))
