"""Drop-ins for Unsloth's and PEFT's call sites: save_pretrained_merged, push_to_hub_merged, merge_and_unload,
patch_peft."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Callable

import torch
from torch import nn

from ..checkpoint.base_folder import TOKENIZER_FILES
from ..engine.report import MergeReport
from ..errors import InputError
from ..options import MODEL, MergeOptions
from ..output.hub_push import HubTarget
from ..output.hub_staging import staged_push
from ..output.out_dir import check_out_dir, path_argument, settle_out_dir, source_folders
from ..output.record import unlisted_files
from ..verify.integrity import read_record
from .gguf import push_to_hub_gguf, save_pretrained_gguf
from .hub import Push, publish_model
from .inprocess import ModelJob, merge_and_save, save_merged_4bit, save_model
from .quiet import quiet_libraries
from .unload import merge_and_unload as _merge_and_unload

#: every ``save_method`` Unsloth documents, mapped to what is done here (None: refused, with the alternative)
SAVE_METHODS = {
    "merged_16bit": "merged_16bit",
    "merged_4bit": "merged_4bit",
    "merged_4bit_forced": "merged_4bit",
    "lora": "lora",
    "mxfp4": None,
    "gguf": None,
}
REFUSED_METHODS = {
    "mxfp4": "save_method='mxfp4' (gpt-oss's native format) is not written here; use save_method='merged_16bit' "
    "(a bf16 checkpoint that vLLM and transformers load as is)",
    "gguf": "save_method='gguf' is not a save_method of save_pretrained_merged: call save_pretrained_gguf(model, "
    "folder, tokenizer, quantization_method='q4_k_m'), or merge_and_save(model, 'model.gguf', outtype='q4_k_m')",
}

#: the files of an adapter-only save (``save_method="lora"``)
_LORA_FILES = {"README.md", "adapter_config.json", "adapter_model.safetensors", *TOKENIZER_FILES}


def _earlier_save(folder: str) -> str:
    """What an existing non-empty folder holds: ``"merged"`` (a merged checkpoint whose every file our merge record
    lists, or our model card), ``"adapter"`` (only the files of an adapter save) or ``""`` (anything else)."""
    record, problems = read_record(folder)  # self-checked: a damaged record is no proof the folder is ours
    if record is not None and not problems:
        extra = [n for n in unlisted_files(folder, record) if not (n == "README.md" and _our_card(folder))]
        return "" if extra else "merged"
    names = os.listdir(folder)
    if "adapter_config.json" in names and all(
        n in _LORA_FILES and os.path.isfile(os.path.join(folder, n)) and not os.path.islink(os.path.join(folder, n))
        for n in names
    ):
        return "adapter"
    return ""


def _our_card(folder: str) -> bool:
    """Whether the folder's README.md is the model card a push of ours wrote beside the merge (it names us)."""
    try:
        with open(os.path.join(folder, "README.md"), encoding="utf-8") as f:
            return "peft-shardmerge" in f.read(1 << 16)
    except (OSError, UnicodeDecodeError):
        return False


def _replace_problems(
    save_directory: str, model: nn.Module, method: str | None, any_content: bool = False
) -> list[str]:
    """Problems with saving into ``save_directory`` as Unsloth does: an earlier save there is replaced (a merged
    checkpoint by any save, an adapter folder by an adapter save); an input folder, or a folder with other content,
    never is."""
    settle_out_dir(save_directory, inputs=source_folders(model), overwrite=False)
    problems = check_out_dir(save_directory, inputs=source_folders(model), overwrite=True, only_ours=any_content)
    if problems or any_content:
        return problems
    return _not_an_earlier_save(save_directory, method)


def _not_an_earlier_save(save_directory: str, method: str | None) -> list[str]:
    """Why a non-empty folder may not be replaced by this save (empty when it holds an earlier save it may
    replace); run again under the output lock."""
    if not os.path.isdir(save_directory) or not os.listdir(save_directory):
        return []
    problems, held = [], _earlier_save(save_directory)
    if held == "adapter" and method not in (None, "lora"):
        problems.append(
            f"{save_directory} holds an adapter (adapter_config.json), perhaps the one this model was "
            "loaded from; a merged save does not replace it: choose another folder (or pass "
            "overwrite=True)"
        )
    elif not held:
        extra = sorted(n for n in os.listdir(save_directory) if n not in _LORA_FILES)[:5]
        problems.append(
            f"{save_directory} is not an earlier save (it holds {', '.join(extra)}); a folder is "
            "replaced only when it holds an earlier save: choose an empty or new folder (or pass "
            "overwrite=True)"
        )
    return problems


def _check_compat(save_method, state_dict, safe_serialization, variant) -> list[str]:
    problems = []
    method = save_method.lower().replace(" ", "_") if isinstance(save_method, str) else save_method
    if method in REFUSED_METHODS:
        problems.append(REFUSED_METHODS[method])
    elif method not in SAVE_METHODS:
        offered = ", ".join(repr(k) for k, v in SAVE_METHODS.items() if v)
        problems.append(f"save_method must be one of {offered}, got {save_method!r}")
    if state_dict is not None:
        problems.append("state_dict is not supported: the merge reads the model itself; leave it None")
    if not safe_serialization:
        problems.append("safe_serialization=False is not supported: only safetensors are written")
    if variant is not None:
        problems.append("variant is not supported; leave it None")
    return problems


def _save_lora(model: nn.Module, folder: str, tokenizer: Any) -> None:
    """The adapter alone, as ``model.save_pretrained``, staged beside ``folder`` and renamed into place."""
    parent = os.path.dirname(os.path.abspath(folder))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.lora-", dir=parent)
    try:
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        old = None
        if os.path.isdir(folder):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.old-", dir=parent)
            os.rename(folder, os.path.join(old, "x"))
        os.rename(staging, folder)
        if old is not None:
            shutil.rmtree(old)
    finally:
        if os.path.isdir(staging):
            shutil.rmtree(staging)


def _save_merged(
    model,
    folder,
    tokenizer,
    method,
    *,
    dtype,
    max_shard_size,
    maximum_memory_usage,
    base_precision,
    overwrite,
    progress,
    replace_check: Callable[[str], list[str]] | None = None,
) -> MergeReport:
    """A merged save (``"merged_16bit"`` or ``"merged_4bit"``); ``replace_check`` refuses, under the output lock, a
    non-empty folder that ``overwrite`` would replace."""
    if method == "merged_4bit":
        return save_merged_4bit(
            model,
            folder,
            tokenizer=tokenizer,
            dtype=dtype,
            max_shard_size=max_shard_size,
            maximum_memory_usage=maximum_memory_usage,
            overwrite=overwrite,
            progress=progress,
            replace_check=replace_check,
        )
    opts, problems = MergeOptions.from_call(locals(), path=MODEL)
    return save_model(model, folder, opts, problems, tokenizer=tokenizer, replace_check=replace_check)


def save_pretrained_merged(
    model: nn.Module,
    save_directory: str,
    tokenizer: Any = None,
    save_method: str = "merged_16bit",
    push_to_hub: bool = False,
    token: str | None = None,
    is_main_process: bool = True,
    state_dict: dict | None = None,
    save_function: Callable | None = None,
    max_shard_size: int | str = "5GB",
    safe_serialization: bool = True,
    variant: str | None = None,
    save_peft_format: bool = True,
    tags: list[str] | None = None,
    temporary_location: str | None = None,
    maximum_memory_usage: float = 0.9,
    private: bool | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    base_precision: str = "auto",
    overwrite: bool = False,
    progress: bool = True,
) -> MergeReport | None:
    """Unsloth's ``save_pretrained_merged``: same parameters, flat memory, honoured shard size and budget.

    Like Unsloth's, running it again replaces the earlier save in ``save_directory`` (a merged checkpoint by any
    ``save_method``, an adapter folder by ``"lora"``); a folder the model was loaded from, an adapter folder asked
    to take a merged model, or a folder holding other files is never replaced (the error says which files).

    Args:
        model: the trained ``PeftModel``.
        save_directory: the output folder (for ``push_to_hub=True``, also the repository name, ``"name"`` or
            ``"user/name"``).
        tokenizer: saved with the model when given.
        save_method: ``"merged_16bit"`` (default), ``"merged_4bit"`` / ``"merged_4bit_forced"`` (the merged weights
            re-quantized to bitsandbytes 4-bit, with one warning: lossy) or ``"lora"`` (the adapter only);
            ``"mxfp4"`` is refused, naming ``"merged_16bit"``.
        push_to_hub: upload the folder afterwards; Hub access is checked before merging.
        token: Hub token (never logged).
        is_main_process: when False nothing is done (distributed training).
        state_dict: not supported (the merge reads the model itself); must be None.
        save_function: ignored (safetensors are written directly).
        max_shard_size: largest shard (``"5GB"``).
        safe_serialization: must be True (only safetensors are written).
        variant: not supported; must be None.
        save_peft_format: ignored (kept for compatibility).
        tags: extra model card tags when pushing.
        temporary_location: ignored (output is staged beside ``save_directory``).
        maximum_memory_usage: fraction (0, 0.95] of accelerator memory the merge may occupy.
        private: create the Hub repository private.
        dtype: output dtype; None or ``"auto"`` writes the checkpoint's own 16-bit dtype (see :func:`merge_and_save`).
        base_precision: ``"auto"``, ``"original"`` or ``"dequantized"`` (see :func:`merge_and_save`).
        overwrite: also replace a folder holding other files (never a folder the model was loaded from).
        progress: show progress bars.

    Returns:
        The :class:`MergeReport` for merged methods, None for ``"lora"`` or when not the main process.

    Raises:
        InputError: every problem with the options and the folder, at once, before anything is written.
        HubUploadError: the Hub cannot be reached or the upload failed.

    Example:
        >>> import os, tempfile
        >>> from peft import LoraConfig, get_peft_model
        >>> from transformers import LlamaForCausalLM
        >>> from peft_shardmerge import save_pretrained_merged
        >>> from peft_shardmerge.testing import tiny_config
        >>> model = get_peft_model(LlamaForCausalLM(tiny_config()), LoraConfig(target_modules=["q_proj", "v_proj"]))
        >>> out = os.path.join(tempfile.mkdtemp(), "merged")
        >>> report = save_pretrained_merged(model, out, save_method="merged_16bit", progress=False)
        >>> report.lora_modules_merged, "config.json" in os.listdir(out)
        (4, True)
        >>> report = save_pretrained_merged(model, out, progress=False)  # run again: replaces the earlier save
    """
    if not is_main_process:
        return None
    path, problems = path_argument(save_directory, "output folder")  # str, bytes or os.PathLike
    problems += _check_compat(save_method, state_dict, safe_serialization, variant)
    method = SAVE_METHODS.get(save_method.lower().replace(" ", "_")) if isinstance(save_method, str) else None
    if path is None:
        raise InputError(problems)
    save_directory = path
    problems += _replace_problems(save_directory, model, method, any_content=overwrite)
    repo_id = save_directory.strip("/")
    if push_to_hub and (repo_id.count("/") > 1 or os.path.isabs(save_directory) or not all(repo_id.split("/"))):
        problems.append(
            f"with push_to_hub=True, save_directory is also the Hub repository id ('name' or "
            f"'user/name'); got {save_directory!r} (use push_to_hub_merged(model, 'user/name') to push "
            "without keeping a local folder)"
        )
    if problems:
        raise InputError(problems)
    if push_to_hub:
        from .hub import prepare_repo

        repo_id = prepare_repo(repo_id, token=token, private=private)
        target = HubTarget(repo_id, token=token, private=private, progress=progress)
    report = None
    if method == "lora":
        _save_lora(model, save_directory, tokenizer)
    else:  # checked again under the output lock: a file that appeared since is never deleted
        report = _save_merged(
            model,
            save_directory,
            tokenizer,
            method,
            dtype=dtype,
            max_shard_size=max_shard_size,
            maximum_memory_usage=maximum_memory_usage,
            base_precision=base_precision,
            overwrite=True,
            progress=progress,
            replace_check=None if overwrite else lambda out: _not_an_earlier_save(out, method),
        )
    if push_to_hub:  # the folder kept, as Unsloth keeps it, and pushed in one commit
        publish_model(save_directory, target, model, report, save_method, tags=tags)
    return report


def push_to_hub_merged(
    model: nn.Module,
    repo_id: str,
    tokenizer: Any = None,
    save_method: str = "merged_16bit",
    use_temp_dir: bool | None = None,
    commit_message: str | None = "Trained with peft-shardmerge",
    private: bool | None = None,
    token: str | None = None,
    max_shard_size: int | str = "5GB",
    create_pr: bool = False,
    safe_serialization: bool = True,
    revision: str | None = None,
    commit_description: str | None = None,
    tags: list[str] | None = None,
    temporary_location: str | None = None,
    maximum_memory_usage: float = 0.9,
    *,
    dtype: str | torch.dtype | None = None,
    base_precision: str = "auto",
    progress: bool = True,
    overwrite: bool = False,
) -> str:
    """Unsloth's ``push_to_hub_merged``: check Hub access, then stream the merge to the Hub in one commit.

    The repository is created (or found writable) before any merge work, so a wrong token, a name taken by
    someone else or offline mode fails in seconds. A 16-bit merge is pushed as it is made: each shard is uploaded by
    content as soon as it is written and deleted here, so the local disk holds at most two shards and the files
    beside them (``docs/hub.md``); one commit at the end adds every file, the model card and the merge record.

    Args:
        model: the trained ``PeftModel``.
        repo_id: ``"user/name"``, or a bare ``"name"`` in the token owner's namespace (as huggingface_hub).
        tokenizer: uploaded with the model when given.
        save_method: as in :func:`save_pretrained_merged`.
        use_temp_dir: ignored (shards wait for their upload in ``temporary_location``).
        commit_message: the commit title.
        private: create the repository private.
        token: Hub token (never logged).
        max_shard_size: largest shard.
        create_pr: open a pull request.
        safe_serialization: must be True.
        revision: branch to push to.
        commit_description: the commit's description.
        tags: extra model card tags.
        temporary_location: where shards wait for their upload (None: the system's temporary folder).
        maximum_memory_usage: fraction (0, 0.95] of accelerator memory the merge may occupy.
        dtype: output dtype; None or ``"auto"`` writes the checkpoint's own 16-bit dtype.
        base_precision: ``"auto"``, ``"original"`` or ``"dequantized"``.
        progress: show progress bars.
        overwrite: delete, in the same commit, the repository's weight files this push does not write (an earlier
            push's other shards); without it, such a repository is refused before anything is merged.

    Returns:
        The URL of the commit.

    Raises:
        InputError: bad options or offline mode (all named, before anything is merged).
        HubUploadError: the Hub cannot be reached, refuses the repository, or the upload failed (token masked).

    Example:
        An upload needs the Hub and a token; what is refused is refused before the Hub is contacted:

        >>> from peft import LoraConfig, get_peft_model
        >>> from transformers import LlamaForCausalLM
        >>> from peft_shardmerge import push_to_hub_merged
        >>> from peft_shardmerge.testing import tiny_config
        >>> model = get_peft_model(LlamaForCausalLM(tiny_config()), LoraConfig(target_modules=["q_proj"]))
        >>> push_to_hub_merged(model, "me/llama-merged", save_method="mxfp4")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        peft_shardmerge.errors.InputError: 1 problem found before writing anything:
          - save_method='mxfp4' (gpt-oss's native format) is not written here; use save_method='merged_16bit' ...
    """
    from .hub import prepare_repo

    problems = _check_compat(save_method, None, safe_serialization, None)
    if problems:
        raise InputError(problems)
    method = SAVE_METHODS[save_method.lower().replace(" ", "_")]
    opts, problems = MergeOptions.merged(
        None,
        path=MODEL,
        dtype=dtype,
        max_shard_size=max_shard_size,
        maximum_memory_usage=maximum_memory_usage,
        base_precision=base_precision,
        progress=progress,
    )
    if problems:
        raise InputError(problems)

    def prepare() -> str:
        return prepare_repo(repo_id, token=token, private=private, revision=revision, create_pr=create_pr)

    target = HubTarget(
        repo_id,
        token=token,
        revision=revision,
        private=private,
        commit_message=commit_message or "Upload merged model",
        commit_description=commit_description,
        create_pr=create_pr,
        progress=progress,
    )
    push = Push(
        target, temporary_location, prepare=prepare, replace=overwrite, save_method=save_method, tags=list(tags or [])
    )
    if method == "merged_16bit":  # streamed: each shard uploaded as it is written, one commit
        with quiet_libraries():
            ModelJob(model, None, opts, [], tokenizer=tokenizer, push=push).run()
        return push.url
    repo_id = target.repo_id = prepare()
    with staged_push(push.folder()) as folder:  # the others: saved whole, then pushed
        out = os.path.join(folder, repo_id.split("/")[-1])
        report = None
        if method == "lora":
            _save_lora(model, out, tokenizer)
        else:
            report = _save_merged(
                model,
                out,
                tokenizer,
                method,
                dtype=dtype,
                max_shard_size=max_shard_size,
                maximum_memory_usage=maximum_memory_usage,
                base_precision=base_precision,
                overwrite=False,
                progress=progress,
            )
        return publish_model(out, target, model, report, save_method, tags=tags, replace=overwrite)


def merge_and_unload(
    model: nn.Module,
    progressbar: bool = False,
    safe_merge: bool = False,
    adapter_names: list[str] | None = None,
    *,
    maximum_memory_usage: float = 0.9,
    dtype: str | torch.dtype | None = None,
    weights: list[float] | None = None,
    combination_type: str = "cat",
    density: float | None = None,
    majority_sign_method: str = "total",
    normalize: bool | None = None,
    seed: int = 0,
) -> nn.Module:
    """PEFT's ``merge_and_unload(progressbar, safe_merge, adapter_names)`` without re-quantizing: a plain 16-bit model.

    Takes PEFT's parameters in PEFT's order. Every merge here runs the checks PEFT's ``safe_merge=True`` asks for
    (each merged block checked finite and against the unmerged layer on probe vectors), so ``safe_merge`` only
    documents that; ``progressbar`` shows a tqdm bar over the modules merged, as PEFT's does. The rest is
    :func:`peft_shardmerge.api.unload.merge_and_unload`.

    Args:
        model: a ``PeftModel`` (or a transformers model after ``add_adapter``), base 4-bit, 8-bit or unquantized.
        progressbar: show a progress bar over the modules merged (tqdm, on stderr).
        safe_merge: accepted for PEFT compatibility; the checks always run.
        adapter_names: adapters to merge; None merges the active adapter(s).
        maximum_memory_usage: fraction (0, 0.95] of accelerator memory the merge may occupy.
        dtype: dtype of the returned model; None or ``"auto"`` keeps the checkpoint's own 16-bit dtype.
        weights: one weight per adapter of ``adapter_names``.
        combination_type: ``"cat"``, ``"linear"``, or a task-vector method (``"ties"``, ``"dare_ties"``,
            ``"dare_linear"``, ``"magnitude_prune"``; their combined deltas are not products of factors, so the probe
            check does not apply to them).
        density: the fraction of each delta a task-vector method keeps.
        majority_sign_method: ``"total"`` or ``"frequency"`` (``ties``, ``dare_ties``).
        normalize: None for the method's default.
        seed: DARE's seed.

    Returns:
        The transformers model, with no PEFT or bitsandbytes layers.

    Raises:
        InputError: the model has no adapter (a ``ValueError``, as PEFT raises), bad options, or accelerate-offloaded
            modules whose merged weights cannot be written back; the model is left as it was, with no
            ``peft_config`` attribute added.

    Example:
        >>> from peft import LoraConfig, get_peft_model
        >>> from transformers import LlamaForCausalLM
        >>> from peft_shardmerge import merge_and_unload
        >>> from peft_shardmerge.testing import tiny_config
        >>> model = get_peft_model(LlamaForCausalLM(tiny_config()), LoraConfig(target_modules=["q_proj"]))
        >>> plain = merge_and_unload(model, safe_merge=True)
        >>> type(plain).__name__, type(plain.model.layers[0].self_attn.q_proj).__name__
        ('LlamaForCausalLM', 'Linear')
    """
    del safe_merge  # see the docstring
    return _merge_and_unload(
        model,
        maximum_memory_usage=maximum_memory_usage,
        dtype=dtype,
        adapter_names=adapter_names,
        weights=weights,
        combination_type=combination_type,
        density=density,
        majority_sign_method=majority_sign_method,
        normalize=normalize,
        seed=seed,
        progress=bool(progressbar),
    )


def patch_peft() -> None:
    """Opt in to ``model.save_pretrained_merged(...)``, ``model.push_to_hub_merged(...)`` and
    ``model.merge_and_save(...)`` on every ``PeftModel``, as in Unsloth, and its GGUF saves
    ``model.save_pretrained_gguf(...)`` / ``model.push_to_hub_gguf(...)``.

    PEFT's own ``merge_and_unload`` is left alone; call :func:`merge_and_unload` for the lossless one.

    Returns:
        None.

    Example:
        >>> import peft_shardmerge
        >>> peft_shardmerge.patch_peft()
        >>> from peft import PeftModel
        >>> hasattr(PeftModel, "save_pretrained_merged")
        True
    """
    from peft import PeftModel

    PeftModel.save_pretrained_merged = save_pretrained_merged
    PeftModel.push_to_hub_merged = push_to_hub_merged
    PeftModel.save_pretrained_gguf = save_pretrained_gguf
    PeftModel.push_to_hub_gguf = push_to_hub_gguf
    PeftModel.merge_and_save = merge_and_save
